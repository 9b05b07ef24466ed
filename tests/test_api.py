"""The planning service in-process (FastAPI TestClient): plans, jobs, cache, cancel, limits, errors, auth.

Solves run in real worker processes. Slow solves come from test-only
strategies in a plugin file written to tmp (so they never leak into the
strategy registry of other tests' processes; the parent copy is removed after).
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")

from fastapi.testclient import TestClient  # noqa: E402

from api import Settings, create_app  # noqa: E402
from api.examples import EXAMPLE_PROFILE  # noqa: E402
from api.store import INTERRUPTED, Store  # noqa: E402
from planner.budget import minimum_budget_bytes  # noqa: E402
from planner.profile import parse_profile  # noqa: E402
from planner.schedule import parse_schedule  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.strategies import STRATEGIES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEST_STRATEGIES = ("test-sleep", "test-stubborn", "test-crash")

PLUGIN_SOURCE = textwrap.dedent(
    '''
    """Test-only strategies: a cooperative slow solve, one that ignores cancel, one that crashes."""
    import os
    import time

    from planner.builder import certify
    from planner.strategies import strategy
    from planner.strategies.keep_all import keep_all_schedule


    @strategy("test-sleep", "sleeps time_limit_s, reporting progress, stops early when asked", uses_budget=False)
    def sleepy(profile, budget_bytes, options):
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < options.time_limit_s:
            if options.should_stop is not None and options.should_stop():
                break
            step += 1
            if options.progress is not None:
                objective = 100.0 + 100.0 / step
                options.progress({"strategy": "test-sleep", "objective": objective, "bound": 100.0,
                                  "gap": (objective - 100.0) / objective, "solutions": step})
            time.sleep(0.02)
        return certify(profile, keep_all_schedule(profile, None), "test-sleep")


    @strategy("test-stubborn", "sleeps 10 times time_limit_s and never looks at should_stop", uses_budget=False)
    def stubborn(profile, budget_bytes, options):
        time.sleep(10 * options.time_limit_s)
        return certify(profile, keep_all_schedule(profile, None), "test-stubborn")


    @strategy("test-crash", "the solve process dies", uses_budget=False)
    def crash(profile, budget_bytes, options):
        os._exit(3)
    '''
)


def shipped_profile() -> dict:
    """The smallest shipped example profile if there is one, else the service's own example."""
    candidates = sorted((REPO / "models" / "profiles").glob("*.json"), key=lambda path: path.stat().st_size)
    for path in candidates:
        try:
            data = json.loads(path.read_text())
            parse_profile(data)
        except Exception:
            continue
        if path.stat().st_size < 2 * 2**20:
            return data
    return EXAMPLE_PROFILE


def write_plugin(directory: Path) -> str:
    path = directory / "api_test_strategies.py"
    path.write_text(PLUGIN_SOURCE)
    return str(path)


def forget_test_strategies() -> None:
    for name in TEST_STRATEGIES:
        STRATEGIES.pop(name, None)


