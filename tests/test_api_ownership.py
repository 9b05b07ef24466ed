"""One server per plan store: a second `mosos serve` on a store a live server holds refuses to start, naming it.

Real server processes (each in its own session, killed with it). The first
server solves a plan that finishes only when the test opens a gate file, so the
second server is tried while the plan is certainly `solving`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("platformdirs")
httpx = pytest.importorskip("httpx")

from api.store import INTERRUPTED, Store  # noqa: E402
from planner.strategies import STRATEGIES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROFILE = {
    "name": "two nodes",
    "hardware": {"name": "test GPU", "memory_capacity_bytes": 2**30},
    "nodes": [
        {"id": "f", "kind": "forward", "output_bytes": 2**20, "implementations": [{"name": "a", "time_ms": 1.0}]},
        {"id": "loss", "kind": "loss", "output_bytes": 4, "inputs": ["f"], "implementations": [{"name": "a", "time_ms": 0.1}]},
    ],
    "provenance": {"source": "handmade"},
}


def write_gate_plugin(directory: Path) -> tuple[Path, Path]:
    """A strategy that solves until the gate file exists (or it is cancelled): (plugin, gate)."""
    gate = directory / "gate"
    plugin = directory / "gate_strategy.py"
    plugin.write_text(textwrap.dedent(f'''
        import time
        from pathlib import Path

        from planner.builder import certify
        from planner.strategies import strategy
        from planner.strategies.keep_all import keep_all_schedule

        GATE = Path({str(gate)!r})


        @strategy("test-gate", "solves until the test opens the gate", uses_budget=False)
        def gated(profile, budget_bytes, options):
            while not GATE.exists():
                if options.should_stop is not None and options.should_stop():
                    break
                time.sleep(0.05)
            return certify(profile, keep_all_schedule(profile, None), "test-gate")
    '''))
    return plugin, gate


def environment(data_home: Path) -> dict[str, str]:
    """The default store lives under XDG_DATA_HOME (platformdirs): a private one per test."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_DATA_HOME": str(data_home)}
    env.pop("MOSOS_API_TOKEN", None)
    return env


