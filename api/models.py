"""Request and response documents of the HTTP API. Profiles and schedules are the planner's own models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import SimulationFigures
from planner.units import MAX_SIZE_BYTES
from planner.validation import NumbersAreNumbers

PlanState = Literal["queued", "solving", "done", "failed", "cancelled"]


class _Request(NumbersAreNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PlanRequest(_Request):
    """Plan `profile` within a budget: bytes or a fraction of the keep-all peak (not both)."""

    profile: GraphProfile
    budget_bytes: int | None = Field(default=None, ge=0, le=MAX_SIZE_BYTES, description="Device memory the plan may use, in bytes.")
    memory_ratio: float | None = Field(
        default=None, gt=0, le=1, description="Budget as a fraction of the keep-all peak (the MO-SOS paper's ratio)."
    )
    strategy: str = Field(default="mosos", min_length=1, max_length=100, description="Planner to use; see /healthz.")
    time_limit_s: float | None = Field(default=None, gt=0, description="Solver time limit; default and maximum are server settings.")
    workers: int | None = Field(default=None, ge=1, description="Solver threads for this solve; capped by the server.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Solver seed; with workers=1 the plan is reproducible while no phase of the solve is cut short by the time limit (on a server that is not overloaded).")
    wait_s: float | None = Field(
        default=None, ge=0, description="Answer 200 with the plan if it is ready within this many seconds, else 202."
    )

    @model_validator(mode="after")
    def _one_budget(self) -> "PlanRequest":
        if self.budget_bytes is not None and self.memory_ratio is not None:
            raise ValueError("give either a budget in bytes or a memory ratio, not both")
        return self


class SimulateRequest(_Request):
    """Replay `schedule` on `profile`; `budget_bytes` overrides the schedule's own budget."""

    profile: GraphProfile
    schedule: Schedule
    budget_bytes: int | None = Field(default=None, ge=0, le=MAX_SIZE_BYTES)


class Issue(BaseModel):
    path: str = Field(description="JSON path of the offending value in the request; empty for the whole request.")
    message: str


class ErrorBody(BaseModel):
    """Every error has this shape: a code, a sentence, and for bad input one issue per problem."""

    error: str = Field(description="invalid_request, limit_exceeded, not_found, queue_full, unauthorized, conflict, ...")
    message: str
    issues: list[Issue] = Field(default_factory=list)
    limit: str | None = Field(default=None, description="The server setting that was exceeded, if any.")
    limit_value: float | None = None


class Progress(BaseModel):
    """The solver's latest report while solving (CP-SAT: best objective, bound, gap)."""

    model_config = ConfigDict(extra="allow")

    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    solutions: int | None = None
    elapsed_s: float | None = None


class PlanLinks(BaseModel):
    self: str
    trace: str
    memory_png: str
    view: str = Field(description="The plan viewer: one self-contained HTML page.")


class PlanStatus(BaseModel):
    """A plan's state; `schedule` is there when it is done and feasible (not in listings)."""

    id: str
    status: PlanState
    cached: bool = Field(default=False, description="True when this answer came from the store without solving.")
    request_hash: str = Field(description="Canonical hash of profile, budget, options and planner version.")
    planner_version: str
    profile_name: str
    profile_digest: str
    strategy: str
    budget_bytes: int | None = Field(default=None, description="As asked. With memory_ratio it is null here; the "
                                     "budget the ratio came to is the schedule's budget_bytes.")
    memory_ratio: float | None = None
    time_limit_s: float
    workers: int | None = None
    seed: int
    created_at: float = Field(description="Unix time, seconds.")
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress | None = Field(default=None, description="While queued or solving: the solver's latest figures. Done: none (see the schedule's summary); failed or cancelled: the last figures reached.")
    feasible: bool | None = Field(default=None, description="False: no plan fits; see minimum_budget_bytes.")
    minimum_budget_bytes: int | None = None
    proven: bool | None = Field(default=None, description="Infeasible: whether the solver proved that no plan fits "
                                "(false: its time ran out first; such an answer is not reused for identical requests; "
                                "true too for a budget below what any plan needs; null for a heuristic's answer).")
    reason: str | None = Field(default=None, description="Why it failed, was cancelled, or is infeasible.")
    solve_seconds: float | None = None
    links: PlanLinks
    schedule: Schedule | None = None


class PlanList(BaseModel):
    plans: list[PlanStatus]
    next_cursor: str | None = Field(default=None, description="Pass as `cursor` for the next (older) page.")


class Violation(BaseModel):
    reason: str
    message: str
    stage: int | None = None
    path: str | None = Field(default=None, description="JSON path of the operation in the schedule, e.g. stages[1].operations[0].")
    operation_index: int | None = None
    operation: str | None = None
    tensor: str | None = None
    over_budget_bytes: int | None = None
    time_ms: float | None = None


class SimulateResponse(BaseModel):
    valid: bool
    figures: SimulationFigures | None = None
    violation: Violation | None = None


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    strategies: list[str]
    backend: Literal["local", "ray"] = Field(default="local", description="Where solves run: local processes or Ray tasks.")
    solve_processes: int = Field(description="Solves that may run at once.")
    solve_processes_ready: int = Field(description="Started and waiting for or running a plan (others are starting).")
    queue_depth: int
    solves_running: int
