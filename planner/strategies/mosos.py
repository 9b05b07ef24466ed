"""mosos: the joint MO-SOS model (keep / offload+prefetch / recompute, and algorithm choice) on CP-SAT.

It contains the project's other strategies, so it must never lose to one:
their plans at this budget (an explicit list, `BASELINE_STRATEGIES` and
`SOLVED_INSIDE`; never plugin strategies) start the search (the fastest one
the model can express is its first solution, improved by the window search of
`planner.cpsat.lns`), and the plan returned is the fastest, in simulation,
among the model's solution and every baseline plan that fits. The solver info
says which one won. One deadline bounds the whole call, each phase within its
share of it; progress events name `mosos`, with the phase (an inner solve, or
a heuristic whose plan improved on the best so far) in `phase`.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.greedy import smallest_workspaces_differ
from planner.cpsat.reorder import in_profile_order, reordered_schedule
from planner.cpsat.run import fits, plan_with_model
from planner.errors import MososError
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy
from planner.strategies.auto import plan_auto
from planner.strategies.checkmate_auto import checkmate_auto_plan
from planner.strategies.checkpoint_all import plan_checkpoint_all
from planner.strategies.chen_sqrt import plan_chen_sqrt
from planner.strategies.keep_all import plan_keep_all
from planner.strategies.per_block import plan_per_block
from planner.strategies.recompute_only import (
    at_lower_bound,
    certify_lower_bound,
    greedy_phase,
    phase_deadline,
    recompute_only_plan,
)
from planner.strategies.str_auto import str_auto_plan
from planner.strategies.swap_recompute import plan_swap_recompute
from planner.strategies.vdnn import plan_vdnn_all, plan_vdnn_conv, plan_vdnn_dyn

MOSOS = Features(recompute=True, transfers=True, implementations="all", max_recomputes=2, max_prefetches=1)

# The project's own heuristic baselines that start (and compete with) the joint model.
# An explicit list, not the registry: a strategy a plugin registers must not slow down or break mosos.
# The swap/recompute heuristic comes second although it costs most: it is the one that finds plans at the lower
# bound where transfers hide (VGG-416), and on a loaded machine the phase may end before the last ones start.
BASELINE_STRATEGIES = (
    "keep-all", "swap-recompute-heuristic", "per-block", "vdnn-all", "vdnn-conv", "vdnn-dyn", "chen-sqrt",
    "checkpoint-all", "auto",
)

# The CP-SAT strategies solved inside mosos, with their share of its time limit.
SOLVED_INSIDE = {"recompute-only": 0.1, "checkmate-auto": 0.1, "str-auto": 0.15}
# On graphs larger than this the whole-model solves inside find little the greedy plan has not (measured:
# transformer-b64-h100, 963 nodes, all three at the greedy plan's 646 ms; ResNet-50, 351 nodes, within 1% of
# it), while the joint model's window search gains with every second: they get a third of their share there.
LARGE_GRAPH_NODES = 150
LARGE_GRAPH_SHARE_FACTOR = 1 / 3

JOINT_PHASE = "joint model"

# The most of the time limit one heuristic baseline may take inside mosos (the swap/recompute heuristic
# replays the whole step per candidate: a minute on a 1,000-node graph if let run).
HEURISTIC_BASELINE_SHARE = 0.05
# ... except the swap/recompute heuristic, anytime and the strongest of them where links are fast
HEURISTIC_BASELINE_SHARES = {"swap-recompute-heuristic": 0.1}
# The most of the time limit the memory-aware reordering and the greedy evict-and-recompute pass may take, each.
ORDER_AND_GREEDY_SHARE = 0.1


def solved_inside_shares(profile: GraphProfile) -> dict[str, float]:
    factor = LARGE_GRAPH_SHARE_FACTOR if len(profile.nodes) > LARGE_GRAPH_NODES else 1.0
    return {name: share * factor for name, share in SOLVED_INSIDE.items()}


def _baseline_functions() -> dict:
    """Imported directly, so that a plugin registering one of these names cannot replace it here."""
    functions = {
        "keep-all": plan_keep_all, "vdnn-all": plan_vdnn_all, "vdnn-conv": plan_vdnn_conv, "vdnn-dyn": plan_vdnn_dyn,
        "chen-sqrt": plan_chen_sqrt, "checkpoint-all": plan_checkpoint_all,
        "swap-recompute-heuristic": plan_swap_recompute, "auto": plan_auto, "per-block": plan_per_block,
    }
    return {name: functions[name] for name in BASELINE_STRATEGIES}


def _reporting_as_mosos(options: SolveOptions, phase: str) -> SolveOptions:
    """Progress events of an inner solve, reported as mosos's with the inner phase beside."""
    if options.progress is None:
        return options
    report = options.progress
    return replace(options, progress=lambda event: report({**event, "strategy": "mosos", "phase": phase}))


class _PlanReporter:
    """Progress for the plans mosos finds outside CP-SAT: each one that improves on the best so far, by its name."""

    def __init__(self, profile: GraphProfile, budget_bytes: int, options: SolveOptions, started: float):
        self.profile, self.budget_bytes, self.options, self.started = profile, budget_bytes, options, started
        self.best = float("inf")
        self.count = 0

    def __call__(self, name: str, schedule: Schedule | None) -> None:
        if self.options.progress is None or schedule is None:
            return
        step = fits(self.profile, schedule, self.budget_bytes)
        if step is None or step >= self.best:
            return
        self.best, self.count = step, self.count + 1
        self.options.progress({
            "strategy": "mosos", "phase": name, "objective": step, "bound": None, "gap": None,
            "solutions": self.count, "elapsed_s": time.monotonic() - self.started,
        })


