"""The Schedule contract: one plan for one profile and one budget.

A schedule is a program on three streams. The compute stream runs the
operations in order; `offload` and `prefetch` start copies on the
device-to-host and host-to-device streams, `wait` makes the compute stream
wait for a copy, `free` releases a tensor's device memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.errors import Issue, ScheduleError
from planner.profile import read_json
from planner.validation import NumbersAreNumbers, issues_from_validation_error

SCHEDULE_SCHEMA_VERSION = "1.1"
# 1.1: planned addresses (`arena_bytes`, and the offsets of computations and prefetches); a 1.0 schedule has none
SUPPORTED_SCHEDULE_VERSIONS = ("1.0", "1.1")


class _Strict(NumbersAreNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _op_required(schema: dict[str, Any]) -> None:
    """`op` has a default for code that builds operations, but a document must name it: it is the union's tag."""
    schema["required"] = ["op", *(name for name in schema.get("required", []) if name != "op")]


class _Operation(BaseModel):
    """No numbers here (so no NumbersAreNumbers, whose validator would run on the union's tag)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_op_required)

    @field_validator("offset_bytes", "workspace_offset_bytes", mode="before", check_fields=False)
    @classmethod
    def _offsets_are_numbers(cls, value: Any) -> Any:
        """A quoted number or a boolean is a mistake, not an offset to coerce (as NumbersAreNumbers says of sizes)."""
        if isinstance(value, (bool, str)):
            raise ValueError(f"must be a number, not {type(value).__name__} {value!r}")
        return value


_OFFSET_LIMIT_BYTES = 2**50  # 1 PiB, as every size of a profile


def _offset(description: str):
    return Field(default=None, ge=0, le=_OFFSET_LIMIT_BYTES, description=description)


class Compute(_Operation):
    """Compute node `node` with implementation `implementation` on the compute stream."""

    op: Literal["compute"] = "compute"
    node: str
    implementation: str
    offset_bytes: int | None = _offset("Where the node's output lives in the arena (planned addresses).")
    workspace_offset_bytes: int | None = _offset("Where its implementation's workspace lives in the arena.")

    def describe(self) -> str:
        return f"compute {self.node} with {self.implementation}"


class Offload(_Operation):
    """Start copying `tensor` to host memory on the device-to-host stream."""

    op: Literal["offload"] = "offload"
    tensor: str

    def describe(self) -> str:
        return f"offload {self.tensor}"


class Prefetch(_Operation):
    """Allocate `tensor` on the device and start copying it back on the host-to-device stream."""

    op: Literal["prefetch"] = "prefetch"
    tensor: str
    offset_bytes: int | None = _offset("Where the prefetched copy lives in the arena (planned addresses).")

    def describe(self) -> str:
        return f"prefetch {self.tensor}"


class Wait(_Operation):
    """Make the compute stream wait until the latest `transfer` of `tensor` has finished."""

    op: Literal["wait"] = "wait"
    tensor: str
    transfer: Literal["offload", "prefetch"]

    def describe(self) -> str:
        return f"wait for {self.transfer} of {self.tensor}"


class Free(_Operation):
    """Release the device copy of `tensor` (once any offload reading it has finished)."""

    op: Literal["free"] = "free"
    tensor: str

    def describe(self) -> str:
        return f"free {self.tensor}"


Operation = Annotated[Union[Compute, Offload, Prefetch, Wait, Free], Field(discriminator="op")]


class Stage(_Strict):
    """Operations issued while computing `node` for the first time (MO-SOS stage t)."""

    index: int = Field(ge=0, description="Its position in `stages`: 0, 1, 2, ... in order.")
    node: str | None = Field(default=None, description="The node first computed in this stage, if any.")
    operations: list[Operation] = Field(default_factory=list)


def relative_gap(objective: float | None, bound: float | None) -> float | None:
    """(objective - bound) / objective, the solver's gap; None where either is unknown."""
    if objective is None or bound is None:
        return None
    if objective == 0:
        return 0.0 if bound >= 0 else None
    return max(0.0, (objective - bound) / abs(objective))


