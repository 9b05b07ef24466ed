"""What every CP-SAT strategy does around the solve: pick the best certified plan, or explain infeasibility."""

from __future__ import annotations

import time

from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.solve import solve_model
from planner.errors import ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import Schedule, SolverInfo
from planner.simulator import simulate
from planner.strategies import SolveOptions
from planner.units import format_bytes


def fits(profile: GraphProfile, schedule: Schedule | None, budget_bytes: int | None) -> float | None:
    """Simulated step time of `schedule` within the budget, or None if it does not fit or is invalid."""
    if schedule is None:
        return None
    try:
        return simulate(profile, schedule, budget_bytes, keep_timeline=False).step_time_ms
    except ScheduleRejected:
        return None


def best_plan(profile: GraphProfile, budget_bytes: int | None, candidates: list[tuple[str, Schedule | None]]):
    """(name, schedule, step time) of the fastest candidate that fits; the earlier one wins ties."""
    best = None
    for name, schedule in candidates:
        step = fits(profile, schedule, budget_bytes)
        if step is not None and (best is None or step < best[2] - 1e-9):
            best = (name, schedule, step)
    return best


def infeasible(
    profile: GraphProfile, budget_bytes: int, features: Features, options: SolveOptions, strategy: str, status: str,
    time_limit_s: float | None = None,
):
    """Search the smallest budget the strategy can meet; return a plan if that search found one within the budget."""
    from planner.minimum import smallest_budget
    from planner.planning import InfeasibleBudget

    minimum = smallest_budget(profile, features, options, strategy, time_limit_s=time_limit_s)
    if minimum.schedule is not None and fits(profile, minimum.schedule, budget_bytes) is not None:
        return minimum.schedule.model_copy(update={"budget_bytes": budget_bytes})
    reason = "proven infeasible" if status == "INFEASIBLE" else f"no plan found ({status}) within the time limit"
    raise InfeasibleBudget(
        f"strategy {strategy!r}: no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)}), {reason}; "
        + minimum.describe(),
        minimum_budget_bytes=minimum.budget_bytes,
        proven=status == "INFEASIBLE",
    )


def plan_with_model(
    profile: GraphProfile,
    budget_bytes: int,
    options: SolveOptions,
    strategy: str,
    features: Features,
    hints: list[Schedule] = (),
    others: list[tuple[str, Schedule | None]] = (),
    time_limit_s: float | None = None,
    explain_infeasible: bool = True,
    fallbacks: list[tuple[str, Schedule | None]] = (),
    deadline: float | None = None,
) -> tuple[Schedule | None, SolverInfo, str | None]:
    """Solve the model; return (uncertified best plan, solver info, which plan won).

    `others` compete with the CP-SAT plan; `fallbacks` are used only when
    neither it nor `others` gives a plan. With nothing that fits: search the smallest feasible budget and raise
    InfeasibleBudget, or return (None, info, None) if `explain_infeasible` is off. `deadline`
    (time.monotonic()) caps the solve's wall clock; the minimum-budget search then gets what is left, 1 s at least.
    """
    outcome = solve_model(
        profile, budget_bytes, features, options, strategy, hints=list(hints), time_limit_s=time_limit_s,
        deadline=deadline,
    )
    best = best_plan(profile, budget_bytes, [("cp-sat", outcome.schedule)] + list(others))
    if best is None:
        best = best_plan(profile, budget_bytes, list(fallbacks))
    info = outcome.info
    if best is None:
        if not explain_infeasible:
            return None, info, None
        search_s = None if deadline is None else max(1.0, deadline - time.monotonic())
        schedule = infeasible(profile, budget_bytes, features, options, strategy, info.status, search_s)
        note = f"{info.encoding}; plan from the memory-minimizing search"
        return schedule, info.model_copy(update={"encoding": note}), "cp-sat (memory-minimizing)"
    name, schedule, _ = best
    encoding = info.encoding
    if name != "cp-sat":
        # The plan that won lies outside what the model proved (another compute order, more recomputations,
        # deliberate stalls): its status, objective and bound describe the model, not this plan.
        alone = info.status
        if info.objective is not None:
            alone += f", objective {info.objective:.6g}, bound {info.bound:.6g}"
        encoding = f"{info.encoding}; best plan: {name}; the model alone: {alone}"
        info = info.model_copy(update={"status": "FEASIBLE", "objective": None, "bound": None, "gap": None})
    schedule = schedule.model_copy(update={"budget_bytes": budget_bytes})
    return schedule, info.model_copy(update={"encoding": encoding}), name


def certified(profile: GraphProfile, schedule: Schedule, strategy: str, info: SolverInfo) -> Schedule:
    return certify(profile, schedule, strategy, info)
