"""The OpenAPI document and the server agree: schemathesis with every check, and the constraints the document states.

The schemathesis run is benchmarks/service_schemathesis.py with few examples per
operation (about a thousand generated requests, every phase, a bearer token);
the long run and its figures are in benchmarks/results/service.md. Any failure,
error, or 5xx the server counted fails the test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")
pytest.importorskip("schemathesis")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from api import Settings, create_app  # noqa: E402
from planner.strategies import load_all  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("service_schemathesis_bench", REPO / "benchmarks" / "service_schemathesis.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schemathesis_with_every_check_finds_nothing(tmp_path):
    bench = _load_bench()
    result = bench.run_schemathesis(tmp_path, max_examples=10, seed=1, token=True, timeout_s=900)
    summary = {key: result[key] for key in ("generated", "failures", "errors", "phases", "server_5xx", "statuses", "plans",
                                            "internal_errors", "exit_code")}
    assert result["complete"] and result["exit_code"] == 0, (summary, result["output"][-8000:])
    assert result["failures"] == [] and result["errors"] == [], (summary, result["output"][-8000:])
    assert result["server_5xx"] == 0 and result["internal_errors"] == 0, summary
    assert result["tracebacks_in_server_log"] == 0, summary
    assert set(result["phases"].values()) == {"success"}, summary
    assert result["operations"] >= 10 and result["generated"] >= 500, summary
    assert result["statuses"].get("401", 0) > 0, summary  # the token was tested, not only presented


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    settings = Settings(db_path=tmp_path_factory.mktemp("schema") / "plans.sqlite3", solve_processes=1,
                        request_processes=1, max_nodes=77, max_time_limit_s=12, max_solver_workers=3, max_wait_s=7,
                        token="t")
    with TestClient(create_app(settings)) as client:
        yield client.get("/openapi.json", headers={"Authorization": "Bearer t"}).json()


def test_the_document_states_this_servers_limits_and_strategies(document):
    schemas = document["components"]["schemas"]
    request = schemas["PlanRequest"]["properties"]
    assert request["strategy"]["enum"] == sorted(load_all())
    bounds = {name: [branch.get("maximum") for branch in request[name]["anyOf"] if "type" in branch and branch["type"] != "null"]
              for name in ("time_limit_s", "workers", "wait_s")}
    assert bounds == {"time_limit_s": [12], "workers": [3], "wait_s": [7]}
    assert schemas["GraphProfile"]["properties"]["nodes"]["maxItems"] == 77
    assert schemas["Node"]["properties"]["implementations"]["minItems"] == 1
    assert schemas["GraphProfile"]["properties"]["schema_version"]["enum"] == ["1.0"]
    assert all("op" in schemas[name]["required"] for name in ("Compute", "Offload", "Prefetch", "Wait", "Free"))
    rules = schemas["PlanRequest"]["allOf"]
    assert rules[0]["not"]["required"] == ["budget_bytes", "memory_ratio"]
    budgeted = {name for name, info in load_all().items() if info.uses_budget}
    moving = {name for name, info in load_all().items() if info.needs_transfers}
    assert set(rules[1]["if"]["properties"]["strategy"]["enum"]) == budgeted
    assert set(rules[2]["if"]["properties"]["strategy"]["enum"]) == moving


def test_every_body_answers_415_and_open_paths_need_no_token(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if "requestBody" in operation:
                assert "415" in operation["responses"], (method, path)
            if path == "/healthz":
                assert operation["security"] == [], "healthz is open, the document must not ask for a token"
            else:
                assert "security" not in operation and document["security"] == [{"bearer": []}]
