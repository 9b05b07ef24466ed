"""str-auto: the optimal offload + recompute plan without algorithm choice, then Auto.

The STR model (IPDPS 2022) is MO-SOS without implementation variables: here
the same CP-SAT model with one implementation per node (the smallest
workspace, timed as the fastest), after which Auto picks the algorithms.
"""

from __future__ import annotations

from planner.cpsat.data import Features
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy
from planner.strategies.checkmate_auto import plan_then_auto

STR = Features(recompute=True, transfers=True, implementations="framework", max_recomputes=2, max_prefetches=1)


def str_auto_plan(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, time_limit_s: float | None = None,
    explain_infeasible: bool = True, hints: list[Schedule] = (), deadline: float | None = None,
    greedy: Schedule | None | bool = False,
) -> Schedule | None:
    return plan_then_auto(
        profile, budget_bytes, options, "str-auto", STR, time_limit_s=time_limit_s,
        explain_infeasible=explain_infeasible, hints=hints, deadline=deadline, greedy=greedy,
    )


@strategy("str-auto", "optimal offload+recompute plan (CP-SAT, no algorithm choice), then Auto algorithm choice")
def plan_str_auto(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return str_auto_plan(profile, budget_bytes, options)
