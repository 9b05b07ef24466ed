"""swap-recompute-heuristic: the runtime-profiling swap/recompute planner of the Chainer work.

Every forward tensor that backward reads gets an attribute, keep, swap or
recompute (section 4.1), each choice judged by replaying the whole plan (here:
the simulator), in two stages:

1. keep or swap (4.4.2): start with everything swapped and replay it. A
   tensor whose swap is hidden behind computation stays swapped. For the
   tensors whose swap-in stalls backward, every keep/swap combination is tried
   (when there are at most `EXHAUSTIVE_LIMIT` of them; beyond that they join
   the greedy pass); in each, the tensors whose swap-out runs past the end of
   forward are switched to keep greedily from the output side while memory
   allows. The fastest combination that fits wins.
2. swap or recompute (4.4.3): for each swapped tensor X, with everything else
   fixed, r(X) = recompute overhead / swap overhead (both against keeping X).
   A swap hidden behind computation has no overhead (r is infinite), so only
   the tensors whose swap-in stalls or whose swap-out outlasts forward are
   measured. Tensors with r >= 1 stay swapped; the one with the smallest r < 1 becomes
   recompute (if the plan still fits), and the rest are judged again. The
   re-evaluation is lazy: a tensor's stale r is refreshed when it comes to the
   top, which gives the same choice whenever ratios only grow as recomputes
   are added.

Swap-outs start when the last forward reader ends and do not block forward
(a buffer is released when its copy ends); only when memory is full does the
compute stream wait for in-flight swap-outs, as an allocator that synchronizes
and retries would. Swap-ins start as early as free memory allows (4.3,
`move_prefetches_early`). Algorithms: Auto's choice at the budget (the
fastest wherever it fits). The search stops at the time limit (or when asked
to stop) with the best fitting plan so far; within the limit it is
deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable

from planner.attribute_plans import AttributeProgram, GraphFacts, move_prefetches_early, require_transfers
from planner.auto_algorithms import apply_auto
from planner.budget import smallest_budget
from planner.builder import PlannerBug, certify
from planner.errors import InfeasibleBudget, ScheduleRejected
from planner.liveness import build_schedule
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import SimulationResult, simulate
from planner.strategies import strategy
from planner.units import format_bytes

NAME = "swap-recompute-heuristic"
EXHAUSTIVE_LIMIT = 4  # 2**4 leaves: the paper's exhaustive keep/swap search, bounded


@dataclass
class Evaluation:
    schedule: Schedule
    result: SimulationResult  # replayed without a budget
    fits: bool

    @property
    def step_time_ms(self) -> float:
        return self.result.step_time_ms


class Evaluator:
    """Replays attribute assignments at one budget, remembering each one it has seen."""

    def __init__(self, profile: GraphProfile, budget_bytes: int, facts: GraphFacts):
        self.profile = profile
        self.budget_bytes = budget_bytes
        self.facts = facts
        self.cache: dict[tuple, Evaluation] = {}

    def __call__(self, attributes: dict[str, str], spans: bool = False) -> Evaluation:
        key = tuple(sorted(attributes.items()))
        if key in self.cache and not spans:
            return self.cache[key]
        profile, budget = self.profile, self.budget_bytes
        steps = AttributeProgram(profile, attributes, facts=self.facts).build_steps()
        early = move_prefetches_early(profile, steps, budget, self.facts.first_backward_position)
        evaluation = None
        for variant in (early, steps):  # scheduled swap-ins; the on-demand ones if those do not fit
            schedule = apply_auto(profile, build_schedule(profile, variant, budget), budget, sync_offloads=True)
            try:  # replayed without the budget: it fits exactly when its peak is within it
                result = simulate(profile, schedule.model_copy(update={"budget_bytes": None}), keep_timeline=spans)
            except ScheduleRejected as rejection:
                raise PlannerBug(f"strategy {NAME!r} wrote a schedule the simulator rejects: {rejection}") from rejection
            fits = result.peak_memory_bytes <= budget
            if fits or evaluation is None:
                evaluation = Evaluation(schedule, result, fits)
            if fits:
                break
        self.cache[key] = evaluation
        return evaluation


def unhidden(evaluation: Evaluation, facts: GraphFacts, swapped: list[str]) -> tuple[list[str], list[str]]:
    """Swapped tensors whose swap-in stalls backward, and those whose swap-out runs past the end of forward."""
    spans = evaluation.result.spans
    backward_starts = [
        s.start_ms for s in spans if s.stream == "compute" and s.stage >= facts.first_backward_position
    ]
    forward_end = min(backward_starts) if backward_starts else evaluation.result.step_time_ms
    stalled = {
        s.label.removeprefix("stall: wait for prefetch of ")
        for s in spans
        if s.stream == "compute" and s.label.startswith("stall: wait for prefetch of ") and s.end_ms > s.start_ms
    }
    late = {s.label.removeprefix("offload ") for s in spans if s.stream == "d2h" and s.end_ms > forward_end}
    swap_in = [t for t in swapped if t in stalled]
    swap_out = [t for t in swapped if t in late and t not in stalled]
    return swap_in, swap_out


def keep_from_output_side(
    evaluate: Evaluator, attributes: dict[str, str], tensors: list[str], position,
    out_of_time: Callable[[], bool] = lambda: False,
) -> dict[str, str]:
    """Switch tensors to keep, latest first, as long as the plan still fits.

    Keeping more never uses less memory, so the longest fitting run of latest
    tensors is found by bisection on its length (cut short at the time limit:
    the longest run known to fit so far).
    """
    latest_first = sorted(tensors, key=position.__getitem__, reverse=True)

    def keeping(count: int) -> dict[str, str]:
        return {**attributes, **{t: "keep" for t in latest_first[:count]}}

    if evaluate(keeping(len(latest_first))).fits:
        return keeping(len(latest_first))
    fits, breaks = 0, len(latest_first)
    while breaks - fits > 1 and not out_of_time():
        middle = (fits + breaks) // 2
        if evaluate(keeping(middle)).fits:
            fits = middle
        else:
            breaks = middle
    return keeping(fits)


def choose_keep_or_swap(evaluate: Evaluator, facts: GraphFacts, out_of_time: Callable[[], bool]) -> dict[str, str] | None:
    all_swap = {t: "swap" for t in facts.candidates}
    start = evaluate(all_swap, spans=True)
    if not start.fits:
        return None
    swap_in, swap_out = unhidden(start, facts, facts.candidates)
    position = evaluate.profile.position
    if len(swap_in) > EXHAUSTIVE_LIMIT:
        swap_out, swap_in = swap_out + swap_in, []
    best, best_time = None, None
    for size in range(len(swap_in) + 1):
        for kept in itertools.combinations(swap_in, size):
            if best is not None and out_of_time():
                return best
            leaf = {**all_swap, **{t: "keep" for t in kept}}
            if not evaluate(leaf).fits:
                continue
            leaf = keep_from_output_side(evaluate, leaf, swap_out, position, out_of_time)
            time_ms = evaluate(leaf).step_time_ms
            if best_time is None or time_ms < best_time:
                best, best_time = leaf, time_ms
    return best


def ratio(evaluate: Evaluator, attributes: dict[str, str], tensor: str) -> float:
    """r(X): recompute overhead over swap overhead, both measured against keeping X, the rest fixed."""
    kept = evaluate({**attributes, tensor: "keep"}).step_time_ms
    swap_overhead = evaluate({**attributes, tensor: "swap"}).step_time_ms - kept
    if swap_overhead <= 1e-9:
        return float("inf")  # the swap costs nothing: nothing to gain by recomputing
    recompute_overhead = evaluate({**attributes, tensor: "recompute"}).step_time_ms - kept
    return recompute_overhead / swap_overhead


def choose_recomputes(
    evaluate: Evaluator, attributes: dict[str, str], facts: GraphFacts, out_of_time: Callable[[], bool]
) -> dict[str, str]:
    position = evaluate.profile.position
    if evaluate(attributes).result.stall_time_ms <= 1e-9:
        return attributes  # no swap stalls anything: every swap overhead is zero, every r infinite
    heap = []
    for t in facts.candidates:
        if out_of_time():
            break
        if attributes.get(t) != "swap":
            continue
        r = ratio(evaluate, attributes, t)
        if r < 1.0:
            heapq.heappush(heap, (r, position[t], t))
    while heap and not out_of_time():
        _, order, t = heapq.heappop(heap)
        r = ratio(evaluate, attributes, t)
        if r >= 1.0:
            continue
        if heap and r > heap[0][0]:
            heapq.heappush(heap, (r, order, t))  # stale: someone else is now the best
            continue
        trial = {**attributes, t: "recompute"}
        if evaluate(trial).fits:
            attributes = trial
    return attributes


def heuristic(profile: GraphProfile, budget_bytes: int, facts: GraphFacts, options: SolveOptions) -> Schedule | None:
    """The plan at this budget, or None when not even everything swapped fits.

    Past the time limit, or when asked to stop, the search stops where it is
    (the plan found so far fits).
    """
    options = options.started()

    def out_of_time() -> bool:
        return options.out_of_time()

    evaluate = Evaluator(profile, budget_bytes, facts)
    attributes = choose_keep_or_swap(evaluate, facts, out_of_time)
    if attributes is None:
        return None
    attributes = choose_recomputes(evaluate, attributes, facts, out_of_time)
    evaluation = evaluate(attributes)
    return evaluation.schedule if evaluation.fits else None


@strategy(NAME, "Chainer swap/recompute heuristic: swap what hides behind compute, keep the rest from the output side while memory allows, recompute where cheaper than the swap's stall; swap-ins as early as memory allows", needs_transfers=True)
def plan_swap_recompute(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    require_transfers(profile, NAME)
    options = options.started()
    facts = GraphFacts(profile)
    schedule = heuristic(profile, budget_bytes, facts, options)
    if schedule is not None:
        return certify(profile, schedule, NAME)
    if not options.explain_infeasible:
        raise InfeasibleBudget(f"strategy {NAME!r} finds no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)})")
    # The heuristic finds a plan exactly when its starting point, everything swapped, fits.
    all_swap = {t: "swap" for t in facts.candidates}

    def starting_point_fits(budget: int) -> int | None:
        return budget if Evaluator(profile, budget, facts)(all_swap).fits else None

    def heuristic_fits(budget: int) -> int | None:
        return None if heuristic(profile, budget, facts, options) is None else budget

    unbounded = Evaluator(profile, 2**62, facts)(all_swap).result.peak_memory_bytes
    minimum = smallest_budget(starting_point_fits, budget_bytes, max(unbounded, budget_bytes + 1), options.out_of_time)
    if minimum is not None and not options.out_of_time() and heuristic(profile, minimum, facts, options) is None:
        minimum = smallest_budget(heuristic_fits, minimum, 2 * minimum, options.out_of_time)
    if minimum is None:
        raise InfeasibleBudget(f"strategy {NAME!r} finds no plan within {budget_bytes} bytes, nor within any budget it tried")
    raise InfeasibleBudget(
        f"strategy {NAME!r} finds no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)}); "
        f"the smallest budget it can meet is {minimum} bytes ({format_bytes(minimum)})",
        minimum_budget_bytes=minimum,
    )
