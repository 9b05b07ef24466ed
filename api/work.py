"""The CPU-heavy part of requests: reading bodies into profiles and schedules, hashing, simulating, drawing.

These functions run in the request processes (`api.pool`), not in the server: each
takes tens of milliseconds of pure Python on a real profile, and done in the server
they would hold its GIL while status calls wait. They take and return plain data
(bytes, strings, small dicts) so that little crosses the pipe, and raise `ApiError`
with the same wording the server used to give.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

import planner
from api.errors import ApiError, invalid, over_limit
from api.models import PlanRequest, SimulateRequest
from api.settings import Settings
from planner.errors import Issue, ScheduleRejected
from planner.attribute_plans import NoTransferBandwidth, require_transfers
from planner.profile import json_problem, parse_profile
from planner.schedule import parse_schedule
from planner.simulator import simulate
from planner.strategies import load_all
from planner.validation import describe, issues_from_validation_error
# Imports inside functions here are deferred for start-up time: the request processes load the solver, the plot
# (matplotlib), trace and viewer when a request needs them.

PLANNER_VERSION = planner.__version__
log = logging.getLogger("mosos.api")
_settings: Settings | None = None


@dataclass
class ParsedPlan:
    """What the server needs of a valid plan request: no pydantic model, so it is cheap to send back."""

    request_hash: str
    options: dict[str, Any]
    wait_s: float
    profile_json: str
    profile_digest: str
    profile_name: str
    node_count: int


# Process setup --------------------------------------------------------------------


def init_process(settings: Settings, parent_pid: int, nice: int) -> None:
    """Initializer of a request process: same strategies as the server, lower priority, dies with its parent."""
    from api.solver import become_child, load_plugins

    global _settings
    become_child(parent_pid, nice)
    load_plugins(settings.plugins)
    load_all()
    _settings = settings


def ready() -> int:
    """Run once per process at startup, so that the first request does not pay for the imports."""
    return os.getpid()


def _current_settings() -> Settings:
    if _settings is None:
        raise RuntimeError("api.work used outside a request process (init_process was not run)")
    return _settings


# Reading requests -------------------------------------------------------------------


def read_json_body(raw: bytes, what: str) -> dict:
    """Decode a JSON object with the CLI's wording for broken JSON."""
    data, problem = json_problem(raw)
    if problem is not None:
        if problem.startswith("not UTF-8"):  # a client that declared charset=latin-1 is told why that did not count
            problem += ("; a request body is read as UTF-8 (or UTF-16/32 with a BOM) whatever charset its "
                        "Content-Type names, as RFC 8259 says: send it as UTF-8")
        raise invalid([Issue("", problem)])
    if not isinstance(data, dict):
        raise invalid([Issue("", f"a {what} is a JSON object, not {describe(data)}")])
    return data


