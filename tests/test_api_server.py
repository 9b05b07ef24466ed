"""A real `mosos serve` process on a loopback port: plans over HTTP, kill -9 durability, 50 requests in flight.

Every server runs in its own session and is killed with it at the end of its test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("service_concurrency_bench", REPO / "benchmarks" / "service_concurrency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _session_members(session_id: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session_id:
                    members.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return members


def _wait_status(base: str, plan_id: str, states: tuple[str, ...], timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = httpx.get(f"{base}/v1/plans/{plan_id}", timeout=10).json()
        if body["status"] in states:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{plan_id} did not reach {states}: {body['status']}")


def test_a_real_server_plans_synchronously_through_a_job_and_from_the_store(tmp_path):
    profile = bench.chain_profile(8)
    with bench.serve(tmp_path) as (_, base, _log):
        sync = httpx.post(f"{base}/v1/plans", json={"profile": profile, "strategy": "keep-all", "wait_s": 20}, timeout=30)
        assert sync.status_code == 200 and sync.json()["status"] == "done"
        job = httpx.post(
            f"{base}/v1/plans",
            json={"profile": profile, "strategy": "bench-busy", "time_limit_s": 0.5, "workers": 1, "wait_s": 0},
            timeout=30,
        )
        assert job.status_code == 202
        assert job.headers["location"] == f"/v1/plans/{job.json()['id']}"
        done = _wait_status(base, job.json()["id"], ("done",))
        assert done["schedule"]["summary"]["strategy"] == "bench-busy"
        again = httpx.post(f"{base}/v1/plans", json={"profile": profile, "strategy": "keep-all", "wait_s": 0}, timeout=30)
        assert again.status_code == 200 and again.json()["cached"] is True
        assert again.content.split(b'"schedule":', 1)[1] == sync.content.split(b'"schedule":', 1)[1]
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert "mosos_cache_hits_total 1.0" in metrics
        assert 'mosos_solves_total{outcome="feasible",strategy="keep-all"} 1.0' in metrics


def test_after_kill_9_and_restart_finished_plans_are_there_and_the_running_one_failed(tmp_path):
    profile = bench.chain_profile(8)
    db = tmp_path / "durable.sqlite3"
    with bench.serve(tmp_path, db=db) as (process, base, _log):
        finished = httpx.post(f"{base}/v1/plans", json={"profile": profile, "strategy": "keep-all", "wait_s": 20}, timeout=30)
        assert finished.status_code == 200
        running = httpx.post(
            f"{base}/v1/plans",
            json={"profile": profile, "strategy": "bench-busy", "time_limit_s": 60, "workers": 1, "wait_s": 0},
            timeout=30,
        ).json()
        _wait_status(base, running["id"], ("solving",))
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _session_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session_members(process.pid) == [], "solve processes outlived the killed server"
    with bench.serve(tmp_path, db=db) as (_, base, log_path):
        kept = httpx.get(f"{base}/v1/plans/{finished.json()['id']}", timeout=10)
        assert kept.status_code == 200 and kept.json()["status"] == "done"
        assert kept.json()["schedule"] == finished.json()["schedule"]
        interrupted = httpx.get(f"{base}/v1/plans/{running['id']}", timeout=10).json()
        assert interrupted["status"] == "failed" and interrupted["reason"] == "interrupted by restart"
        assert str(db) in log_path.read_text()  # the store's path is in the startup log


def test_fifty_requests_in_flight_against_two_solve_processes(tmp_path):
    with bench.serve(tmp_path, workers=2, queue_size=32) as (_, base, _log):
        stats = asyncio.run(bench.run_mix(base, requests=50, plans=10, simulates=10, solve_seconds=1.0))
    assert stats["answered"] == stats["requests"] == 50
    assert stats["errors"] == [] and stats["wrong"] == []
    assert stats["plans"] == 10
    assert sorted(stats["finals"].values()) == ["done"] * 10  # none lost, none stuck
    assert stats["busy_during"] >= 1 and stats["status_errors_during"] == []
    # Generous bounds for a loaded 2-core CI machine (the 50 ms is measured, with the load average, in
    # benchmarks/results/service.md: 17-37 ms in the burst). Status calls that waited for a solve, for a body
    # being validated or for the thread pool behind plan writes would take far longer than these.
    assert stats["status_p50_sequential_ms"] < 250, stats
    assert stats["status_p50_during_ms"] < 1000, stats
    assert stats["status_p50_burst_ms"] < 500, stats
    # A separate client polling during the burst (the way a training job polls) is not held up by it.
    assert stats["probe_errors"] == [], stats
    if stats["probe_calls_burst"]:
        assert stats["probe_p50_burst_ms"] < 250, stats


async def _status_while_simulating(base: str, plan_id: str, body: dict, simulations: int) -> tuple[list[float], list[float]]:
    """Status calls one at a time while `simulations` heavy simulate requests are in flight: (status s, simulate s)."""

    async def timed(request) -> float:
        started = time.perf_counter()
        response = await request
        assert response.status_code == 200, response.text
        return time.perf_counter() - started

    async with httpx.AsyncClient(base_url=base, timeout=120.0) as client:
        pending = [asyncio.ensure_future(timed(client.post("/v1/simulate", json=body))) for _ in range(simulations)]
        await asyncio.sleep(0.05)  # let the bodies go out first
        status = []
        while not all(task.done() for task in pending):
            seconds = await timed(client.get(f"/v1/plans/{plan_id}"))
            if not all(task.done() for task in pending):  # count only calls that ended while simulations ran
                status.append(seconds)
        return status, list(await asyncio.gather(*pending))


def test_status_calls_stay_fast_while_heavy_simulations_are_in_flight(tmp_path):
    """Simulations are read and replayed in request processes: status calls do not queue behind them."""
    profile = bench.chain_profile(200)  # 401 nodes: each simulate request is tens of ms of CPU
    with bench.serve(tmp_path) as (_, base, _log):
        plan = httpx.post(f"{base}/v1/plans", json={"profile": profile, "strategy": "keep-all", "wait_s": 30}, timeout=60)
        assert plan.status_code == 200, plan.text
        body = {"profile": profile, "schedule": plan.json()["schedule"]}
        status, simulate = asyncio.run(_status_while_simulating(base, plan.json()["id"], body, simulations=10))
    assert status, f"no status call ended while the simulations ran: each waited for them ({simulate})"
    status_p50, simulate_p50 = (sorted(x)[len(x) // 2] for x in (status, simulate))
    # Generous for a loaded 2-core CI machine: a status call is a store read, a simulation is CPU work queued on
    # two request processes. Had the status calls waited for that work (the server's GIL, as when the server
    # validated and simulated in its own threads), they would take about as long as the simulations.
    assert status_p50 < 0.2 * simulate_p50, (status, simulate)
    assert status_p50 < 0.3, (status, simulate)
    assert len(status) >= 3, (status, simulate)


def test_a_real_server_takes_a_non_ascii_token_and_refuses_cross_origin_text_bodies(tmp_path):
    """Through uvicorn and httptools: the token's UTF-8 bytes reach the check untouched, and a text/plain body
    from another origin (no preflight, no token needed on loopback) is refused before anything is queued."""
    token = "clé-секрет-🔑"
    token_file = tmp_path / "token"
    token_file.write_bytes(f"{token}\n".encode())
    profile = bench.chain_profile(4)
    with bench.serve(tmp_path, extra=["--token-file", str(token_file)]) as (_, base, _log):
        good = {"Authorization": b"Bearer " + token.encode("utf-8")}
        assert httpx.get(f"{base}/v1/plans", headers=good, timeout=10).status_code == 200
        assert httpx.get(f"{base}/v1/plans", headers={"Authorization": b"Bearer " + token.encode("latin-1", "replace")},
                         timeout=10).status_code == 401
        import json

        body = json.dumps({"profile": profile, "strategy": "keep-all", "wait_s": 10}).encode()
        for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
            refused = httpx.post(f"{base}/v1/plans", content=body, timeout=30,
                                 headers={**good, "Content-Type": content_type, "Origin": "https://attacker.example"})
            assert refused.status_code == 415, refused.text
        assert httpx.get(f"{base}/v1/plans", headers=good, timeout=10).json()["plans"] == []
        accepted = httpx.post(f"{base}/v1/plans", content=body, timeout=30,
                              headers={**good, "Content-Type": "application/json; charset=utf-8"})
        assert accepted.status_code == 200 and accepted.json()["status"] == "done", accepted.text