def wait_for(client, plan_id: str, states: tuple[str, ...], timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = client.get(f"/v1/plans/{plan_id}").json()
        if body["status"] in states:
            return body
        time.sleep(0.02)
    raise AssertionError(f"plan {plan_id} did not reach {states} in {timeout_s} s (last: {body['status']}: {body.get('reason')})")


def metric(client, name: str, **labels) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    text = client.get("/metrics").text
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        sample_name, _, sample_labels = sample.partition("{")
        found = ",".join(sorted(sample_labels.rstrip("}").split(","))) if sample_labels else ""
        if sample_name == name and found == wanted:
            return float(value)
    return 0.0


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    directory = tmp_path_factory.mktemp("api")
    return Settings(
        db_path=directory / "plans.sqlite3",
        solve_processes=2,
        queue_size=2,
        max_body_bytes=2 * 2**20,
        max_nodes=500,
        max_time_limit_s=30,
        max_solver_workers=2,
        max_wait_s=20,
        cancel_grace_s=1.0,
        overrun_factor=1.0,
        overrun_grace_s=1.5,
        plugins=[write_plugin(directory)],
    )


@pytest.fixture(scope="module")
def client(settings):
    app = create_app(settings)
    try:
        with TestClient(app) as test_client:
            yield test_client
    finally:
        forget_test_strategies()


def plan_request(**overrides) -> dict:
    return {"profile": shipped_profile(), "strategy": "keep-all", "workers": 1, "wait_s": 10, **overrides}


def plan_count(client) -> int:
    return len(client.get("/v1/plans", params={"limit": 100}).json()["plans"])


# Plans --------------------------------------------------------------------------


def test_plan_synchronously_returns_a_schedule_the_simulator_accepts(client):
    response = client.post("/v1/plans", json=plan_request())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "done" and body["feasible"] is True
    profile = parse_profile(shipped_profile())
    schedule = parse_schedule(body["schedule"])
    assert schedule.profile_digest == profile.digest() == body["profile_digest"]
    assert simulate(profile, schedule).peak_memory_bytes == schedule.summary.peak_memory_bytes
    assert client.get(f"/v1/plans/{body['id']}").json()["schedule"] == body["schedule"]


def test_plan_through_a_job_reports_progress_then_the_schedule(client):
    response = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=1.0, wait_s=0, seed=11))
    assert response.status_code == 202, response.text
    plan_id = response.json()["id"]
    assert response.headers["location"] == f"/v1/plans/{plan_id}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # while solving, the status carries the solver's latest figures
        solving = client.get(f"/v1/plans/{plan_id}").json()
        if solving["status"] == "solving" and solving["progress"] is not None:
            break
        time.sleep(0.02)
    assert solving["status"] == "solving" and solving["schedule"] is None
    assert {"objective", "bound", "gap", "elapsed_s"} <= set(solving["progress"])
    done = wait_for(client, plan_id, ("done",))
    assert done["schedule"]["summary"]["strategy"] == "test-sleep"
    # Done: the final figures are the schedule's summary; no last snapshot beside them to contradict them.
    assert done["progress"] is None


def test_an_identical_request_is_answered_from_the_store_without_solving(client):
    request = plan_request(seed=5)
    first = client.post("/v1/plans", json=request)
    assert first.status_code == 200 and first.json()["cached"] is False
    solves = metric(client, "mosos_solves_total", strategy="keep-all", outcome="feasible")
    hits = metric(client, "mosos_cache_hits_total")
    reordered = {key: request[key] for key in reversed(list(request))}
    reordered["wait_s"] = 0  # waiting is not part of the request's identity
    second = client.post("/v1/plans", json=reordered)
    assert second.status_code == 200
    assert second.json()["cached"] is True and second.json()["id"] == first.json()["id"]
    assert second.json()["schedule"] == first.json()["schedule"]
    assert metric(client, "mosos_solves_total", strategy="keep-all", outcome="feasible") == solves
    assert metric(client, "mosos_cache_hits_total") == hits + 1
    other = client.post("/v1/plans", json=plan_request(seed=6))
    assert other.json()["cached"] is False and other.json()["id"] != first.json()["id"]


def test_an_identical_request_in_flight_joins_the_running_job(client):
    request = plan_request(strategy="test-sleep", time_limit_s=1.0, wait_s=0, seed=91)
    first = client.post("/v1/plans", json=request)
    second = client.post("/v1/plans", json=request)
    assert first.status_code == second.status_code == 202
    assert second.json()["id"] == first.json()["id"]
    assert wait_for(client, first.json()["id"], ("done",))["status"] == "done"


def test_an_infeasible_budget_is_a_result_with_the_smallest_feasible_budget(client):
    profile = parse_profile(shipped_profile())
    response = client.post("/v1/plans", json=plan_request(strategy="test-sleep", budget_bytes=1, time_limit_s=0.1))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "done" and body["feasible"] is False and body["schedule"] is None
    assert body["minimum_budget_bytes"] == minimum_budget_bytes(profile)
    assert "below what any plan needs" in body["reason"]
    assert body["proven"] is True  # no plan of any strategy can fit: a proof, reused for identical requests
    assert client.get(f"/v1/plans/{body['id']}/trace").status_code == 409


