"""The service's work, free of HTTP: find or queue plans, read the store, render answers.

The CPU-heavy part of a request (validating a large body, hashing, simulating,
drawing) runs in the request processes (`api.work` through `api.pool`); what is
left here is store reads and small JSON, cheap enough for the server process.
"""

from __future__ import annotations

import json
import logging
import uuid

import planner
from api import work
from api.errors import ApiError
from api.jobs import Job, JobQueue
from api.metrics import Metrics
from api.pool import RequestPool
from api.settings import Settings
from api.store import PlanRow, Store
from api.work import ParsedPlan

PLANNER_VERSION = planner.__version__
log = logging.getLogger("mosos.api")


class Service:
    def __init__(self, settings: Settings, store: Store, queue: JobQueue, metrics: Metrics, pool: RequestPool):
        self.settings = settings
        self.store = store
        self.queue = queue
        self.metrics = metrics
        self.pool = pool

    # Plans -----------------------------------------------------------------

    async def parse_plan(self, raw: bytes) -> ParsedPlan:
        """Validated and hashed in a request process (see `api.work.parse_plan`)."""
        return await self.pool.run(work.parse_plan, raw)

    def find_or_queue(self, parsed: ParsedPlan) -> tuple[PlanRow | None, Job | None]:
        """The stored answer (cache hit), the same request already in flight, or a new job."""
        with self.queue.lock:
            hit = self.store.find_done(parsed.request_hash)
            if hit is not None:
                self.metrics.cache_hits.inc()
                return hit, None
            active = self.queue.find_active(parsed.request_hash)
            if active is not None:
                return None, active

            def insert() -> PlanRow:
                return self.store.insert(
                    plan_id=uuid.uuid4().hex,
                    request_hash=parsed.request_hash,
                    profile_digest=parsed.profile_digest,
                    profile_name=parsed.profile_name,
                    profile_json=parsed.profile_json,
                    node_count=parsed.node_count,
                    strategy=parsed.options["strategy"],
                    options={**parsed.options, "planner_version": PLANNER_VERSION},
                )

            job = self.queue.submit(
                insert=insert,
                request_hash=parsed.request_hash,
                strategy=parsed.options["strategy"],
                time_limit_s=parsed.options["time_limit_s"],
                task={**parsed.options, "profile_json": parsed.profile_json},
            )
            return None, job

    def get_row(self, plan_id: str) -> PlanRow:
        row = self.store.get(plan_id)
        if row is None:
            raise ApiError(404, "not_found", f"no plan with id {plan_id!r}")
        return row

    def cancel(self, plan_id: str) -> PlanRow:
        """Stop a queued or running plan; it stays, as cancelled (409 if it had already ended)."""
        row = self.get_row(plan_id)
        if row.status in ("queued", "solving"):
            self.queue.cancel(plan_id)
            row = self.get_row(plan_id)
        if row.status in ("done", "failed"):
            raise ApiError(409, "conflict", f"plan {plan_id} has already ended ({row.status}); nothing to cancel")
        return row

    def delete(self, plan_id: str) -> None:
        """Forget a plan, cancelling it first if it runs (its outcome is then ignored, never stored)."""
        row = self.get_row(plan_id)
        if row.status in ("queued", "solving") and self.queue.cancel(plan_id, forget=True):
            return
        if not self.store.delete(plan_id):
            raise ApiError(404, "not_found", f"no plan with id {plan_id!r}")

    def render(self, row: PlanRow, *, cached: bool = False, with_schedule: bool = True) -> dict:
        """A plan as the API shows it; the in-memory job overrides the store while it runs."""
        job = self.queue.get(row.id) if row.status in ("queued", "solving") else None
        status = row.status
        progress = row.progress
        if job is not None:
            status = job.status if job.status in ("queued", "solving") else status
            progress = job.progress or progress
        if status == "done":
            progress = None  # the schedule's summary holds the final figures; a last snapshot would contradict them
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
            "proven": row.proven,
            "reason": row.reason,
            "solve_seconds": row.solve_seconds,
            "links": {"self": base, "trace": f"{base}/trace", "memory_png": f"{base}/memory.png", "view": f"{base}/view"},
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

    async def simulate(self, raw: bytes) -> dict:
        """Figures or the first violation, computed in a request process."""
        return await self.pool.run(work.simulate_request, raw)

    def replay_inputs(self, plan_id: str) -> tuple[PlanRow, str | None]:
        """A done plan's row and stored profile (store reads only), or 404 / 409."""
        row = self.get_row(plan_id)
        if row.status != "done" or not row.schedule_json:
            state = "infeasible" if row.status == "done" else row.status
            raise ApiError(409, "conflict", f"plan {plan_id} has no schedule to replay (it is {state})")
        return row, self.store.profile_json(row.profile_digest)

    async def trace_json(self, row: PlanRow, profile_json: str | None) -> bytes:
        title = f"{row.profile_name} ({row.strategy})"
        return await self.pool.run(work.trace_json, profile_json, row.schedule_json, title)

    async def memory_png(self, row: PlanRow, profile_json: str | None) -> bytes:
        title = f"{row.profile_name}: device memory ({row.strategy})"
        return await self.pool.run(work.memory_png, profile_json, row.schedule_json, title)

    async def view_html(self, row: PlanRow, profile_json: str | None) -> bytes:
        title = f"{row.profile_name} ({row.strategy})"
        return await self.pool.run(work.plan_view_html, profile_json, row.schedule_json, title)