def serve_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--request-processes", "1", "--max-solver-workers", "1", "--log-level", "warning", *args]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(port: int, args: list[str], env: dict, log_path: Path):
    with open(log_path, "wb") as log:
        process = subprocess.Popen(serve_command(port, *args), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the first server exited with {process.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"the first server did not answer in 90 s:\n{log_path.read_text()}"
            time.sleep(0.1)
        yield process, base
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def second_server(port: int, args: list[str], env: dict) -> str:
    """Start a second server and expect it to refuse at once: its output (a server that starts is killed)."""
    process = subprocess.Popen(serve_command(port, *args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"the second server started instead of refusing:\n{output.decode(errors='replace')}")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    text = output.decode(errors="replace")
    assert process.returncode == 2, text
    assert "Traceback" not in text, text
    return " ".join(text.split())


def status(base: str, plan_id: str) -> dict:
    return httpx.get(f"{base}/v1/plans/{plan_id}", timeout=10).json()


def test_a_second_server_on_a_held_store_refuses_and_the_first_keeps_its_running_plan(tmp_path):
    plugin, gate = write_gate_plugin(tmp_path)
    env = environment(tmp_path / "data")
    default_store = tmp_path / "data" / "mosos" / "plans.sqlite3"
    (tmp_path / "link").symlink_to(tmp_path / "data" / "mosos", target_is_directory=True)
    port = free_port()
    with running_server(port, ["--plugin", str(plugin)], env, tmp_path / "first.log") as (first, base):
        assert default_store.exists()
        plan = httpx.post(f"{base}/v1/plans", json={"profile": PROFILE, "strategy": "test-gate", "time_limit_s": 60,
                                                    "wait_s": 0}, timeout=30)
        assert plan.status_code == 202, plan.text
        plan_id = plan.json()["id"]
        deadline = time.monotonic() + 30
        while status(base, plan_id)["status"] != "solving":
            assert time.monotonic() < deadline, status(base, plan_id)
            time.sleep(0.05)
        other_port = free_port()
        cases = [
            ([], port),  # `mosos serve` twice: the default store, the same port
            ([], other_port),  # the default store, another port
            (["--db", str(default_store)], other_port),  # the same store given explicitly
            (["--db", str(tmp_path / "link" / "plans.sqlite3")], port),  # ... through a symlinked directory
        ]
        for args, second_port in cases:
            message = second_server(second_port, ["--plugin", str(plugin), *args], env)
            for fragment in (f"the plan store {default_store} is in use by another mosos server", f"pid {first.pid}",
                             f"http://127.0.0.1:{port}", "Stop that server first, or give this one another --db"):
                assert fragment in message, (args, second_port, message)
            assert status(base, plan_id)["status"] == "solving", (args, second_port)  # no recovery ran on it
        gate.touch()
        deadline = time.monotonic() + 30
        while (answer := status(base, plan_id))["status"] == "solving":
            assert time.monotonic() < deadline, answer
            time.sleep(0.05)
        assert answer["status"] == "done" and answer["schedule"]["summary"]["strategy"] == "test-gate", answer
        assert first.poll() is None
    assert "not stored" not in (tmp_path / "first.log").read_text()


def test_when_the_owner_is_gone_the_next_server_takes_the_store_and_recovers_it(tmp_path):
    """The lock dies with its process (kill -9 included): no stale lock, and recovery runs for the next server."""
    plugin, _gate = write_gate_plugin(tmp_path)
    env = environment(tmp_path / "data")
    db = tmp_path / "plans.sqlite3"
    port = free_port()
    with running_server(port, ["--plugin", str(plugin), "--db", str(db)], env, tmp_path / "first.log") as (first, base):
        plan_id = httpx.post(f"{base}/v1/plans", json={"profile": PROFILE, "strategy": "test-gate", "time_limit_s": 60,
                                                       "wait_s": 0}, timeout=30).json()["id"]
        deadline = time.monotonic() + 30
        while status(base, plan_id)["status"] != "solving":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
    with running_server(port, ["--plugin", str(plugin), "--db", str(db)], env, tmp_path / "second.log") as (_, base):
        answer = status(base, plan_id)
        assert answer["status"] == "failed" and answer["reason"] == INTERRUPTED


# A result whose row something else ended is logged, never silently dropped ------------------------------------


def test_an_outcome_whose_row_was_ended_elsewhere_is_logged_and_counted(tmp_path, caplog):
    from fastapi.testclient import TestClient

    from api import Settings, create_app

    plugin, gate = write_gate_plugin(tmp_path)
    db = tmp_path / "plans.sqlite3"
    settings = Settings(db_path=db, solve_processes=1, request_processes=1, max_solver_workers=1, plugins=[str(plugin)])
    try:
        with caplog.at_level(logging.ERROR, logger="mosos.api"), TestClient(create_app(settings)) as client:
            plan_id = client.post("/v1/plans", json={"profile": PROFILE, "strategy": "test-gate", "time_limit_s": 60,
                                                     "wait_s": 0}).json()["id"]
            deadline = time.monotonic() + 30
            while client.get(f"/v1/plans/{plan_id}").json()["status"] != "solving":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            elsewhere = Store(db)  # e.g. a server that predates the store lock, recovering at its start
            assert elsewhere.recover() == 1
            elsewhere.close()
            gate.touch()
            deadline = time.monotonic() + 30
            while "mosos_results_not_stored_total 1.0" not in client.get("/metrics").text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
            row = client.get(f"/v1/plans/{plan_id}").json()
    finally:
        STRATEGIES.pop("test-gate", None)
    assert row["status"] == "failed" and row["reason"] == INTERRUPTED  # written once, never overwritten
    messages = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert any(plan_id in message and "was not stored" in message and f"failed: {INTERRUPTED}" in message
               and "(done, feasible)" in message for message in messages), messages
