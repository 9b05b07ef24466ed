"""The service with its solves on Ray (`backend="ray"`, the session's local Ray): plan, cache, progress,
cancel, a solve killed for ignoring its cancel or for overrunning, a worker that dies; the same answers
and the same store as with local processes."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray")

from fastapi.testclient import TestClient  # noqa: E402

from api import Settings, create_app  # noqa: E402
from planner.profile import parse_profile  # noqa: E402
from planner.schedule import parse_schedule  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from tests.test_api import forget_test_strategies, metric, plan_request, shipped_profile, wait_for, write_plugin  # noqa: E402


@pytest.fixture(scope="module")
def ray_client(local_ray, tmp_path_factory):
    directory = tmp_path_factory.mktemp("api-ray")
    settings = Settings(
        db_path=directory / "plans.sqlite3",
        backend="ray",
        solve_processes=2,
        queue_size=4,
        max_time_limit_s=30,
        max_solver_workers=1,
        max_wait_s=30,
        cancel_grace_s=1.0,
        overrun_factor=1.0,
        overrun_grace_s=1.5,
        plugins=[write_plugin(directory)],
    )
    try:
        with TestClient(create_app(settings)) as client:
            yield client
    finally:
        forget_test_strategies()


def test_health_says_solves_run_on_ray(ray_client):
    health = ray_client.get("/healthz").json()
    assert health["backend"] == "ray"
    assert health["solve_processes"] == health["solve_processes_ready"] == 2


def test_a_plan_on_ray_then_the_same_request_from_the_store(ray_client):
    request = plan_request(strategy="mosos", memory_ratio=0.8, time_limit_s=5, seed=3, wait_s=30)
    first = ray_client.post("/v1/plans", json=request)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["status"] == "done" and body["feasible"] is True and body["cached"] is False
    profile = parse_profile(shipped_profile())
    schedule = parse_schedule(body["schedule"])
    figures = simulate(profile, schedule, schedule.budget_bytes)
    assert figures.peak_memory_bytes == schedule.summary.peak_memory_bytes <= schedule.budget_bytes
    solves = metric(ray_client, "mosos_solves_total", strategy="mosos", outcome="feasible")
    second = ray_client.post("/v1/plans", json={**request, "wait_s": 0})
    assert second.status_code == 200
    assert second.json()["cached"] is True and second.json()["id"] == body["id"]
    assert second.json()["schedule"] == body["schedule"]
    assert metric(ray_client, "mosos_solves_total", strategy="mosos", outcome="feasible") == solves


def test_progress_then_cancel_on_ray_frees_the_slot(ray_client):
    running = ray_client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=20, wait_s=0, seed=21)).json()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the solver's figures come back through the control actor
        solving = ray_client.get(f"/v1/plans/{running['id']}").json()
        if solving["status"] == "solving" and solving["progress"] is not None:
            break
        time.sleep(0.05)
    assert solving["status"] == "solving" and {"objective", "bound", "gap", "elapsed_s"} <= set(solving["progress"])
    started = time.monotonic()
    cancelled = ray_client.post(f"/v1/plans/{running['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    # Both slots solve again long before the 20 s limit: the cancelled task stopped on its own.
    after = [ray_client.post("/v1/plans", json=plan_request(strategy="test-sleep", time_limit_s=0.2, seed=22 + i, wait_s=0))
             for i in range(2)]
    assert [wait_for(ray_client, r.json()["id"], ("done",), 30)["status"] for r in after] == ["done", "done"]
    assert time.monotonic() - started < 15
    assert ray_client.get(f"/v1/plans/{running['id']}").json()["status"] == "cancelled"
    assert metric(ray_client, "mosos_solves_total", strategy="test-sleep", outcome="cancelled") >= 1


def test_a_stubborn_solve_is_killed_after_its_cancel_and_an_overrun_fails(ray_client):
    stubborn = ray_client.post("/v1/plans", json=plan_request(strategy="test-stubborn", time_limit_s=25, wait_s=0)).json()
    wait_for(ray_client, stubborn["id"], ("solving",), 60)
    assert ray_client.post(f"/v1/plans/{stubborn['id']}/cancel").json()["status"] == "cancelled"
    overrun = ray_client.post("/v1/plans", json=plan_request(strategy="test-stubborn", time_limit_s=0.5, wait_s=0)).json()
    body = wait_for(ray_client, overrun["id"], ("failed",), 60)
    assert "far past its time limit of 0.5 s" in body["reason"]
    later = ray_client.post("/v1/plans", json=plan_request(seed=41, wait_s=30))
    assert later.status_code == 200 and later.json()["status"] == "done"
    assert ray_client.get("/healthz").json()["solves_running"] == 0


def test_a_dead_ray_worker_fails_its_plan_and_the_next_plan_is_solved(ray_client):
    body = ray_client.post("/v1/plans", json=plan_request(strategy="test-crash", wait_s=30)).json()
    if body["status"] != "failed":
        body = wait_for(ray_client, body["id"], ("failed",), 60)
    assert "solve process died" in body["reason"] and "WorkerCrashedError" in body["reason"]
    later = ray_client.post("/v1/plans", json=plan_request(seed=51, wait_s=30))
    assert later.status_code == 200 and later.json()["status"] == "done"