def validate(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise invalid(issues_from_validation_error(error)) from None


def check_node_count(settings: Settings, data: dict) -> None:
    """Before full validation: a huge profile is refused without being read."""
    profile = data.get("profile")
    nodes = profile.get("nodes") if isinstance(profile, dict) else None
    if isinstance(nodes, list) and len(nodes) > settings.max_nodes:
        raise over_limit(
            413,
            "profile.nodes",
            f"the profile has {len(nodes)} nodes, above this server's limit max_nodes = {settings.max_nodes}",
            "max_nodes",
            settings.max_nodes,
        )


def plan_request_hash(profile_digest: str, options: dict[str, Any]) -> str:
    """What identifies a plan request in the store: profile, budget, options and planner version."""
    canonical = json.dumps(
        {"planner_version": PLANNER_VERSION, "profile_digest": profile_digest, **options},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def parse_plan(raw: bytes) -> ParsedPlan:
    """A plan request checked against the schema and the server's limits, with its canonical hash."""
    settings = _current_settings()
    data = read_json_body(raw, "plan request")
    check_node_count(settings, data)
    request: PlanRequest = validate(PlanRequest, data)
    time_limit_s = request.time_limit_s if request.time_limit_s is not None else settings.effective_default_time_limit_s()
    if time_limit_s > settings.max_time_limit_s:
        raise over_limit(
            422, "time_limit_s", f"{time_limit_s:g} s is above this server's limit max_time_limit_s = "
            f"{settings.max_time_limit_s:g} s", "max_time_limit_s", settings.max_time_limit_s,
        )
    workers = request.workers if request.workers is not None else settings.max_solver_workers
    if workers > settings.max_solver_workers:
        raise over_limit(
            422, "workers", f"{workers} solver threads is above this server's limit max_solver_workers = "
            f"{settings.max_solver_workers}", "max_solver_workers", settings.max_solver_workers,
        )
    wait_s = request.wait_s if request.wait_s is not None else settings.effective_default_wait_s()
    if wait_s > settings.max_wait_s:
        raise over_limit(
            422, "wait_s", f"{wait_s:g} s is above this server's limit max_wait_s = {settings.max_wait_s:g} s",
            "max_wait_s", settings.max_wait_s,
        )
    strategies = load_all()
    info = strategies.get(request.strategy)
    if info is None:
        raise invalid([Issue("strategy", f"unknown strategy {request.strategy!r}; known: {', '.join(sorted(strategies))}")])
    if info.uses_budget and request.budget_bytes is None and request.memory_ratio is None:
        raise invalid([Issue("budget_bytes", f"strategy {request.strategy!r} needs a budget: give budget_bytes or memory_ratio")])
    if info.needs_transfers:
        try:
            require_transfers(request.profile, request.strategy)
        except NoTransferBandwidth as error:
            raise invalid([Issue("strategy", str(error))]) from None
    options = {
        "budget_bytes": request.budget_bytes,
        "memory_ratio": request.memory_ratio,
        "strategy": request.strategy,
        "time_limit_s": float(time_limit_s),
        "workers": int(workers),
        "seed": request.seed,
    }
    profile = request.profile
    digest = profile.digest()
    return ParsedPlan(
        request_hash=plan_request_hash(digest, options),
        options=options,
        wait_s=wait_s,
        profile_json=profile.to_json(indent=None),
        profile_digest=digest,
        profile_name=profile.name,
        node_count=len(profile.nodes),
    )


# Simulation, traces and pictures ------------------------------------------------------


def simulate_request(raw: bytes) -> dict:
    """The simulator's figures, or its first violation, for a POSTed profile and schedule."""
    data = read_json_body(raw, "simulation request")
    check_node_count(_current_settings(), data)
    request: SimulateRequest = validate(SimulateRequest, data)
    try:
        result = simulate(request.profile, request.schedule, request.budget_bytes, keep_timeline=False)
    except ScheduleRejected as rejection:
        return {"valid": False, "figures": None, "violation": rejection.as_dict()}
    except Exception as error:  # a simulator bug on odd input: say so, never a 500
        log.exception("the simulator failed on a schedule")
        raise ApiError(
            422, "simulation_error", f"the simulator could not replay this schedule ({type(error).__name__}: {error})"
        ) from None
    return {"valid": True, "figures": result.figures(), "violation": None}


def _replay(profile_json: str | None, schedule_json: str):
    profile = parse_profile(json.loads(profile_json or "null"))
    return simulate(profile, parse_schedule(json.loads(schedule_json)))


def trace_json(profile_json: str | None, schedule_json: str, title: str) -> bytes:
    """Chrome trace of a stored plan, as the JSON bytes the server sends (JSONResponse's own encoding)."""
    from planner.trace import chrome_trace

    trace = chrome_trace(_replay(profile_json, schedule_json), title=title)
    return json.dumps(trace, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def memory_png(profile_json: str | None, schedule_json: str, title: str) -> bytes:
    """Device memory over the step of a stored plan, as PNG bytes (one request at a time per process)."""
    from planner.plot import plot_memory

    buffer = io.BytesIO()
    plot_memory(_replay(profile_json, schedule_json), buffer, title=title)
    return buffer.getvalue()


def plan_view_html(profile_json: str | None, schedule_json: str, title: str) -> bytes:
    """The plan viewer page of a stored plan, as UTF-8 bytes."""
    from planner.viewer import plan_view_html as render

    profile = parse_profile(json.loads(profile_json or "null"))
    schedule = parse_schedule(json.loads(schedule_json))
    return render(profile, schedule, simulate(profile, schedule), title=title).encode("utf-8")
