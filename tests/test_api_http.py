"""HTTP rules every route of the service follows, in-process (FastAPI TestClient).

Bearer tokens are compared as UTF-8 bytes; request bodies are JSON only (415
otherwise, so that a cross-origin "simple request" queues nothing), and
uncompressed; HEAD answers wherever GET does; `Allow` names every method of a
path on 405 and OPTIONS; /docs works with no network.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")

from fastapi.testclient import TestClient  # noqa: E402

from api import Settings, create_app  # noqa: E402
from api.examples import EXAMPLE_PROFILE  # noqa: E402

TOKEN = "clé-секрет-🔑"  # not ASCII, not even latin-1


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("http")
    settings = Settings(db_path=directory / "plans.sqlite3", solve_processes=1, request_processes=1, max_solver_workers=1)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("http-token")
    settings = Settings(db_path=directory / "plans.sqlite3", solve_processes=1, request_processes=1, max_solver_workers=1,
                        token=TOKEN)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def bearer(token: str, encoding: str = "utf-8") -> dict[str, bytes]:
    return {"Authorization": b"Bearer " + token.encode(encoding)}


# Tokens -------------------------------------------------------------------------------


def test_a_non_ascii_token_can_be_presented_as_utf8(guarded):
    assert guarded.get("/v1/plans", headers=bearer(TOKEN)).status_code == 200
    assert guarded.get("/metrics", headers=bearer(TOKEN)).status_code == 200


def test_a_wrong_or_mis_encoded_token_is_refused(guarded):
    assert guarded.get("/v1/plans").status_code == 401
    assert guarded.get("/v1/plans", headers=bearer(TOKEN[:-1])).status_code == 401
    assert guarded.get("/v1/plans", headers=bearer(TOKEN + "x")).status_code == 401
    # The same characters in another encoding are other bytes: refused, never a 500.
    assert guarded.get("/v1/plans", headers=bearer(TOKEN, "utf-16")).status_code == 401
    assert guarded.get("/v1/plans", headers={"Authorization": b"Bearer \xff\xfe"}).status_code == 401
    assert guarded.get("/v1/plans", headers={"Authorization": b"Basic " + TOKEN.encode()}).status_code == 401


# JSON bodies only ---------------------------------------------------------------------------


def plan_body() -> dict:
    return {"profile": EXAMPLE_PROFILE, "strategy": "keep-all", "workers": 1, "wait_s": 10}


def stored_plans(client) -> int:
    return len(client.get("/v1/plans", params={"limit": 100}).json()["plans"])


def body_operations(client) -> list[tuple[str, str]]:
    """(method, path) of every operation whose OpenAPI entry takes a request body: new routes are covered too."""
    paths = client.get("/openapi.json").json()["paths"]
    return [(method, path) for path, item in paths.items() for method, operation in item.items()
            if "requestBody" in operation]


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain"},
        {"content-type": "text/plain;charset=UTF-8"},  # what fetch() sends for a string body
        {"content-type": "application/x-www-form-urlencoded"},
        {"content-type": "multipart/form-data; boundary=x"},
        {},  # no Content-Type at all
    ],
    ids=["text-plain", "text-plain-charset", "form-urlencoded", "multipart", "none"],
)
def test_a_cross_origin_simple_request_queues_nothing(client, headers):
    """A page on another origin may POST these without a preflight and without a token: 415, nothing stored."""
    import json

    before = stored_plans(client)
    queued = client.get("/healthz").json()["queue_depth"]
    body = json.dumps(plan_body()).encode()
    response = client.post("/v1/plans", content=body, headers={"origin": "https://attacker.example", **headers})
    assert response.status_code == 415, response.text
    answer = response.json()
    assert answer["error"] == "unsupported_media_type"
    assert "Content-Type: application/json" in answer["message"]
    assert (headers.get("content-type", "").split(";")[0] or "no Content-Type") in answer["message"]
    assert "access-control-allow-origin" not in response.headers
    assert stored_plans(client) == before
    assert client.get("/healthz").json()["queue_depth"] == queued


def test_every_operation_with_a_body_refuses_other_media_types(client):
    operations = body_operations(client)
    assert ("post", "/v1/plans") in operations and ("post", "/v1/simulate") in operations
    schema = client.get("/openapi.json").json()
    for method, path in operations:
        url = re.sub(r"\{[^}]+\}", "x", path)
        response = client.request(method.upper(), url, content=b"{}", headers={"content-type": "text/plain"})
        assert response.status_code == 415, (method, path, response.text)
        documented = schema["paths"][path][method]["responses"]
        assert "415" in documented, (method, path)
        assert list(schema["paths"][path][method]["requestBody"]["content"]) == ["application/json"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_with_any_charset_parameter_is_accepted(client, content_type):
    import json

    response = client.post("/v1/plans", content=json.dumps(plan_body()).encode(), headers={"content-type": content_type})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "done"


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate"])
def test_a_compressed_body_is_refused_by_its_encoding(client, encoding):
    import gzip
    import json

    before = stored_plans(client)
    body = gzip.compress(json.dumps(plan_body()).encode())
    response = client.post("/v1/plans", content=body,
                           headers={"content-type": "application/json", "content-encoding": encoding})
    assert response.status_code == 415, response.text
    assert response.json()["error"] == "unsupported_media_type"
    assert f"Content-Encoding: {encoding}" in response.json()["message"] and "uncompressed" in response.json()["message"]
    assert stored_plans(client) == before


def test_an_identity_content_encoding_is_a_plain_body(client):
    import json

    response = client.post("/v1/plans", content=json.dumps(plan_body()).encode(),
                           headers={"content-type": "application/json", "content-encoding": "identity"})
    assert response.status_code == 200, response.text


# HEAD wherever GET --------------------------------------------------------------------------


def test_head_answers_every_get_path_like_get_without_a_body(client):
    posted = client.post("/v1/plans", json=plan_body())
    assert posted.status_code == 200, posted.text
    plan_id = posted.json()["id"]
    checked = 0
    for path, methods in documented_methods(client).items():
        if "GET" not in methods or "{" in path and "plan_id" not in path:
            continue
        url = path.replace("{plan_id}", plan_id)
        got, head = client.get(url), client.head(url)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        if path != "/metrics":  # the counters move between the two requests
            assert head.headers["content-length"] == got.headers["content-length"], path
        checked += 1
    assert checked >= 6
    missing = client.head("/v1/plans/0123456789abcdef")
    assert missing.status_code == 404 and missing.content == b""


def test_head_on_a_path_without_get_is_405_naming_head(client):
    response = client.head("/v1/simulate")
    assert response.status_code == 405 and response.headers["allow"] == "POST, OPTIONS"
    assert client.request("GET", "/v1/simulate").json()["message"].startswith("GET is not a method")
    # A HEAD answer has no body; its message is the same as for the method named.
    assert response.content == b""


def test_head_needs_the_token_a_get_needs(guarded):
    assert guarded.head("/v1/plans").status_code == 401
    assert guarded.head("/v1/plans", headers=bearer(TOKEN)).status_code == 200


def test_requests_answered_before_routing_are_counted_under_their_route(guarded):
    guarded.get("/v1/plans")  # 401, answered by the guard before the router runs
    metrics = guarded.get("/metrics", headers=bearer(TOKEN)).text
    assert re.search(r'mosos_http_requests_total\{method="GET",route="/v1/plans",status="401"\} [1-9]', metrics), metrics
    guarded.head("/v1/plans", headers=bearer(TOKEN))
    metrics = guarded.get("/metrics", headers=bearer(TOKEN)).text
    assert re.search(r'mosos_http_requests_total\{method="HEAD",route="/v1/plans",status="200"\} [1-9]', metrics)


# Allow names every method of a path --------------------------------------------------------


def documented_methods(client) -> dict[str, set[str]]:
    paths = client.get("/openapi.json").json()["paths"]
    return {path: {method.upper() for method in item} for path, item in paths.items()}


def test_options_and_405_list_every_method_of_every_path(client):
    checked = 0
    for path, methods in documented_methods(client).items():
        url = re.sub(r"\{[^}]+\}", "0123456789abcdef", path)
        expected = methods | {"OPTIONS"} | ({"HEAD"} if "GET" in methods else set())
        options = client.options(url)
        assert options.status_code == 204, (path, options.text)
        assert set(options.headers["allow"].split(", ")) == expected, (path, options.headers["allow"])
        for unsupported in {"GET", "POST", "PUT", "PATCH", "DELETE"} - methods:
            response = client.request(unsupported, url)
            assert response.status_code == 405, (unsupported, path, response.text)
            assert set(response.headers["allow"].split(", ")) == expected, (unsupported, path, response.headers["allow"])
            assert response.json()["error"] == "method_not_allowed" and path.split("{")[0] in response.json()["message"]
            checked += 1
    assert checked >= 10
    assert client.options("/v1/plans").headers["allow"] == "GET, HEAD, POST, OPTIONS"
    assert client.options("/v1/plans/x").headers["allow"] == "GET, HEAD, DELETE, OPTIONS"


def test_an_unknown_path_is_404_whatever_the_method(client):
    for method in ("GET", "POST", "OPTIONS", "DELETE"):
        assert client.request(method, "/v1/nothing-here").status_code == 404, method


# /docs works offline ----------------------------------------------------------------------


def test_the_docs_page_loads_every_asset_from_the_service_itself(client):
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "cdn" not in html.lower()
    assert not re.findall(r"(?:src|href|url)\s*[=:]\s*['\"](?:https?:)?//", html), html  # nothing from elsewhere
    assets = re.findall(r"(?:src|href)\s*=\s*['\"]([^'\"]+)['\"]", html)
    kinds = {}
    for url in assets:
        answer = client.get(url)
        assert answer.status_code == 200 and answer.content, url
        kinds[url.rsplit(".", 1)[-1]] = answer
    assert set(kinds) == {"js", "css", "png"}, assets
    assert "javascript" in kinds["js"].headers["content-type"] and b"SwaggerUIBundle" in kinds["js"].content
    assert kinds["css"].headers["content-type"].startswith("text/css")
    # Swagger UI 5 or later: earlier ones cannot read the OpenAPI 3.1 documents FastAPI writes.
    version = re.search(rb'PACKAGE_VERSION:"(\d+)\.', kinds["js"].content)
    assert version is not None and int(version.group(1)) >= 5
    schema_url = re.search(r"url:\s*['\"]([^'\"]+)['\"]", html).group(1)
    assert client.get(schema_url).json()["openapi"].startswith("3.1")
    assert '"validatorUrl": null' in html  # no badge fetched from validator.swagger.io


def test_no_documentation_page_that_needs_a_cdn_is_served(client):
    assert client.get("/redoc").status_code == 404


def test_a_key_given_twice_is_refused_not_read_as_its_last_value(client):
    """`memory_ratio` twice in one request was planned at whichever came last."""
    import json

    body = json.dumps(plan_body())[:-1] + ', "wait_s": 5}'  # wait_s again
    response = client.post("/v1/plans", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "the key 'wait_s' appears twice in one object" in response.json()["message"]


def test_the_docs_assets_are_counted_under_their_folder_not_as_unmatched(client):
    page = client.get("/docs").text
    assets = re.findall(r"(?:src|href)\s*=\s*['\"]([^'\"]+)['\"]", page)
    for url in assets:
        assert client.get(url).status_code == 200
    metrics = client.get("/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith("mosos_http_requests_total{")]
    assert not [line for line in counted if 'route="unmatched",status="200"' in line], counted
    assert any('/{path}",status="200"' in line for line in counted), counted
