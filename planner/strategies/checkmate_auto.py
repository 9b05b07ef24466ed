"""checkmate-auto: the optimal recompute-only plan, then the framework's Auto algorithm choice.

As the MO-SOS paper's baseline: the recomputation plan does not know about
algorithms (it plans with each node's smallest-workspace implementation,
timed as its fastest), then Auto gives each computation the fastest
implementation whose workspace fits in the memory left at that moment.
"""

from __future__ import annotations

from dataclasses import replace

from planner.auto_algorithms import apply_auto
from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.run import best_plan, plan_with_model
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy
from planner.strategies.recompute_only import HEURISTIC_SHARE, greedy_phase

CHECKMATE = Features(recompute=True, transfers=False, implementations="framework", max_recomputes=2)


def with_auto(profile: GraphProfile, budget_bytes: int, base: Schedule) -> tuple[Schedule, str]:
    """Auto's algorithm choice on top of `base`, unless that is no faster (or, by a bug, does not fit)."""
    candidates = [("auto", apply_auto(profile, base, budget_bytes)), ("base", base)]
    name, schedule, _ = best_plan(profile, budget_bytes, candidates)
    return schedule, name


def plan_then_auto(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, strategy_name: str, features: Features,
    time_limit_s: float | None = None, explain_infeasible: bool = True, hints: list[Schedule] = (),
    deadline: float | None = None, greedy: Schedule | None | bool = False,
) -> Schedule | None:
    """The paper's two-phase baselines: solve without algorithm choice, then let Auto pick the algorithms.

    `options.deadline` (or `deadline` when sooner) caps the wall clock; `greedy`: the greedy plan if the
    caller has it already.
    """
    options = options.started()
    if deadline is not None and deadline < options.deadline:
        options = replace(options, deadline=deadline)
    if greedy is False:
        greedy = greedy_phase(profile, budget_bytes, options, HEURISTIC_SHARE)
    base, info, _ = plan_with_model(
        profile, budget_bytes, options, strategy_name, features,
        hints=[s for s in (greedy, *hints) if s is not None], fallbacks=[("greedy evict-and-recompute", greedy)],
        time_limit_s=time_limit_s, explain_infeasible=explain_infeasible,
    )
    if base is None:
        return None
    schedule, _ = with_auto(profile, budget_bytes, base)
    return certify(profile, schedule, strategy_name, info)


def checkmate_auto_plan(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, time_limit_s: float | None = None,
    explain_infeasible: bool = True, deadline: float | None = None, greedy: Schedule | None | bool = False,
) -> Schedule | None:
    return plan_then_auto(
        profile, budget_bytes, options, "checkmate-auto", CHECKMATE, time_limit_s=time_limit_s,
        explain_infeasible=explain_infeasible, deadline=deadline, greedy=greedy,
    )


@strategy("checkmate-auto", "optimal recompute-only plan (CP-SAT), then Auto algorithm choice in the memory left")
def plan_checkmate_auto(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return checkmate_auto_plan(profile, budget_bytes, options)