def test_cancel_a_running_solve_and_a_queued_one(client):
    running = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=20, wait_s=0, seed=21)).json()
    wait_for(client, running["id"], ("solving",))
    started = time.monotonic()
    cancelled = client.post(f"/v1/plans/{running['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert client.get(f"/v1/plans/{running['id']}").json()["status"] == "cancelled"
    assert client.post(f"/v1/plans/{running['id']}/cancel").status_code == 200  # idempotent
    # The worker stops and takes the next plan long before the 20 s limit.
    after = client.post("/v1/plans", json=plan_request(seed=22, wait_s=15))
    assert after.status_code == 200 and time.monotonic() - started < 10
    assert metric(client, "mosos_solves_total", strategy="test-sleep", outcome="cancelled") >= 1
    done = client.post("/v1/plans", json=plan_request(seed=23)).json()
    assert client.post(f"/v1/plans/{done['id']}/cancel").status_code == 409
    assert client.post("/v1/plans/no-such-plan/cancel").status_code == 404


def test_delete_forgets_a_plan_running_or_done(client, caplog):
    """DELETE means what HTTP says: the plan is gone (404 after), cancelled first if it runs. Cancelling and keeping
    the record is POST .../cancel."""
    import logging

    request = plan_request(seed=26)
    done = client.post("/v1/plans", json=request).json()
    assert done["status"] == "done"
    answer = client.delete(f"/v1/plans/{done['id']}")
    assert answer.status_code == 204 and answer.content == b""
    assert client.get(f"/v1/plans/{done['id']}").status_code == 404
    assert client.get(f"/v1/plans/{done['id']}/trace").status_code == 404
    assert client.delete(f"/v1/plans/{done['id']}").status_code == 404
    assert done["id"] not in [plan["id"] for plan in client.get("/v1/plans", params={"limit": 100}).json()["plans"]]
    again = client.post("/v1/plans", json=request).json()  # forgotten: solved anew, not answered from the store
    assert again["cached"] is False and again["id"] != done["id"] and again["status"] == "done"
    with caplog.at_level(logging.ERROR, logger="mosos.api"):
        running = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=20, wait_s=0, seed=27)).json()
        wait_for(client, running["id"], ("solving",))
        assert client.delete(f"/v1/plans/{running['id']}").status_code == 204
        assert client.get(f"/v1/plans/{running['id']}").status_code == 404
        after = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=0.2, seed=28, wait_s=15))
        assert after.status_code == 200 and after.json()["status"] == "done"  # its solve process was freed
    assert not [record for record in caplog.records if running["id"] in record.getMessage()]


def test_a_solve_that_ignores_cancel_is_killed_and_its_process_replaced(client):
    stubborn = client.post("/v1/plans", json=plan_request(strategy="test-stubborn", time_limit_s=25, wait_s=0)).json()
    wait_for(client, stubborn["id"], ("solving",))
    assert client.post(f"/v1/plans/{stubborn['id']}/cancel").json()["status"] == "cancelled"
    seeds = iter(range(100, 200))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # both processes serve plans again
        first = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=0.5, seed=next(seeds), wait_s=0))
        second = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=0.5, seed=next(seeds), wait_s=0))
        states = [wait_for(client, r.json()["id"], ("done", "failed"))["status"] for r in (first, second)]
        health = client.get("/healthz").json()
        if states == ["done", "done"] and health["solves_running"] == 0:
            break
    else:
        raise AssertionError("the solve processes did not recover")
    assert client.get(f"/v1/plans/{stubborn['id']}").json()["status"] == "cancelled"


def test_a_solve_far_past_its_time_limit_is_stopped_and_fails(client):
    body = client.post("/v1/plans", json=plan_request(strategy="test-stubborn", time_limit_s=0.5, wait_s=10)).json()
    if body["status"] != "failed":
        body = wait_for(client, body["id"], ("failed",))
    assert "far past its time limit of 0.5 s" in body["reason"]
    assert metric(client, "mosos_solves_total", strategy="test-stubborn", outcome="failed") == 1