def baseline_plans(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, deadline: float | None = None,
    greedy: Schedule | None | bool = False, reordered: Schedule | None | bool = False,
    on_plan=None,
) -> list[tuple[str, Schedule]]:
    """The baselines' plans at this budget; baselines that fail are skipped, and so are those left at the deadline.

    `deadline` (time.monotonic(); default the options' own) ends this phase: no baseline starts after it, each
    heuristic gets its share of the limit at most (`HEURISTIC_BASELINE_SHARE(S)`), and the inner CP-SAT solves
    get theirs (`solved_inside_shares`) as a wall-clock window, model building included. `on_plan(name, plan)`
    hears of each heuristic plan as it comes.
    """
    options = options.started()
    phase_end = options.deadline if deadline is None else min(deadline, options.deadline)
    phase = replace(options, deadline=phase_end)
    limit = options.time_limit_s
    quiet = replace(phase, progress=None, explain_infeasible=False)
    plans: list[tuple[str, Schedule]] = []
    # a heuristic needs a few whole simulations whatever its share (auto: 0.5 s on 2,000 nodes); one is started only
    # where the slowest so far would still end in the phase (started on what was left, they took mosos 0.4 s past
    # its limit on VGG-416)
    slowest_s = 0.0
    for name, function in _baseline_functions().items():
        if phase.out_of_time(slowest_s):
            break
        began = time.monotonic()
        try:
            share = HEURISTIC_BASELINE_SHARES.get(name, HEURISTIC_BASELINE_SHARE)
            plans.append((name, function(profile, budget_bytes, quiet.within(share * limit))))
            if on_plan is not None:
                on_plan(*plans[-1])
        except MososError:
            continue
        finally:
            slowest_s = max(slowest_s, time.monotonic() - began)
    solved = {"recompute-only": recompute_only_plan, "checkmate-auto": checkmate_auto_plan, "str-auto": str_auto_plan}
    for name, share in solved_inside_shares(profile).items():
        if phase.out_of_time():
            break
        computed = {"reordered": reordered} if name == "recompute-only" else {}  # not worked out twice
        try:
            # its share of the limit as a wall-clock window too (model building included), never past the phase
            window = replace(phase, deadline=min(phase.deadline, time.monotonic() + share * limit))
            schedule = solved[name](
                profile, budget_bytes, _reporting_as_mosos(window, name), time_limit_s=share * limit,
                explain_infeasible=False, greedy=greedy, **computed,
            )
        except MososError:
            continue
        if schedule is not None:
            plans.append((name, schedule))
    return plans


def mosos_plan(profile: GraphProfile, budget_bytes: int, options: SolveOptions, baselines: bool = True) -> Schedule:
    """`options.deadline` bounds the whole call (heuristics, baselines, inner solves, joint model), wall clock."""
    options = options.started()
    started = time.monotonic()
    limit = options.time_limit_s
    reporter = _PlanReporter(profile, budget_bytes, options, started)
    reordered = reordered_schedule(profile, budget_bytes, deadline=phase_deadline(options, ORDER_AND_GREEDY_SHARE))
    if at_lower_bound(profile, reordered):
        return certify_lower_bound(profile, reordered, "mosos", options, started)
    # The joint model keeps at least this share of the budget; the baselines and inner solves use the rest.
    reserve = (1 - sum(solved_inside_shares(profile).values())) * limit if baselines else limit
    reporter("memory-aware order", reordered)
    greedy = greedy_phase(profile, budget_bytes, options, ORDER_AND_GREEDY_SHARE)
    reporter("greedy evict-and-recompute", greedy)
    frugal = None
    if greedy is None and smallest_workspaces_differ(profile):
        # the fastest algorithms' workspaces leave no room: a start for the joint model, which chooses algorithms
        frugal = greedy_phase(profile, budget_bytes, options, ORDER_AND_GREEDY_SHARE, "smallest-workspace")
        reporter("greedy on the smallest workspaces", frugal)
    inner_deadline = min(options.deadline, started + limit - 0.5 * reserve)
    others = baseline_plans(
        profile, budget_bytes, options, deadline=inner_deadline, greedy=greedy, reordered=reordered, on_plan=reporter,
    ) if baselines else []
    if greedy is not None:
        others.append(("greedy evict-and-recompute", greedy))
    if frugal is not None:
        others.append(("greedy on the smallest workspaces", frugal))
    if reordered is not None:
        others.append(("memory-aware order", reordered))
    if options.candidates is not None:
        options.candidates.extend(others)
    remaining = reserve
    if options.workers != 1:
        # wall-clock budgeting; with one worker the shares stay fixed so that a seeded run repeats exactly
        remaining = max(0.05 * limit, options.remaining_s())
    schedule, info, _ = plan_with_model(
        profile, budget_bytes, _reporting_as_mosos(options, JOINT_PHASE), "mosos", MOSOS,
        # a plan in another compute order cannot warm-start the model, whose stages follow the profile's order
        hints=[s for _, s in others if in_profile_order(profile, s)], others=others, time_limit_s=remaining,
        windows=True,
    )
    # the wall time covers the whole strategy: baselines, inner solves and the joint model
    return certify(profile, schedule, "mosos", info.model_copy(update={"wall_time_s": time.monotonic() - started}))


@strategy(
    "mosos", "the joint MO-SOS model on CP-SAT: keep, offload+prefetch or recompute, and the algorithm of every node",
    offers_candidates=True,
)
def plan_mosos(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return mosos_plan(profile, budget_bytes, options)
