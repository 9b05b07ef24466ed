"""mosos: the joint MO-SOS model (keep / offload+prefetch / recompute, and algorithm choice) on CP-SAT.

It contains every other strategy, so it must never lose to one: the
baselines' plans at this budget start the search (the fastest one that fits
is the hint), and the plan returned is the fastest, in simulation, among the
CP-SAT solution and every baseline plan that fits. The solver info says
which one won.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.run import plan_with_model
from planner.errors import MososError
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import STRATEGIES, SolveOptions, load_all, strategy

MOSOS = Features(recompute=True, transfers=True, implementations="all", max_recomputes=2, max_prefetches=1)

# The CP-SAT strategies solved inside mosos, with their share of its time limit.
SOLVED_INSIDE = {"recompute-only": 0.1, "checkmate-auto": 0.1, "str-auto": 0.15}


def baseline_plans(profile: GraphProfile, budget_bytes: int, options: SolveOptions) -> list[tuple[str, Schedule]]:
    """Every other registered strategy's plan at this budget; strategies that fail or are absent are skipped."""
    from planner.strategies.checkmate_auto import checkmate_auto_plan
    from planner.strategies.recompute_only import recompute_only_plan
    from planner.strategies.str_auto import str_auto_plan

    load_all()
    quiet = replace(options, progress=None)
    plans: list[tuple[str, Schedule]] = []
    for name in sorted(STRATEGIES):
        if name == "mosos" or name in SOLVED_INSIDE:
            continue
        try:
            plans.append((name, STRATEGIES[name].function(profile, budget_bytes, quiet)))
        except MososError:
            continue
    solved = {"recompute-only": recompute_only_plan, "checkmate-auto": checkmate_auto_plan, "str-auto": str_auto_plan}
    for name, share in SOLVED_INSIDE.items():
        if options.should_stop is not None and options.should_stop():
            break
        try:
            schedule = solved[name](
                profile, budget_bytes, options, time_limit_s=share * options.time_limit_s, explain_infeasible=False
            )
        except MososError:
            continue
        if schedule is not None:
            plans.append((name, schedule))
    return plans


def mosos_plan(profile: GraphProfile, budget_bytes: int, options: SolveOptions, baselines: bool = True) -> Schedule:
    started = time.monotonic()
    others = baseline_plans(profile, budget_bytes, options) if baselines else []
    greedy = greedy_recompute_schedule(profile, budget_bytes)
    if greedy is not None:
        others.append(("greedy evict-and-recompute", greedy))
    remaining = options.time_limit_s * (1 - sum(SOLVED_INSIDE.values())) if baselines else options.time_limit_s
    if options.workers != 1:
        # wall-clock budgeting; with one worker the shares stay fixed so that a seeded run repeats exactly
        remaining = max(0.2 * options.time_limit_s, options.time_limit_s - (time.monotonic() - started))
    schedule, info, _ = plan_with_model(
        profile, budget_bytes, options, "mosos", MOSOS,
        hints=[s for _, s in others], others=others, time_limit_s=remaining,
    )
    # the wall time covers the whole strategy: baselines, inner solves and the joint model
    return certify(profile, schedule, "mosos", info.model_copy(update={"wall_time_s": time.monotonic() - started}))


@strategy(
    "mosos", "the joint MO-SOS model on CP-SAT: keep, offload+prefetch or recompute, and the algorithm of every node"
)
def plan_mosos(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return mosos_plan(profile, budget_bytes, options)