def test_a_crashed_solve_process_fails_its_plan_and_is_replaced(client):
    response = client.post("/v1/plans", json=plan_request(strategy="test-crash", wait_s=10))
    body = response.json()
    if body["status"] != "failed":
        body = wait_for(client, body["id"], ("failed",))
    assert "solve process died" in body["reason"]
    later = client.post("/v1/plans", json=plan_request(seed=31, wait_s=15))
    assert later.status_code == 200 and later.json()["status"] == "done"


def wait_until_idle(client, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = client.get("/healthz").json()
        if health["solve_processes_ready"] == health["solve_processes"] and health["solves_running"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the solve processes are not idle: {health}")


def test_a_full_queue_answers_429_with_retry_after_and_stores_nothing(client):
    wait_until_idle(client)
    busy = [
        client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=20, wait_s=0, seed=40 + i)).json()
        for i in range(4)  # 2 solving + 2 waiting (queue_size 2)
    ]
    try:
        assert [b["status"] for b in busy].count("queued") >= 2
        before = plan_count(client)
        refused = client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=20, wait_s=0, seed=49))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["limit"] == "queue_size"
        assert plan_count(client) == before
        assert client.get("/healthz").json()["queue_depth"] == 2
        assert metric(client, "mosos_queue_depth") == 2
    finally:
        for plan in busy:
            client.post(f"/v1/plans/{plan['id']}/cancel")
    assert wait_for(client, busy[0]["id"], ("cancelled",))


# Bad input, limits ---------------------------------------------------------------


