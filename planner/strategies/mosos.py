"""mosos: the joint MO-SOS model (keep / offload+prefetch / recompute, and algorithm choice) on CP-SAT.

It contains the project's other strategies, so it must never lose to one:
their plans at this budget (an explicit list, `BASELINE_STRATEGIES` and
`SOLVED_INSIDE`; never plugin strategies) start the search (the fastest one
that fits is the hint), and the plan returned is the fastest, in simulation,
among the CP-SAT solution and every baseline plan that fits. The solver info
says which one won. `time_limit_s` is the wall-clock budget of the whole
call; progress events name `mosos`, with the inner solve in `phase`.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.reorder import in_profile_order, reordered_schedule
from planner.cpsat.run import plan_with_model
from planner.errors import MososError
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import SolveOptions, strategy
from planner.strategies.recompute_only import at_lower_bound, certify_lower_bound

MOSOS = Features(recompute=True, transfers=True, implementations="all", max_recomputes=2, max_prefetches=1)

# The project's own heuristic baselines that start (and compete with) the joint model, cheapest first.
# An explicit list, not the registry: a strategy a plugin registers must not slow down or break mosos.
BASELINE_STRATEGIES = (
    "keep-all", "vdnn-all", "vdnn-conv", "vdnn-dyn", "chen-sqrt", "checkpoint-all", "swap-recompute-heuristic", "auto",
)

# The CP-SAT strategies solved inside mosos, with their share of its time limit.
SOLVED_INSIDE = {"recompute-only": 0.1, "checkmate-auto": 0.1, "str-auto": 0.15}

JOINT_PHASE = "joint model"


def _baseline_functions() -> dict:
    """Imported directly, so that a plugin registering one of these names cannot replace it here."""
    from planner.strategies.auto import plan_auto
    from planner.strategies.checkpoint_all import plan_checkpoint_all
    from planner.strategies.chen_sqrt import plan_chen_sqrt
    from planner.strategies.keep_all import plan_keep_all
    from planner.strategies.swap_recompute import plan_swap_recompute
    from planner.strategies.vdnn import plan_vdnn_all, plan_vdnn_conv, plan_vdnn_dyn

    functions = {
        "keep-all": plan_keep_all, "vdnn-all": plan_vdnn_all, "vdnn-conv": plan_vdnn_conv, "vdnn-dyn": plan_vdnn_dyn,
        "chen-sqrt": plan_chen_sqrt, "checkpoint-all": plan_checkpoint_all,
        "swap-recompute-heuristic": plan_swap_recompute, "auto": plan_auto,
    }
    return {name: functions[name] for name in BASELINE_STRATEGIES}


def _reporting_as_mosos(options: SolveOptions, phase: str) -> SolveOptions:
    """Progress events of an inner solve, reported as mosos's with the inner phase beside."""
    if options.progress is None:
        return options
    report = options.progress
    return replace(options, progress=lambda event: report({**event, "strategy": "mosos", "phase": phase}))


def baseline_plans(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, deadline: float | None = None,
    greedy: Schedule | None | bool = False, reordered: Schedule | None | bool = False,
) -> list[tuple[str, Schedule]]:
    """The baselines' plans at this budget; baselines that fail are skipped, and so are those left at the deadline.

    `deadline` (time.monotonic()) is mosos's total budget: the heuristics stop being started once it has
    passed, the inner CP-SAT solves get their share of the limit and never run past it.
    """
    from planner.strategies.checkmate_auto import checkmate_auto_plan
    from planner.strategies.recompute_only import recompute_only_plan
    from planner.strategies.str_auto import str_auto_plan

    def out_of_time() -> bool:
        stopped = options.should_stop is not None and options.should_stop()
        return stopped or (deadline is not None and time.monotonic() >= deadline)

    quiet = replace(options, progress=None)
    plans: list[tuple[str, Schedule]] = []
    for name, function in _baseline_functions().items():
        if out_of_time():
            break
        try:
            plans.append((name, function(profile, budget_bytes, quiet)))
        except MososError:
            continue
    solved = {"recompute-only": recompute_only_plan, "checkmate-auto": checkmate_auto_plan, "str-auto": str_auto_plan}
    for name, share in SOLVED_INSIDE.items():
        if out_of_time():
            break
        computed = {"reordered": reordered} if name == "recompute-only" else {}  # not worked out twice
        try:
            schedule = solved[name](
                profile, budget_bytes, _reporting_as_mosos(options, name), time_limit_s=share * options.time_limit_s,
                explain_infeasible=False, deadline=deadline, greedy=greedy, **computed,
            )
        except MososError:
            continue
        if schedule is not None:
            plans.append((name, schedule))
    return plans


def mosos_plan(profile: GraphProfile, budget_bytes: int, options: SolveOptions, baselines: bool = True) -> Schedule:
    """`options.time_limit_s` is the budget of the whole call (baselines, inner solves, joint model), wall clock."""
    started = time.monotonic()
    reordered = reordered_schedule(profile, budget_bytes)
    if at_lower_bound(profile, reordered):
        return certify_lower_bound(profile, reordered, "mosos", options, started)
    limit = options.time_limit_s
    # The joint model keeps at least this share of the budget; the baselines and inner solves use the rest.
    reserve = (1 - sum(SOLVED_INSIDE.values())) * limit if baselines else limit
    greedy = greedy_recompute_schedule(profile, budget_bytes)
    inner_deadline = started + limit - 0.5 * reserve
    others = baseline_plans(
        profile, budget_bytes, options, deadline=inner_deadline, greedy=greedy, reordered=reordered
    ) if baselines else []
    if greedy is not None:
        others.append(("greedy evict-and-recompute", greedy))
    if reordered is not None:
        others.append(("memory-aware order", reordered))
    remaining = reserve
    if options.workers != 1:
        # wall-clock budgeting; with one worker the shares stay fixed so that a seeded run repeats exactly
        remaining = max(0.05 * limit, limit - (time.monotonic() - started))
    schedule, info, _ = plan_with_model(
        profile, budget_bytes, _reporting_as_mosos(options, JOINT_PHASE), "mosos", MOSOS,
        # a plan in another compute order cannot warm-start the model, whose stages follow the profile's order
        hints=[s for _, s in others if in_profile_order(profile, s)], others=others, time_limit_s=remaining,
        deadline=started + limit,
    )
    # the wall time covers the whole strategy: baselines, inner solves and the joint model
    return certify(profile, schedule, "mosos", info.model_copy(update={"wall_time_s": time.monotonic() - started}))


@strategy(
    "mosos", "the joint MO-SOS model on CP-SAT: keep, offload+prefetch or recompute, and the algorithm of every node"
)
def plan_mosos(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return mosos_plan(profile, budget_bytes, options)
