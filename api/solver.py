"""What runs inside a solve process: take one task at a time from the pipe, plan it, send events back.

Solves are CPU-bound (CP-SAT), so they run here and never in the server's
event loop. The parent stops a solve by writing its sequence number into the
shared `cancel_seq`; `should_stop` reads it. A solve process exits by itself
when its parent dies (kill -9 of the server leaves no orphans solving).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from planner.plugins import PluginError, load_plugins  # noqa: F401  (api.app and api.work import them from here)
# Imports inside functions here are deferred for start-up time: the planner (OR-Tools) loads in the solver processes,
# which import this module before they solve.

PROGRESS_INTERVAL_S = 0.2


def _json_safe(event: dict) -> dict[str, Any]:
    safe: dict[str, Any] = {}
    for key, value in event.items():
        if isinstance(value, bool) or value is None or isinstance(value, str):
            safe[str(key)] = value
        elif isinstance(value, int):
            safe[str(key)] = value
        elif isinstance(value, float):
            safe[str(key)] = value if math.isfinite(value) else None
    return safe


def watch_parent(parent_pid: int) -> None:
    """Exit as soon as the parent is gone (a kill -9 of the server leaves no orphans)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def solve_task(task: dict, send, should_stop) -> dict:
    """Plan one task; the outcome is a dict, never an exception."""
    from planner.errors import BudgetError, MososError
    from planner.planning import plan
    from planner.profile import parse_profile

    last_sent = [0.0]

    def progress(event: dict) -> None:
        now = time.monotonic()
        if now - last_sent[0] >= PROGRESS_INTERVAL_S:
            last_sent[0] = now
            send(("progress", task["seq"], _json_safe(event)))

    started = time.monotonic()
    try:
        import json

        profile = parse_profile(json.loads(task["profile_json"]))
        schedule = plan(
            profile,
            task.get("budget_bytes"),
            memory_ratio=task.get("memory_ratio"),
            strategy=task["strategy"],
            time_limit_s=task["time_limit_s"],
            workers=task.get("workers"),
            seed=task.get("seed", 0),
            progress=progress,
            should_stop=should_stop,
            started_at=started,  # the limit counts from the task's start: reading its profile is part of it
        )
        return {
            "status": "done",
            "feasible": True,
            "schedule_json": schedule.model_dump_json(exclude_none=True),
            "solve_seconds": time.monotonic() - started,
        }
    except BudgetError as error:
        # InfeasibleBudget or a budget below what any plan needs: an answer, not a failure.
        if error.minimum_budget_bytes is not None:
            return {
                "status": "done",
                "feasible": False,
                "minimum_budget_bytes": int(error.minimum_budget_bytes),
                # a budget below what any plan needs is a proof of its own; a strategy's answer says whether it is
                "proven": getattr(error, "proven", None) if hasattr(error, "proven") else True,
                "reason": str(error),
                "solve_seconds": time.monotonic() - started,
            }
        return {"status": "failed", "reason": str(error), "solve_seconds": time.monotonic() - started}
    except MososError as error:
        return {"status": "failed", "reason": str(error), "solve_seconds": time.monotonic() - started}
    except Exception as error:  # a planner bug must not take the service down
        traceback.print_exc(file=sys.stderr)
        return {
            "status": "failed",
            "reason": f"internal planner error: {type(error).__name__}: {error}",
            "solve_seconds": time.monotonic() - started,
        }


def become_child(parent_pid: int, nice: int) -> None:
    """A helper process dies with the server and yields the CPU to it.

    It ignores Ctrl-C, which a terminal sends to the whole process group: the server stops its helpers in
    order (finishing what it can), instead of seeing them die and starting new ones while it shuts down.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    if nice > 0:
        try:
            os.nice(nice)
        except OSError:
            pass


def worker_main(connection, cancel_seq, plugins: list[str], parent_pid: int, nice: int = 0) -> None:
    """Entry point of a solve process; `nice` lowers its priority so that the HTTP server stays responsive."""
    become_child(parent_pid, nice)
    try:
        load_plugins(plugins)
        from planner.strategies import load_all

        load_all()
    except Exception as error:  # reported to the parent, which fails every task it would have sent
        connection.send(("broken", 0, {"reason": f"cannot load plugins: {error}"}))
        return
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            connection.send(message)

    send(("ready", 0, {}))
    while True:
        try:
            task = connection.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        seq = task["seq"]
        send(("started", seq, {}))
        outcome = solve_task(task, send, lambda: cancel_seq.value == seq)
        send(("result", seq, outcome))
