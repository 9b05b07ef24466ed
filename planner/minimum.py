"""The smallest budget a strategy can meet, found by search rather than guessed.

The strategy's own model is solved with the peak as the objective (the
budget becomes a variable), starting from the keep-all plan. When CP-SAT
proves that objective optimal, no plan of that model fits in a byte less;
otherwise the figure is the best found in the time given, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.budget import minimum_budget_bytes
from planner.cpsat.data import Features
from planner.cpsat.solve import solve_model
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import SolveOptions
from planner.units import format_bytes


@dataclass
class MinimumBudget:
    budget_bytes: int | None  # None: the search found no plan at all
    proven: bool
    schedule: Schedule | None  # a certified plan that fits in budget_bytes
    wall_time_s: float

    def describe(self) -> str:
        if self.budget_bytes is None:
            return "the search for the smallest feasible budget found no plan"
        how = "proven minimal" if self.proven else f"best found in {self.wall_time_s:.1f} s, not proven minimal"
        size = format_bytes(self.budget_bytes)
        return f"the smallest budget it can meet is {self.budget_bytes} bytes ({size}, {how})"


def smallest_budget(
    profile: GraphProfile, features: Features, options: SolveOptions, strategy: str, time_limit_s: float | None = None
) -> MinimumBudget:
    from planner.strategies.keep_all import keep_all_schedule

    limit = time_limit_s if time_limit_s is not None else min(options.time_limit_s, 30.0)
    quiet = replace(options, progress=None)
    outcome = solve_model(
        profile,
        None,
        replace(features, minimize_memory=True),
        quiet,
        strategy,
        hints=[keep_all_schedule(profile)],
        time_limit_s=limit,
    )
    if outcome.schedule is None or outcome.objective_value is None:
        return MinimumBudget(None, False, None, outcome.info.wall_time_s)
    budget = max(int(round(outcome.objective_value)), minimum_budget_bytes(profile))
    schedule = outcome.schedule.model_copy(update={"budget_bytes": budget})
    proven = outcome.info.status == "OPTIMAL"
    if features.recompute:
        # The strategies also fall back on the greedy plan, which may recompute more often than the model allows.
        greedy = _greedy_minimum(profile, budget)
        if greedy is not None:
            budget, schedule, proven = greedy[0], greedy[1], False
    return MinimumBudget(budget, proven, schedule, outcome.info.wall_time_s)


def _greedy_minimum(profile: GraphProfile, above_bytes: int):
    """The smallest budget below `above_bytes` at which the greedy recompute plan fits (bisection), if any."""
    from planner.budget_search import smallest_budget as bisect_budget
    from planner.cpsat.greedy import greedy_recompute_schedule

    if greedy_recompute_schedule(profile, above_bytes - 1) is None:
        return None
    low = minimum_budget_bytes(profile) - 1  # fails: below what any plan needs
    budget = bisect_budget(lambda bytes_: greedy_recompute_schedule(profile, bytes_), low, above_bytes - 1)
    schedule = greedy_recompute_schedule(profile, budget)
    return budget, schedule.model_copy(update={"budget_bytes": budget})
