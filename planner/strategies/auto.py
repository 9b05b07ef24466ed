"""auto: keep everything, each compute takes the fastest implementation that fits at that moment.

What a cuDNN-backed framework does when memory is tight: nothing is moved or
recomputed, but a convolution whose fastest algorithm's workspace does not
fit in the memory free when it starts falls back to a slower one that does.
"""

from __future__ import annotations

from planner.auto_algorithms import apply_auto, with_smallest_workspaces
from planner.budget_search import fitting, peak_bytes, plan_within
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy
from planner.strategies.keep_all import keep_all_schedule

NAME = "auto"


def auto_schedule(profile: GraphProfile, budget_bytes: int | None) -> Schedule:
    return apply_auto(profile, keep_all_schedule(profile, budget_bytes), budget_bytes)


@strategy(NAME, "keep everything; each compute takes the fastest implementation whose workspace fits in the memory free when it starts")
def plan_auto(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    def attempt(budget: int) -> Schedule | None:
        schedule = auto_schedule(profile, budget)
        return schedule if fitting(profile, schedule, budget, NAME) else None

    # With nothing moved, memory does not depend on timing: auto fits wherever the smallest workspaces do.
    feasible = peak_bytes(profile, with_smallest_workspaces(profile, keep_all_schedule(profile)), NAME)
    return plan_within(profile, budget_bytes, NAME, attempt, feasible, options.started())