def test_bad_input_gets_422_with_paths_and_sentences_and_stores_nothing(client):
    before = plan_count(client)
    profile = json.loads(json.dumps(shipped_profile()))
    profile["nodes"][0]["implementations"] = []
    profile["nodes"][-1]["inputs"] = ["ghost"]
    no_links = json.loads(json.dumps(shipped_profile()))
    no_links["hardware"].pop("d2h_bandwidth_gb_per_s", None)
    no_links["hardware"].pop("h2d_bandwidth_gb_per_s", None)
    cases = [
        (plan_request(profile=no_links, strategy="vdnn-all", memory_ratio=0.9), ["strategy"]),
        (plan_request(profile=profile), ["profile.nodes[0].implementations"]),
        (plan_request(strategy="nope"), ["strategy"]),
        (plan_request(strategy="test-sleep", budget_bytes=10, memory_ratio=0.5), [""]),
        (plan_request(memory_ratio=1.5), ["memory_ratio"]),
        (plan_request(memory_ratio="0.5"), ["memory_ratio"]),
        (plan_request(budget_bytes=True), ["budget_bytes"]),
        (plan_request(unknown_field=1), ["unknown_field"]),
        ({"strategy": "keep-all"}, ["profile"]),
    ]
    for request, paths in cases:
        response = client.post("/v1/plans", json=request)
        assert response.status_code == 422, (request.keys(), response.text)
        body = response.json()
        assert [issue["path"] for issue in body["issues"]][: len(paths)] == paths or set(paths) <= {
            issue["path"] for issue in body["issues"]
        }, body
        assert all(issue["message"] for issue in body["issues"])
    broken = client.post("/v1/plans", content=b'{"profile": ', headers={"content-type": "application/json"})
    assert broken.status_code == 422 and broken.json()["issues"][0]["message"].startswith("not valid JSON")
    assert client.post("/v1/plans", json=[1, 2]).json()["issues"][0]["message"] == (
        "a plan request is a JSON object, not a list")
    # in JSON's words, not pydantic's ("Input should be a valid dictionary or instance of GraphProfile")
    listed = client.post("/v1/plans", json=plan_request(profile=[1, 2])).json()["issues"]
    assert listed == [{"path": "profile", "message": "must be a JSON object, not a list"}], listed
    # a declared charset changes nothing (RFC 8259), and a body in another one is told so
    latin = json.dumps(plan_request(seed=1)).replace('"seed"', '"caf\u00e9": 1, "seed"', 1)
    latin = json.dumps(json.loads(latin), ensure_ascii=False).encode("latin-1")
    refused = client.post("/v1/plans", content=latin, headers={"content-type": "application/json; charset=latin-1"})
    message = refused.json()["issues"][0]["message"]
    assert refused.status_code == 422 and message.startswith("not UTF-8 text") and "RFC 8259" in message, message
    # Numbers so large that a step's sums would overflow are refused at their path, never answered with a 500.
    huge = json.loads(json.dumps(shipped_profile()))
    huge["nodes"][0]["implementations"][0]["time_ms"] = 1e308
    for endpoint, body in (("/v1/plans", plan_request(profile=huge)), ("/v1/simulate", {"profile": huge, "schedule": {}})):
        answer = client.post(endpoint, json=body)
        assert answer.status_code == 422, answer.text
        assert "profile.nodes[0].implementations[0].time_ms" in [issue["path"] for issue in answer.json()["issues"]]
    deep = client.post("/v1/plans", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert deep.status_code == 422 and "nested too deeply" in deep.json()["issues"][0]["message"]
    assert plan_count(client) == before


def test_profile_messages_are_the_cli_messages(client):
    from planner.errors import ProfileError

    profile = json.loads(json.dumps(shipped_profile()))
    profile["nodes"][1]["inputs"] = [profile["nodes"][1]["id"]]
    with pytest.raises(ProfileError) as raised:
        parse_profile(profile)
    expected = [(f"profile.{issue.path}", issue.message) for issue in raised.value.issues]
    body = client.post("/v1/plans", json=plan_request(profile=profile)).json()
    assert [(issue["path"], issue["message"]) for issue in body["issues"]] == expected


def test_limits_are_named(client, settings):
    big = client.post("/v1/plans", content=b" " * (settings.max_body_bytes + 1), headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["limit"] == "max_body_bytes"
    def chunks():  # no content-length: counted while it is read
        for _ in range(settings.max_body_bytes // 65536 + 2):
            yield b" " * 65536

    streamed = client.post("/v1/plans", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["limit"] == "max_body_bytes"
    many = plan_request(profile={**EXAMPLE_PROFILE, "nodes": [EXAMPLE_PROFILE["nodes"][0]] * (settings.max_nodes + 1)})
    response = client.post("/v1/plans", json=many)
    assert response.status_code == 413 and response.json()["limit"] == "max_nodes"
    slow = client.post("/v1/plans", json=plan_request(time_limit_s=settings.max_time_limit_s + 1))
    assert slow.status_code == 422 and slow.json()["limit"] == "max_time_limit_s"
    assert "max_time_limit_s" in slow.json()["issues"][0]["message"]
    threads = client.post("/v1/plans", json=plan_request(workers=settings.max_solver_workers + 1))
    assert threads.status_code == 422 and threads.json()["limit"] == "max_solver_workers"
    wait = client.post("/v1/plans", json=plan_request(wait_s=settings.max_wait_s + 1))
    assert wait.status_code == 422 and wait.json()["limit"] == "max_wait_s"


# Listing, simulation, traces, metrics --------------------------------------------


def test_listing_pages_newest_first(client):
    ids = [client.post("/v1/plans", json=plan_request(seed=60 + i)).json()["id"] for i in range(3)]
    first = client.get("/v1/plans", params={"limit": 2}).json()
    assert [plan["id"] for plan in first["plans"]] == ids[::-1][:2]
    assert all("schedule" not in plan for plan in first["plans"])
    second = client.get("/v1/plans", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert second["plans"][0]["id"] == ids[0]
    for cursor in ("x", ""):
        refused = client.get("/v1/plans", params={"cursor": cursor})
        assert refused.status_code == 422 and refused.json()["issues"] == [{
            "path": "query.cursor", "message": f"must be the next_cursor of an earlier page (up to 18 digits), not "
                                               f"{cursor!r}; leave it out for the first page"}], refused.text


def test_simulate_returns_figures_or_the_first_violation(client):
    body = client.post("/v1/plans", json=plan_request(seed=70)).json()
    ok = client.post("/v1/simulate", json={"profile": shipped_profile(), "schedule": body["schedule"]})
    assert ok.status_code == 200 and ok.json()["valid"] is True
    assert ok.json()["figures"]["peak_memory_bytes"] == body["schedule"]["summary"]["peak_memory_bytes"]
    tight = client.post("/v1/simulate", json={"profile": shipped_profile(), "schedule": body["schedule"], "budget_bytes": 1})
    assert tight.status_code == 200 and tight.json()["valid"] is False
    assert "over the budget" in tight.json()["violation"]["reason"]
    bad = client.post("/v1/simulate", json={"profile": shipped_profile(), "schedule": {"stages": []}})
    assert bad.status_code == 422 and {"schedule.profile_name", "schedule.profile_digest"} <= {
        issue["path"] for issue in bad.json()["issues"]
    }


def test_a_lost_request_process_is_a_503_then_a_fresh_pool_answers(client):
    """Request bodies are read in request processes; if one dies the server answers 503 once, never 500."""
    body = client.post("/v1/plans", json=plan_request(seed=75)).json()
    request = {"profile": shipped_profile(), "schedule": body["schedule"]}
    pool = client.app.state.service.pool
    victim = next(iter(pool._executor._processes.values()))
    victim.kill()
    victim.join(timeout=10)
    codes = []
    for _ in range(20):
        answer = client.post("/v1/simulate", json=request)
        codes.append(answer.status_code)
        if answer.status_code == 503:
            assert answer.json()["error"] == "request_process_lost" and "retry" in answer.json()["message"]
        if answer.status_code == 200:
            break
        time.sleep(0.05)
    assert set(codes) <= {200, 503} and codes[-1] == 200, codes
    assert client.post("/v1/simulate", json=request).json()["valid"] is True


def test_trace_and_memory_picture_of_a_done_plan(client):
    body = client.post("/v1/plans", json=plan_request(seed=80)).json()
    trace = client.get(f"/v1/plans/{body['id']}/trace")
    assert trace.status_code == 200
    events = trace.json()["traceEvents"]
    assert any(event["ph"] == "X" for event in events) and any(event["ph"] == "C" for event in events)
    picture = client.get(f"/v1/plans/{body['id']}/memory.png")
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
    assert picture.content.startswith(b"\x89PNG")
    assert client.get("/v1/plans/unknown/memory.png").status_code == 404


def test_viewer_page_of_a_done_plan(client):
    from planner.viewer import content_security_policy, plan_view_html

    body = client.post("/v1/plans", json=plan_request(seed=81)).json()
    assert body["links"]["view"] == f"/v1/plans/{body['id']}/view"
    page = client.get(body["links"]["view"])
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == content_security_policy(header=True)
    assert page.headers["x-content-type-options"] == "nosniff"
    profile, schedule = parse_profile(shipped_profile()), parse_schedule(body["schedule"])
    assert page.text == plan_view_html(profile, schedule, title=f"{profile.name} (keep-all)")
    assert client.get("/v1/plans/unknown/view").status_code == 404
    infeasible = client.post("/v1/plans", json=plan_request(budget_bytes=1, strategy="test-sleep", time_limit_s=0.1)).json()
    refused = client.get(f"/v1/plans/{infeasible['id']}/view")
    assert refused.status_code == 409 and "no schedule to replay" in refused.json()["message"]


def test_health_metrics_and_docs(client):
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and "keep-all" in health["strategies"]
    text = client.get("/metrics").text
    for name in ("mosos_http_requests_total", "mosos_solves_total", "mosos_solve_seconds", "mosos_cache_hits_total", "mosos_queue_depth"):
        assert name in text
    assert client.get("/docs").status_code == 200


# Auth, store recovery, the serve command --------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with a token and only the shipped strategies (mosos runs every registered one inside)."""
    directory = tmp_path_factory.mktemp("guarded")
    app = create_app(Settings(db_path=directory / "plans.sqlite3", solve_processes=1, token="s3cret", max_solver_workers=1))
    with TestClient(app) as client:
        yield client


def test_bearer_token_guards_everything_but_healthz(guarded):
    assert guarded.get("/healthz").status_code == 200
    for path in ("/v1/plans", "/metrics", "/openapi.json", "/docs"):
        assert guarded.get(path).status_code == 401
        assert guarded.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get("/v1/plans", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    denied = guarded.post("/v1/plans", json=plan_request())
    assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Bearer")


def test_the_openapi_example_request_works(guarded):
    headers = {"Authorization": "Bearer s3cret"}
    schema = guarded.get("/openapi.json", headers=headers).json()
    assert {"GraphProfile", "Schedule", "PlanRequest", "PlanStatus"} <= set(schema["components"]["schemas"])
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    example = schema["paths"]["/v1/plans"]["post"]["requestBody"]["content"]["application/json"]["example"]
    response = guarded.post("/v1/plans", json=example, headers=headers)
    assert response.status_code in (200, 202), response.text
    deadline = time.monotonic() + 30
    body = response.json()
    while body["status"] in ("queued", "solving") and time.monotonic() < deadline:
        time.sleep(0.05)
        body = guarded.get(f"/v1/plans/{body['id']}", headers=headers).json()
    assert body["status"] == "done" and body["feasible"] is True, body.get("reason")
    assert body["schedule"]["summary"]["strategy"] == example["strategy"]


def test_store_recovery_marks_unfinished_plans_interrupted(tmp_path):
    store = Store(tmp_path / "plans.sqlite3")
    common = dict(request_hash="h", profile_digest="d", profile_name="p", profile_json="{}", node_count=1, strategy="s", options={})
    store.insert(plan_id="queued", **common)
    store.insert(plan_id="solving", **common)
    store.mark_solving("solving")
    store.insert(plan_id="done", **common)
    assert store.finish("done", "done", schedule_json="{}", feasible=True)
    assert store.recover() == 2
    assert [store.get(i).status for i in ("queued", "solving", "done")] == ["failed", "failed", "done"]
    assert store.get("solving").reason == INTERRUPTED
    assert not store.finish("queued", "done")  # a finished plan is never overwritten
    store.close()


def test_serve_refuses_a_public_address_without_a_token(monkeypatch):
    from typer.testing import CliRunner

    from cli import app

    monkeypatch.delenv("MOSOS_API_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert "refusing to bind 0.0.0.0 without a token" in result.output


def test_token_comes_from_the_file_or_the_environment(tmp_path, monkeypatch):
    from api.settings import TOKEN_ENV, is_loopback, read_token

    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert read_token(None) == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert read_token(token_file) == "from-file"
    monkeypatch.setenv(TOKEN_ENV, "  ")
    assert read_token(None) is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")


def test_a_request_waiting_on_a_solve_answers_503_at_once_when_the_server_shuts_down(client):
    """SIGTERM with a client waiting on a plan: uvicorn waited its 5 s grace period, then cancelled the request,
    which the client got as a bare 500; now the waiting request sees the shutdown and answers a JSON 503."""
    import threading
    from types import SimpleNamespace

    server = SimpleNamespace(should_exit=False)
    client.app.state.http_server = server
    answers = {}
    try:
        waiting = threading.Thread(target=lambda: answers.setdefault("answer", client.post(
            "/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=3.0, wait_s=15, seed=503))))
        waiting.start()
        time.sleep(0.5)
        server.should_exit = True
        stopped = time.monotonic()
        waiting.join(timeout=10)
        took_s = time.monotonic() - stopped
    finally:
        client.app.state.http_server = None
    answer = answers["answer"]
    assert answer.status_code == 503 and answer.json()["error"] == "stopping", answer.text
    assert answer.headers["retry-after"] == "5" and took_s < 1.0, took_s
