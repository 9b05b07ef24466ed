"""Running a sweep on Ray: every solve a Ray task, one row per solve whatever happens to it.

The driver sends all tasks at once (Ray queues what the CPUs cannot run yet),
shares one copy of each profile among its solves (a file read here, or a
profile a worker estimated), and watches them through the `SolveControl`
actor: when each starts, on which process, which attempt. A solve that runs
past the spec's hard limit is stopped (`ray.cancel(force=True)`) and its row
says so; a solve whose worker died is re-run by Ray up to `retries` times and
its row lists every process it ran on; one that still failed says why. Ctrl-C
stops what is running, and the rows of what finished are kept.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.remote import new_control, plain_task, solve_task
from cluster.runtime import RaySession
from cluster.sweep_solve import estimate_profile
from cluster.sweep_spec import LoadedSpec, Solve

SOLVE_TARGET = "cluster.sweep_solve:solve"
POLL_S = 0.25
SNAPSHOT_INTERVAL_S = 0.5
STATUSES = ("done", "infeasible", "failed", "timed_out", "cancelled")

COLUMNS = [
    "index", "source", "profile", "model", "gpu", "batch", "strategy", "budget", "budget_bytes", "memory_ratio",
    "status", "predicted_step_time_ms", "lower_bound_ms", "overhead_percent", "peak_memory_bytes", "offloaded_bytes",
    "recompute_time_ms", "stall_time_ms", "implementations_changed", "solver_status", "solver_gap",
    "minimum_budget_bytes", "solve_seconds", "wall_time_s", "attempts", "pids", "node", "schedule_path", "reason",
]


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]
    wall_time_s: float
    where: str
    interrupted: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def all_solved(self) -> bool:
        """Every row has an answer (a plan, or the budget is infeasible); nothing failed, timed out or stopped."""
        return all(row["status"] in ("done", "infeasible") for row in self.rows)


def first_row(solve: Solve) -> dict[str, Any]:
    row: dict[str, Any] = {column: None for column in COLUMNS}
    row.update(
        index=solve.index, source=solve.source, model=solve.model, gpu=solve.gpu, batch=solve.batch,
        strategy=solve.strategy, budget=solve.budget_text, memory_ratio=solve.memory_ratio, status="pending",
        budget_bytes=solve.budget if isinstance(solve.budget, int) else None,
    )
    row["history"] = []
    return row


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:60] or "profile"


class SweepRunner:
    def __init__(
        self,
        loaded: LoadedSpec,
        session: RaySession,
        *,
        schedules_dir: Path | None = None,
        on_row: Callable[[dict], None] | None = None,
        on_running: Callable[[int], None] | None = None,
    ):
        self.loaded = loaded
        self.spec = loaded.spec
        self.session = session
        self.ray = session.ray
        self.schedules_dir = schedules_dir
        self.on_row = on_row or (lambda row: None)
        self.on_running = on_running or (lambda count: None)
        self.rows = [first_row(solve) for solve in loaded.solves]
        self._started: dict[int, tuple[int, float]] = {}  # index -> (attempt, when this driver saw it start)
        self._pending: dict[Any, int] = {}  # object ref -> index
        self.control: Any = None  # the SolveControl actor while the sweep runs (its snapshot: who runs what, where)

    # Submitting ---------------------------------------------------------------------------

    def _profile_objects(self) -> dict[str, Any]:
        """One object per profile, shared by its solves: a file read here, or an estimate made on a worker."""
        objects: dict[str, Any] = {}
        for key, file in self.loaded.profile_files.items():
            objects[key] = self.ray.put({"profile_json": file.read_text(encoding="utf-8")})
        estimate = plain_task(self.ray, estimate_profile)
        for key, (entry, batch) in self.loaded.models.items():
            objects[key] = estimate.options(num_cpus=1, max_retries=self.spec.retries, name=f"mosos-estimate-{entry.model}-b{batch}").remote(
                {"model": entry.model, "batch": batch, "gpu": entry.gpu, "image_size": entry.image_size,
                 "tokens": entry.tokens, "small": entry.small, "math": entry.math, "optimizer": entry.optimizer,
                 "memory": entry.memory}
            )
        return objects

    def _submit(self, control: Any) -> None:
        objects = self._profile_objects()
        remote = solve_task(self.ray)
        for solve in self.loaded.solves:
            payload = {
                "strategy": solve.strategy, "budget": solve.budget, "memory_ratio": solve.memory_ratio,
                "time_limit_s": self.spec.time_limit_s, "workers": self.spec.workers, "seed": self.spec.seed,
                "plugins": self.spec.plugins,
            }
            reference = remote.options(
                num_cpus=self.spec.workers, max_retries=self.spec.retries, retry_exceptions=False,
                name=f"mosos-sweep-{solve.index}-{solve.strategy}",
            ).remote(SOLVE_TARGET, payload, control, solve.index, False, objects[solve.source_key])
            self._pending[reference] = solve.index

    # Watching --------------------------------------------------------------------------------

    def run(self) -> SweepResult:
        started = time.monotonic()
        control = self.control = new_control(self.ray)
        interrupted = False
        try:
            self._submit(control)
            last_snapshot = 0.0
            while self._pending:
                ready, _ = self.ray.wait(list(self._pending), num_returns=len(self._pending), timeout=POLL_S)
                if ready or time.monotonic() - last_snapshot >= SNAPSHOT_INTERVAL_S:
                    snapshot = self.ray.get(control.snapshot.remote())
                    last_snapshot = time.monotonic()
                    self._note_starts(snapshot)
                    finished = [self._collect(reference, snapshot) for reference in ready]
                    if finished:
                        control.forget.remote(finished)
                    self._stop_overruns()
                    self.on_running(sum(1 for index in self._pending.values() if index in self._started))
        except KeyboardInterrupt:
            interrupted = True
            for reference, index in list(self._pending.items()):
                self.ray.cancel(reference, force=True)
                self._finish(index, status="cancelled", reason="the sweep was interrupted (Ctrl-C) before this solve ended")
            self._pending.clear()
        finally:
            try:
                self.ray.kill(control)
            except Exception:  # Ray already gone (interrupted while shutting down)
                pass
        counts = {status: sum(1 for row in self.rows if row["status"] == status) for status in STATUSES}
        return SweepResult(self.rows, time.monotonic() - started, self.session.where, interrupted, counts)

    def _note_starts(self, snapshot: dict) -> None:
        now = time.monotonic()
        for index, entry in snapshot.items():
            attempt = entry.get("attempts", 0)
            if index not in self._started or self._started[index][0] != attempt:
                self._started[index] = (attempt, now)  # a retry starts the clock again
            row = self.rows[index]
            row["history"] = [dict(item) for item in entry.get("history", [])]

    def _stop_overruns(self) -> None:
        """Stop a solve far past its limit: the planner honours its time limit, so this is a hung or starved one."""
        now = time.monotonic()
        limit = self.spec.hard_timeout_s
        for reference, index in list(self._pending.items()):
            seen = self._started.get(index)
            if seen is not None and now - seen[1] > limit:
                self.ray.cancel(reference, force=True)
                del self._pending[reference]
                self._finish(index, status="timed_out", wall_time_s=now - seen[1],
                             reason=f"ran {now - seen[1]:.0f} s, past the hard limit of {limit:g} s "
                             f"(time limit {self.spec.time_limit_s:g} s), and was stopped")

    def _collect(self, reference: Any, snapshot: dict) -> int:
        index = self._pending.pop(reference)
        ray = self.ray
        entry = snapshot.get(index, {})
        if entry:
            self.rows[index]["history"] = [dict(item) for item in entry.get("history", [])]
        try:
            outcome = ray.get(reference)
        except ray.exceptions.TaskCancelledError:
            self._finish(index, status="cancelled", reason="the solve was cancelled")
            return index
        except ray.exceptions.RayError as error:
            attempts = len(self.rows[index]["history"])
            text = str(error).strip().splitlines()
            detail = text[-1] if text else type(error).__name__
            self._finish(index, status="failed", reason=f"the Ray task failed after {attempts} attempt(s) "
                         f"(retries {self.spec.retries}): {type(error).__name__}: {detail}")
            return index
        schedule_json = outcome.pop("schedule_json", None)
        fields = {key: value for key, value in outcome.items() if key in COLUMNS}
        fields["wall_time_s"] = outcome.get("task_seconds")
        if schedule_json is not None and self.schedules_dir is not None:
            fields["schedule_path"] = self._write_schedule(index, outcome.get("profile") or "", schedule_json)
        self._finish(index, **fields)
        return index

    def _write_schedule(self, index: int, profile_name: str, schedule_json: str) -> str:
        row = self.rows[index]
        name = f"{index:04d}-{_slug(profile_name)}-{row['strategy']}-{_slug(row['budget'])}.json"
        path = self.schedules_dir / name
        path.write_text(schedule_json)
        return f"{self.schedules_dir.name}/{name}"

    def _finish(self, index: int, **fields: Any) -> None:
        row = self.rows[index]
        row.update(fields)
        history = row.get("history") or []
        row["attempts"] = len(history) or None
        row["pids"] = ">".join(str(item["pid"]) for item in history) or None
        row["node"] = history[-1]["node"] if history else None
        self.on_row(row)
