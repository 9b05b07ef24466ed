"""str-auto: the optimal offload + recompute plan without algorithm choice, then Auto.

The STR model (IPDPS 2022) is MO-SOS without implementation variables: here
the same CP-SAT model with one implementation per node (the smallest
workspace, timed as the fastest), after which Auto picks the algorithms.
"""

from __future__ import annotations

from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.run import plan_with_model
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import SolveOptions, strategy
from planner.strategies.checkmate_auto import with_auto

STR = Features(recompute=True, transfers=True, implementations="framework", max_recomputes=2, max_prefetches=1)


def str_auto_plan(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, time_limit_s: float | None = None,
    explain_infeasible: bool = True, hints: list[Schedule] = (), deadline: float | None = None,
    greedy: Schedule | None | bool = False,
) -> Schedule | None:
    """`deadline` (time.monotonic()) caps the wall clock; `greedy`: the greedy plan if the caller has it already."""
    if greedy is False:
        greedy = greedy_recompute_schedule(profile, budget_bytes)
    base, info, _ = plan_with_model(
        profile, budget_bytes, options, "str-auto", STR,
        hints=[s for s in (greedy, *hints) if s is not None], fallbacks=[("greedy evict-and-recompute", greedy)],
        time_limit_s=time_limit_s, explain_infeasible=explain_infeasible, deadline=deadline,
    )
    if base is None:
        return None
    schedule, _ = with_auto(profile, budget_bytes, base)
    return certify(profile, schedule, "str-auto", info)


@strategy("str-auto", "optimal offload+recompute plan (CP-SAT, no algorithm choice), then Auto algorithm choice")
def plan_str_auto(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return str_auto_plan(profile, budget_bytes, options)
