"""The service's work, free of HTTP: read requests, hash them, find or queue plans, render answers."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

import planner
from api.errors import ApiError, invalid, over_limit
from api.jobs import Job, JobQueue
from api.metrics import Metrics
from api.models import PlanRequest, SimulateRequest
from api.settings import Settings
from api.store import PlanRow, Store
from planner.errors import Issue, ScheduleRejected
from planner.profile import GraphProfile, parse_profile
from planner.schedule import parse_schedule
from planner.simulator import simulate
from planner.strategies import load_all
from planner.validation import issues_from_validation_error

PLANNER_VERSION = planner.__version__
log = logging.getLogger("mosos.api")
_plot_lock = threading.Lock()  # pyplot is not thread-safe


@dataclass
class ParsedPlan:
    request: PlanRequest
    request_hash: str
    options: dict[str, Any]
    wait_s: float


def read_json_body(raw: bytes, what: str) -> dict:
    """Decode a JSON object with the CLI's wording for broken JSON."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as error:
        raise invalid([Issue("", f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}")]) from None
    except ValueError as error:  # not UTF-8
        raise invalid([Issue("", f"not valid JSON: {error}")]) from None
    except RecursionError:
        raise invalid([Issue("", "not valid JSON here: nested too deeply")]) from None
    if not isinstance(data, dict):
        raise invalid([Issue("", f"a {what} is a JSON object, not {type(data).__name__}")])
    return data


def validate(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise invalid(issues_from_validation_error(error)) from None


class Service:
    def __init__(self, settings: Settings, store: Store, queue: JobQueue, metrics: Metrics):
        self.settings = settings
        self.store = store
        self.queue = queue
        self.metrics = metrics

    # Limits ----------------------------------------------------------------

    def _check_node_count(self, data: dict) -> None:
        """Before full validation: a huge profile is refused without being read."""
        profile = data.get("profile")
        nodes = profile.get("nodes") if isinstance(profile, dict) else None
        if isinstance(nodes, list) and len(nodes) > self.settings.max_nodes:
            raise over_limit(
                413,
                "profile.nodes",
                f"the profile has {len(nodes)} nodes, above this server's limit max_nodes = {self.settings.max_nodes}",
                "max_nodes",
                self.settings.max_nodes,
            )

    # Plans -----------------------------------------------------------------

    def parse_plan(self, raw: bytes) -> ParsedPlan:
        data = read_json_body(raw, "plan request")
        self._check_node_count(data)
        request: PlanRequest = validate(PlanRequest, data)
        settings = self.settings
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
        options = {
            "budget_bytes": request.budget_bytes,
            "memory_ratio": request.memory_ratio,
            "strategy": request.strategy,
            "time_limit_s": float(time_limit_s),
            "workers": int(workers),
            "seed": request.seed,
        }
        canonical = json.dumps(
            {"planner_version": PLANNER_VERSION, "profile_digest": request.profile.digest(), **options},
            sort_keys=True,
            separators=(",", ":"),
        )
        return ParsedPlan(request, hashlib.sha256(canonical.encode()).hexdigest(), options, wait_s)

    def find_or_queue(self, parsed: ParsedPlan) -> tuple[PlanRow | None, Job | None]:
        """The stored answer (cache hit), the same request already in flight, or a new job."""
        profile: GraphProfile = parsed.request.profile
        with self.queue.lock:
            hit = self.store.find_done(parsed.request_hash)
            if hit is not None:
                self.metrics.cache_hits.inc()
                return hit, None
            active = self.queue.find_active(parsed.request_hash)
            if active is not None:
                return None, active
            profile_json = profile.to_json(indent=None)
            digest = profile.digest()

            def insert() -> PlanRow:
                return self.store.insert(
                    plan_id=uuid.uuid4().hex,
                    request_hash=parsed.request_hash,
                    profile_digest=digest,
                    profile_name=profile.name,
                    profile_json=profile_json,
                    node_count=len(profile.nodes),
                    strategy=parsed.options["strategy"],
                    options={**parsed.options, "planner_version": PLANNER_VERSION},
                )

            job = self.queue.submit(
                insert=insert,
                request_hash=parsed.request_hash,
                strategy=parsed.options["strategy"],
                time_limit_s=parsed.options["time_limit_s"],
                task={**parsed.options, "profile_json": profile_json},
            )
            return None, job

    def get_row(self, plan_id: str) -> PlanRow:
        row = self.store.get(plan_id)
        if row is None:
            raise ApiError(404, "not_found", f"no plan with id {plan_id!r}")
        return row

    def render(self, row: PlanRow, *, cached: bool = False, with_schedule: bool = True) -> dict:
        """A plan as the API shows it; the in-memory job overrides the store while it runs."""
        job = self.queue.get(row.id) if row.status in ("queued", "solving") else None
        status = row.status
        progress = row.progress
        if job is not None:
            status = job.status if job.status in ("queued", "solving") else status
            progress = job.progress or progress
        options = row.options
        base = f"/v1/plans/{row.id}"
        body = {
            "id": row.id,
            "status": status,
            "cached": cached,
            "request_hash": row.request_hash,
            "planner_version": options.get("planner_version", PLANNER_VERSION),
            "profile_name": row.profile_name,
            "profile_digest": row.profile_digest,
            "strategy": row.strategy,
            "budget_bytes": options.get("budget_bytes"),
            "memory_ratio": options.get("memory_ratio"),
            "time_limit_s": options.get("time_limit_s"),
            "workers": options.get("workers"),
            "seed": options.get("seed", 0),
            "created_at": row.created_at,
            "started_at": row.started_at,
            "finished_at": row.finished_at,
            "progress": progress,
            "feasible": row.feasible,
            "minimum_budget_bytes": row.minimum_budget_bytes,
            "reason": row.reason,
            "solve_seconds": row.solve_seconds,
            "links": {"self": base, "trace": f"{base}/trace", "memory_png": f"{base}/memory.png"},
        }
        if with_schedule:
            body["schedule"] = None
        return body

    def render_json(self, row: PlanRow, *, cached: bool = False) -> bytes:
        """JSON text of a plan, the stored schedule spliced in byte for byte (no re-serialising)."""
        body = self.render(row, cached=cached, with_schedule=False)
        text = json.dumps(body, separators=(",", ":"))
        schedule = row.schedule_json if row.status == "done" and row.schedule_json else "null"
        return (text[:-1] + ',"schedule":' + schedule + "}").encode()

    def list(self, limit: int, cursor: str | None) -> dict:
        before = int(cursor) if cursor else None
        rows = self.store.list(limit + 1, before)
        page = rows[:limit]
        return {
            "plans": [self.render(row, with_schedule=False) for row in page],
            "next_cursor": str(page[-1].seq) if len(rows) > limit and page else None,
        }

    # Simulation, traces and pictures ----------------------------------------------

    def simulate(self, raw: bytes) -> dict:
        data = read_json_body(raw, "simulation request")
        self._check_node_count(data)
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

    def _replay(self, plan_id: str):
        row = self.get_row(plan_id)
        if row.status != "done" or not row.schedule_json:
            state = "infeasible" if row.status == "done" else row.status
            raise ApiError(409, "conflict", f"plan {plan_id} has no schedule to replay (it is {state})")
        profile = parse_profile(json.loads(self.store.profile_json(row.profile_digest) or "null"))
        schedule = parse_schedule(json.loads(row.schedule_json))
        return row, simulate(profile, schedule)

    def trace(self, plan_id: str) -> dict:
        from planner.trace import chrome_trace

        row, result = self._replay(plan_id)
        return chrome_trace(result, title=f"{row.profile_name} ({row.strategy})")

    def memory_png(self, plan_id: str) -> bytes:
        from planner.plot import plot_memory

        row, result = self._replay(plan_id)
        buffer = io.BytesIO()
        with _plot_lock:
            plot_memory(result, buffer, title=f"{row.profile_name}: device memory ({row.strategy})")
        return buffer.getvalue()