class SolverInfo(_Strict):
    status: str = Field(description="OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, ...")
    objective: float | None = None
    bound: float | None = None
    gap: float | None = Field(default=None, description="(objective - bound) / objective.")
    wall_time_s: float = Field(ge=0)
    time_to_first_solution_s: float | None = None
    workers: int | None = None
    seed: int | None = None
    encoding: str | None = None


class Summary(_Strict):
    """Figures from the simulator, never from the planner's own objective."""

    strategy: str
    predicted_step_time_ms: float = Field(ge=0)
    compute_time_ms: float = Field(ge=0, description="Busy time of the compute stream.")
    stall_time_ms: float = Field(ge=0, description="Time the compute stream waited for copies.")
    recompute_time_ms: float = Field(ge=0)
    peak_memory_bytes: int = Field(ge=0)
    offloaded_bytes: int = Field(ge=0)
    prefetched_bytes: int = Field(ge=0)
    implementations_changed: int = Field(
        default=0, ge=0, description="Computations not using the node's fastest implementation."
    )
    arena_bytes: int | None = Field(
        default=None, ge=0,
        description="The arena that planned addresses need for this plan's buffers (fixed memory apart); where fixed "
        "memory and it pass the budget, the schedule carries no addresses (its `arena_bytes` is None).")
    solver: SolverInfo | None = None


class Schedule(_Strict):
    schema_version: str = Field(
        default=SCHEDULE_SCHEMA_VERSION, json_schema_extra={"enum": list(SUPPORTED_SCHEDULE_VERSIONS)}
    )
    profile_name: str
    profile_digest: str = Field(description="GraphProfile.digest() of the profile it was made for.")
    budget_bytes: int | None = Field(default=None, ge=0, description="None: no memory limit.")
    stages: list[Stage]
    compute_order: list[str] = Field(description="Node ids in the order they are computed, repeats included.")
    arena_bytes: int | None = Field(
        default=None, ge=0, le=_OFFSET_LIMIT_BYTES,
        description="Planned addresses: every buffer the step allocates (outputs, prefetched copies, workspaces) "
        "has an offset in one arena of this size, allocated once beside fixed memory; None: no addresses.")
    summary: Summary | None = None

    @field_validator("stages")
    @classmethod
    def _numbered_in_order(cls, stages: list[Stage]) -> list[Stage]:
        for position, stage in enumerate(stages):
            if stage.index != position:
                raise ValueError(
                    f"stages are numbered 0, 1, 2, ... in order, but the stage at position {position} has index "
                    f"{stage.index}"
                )
        return stages

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: str) -> str:
        if value not in SUPPORTED_SCHEDULE_VERSIONS:
            raise ValueError(
                f"unknown schedule schema version {value!r}; this mosos reads {', '.join(SUPPORTED_SCHEDULE_VERSIONS)}"
            )
        return value

    def operations(self):
        """(stage index, operation index in the whole program, operation), in program order."""
        position = 0
        for stage in self.stages:
            for operation in stage.operations:
                yield stage.index, position, operation
                position += 1

    def path_of(self, position: int) -> str | None:
        """JSON path of the operation at `position` in program order (as `operations()` counts)."""
        for stage_number, stage in enumerate(self.stages):
            if position < len(stage.operations):
                return f"stages[{stage_number}].operations[{position}]"
            position -= len(stage.operations)
        return None

    def to_json(self, indent: int | None = 1) -> str:
        return self.model_dump_json(indent=indent, exclude_none=True)


def parse_schedule(data: Any, source: str | None = None) -> Schedule:
    if not isinstance(data, dict):
        raise ScheduleError([Issue("", f"a schedule is a JSON object, not {type(data).__name__}")], source)
    try:
        return Schedule.model_validate(data)
    except ValidationError as error:
        raise ScheduleError(issues_from_validation_error(error), source) from None


def load_schedule(path: str | Path) -> Schedule:
    path = Path(path)
    return parse_schedule(read_json(path, ScheduleError), str(path))
