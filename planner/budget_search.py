"""For the heuristic baselines: does a plan fit, and the smallest budget at which a strategy's plan fits.

Heuristics are cheap, so when one fails its budget the smallest budget it can
meet is found by bisection over the budget (`planner.budget.smallest_budget`),
each probe judged by the simulator, rather than guessed from a formula.
"""

from __future__ import annotations

from typing import Callable

from planner.auto_algorithms import apply_auto, with_smallest_workspaces
from planner.budget import smallest_budget
from planner.builder import PlannerBug, certify
from planner.errors import InfeasibleBudget, ScheduleRejected
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import SimulationResult, simulate
from planner.units import format_bytes

Attempt = Callable[[int], "Schedule | None"]


def fitting(profile: GraphProfile, schedule: Schedule, budget_bytes: int | None, strategy: str) -> SimulationResult | None:
    """The simulation of `schedule` if it fits the budget; None if it only breaks the budget.

    Any other rejection means the strategy wrote an impossible program: a bug.
    """
    if schedule.budget_bytes != budget_bytes:  # the simulator falls back to the schedule's own budget on None
        schedule = schedule.model_copy(update={"budget_bytes": budget_bytes})
    try:
        return simulate(profile, schedule, budget_bytes=budget_bytes, keep_timeline=False)
    except ScheduleRejected as rejection:
        if rejection.over_budget_bytes is not None:
            return None
        raise PlannerBug(f"strategy {strategy!r} wrote a schedule the simulator rejects: {rejection}") from rejection


def peak_bytes(profile: GraphProfile, schedule: Schedule, strategy: str) -> int:
    result = fitting(profile, schedule, None, strategy)
    assert result is not None  # no budget, nothing to break
    return result.peak_memory_bytes


def plan_within(
    profile: GraphProfile, budget_bytes: int, strategy: str, attempt: Attempt, feasible_bytes: int,
    options: SolveOptions | None = None,
) -> Schedule:
    """Certify `attempt(budget)`, or raise InfeasibleBudget with the smallest budget `attempt` can meet.

    The search for that budget stops at `options`' deadline with the smallest budget seen to work so far.
    """
    schedule = attempt(budget_bytes)
    if schedule is not None:
        return certify(profile, schedule, strategy)
    if options is not None and not options.explain_infeasible:
        raise InfeasibleBudget(f"strategy {strategy!r} finds no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)})")
    minimum = smallest_budget(lambda budget: None if attempt(budget) is None else budget, budget_bytes,
                              max(feasible_bytes, budget_bytes + 1),
                              (lambda: False) if options is None else options.out_of_time)
    if minimum is None:
        raise InfeasibleBudget(
            f"strategy {strategy!r} finds no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)}), "
            "nor within any budget it tried" + (" before the time limit" if options and options.out_of_time() else "")
        )
    searched = "" if options is None or not options.out_of_time() else " (the search stopped at the time limit: not the smallest)"
    raise InfeasibleBudget(
        f"strategy {strategy!r} finds no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)}); "
        f"the smallest budget it can meet is {minimum} bytes ({format_bytes(minimum)}){searched}",
        minimum_budget_bytes=minimum,
    )


def plan_fixed_recompute(
    profile: GraphProfile, fastest: Schedule, budget_bytes: int, strategy: str, options: SolveOptions
) -> Schedule:
    """A recompute-only plan with a fixed program (checkpointing policies): its fastest algorithms where they fit,
    else Auto's; InfeasibleBudget with the smallest budget it meets otherwise.

    Nothing moves, so memory does not depend on timing: Auto fits wherever the smallest workspaces do.
    """
    smallest = with_smallest_workspaces(profile, fastest)

    def attempt(budget: int) -> Schedule | None:
        plain = fastest.model_copy(update={"budget_bytes": budget})
        if fitting(profile, plain, budget, strategy):
            return plain
        auto = apply_auto(profile, fastest, budget)
        return auto if fitting(profile, auto, budget, strategy) else None

    return plan_within(profile, budget_bytes, strategy, attempt, peak_bytes(profile, smallest, strategy),
                       options.started())
