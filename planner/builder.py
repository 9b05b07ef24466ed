"""Build schedules operation by operation, then let the simulator fill in the summary."""

from __future__ import annotations

from planner.errors import MososError, ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import (Compute, Free, Offload, Prefetch, Schedule, SolverInfo, Stage, Summary, Wait,
                              relative_gap)
from planner.simulator import SimulationResult, simulate


class PlannerBug(MososError):
    """A strategy produced a schedule that the simulator rejects: never shown as a plan."""


class ScheduleBuilder:
    def __init__(self, profile: GraphProfile):
        self.profile = profile
        self.stages: list[Stage] = []
        self.compute_order: list[str] = []

    def stage(self, node: str | None = None) -> "ScheduleBuilder":
        self.stages.append(Stage(index=len(self.stages), node=node))
        return self

    def _add(self, operation) -> "ScheduleBuilder":
        if not self.stages:
            self.stage()
        self.stages[-1].operations.append(operation)
        return self

    def compute(self, node: str, implementation: str | None = None) -> "ScheduleBuilder":
        if implementation is None:
            implementation = self.profile.node_by_id[node].fastest.name
        self.compute_order.append(node)
        return self._add(Compute(node=node, implementation=implementation))

    def offload(self, tensor: str) -> "ScheduleBuilder":
        return self._add(Offload(tensor=tensor))

    def prefetch(self, tensor: str) -> "ScheduleBuilder":
        return self._add(Prefetch(tensor=tensor))

    def wait(self, tensor: str, transfer: str) -> "ScheduleBuilder":
        return self._add(Wait(tensor=tensor, transfer=transfer))

    def free(self, tensor: str) -> "ScheduleBuilder":
        return self._add(Free(tensor=tensor))

    def build(self, budget_bytes: int | None) -> Schedule:
        return Schedule(
            profile_name=self.profile.name,
            profile_digest=self.profile.digest(),
            budget_bytes=budget_bytes,
            stages=self.stages,
            compute_order=list(self.compute_order),
        )


# Relative slack within which a model's objective and the simulated step are the same figure: the model rounds each
# time up to its time unit, so its objective may sit a little above the step it simulates to.
_SAME_STEP = 1e-4


def solver_info_for_plan(solver: SolverInfo | None, step_ms: float) -> SolverInfo | None:
    """The solver's figures restated for the plan the simulator ran: the objective is its simulated step, the bound
    never above it, and a status of OPTIMAL kept only where the step meets the bound. A model that solved another
    problem (the recompute plan before Auto's algorithm choice, times rounded up) said OPTIMAL of its own objective;
    its own figures stay in the note."""
    if solver is None or solver.objective is None:
        return solver
    objective = solver.objective
    bound = None if solver.bound is None else min(solver.bound, step_ms)
    status = solver.status
    same = abs(objective - step_ms) <= _SAME_STEP * max(abs(step_ms), 1e-9)
    if not same:
        if status == "OPTIMAL" and (bound is None or step_ms > bound * (1 + _SAME_STEP)):
            status = "FEASIBLE"
        note = f"the model's own objective {objective:.6g}" + (
            f", bound {solver.bound:.6g}" if solver.bound is not None else "") + f", status {solver.status}"
        solver = solver.model_copy(update={"encoding": f"{solver.encoding}; {note}" if solver.encoding else note})
    return solver.model_copy(update={"objective": step_ms, "bound": bound, "gap": relative_gap(step_ms, bound),
                                      "status": status})


def summarize(result: SimulationResult, strategy: str, solver: SolverInfo | None = None) -> Summary:
    solver = solver_info_for_plan(solver, result.step_time_ms)
    return Summary(
        strategy=strategy,
        predicted_step_time_ms=result.step_time_ms,
        compute_time_ms=result.compute_busy_ms,
        stall_time_ms=result.stall_time_ms,
        recompute_time_ms=result.recompute_time_ms,
        peak_memory_bytes=result.peak_memory_bytes,
        offloaded_bytes=result.offloaded_bytes,
        prefetched_bytes=result.prefetched_bytes,
        implementations_changed=result.implementations_changed,
        solver=solver,
    )


def certify(profile: GraphProfile, schedule: Schedule, strategy: str, solver: SolverInfo | None = None) -> Schedule:
    """Referee a strategy's schedule and attach the simulator's summary.

    A rejection here means the strategy is wrong, not the user's input.
    """
    try:
        result = simulate(profile, schedule, keep_timeline=False)
    except ScheduleRejected as rejection:
        raise PlannerBug(f"strategy {strategy!r} produced a schedule the simulator rejects: {rejection}") from rejection
    return schedule.model_copy(update={"summary": summarize(result, strategy, solver)})
