"""The smallest budget a strategy can meet, found by search rather than guessed.

The strategy's own model is solved with the peak as the objective (the
budget becomes a variable), starting from the keep-all plan. When CP-SAT
proves that objective optimal, no plan of that model fits in a byte less;
otherwise the figure is the best found in the time given, and says so. The
search shares the caller's deadline: with no time left the answer is the
smallest budget known to work so far (the keep-all peak at worst, a plan
every strategy may return), never a guess. The strategies that may compute
in another topological order (`REORDERING_STRATEGIES`) also count keep-all
in the memory-aware order: on graphs with wide joins its peak is far below
anything the model, bound to the profile's order, finds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from planner.budget import minimum_budget_bytes, smallest_budget
from planner.cpsat.data import Features
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.reorder import MEMORY_AWARE_VIEW, keep_all_in_order, memory_aware_order
from planner.cpsat.solve import finish_margin_s, solve_model
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies.keep_all import keep_all_peak_bytes, keep_all_schedule
from planner.units import format_bytes

# The strategies whose plans may follow the memory-aware order (`planner.cpsat.reorder.reordered_schedule`).
REORDERING_STRATEGIES = frozenset({"mosos", "recompute-only"})


@dataclass
class MinimumBudget:
    budget_bytes: int | None  # None: no plan known at all
    proven: bool
    schedule: Schedule | None  # a certified plan that fits in budget_bytes
    wall_time_s: float
    searched: bool = True  # False: no time was left to search; budget_bytes is what was known (`known_as`)
    known_as: str = "the keep-all peak"

    def describe(self) -> str:
        if self.budget_bytes is None:
            return "the search for the smallest feasible budget found no plan"
        size = format_bytes(self.budget_bytes)
        if not self.searched:
            return (f"no time was left to search for the smallest feasible budget; the smallest known so far is "
                    f"{self.budget_bytes} bytes ({size}, {self.known_as})")
        how = "proven minimal" if self.proven else f"best found in {self.wall_time_s:.1f} s, not proven minimal"
        return f"the smallest budget it can meet is {self.budget_bytes} bytes ({size}, {how})"


def minimum_budget(
    profile: GraphProfile, features: Features, options: SolveOptions, strategy: str, time_limit_s: float | None = None
) -> MinimumBudget:
    """`time_limit_s`: the nominal search time (default: the options' limit, 30 s at most); never past the deadline."""
    options = options.started()
    limit = time_limit_s if time_limit_s is not None else min(options.time_limit_s, 30.0)
    searching = not options.out_of_time(2 * finish_margin_s(len(profile.nodes)))
    greedy = None
    if features.recompute and not options.out_of_time():
        # The strategies also fall back on the greedy plan, which may recompute more often than the model allows;
        # its bisection takes a fraction of a second, so it comes first, with half the time left at most where the
        # model's solve is to follow (after the solve it often had none: a T5 whose solve found nothing in its 10 s
        # was told the keep-all peak, 2x its floor)
        share = 0.5 if searching else 1.0
        within = replace(options, deadline=min(options.deadline, time.monotonic() + share * options.remaining_s()))
        greedy = _greedy_minimum(profile, keep_all_peak_bytes(profile), within)
    if not searching:
        answer = _known_without_search(profile, strategy)
        if greedy is not None and greedy[0] < answer.budget_bytes:
            answer = replace(answer, budget_bytes=greedy[0], schedule=greedy[1],
                             known_as="the greedy evict-and-recompute plan's, bisected in the time left")
        return answer
    # then, while there is time: the model's solve runs to the deadline
    reordered = _memory_aware_answer(profile, strategy, options)
    keep_all = keep_all_schedule(profile)
    outcome = solve_model(
        profile,
        None,
        replace(features, minimize_memory=True),
        options.quiet(),
        strategy,
        hints=[keep_all],
        time_limit_s=limit,
    )
    if outcome.schedule is None or outcome.objective_value is None:
        answer = _keep_all_answer(profile, searched=True, wall_time_s=outcome.info.wall_time_s)
    else:
        budget = max(int(round(outcome.objective_value)), minimum_budget_bytes(profile))
        schedule = outcome.schedule.model_copy(update={"budget_bytes": budget})
        answer = MinimumBudget(budget, outcome.info.status == "OPTIMAL", schedule, outcome.info.wall_time_s)
    if reordered is not None and reordered.budget_bytes < answer.budget_bytes:
        answer = replace(reordered, wall_time_s=answer.wall_time_s)
    if greedy is not None and greedy[0] < answer.budget_bytes:
        answer = replace(answer, budget_bytes=greedy[0], schedule=greedy[1], proven=False)
    return answer


def _memory_aware_answer(profile: GraphProfile, strategy: str, options: SolveOptions) -> MinimumBudget | None:
    """Keep-all in the memory-aware order, for the strategies that may use it; None for the others.

    A proof of the model's minimum holds in the profile's order only, so this figure is never "proven".
    """
    if strategy not in REORDERING_STRATEGIES:
        return None
    # usually known already (the strategy asked for it); else a quarter of what is left at most
    order, peak_bytes = memory_aware_order(profile, deadline=time.monotonic() + 0.25 * max(0.0, options.remaining_s()))
    return MinimumBudget(peak_bytes, False, keep_all_in_order(profile, order, peak_bytes), 0.0)


def _known_without_search(profile: GraphProfile, strategy: str) -> MinimumBudget:
    """With no time left: the keep-all peak, or keep-all in the memory-aware order where the strategy may use it
    and the strategy already worked that order out (nothing is computed here)."""
    answer = _keep_all_answer(profile, searched=False)
    known = profile.__dict__.get(MEMORY_AWARE_VIEW) if strategy in REORDERING_STRATEGIES else None
    if known is not None and known[2] < answer.budget_bytes:
        order, peak_bytes = list(known[1]), known[2]
        answer = MinimumBudget(peak_bytes, False, keep_all_in_order(profile, order, peak_bytes), 0.0, searched=False,
                               known_as="keep-all in the memory-aware order")
    return answer


def _keep_all_answer(profile: GraphProfile, searched: bool, wall_time_s: float = 0.0) -> MinimumBudget:
    """Keep-all fits in its own peak, whatever the strategy: the smallest budget known when the search found nothing.

    No plan comes with it: keep-all fits no budget below its peak, which is all a caller asks it for.
    """
    return MinimumBudget(keep_all_peak_bytes(profile), False, None, wall_time_s, searched=searched)


def _greedy_minimum(profile: GraphProfile, above_bytes: int, options: SolveOptions):
    """(budget, plan): the smallest budget below `above_bytes` at which the greedy recompute plan fits, with the
    plan; None if none is found before `options`' deadline. Each probe's budget becomes its plan's own peak when
    lower; the search stops at the deadline with what it has (a call takes up to half a second on a 300-node
    graph)."""
    found: dict[int, Schedule] = {}

    def fits(budget: int) -> int | None:
        schedule = greedy_recompute_schedule(profile, budget, deadline=options.deadline)
        if schedule is None:
            return None
        needed = min(budget, schedule.summary.peak_memory_bytes if schedule.summary is not None else budget)
        found[needed] = schedule
        return needed

    # below the floor, nothing fits; at `above_bytes` (the keep-all peak) keep-all does, and the greedy plan with it
    budget = smallest_budget(fits, minimum_budget_bytes(profile) - 1, above_bytes, options.out_of_time, doublings=0)
    if budget not in found:
        return None
    return budget, found[budget].model_copy(update={"budget_bytes": budget})
