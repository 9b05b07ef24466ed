"""What one sweep task does on its Ray worker: estimate a profile, or plan one (profile, budget, strategy).

Both return plain dicts, never raise for a planning problem: an infeasible
budget is a row that says the smallest budget that fits, a strategy that cannot
run is a row that says why. Only a dead worker or a stopped task has no row
from here; the driver writes those.
"""

from __future__ import annotations

import functools
import json
import time
import traceback
from typing import Any, Callable

from cluster.sweep_spec import DEVICE_BUDGET
# Imports inside functions here are deferred for start-up time: a Ray worker loads the planner and the estimator when
# its first task runs.


def estimate_profile(entry: dict) -> dict:
    """A Ray task: the estimated profile of a reference network at one batch, as JSON text (needs torch here)."""
    started = time.monotonic()
    try:
        from models.estimator import estimate
    except ImportError as error:
        return {"error": f"estimating needs torch on the Ray workers: pip install torch ({error})"}
    from planner.errors import MososError

    try:
        profile = estimate(
            entry["model"], entry["batch"], entry["gpu"], image_size=entry.get("image_size"), tokens=entry.get("tokens"),
            small=entry.get("small", False), math=entry.get("math", "fp32"),
            optimizer=entry.get("optimizer", "sgd-momentum"), memory_bytes=entry.get("memory"),
        )
    except MososError as error:
        return {"error": f"cannot estimate {entry['model']} batch {entry['batch']} on {entry['gpu']}: {error}"}
    except Exception as error:  # an estimator bug on one model must not stop the sweep
        traceback.print_exc()
        return {"error": f"estimating failed: {type(error).__name__}: {error}"}
    return {"profile_json": profile.to_json(indent=None), "estimate_seconds": time.monotonic() - started}


@functools.lru_cache(maxsize=4)
def _parsed(profile_json: str):
    """A worker solves the same profile at many budgets: parse it and find its lower bound once."""
    from planner.profile import parse_profile
    from planner.simulator import simulate
    from planner.strategies.keep_all import keep_all_schedule

    profile = parse_profile(json.loads(profile_json))
    lower_bound_ms = simulate(profile, keep_all_schedule(profile), keep_timeline=False).step_time_ms
    return profile, lower_bound_ms


def solve(payload: dict, send: Callable[[dict], None], should_stop: Callable[[], bool] | None, source: dict) -> dict:
    """Plan one sweep row; `source` is {'profile_json': ...} or {'error': ...} (a failed estimate)."""
    started = time.monotonic()
    row: dict[str, Any] = {}
    try:
        row.update(_solve(payload, send, should_stop, source))
    except Exception as error:  # a planner bug is this row's failure, not the sweep's
        traceback.print_exc()
        row.update(status="failed", reason=f"internal planner error: {type(error).__name__}: {error}")
    row["task_seconds"] = time.monotonic() - started
    return row


_loaded_plugins: list[list[str]] = []


def _load_plugins(plugins: list[str]) -> None:
    """Once per worker process and plugin list: the spec's extra strategies."""
    if plugins and plugins not in _loaded_plugins:
        from planner.plugins import load_plugins

        load_plugins(plugins)
        _loaded_plugins.append(list(plugins))


def _solve(payload: dict, send, should_stop, source: dict) -> dict:
    from planner.budget import budget_from_ratio
    from planner.errors import BudgetError, MososError
    from planner.planning import plan

    try:
        _load_plugins(payload.get("plugins") or [])
    except Exception as error:
        return {"status": "failed", "reason": f"cannot import the spec's plugins on this worker: {type(error).__name__}: {error}"}

    if "error" in source:
        return {"status": "failed", "reason": source["error"]}
    profile, lower_bound_ms = _parsed(source["profile_json"])
    row: dict[str, Any] = {"profile": profile.name, "lower_bound_ms": lower_bound_ms}
    budget = payload.get("budget")
    if budget == DEVICE_BUDGET:
        budget = profile.hardware.memory_capacity_bytes
    started = time.monotonic()
    try:
        if payload.get("memory_ratio") is not None:
            budget = budget_from_ratio(profile, payload["memory_ratio"])
        row["budget_bytes"] = budget
        schedule = plan(
            profile, budget, strategy=payload["strategy"],
            time_limit_s=payload["time_limit_s"], workers=payload["workers"], seed=payload["seed"],
            progress=send, should_stop=should_stop,
        )
    except BudgetError as error:
        row["solve_seconds"] = time.monotonic() - started
        if error.minimum_budget_bytes is not None:
            return {**row, "status": "infeasible", "minimum_budget_bytes": int(error.minimum_budget_bytes), "reason": str(error)}
        return {**row, "status": "failed", "reason": str(error)}
    except MososError as error:
        return {**row, "status": "failed", "reason": str(error), "solve_seconds": time.monotonic() - started}
    summary = schedule.summary
    row.update(
        status="done",
        solve_seconds=time.monotonic() - started,
        predicted_step_time_ms=summary.predicted_step_time_ms,
        overhead_percent=100.0 * (summary.predicted_step_time_ms / lower_bound_ms - 1.0) if lower_bound_ms else None,
        peak_memory_bytes=summary.peak_memory_bytes,
        offloaded_bytes=summary.offloaded_bytes,
        recompute_time_ms=summary.recompute_time_ms,
        stall_time_ms=summary.stall_time_ms,
        implementations_changed=summary.implementations_changed,
        schedule_json=schedule.to_json(),
    )
    if summary.solver is not None:
        row.update(solver_status=summary.solver.status, solver_gap=summary.solver.gap)
    return row
