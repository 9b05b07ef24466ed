"""`plan()`: the one entry point the CLI, the service and the executor call."""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import Callable

from planner.addresses import ALIGNMENT_BYTES, AddressPlan, place, with_addresses, without_addresses
from planner.budget import resolve_budget
from planner.builder import PlannerBug
from planner.errors import BudgetError, InfeasibleBudget, MososError, ScheduleRejected
from planner.interrupt import stop_on_interrupt
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Compute, Prefetch, Schedule
from planner.simulator import allocations, simulate
from planner.strategies import load_all
from planner.strategies.keep_all import keep_all_peak_bytes

__all__ = ["InfeasibleBudget", "UnknownStrategy", "plan", "strategy_names", "check_plan_options", "addressed"]


class UnknownStrategy(MososError):
    pass


def strategy_names() -> list[str]:
    return sorted(load_all())


# The longest time limit a solve may be given: a day (CP-SAT's own limit is a 64-bit count of its ticks, which a
# limit of 1e17 s overflowed after the rest of the solve had run).
MAX_TIME_LIMIT_S = 86_400


def check_plan_options(strategy: str | None, time_limit_s: float) -> None:
    """A strategy that exists (None: not checked here) and a time limit that is one: what plan() checks first, for
    callers that check before any work (optimize() before its capture)."""
    strategies = load_all()
    if strategy is not None and strategy not in strategies:
        raise UnknownStrategy(f"unknown strategy {strategy!r}; known: {', '.join(sorted(strategies))}")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, numbers.Real) or not (
            math.isfinite(time_limit_s) and time_limit_s > 0):
        raise MososError(f"time limit must be a positive number of seconds, not {time_limit_s!r}")
    if time_limit_s > MAX_TIME_LIMIT_S:
        raise MososError(f"time limit must be at most {MAX_TIME_LIMIT_S} s (a day), not {time_limit_s!r}")


def plan(
    profile: GraphProfile,
    budget_bytes: int | None = None,
    *,
    memory_ratio: float | None = None,
    strategy: str = "mosos",
    time_limit_s: float = 60.0,
    workers: int | None = None,
    seed: int = 0,
    progress: Callable[[dict], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    started_at: float | None = None,
    addresses: bool = True,
) -> Schedule:
    """Plan one training step of `profile` within `budget_bytes` (or `memory_ratio` of the keep-all peak).

    The returned schedule has been replayed by the simulator; its summary holds
    the simulated figures. Ctrl-C (in the main thread) stops it within a fraction
    of a second with KeyboardInterrupt. `time_limit_s` bounds the whole call: every phase of
    every strategy shares one deadline, set here, and the answer is the best plan
    found by then (or InfeasibleBudget: no plan in that time, with the smallest
    budget known to work so far). `started_at` (time.monotonic()) is when the
    caller's clock started, if before this call (the CLI's command start). `addresses`: place the plan's buffers
    in one arena (planned addresses, within the time limit), planning again within less where they do not fit.
    """
    started = time.monotonic() if started_at is None else min(started_at, time.monotonic())
    check_plan_options(strategy, time_limit_s)
    info = load_all()[strategy]
    budget = resolve_budget(profile, budget_bytes, memory_ratio)
    if budget is None and info.uses_budget:
        raise BudgetError(f"strategy {strategy!r} needs a budget: give budget_bytes or memory_ratio")
    if workers is not None and workers < 1:
        raise MososError(f"workers must be at least 1, got {workers}")
    with stop_on_interrupt() as interrupted:  # Ctrl-C stops every solve, then raises KeyboardInterrupt
        def stop() -> bool:
            return interrupted.is_set() or (should_stop is not None and bool(should_stop()))

        # The strategy's deadline leaves time, within the limit, to place its plan's buffers (none are placed where
        # that would take more than its share: a large graph on a short limit), and a tenth of the limit (a second
        # at most) to search for a smaller arena: without it, a solver that used its whole limit left its plan to
        # the greedy passes, a few percent over what fits.
        addresses = addresses and ADDRESS_S_PER_NODE * len(profile.nodes) <= ADDRESS_SHARE * time_limit_s
        reserve_s = min(ADDRESS_SHARE * time_limit_s, _placing_s(profile, time_limit_s)) if addresses else 0.0
        fits_later = addresses and budget is not None and info.uses_budget
        if fits_later and budget < keep_all_peak_bytes(profile):
            # a plan under the keep-all peak fills memory to its budget, where its buffers may not place within it:
            # a share of the limit stays for planning again within less (without it, a solver that used its whole
            # share left none, and at 20 s the U-Net and ResNet-50 plans at 0.5 came back unplaced)
            # (and, for a strategy that hands them on, the sweeps over the other plans it made, for a plan that fits
            # where none places)
            reserve_s = min(ADDRESS_SHARE * time_limit_s, reserve_s + ARENA_FIT_SHARE * time_limit_s
                            + (_sweeps_s(profile) if info.offers_candidates else 0.0))
        candidates: list | None = [] if fits_later and info.offers_candidates else None
        options = SolveOptions(
            time_limit_s=time_limit_s, workers=workers, seed=seed, progress=progress, should_stop=stop,
            deadline=started + time_limit_s - reserve_s, candidates=candidates,
        )
        schedule = info.function(profile, budget, options)
        if not addresses:  # a caller that shares one time limit among many strategies (compare)
            return schedule
        solved_s = time.monotonic() - started
        options = dataclasses.replace(options, deadline=started + time_limit_s)
        schedule = addressed(profile, schedule, options)
        if fits_later and schedule.arena_bytes is None:
            # planning again takes at most a few times what the first plan took: a solver that proved its plan in
            # a second is not given the rest of a long limit to plan again within less
            # (the sweeps over the other plans mosos made on its way keep their time, after it)
            fit_deadline = min(options.deadline - (_sweeps_s(profile) if candidates else 0.0),
                               time.monotonic() + max(MIN_REPLAN_S, ARENA_FIT_TIMES_FIRST * solved_s))
            fitted = _fit_the_arena(profile, schedule, info.function,
                                    dataclasses.replace(options, deadline=fit_deadline, candidates=None))
            if fitted.arena_bytes is not None:
                return fitted
            # the fastest of those whose buffers place within the budget (a checkpointing baseline places at its
            # live peak where an optimised plan's interleaved lifetimes leave gaps): a plan that fits, slower
            placed = _fastest_placed(profile, candidates or [], schedule, options)
            return placed if placed is not None else fitted
        return schedule


# What placing a plan's buffers takes (replay, sweep, offsets, the simulator's check): 0.3-0.5 ms a node for a
# 2,000-node graph on a loaded 2-core machine; never more than this share of a time limit is set aside for it
ADDRESS_S_PER_NODE = 0.0005
ADDRESS_SHARE = 0.5
# How long the canonical search and CP-SAT may look for a smaller arena than the first passes found (only where
# they are over the lower bound), within the call's time limit
ADDRESS_SEARCH_S = 1.0
# Plans made again, each within a budget lowered by what the last one's arena passed it, while this much time is left
ARENA_REPLANS = 4
MIN_REPLAN_S = 0.5
# The share of a time limit kept for those, where the budget is under the keep-all peak; and how many times the
# first plan's time they may take in all
ARENA_FIT_SHARE = 0.2
ARENA_FIT_TIMES_FIRST = 2.0
# What placing one of the strategy's other plans by the sweep alone takes (its buffers from the simulator, the
# sweep): 0.03-0.15 ms a node on a loaded 2-core machine; mosos makes about ten (baselines and heuristics)
CANDIDATE_S_PER_NODE = 0.0001
CANDIDATES = 10


def _sweeps_s(profile: GraphProfile) -> float:
    return CANDIDATE_S_PER_NODE * CANDIDATES * len(profile.nodes)


def _placing_s(profile: GraphProfile, time_limit_s: float, search: bool = True) -> float:
    """What placing a plan's buffers is given of `time_limit_s`: its passes, and (with `search`) a tenth for the
    search."""
    search_s = min(ADDRESS_SEARCH_S, 0.1 * time_limit_s) if search else 0.0
    return ADDRESS_S_PER_NODE * len(profile.nodes) + search_s


def _fit_the_arena(profile: GraphProfile, schedule: Schedule, solve, options: SolveOptions) -> Schedule:
    """A plan whose buffers cannot be placed within the budget (fragmentation: the arena is more than the most bytes
    ever live) planned again within less, so that its addresses fit: below the last plan's peak by a quarter more
    than its arena passed the budget, or halfway back up where the strategy finds no plan that low. With no time
    left for that, as it is (its summary says the arena it would need)."""
    budget = schedule.budget_bytes
    if schedule.arena_bytes is not None:
        return schedule
    # an arena over by no more than the buffers' rounding to the alignment is a budget set at the byte (a ratio of
    # 1.0 is the keep-all peak itself): planning again within less would trade speed for the padding's bytes
    rounding_bytes = ALIGNMENT_BYTES * sum(isinstance(operation, (Compute, Prefetch))
                                           for _, _, operation in schedule.operations())
    if profile.fixed_bytes + schedule.summary.arena_bytes - budget <= rounding_bytes:
        return schedule
    last, planned_at, refused_at = schedule, budget, None
    for attempt in range(ARENA_REPLANS):
        if (options.deadline - time.monotonic() < MIN_REPLAN_S
                or (options.should_stop is not None and options.should_stop())):
            break
        # below the last plan's peak, not its budget (a plan under its budget came back unchanged), by a quarter
        # more than the excess: the new plan's buffers fragment too, and a second attempt has half the time
        excess = profile.fixed_bytes + last.summary.arena_bytes - budget
        lowered = min(planned_at, last.summary.peak_memory_bytes) - excess * 5 // 4
        if refused_at is not None:
            lowered = max(lowered, (refused_at + planned_at) // 2)
        if lowered < profile.fixed_bytes or lowered >= planned_at:
            break
        # each attempt gets half of what is left (the last all of it), less the time placing its buffers by the
        # greedy passes takes: an attempt cut into quarters was too short for CP-SAT to find any plan on a few
        # hundred nodes
        left_s = options.deadline - time.monotonic()
        share = 1.0 if attempt == ARENA_REPLANS - 1 else 0.5
        attempt_options = dataclasses.replace(options, deadline=time.monotonic() + max(
            MIN_REPLAN_S / 2, share * (left_s - _placing_s(profile, left_s, search=False))))
        try:
            candidate = solve(profile, lowered, attempt_options)
        except BudgetError:
            refused_at = lowered
            continue
        # the placement passes without their search: the time it would take goes to planning again, lower
        candidate = addressed(profile, candidate.model_copy(update={"budget_bytes": budget}), options, search_s=0.0)
        if candidate.arena_bytes is not None:
            return candidate
        last, planned_at = candidate, lowered
    return schedule


def _step_ms(schedule: Schedule) -> float:
    return schedule.summary.predicted_step_time_ms if schedule.summary is not None else math.inf


def _fastest_placed(profile: GraphProfile, candidates: list, unplaced: Schedule,
                    options: SolveOptions) -> Schedule | None:
    """Of `candidates` ((name, schedule) within the budget of `unplaced`, the strategy's own plan, whose buffers
    do not place), the fastest whose buffers the sweep in step order places within that budget with fixed memory,
    addressed and checked by the simulator, under the strategy's name with the choice in its solver note (as a
    baseline that beats the model is); None where none does by the deadline. Only the sweep: it places a
    checkpointing baseline's buffers at their live peak in milliseconds (their time is kept from the start)."""
    budget = unplaced.budget_bytes
    tried: set[int] = set()
    ordered = sorted(((name, schedule) for name, schedule in candidates
                      if schedule is not None and schedule.summary is not None), key=lambda item: _step_ms(item[1]))
    for index, (name, candidate) in enumerate(ordered):
        if id(candidate) in tried:
            continue
        tried.add(id(candidate))
        if index and options.out_of_time():
            return None
        if candidate.summary.peak_memory_bytes > budget:
            continue
        buffers = allocations(profile, candidate)
        # the sweep alone (a deadline already reached): what it does not place stays for planning again
        address_plan = place(buffers, 0.0, time.monotonic())
        if profile.fixed_bytes + address_plan.arena_bytes > budget:
            continue
        address_plan = _tightened(buffers, address_plan, options)
        solver = unplaced.summary.solver
        if solver is not None:
            step = _step_ms(candidate)
            bound = solver.bound if solver.bound is not None and solver.bound <= step else None
            solver = solver.model_copy(update={
                "status": "FEASIBLE", "objective": step, "bound": bound,
                "gap": (step - bound) / step if bound is not None and step > 0 else None,
                "encoding": f"{solver.encoding}; the plan's own buffers did not place within the budget: the "
                            f"fastest plan whose buffers do, {name}'s"})
        summary = candidate.summary.model_copy(update={
            "arena_bytes": address_plan.arena_bytes, "strategy": unplaced.summary.strategy, "solver": solver})
        chosen = with_addresses(profile, candidate.model_copy(update={"budget_bytes": budget}), address_plan,
                                buffers).model_copy(update={"summary": summary})
        try:
            simulate(profile, chosen, keep_timeline=False)
        except ScheduleRejected as rejection:
            raise PlannerBug(f"planned addresses the simulator rejects: {rejection}") from rejection
        return chosen
    return None


# An arena that fits its budget but lies more than this over the live peak is searched for a smaller one, with what
# is left of the time and at least this much of it
TIGHTEN_OVER = 0.03
MIN_TIGHTEN_S = 0.1


def _tightened(buffers: list, address_plan: AddressPlan, options: SolveOptions | None) -> AddressPlan:
    """A placement that fits, by the greedy passes alone, searched for a smaller arena with what is left of the time
    (at most `ADDRESS_SEARCH_S`): a plan made again within less, or a checkpointing baseline, lies under its budget,
    and the greedy passes may fill the room it leaves (a ResNet-50 plan made again at 0.7 of its peak: 1.25 of its
    live peak). The step holds the arena, so a smaller one is memory given back; where no time is left, as it is."""
    if options is None or address_plan.overhead <= TIGHTEN_OVER:
        return address_plan
    if options.should_stop is not None and options.should_stop():
        return address_plan
    left_s = math.inf if options.deadline is None else options.deadline - time.monotonic()
    if left_s < MIN_TIGHTEN_S:
        return address_plan
    tighter = place(buffers, min(ADDRESS_SEARCH_S, left_s / 2), options.deadline)
    return tighter if tighter.arena_bytes < address_plan.arena_bytes else address_plan


def addressed(profile: GraphProfile, schedule: Schedule, options: SolveOptions | None = None,
              search_s: float = ADDRESS_SEARCH_S) -> Schedule:
    """`schedule` with planned addresses where fixed memory and their arena fit its budget, and the arena's size in
    its summary either way; the simulator checks the addresses before anyone sees them. Within `options`' deadline
    (the greedy sweep always runs), the search (the canonical search, CP-SAT) for at most `search_s`, and none once
    asked to stop."""
    stopped = options is not None and options.should_stop is not None and options.should_stop()
    buffers = allocations(profile, schedule)
    budget = schedule.budget_bytes
    address_plan = place(buffers, 0.0 if stopped else search_s, options.deadline if options else None,
                         None if budget is None else budget - profile.fixed_bytes)
    summary = schedule.summary.model_copy(update={"arena_bytes": address_plan.arena_bytes}) \
        if schedule.summary is not None else None
    if budget is not None and profile.fixed_bytes + address_plan.arena_bytes > budget:
        return without_addresses(schedule).model_copy(update={"summary": summary})
    if search_s == 0.0 and not stopped:
        address_plan = _tightened(buffers, address_plan, options)
        summary = summary.model_copy(update={"arena_bytes": address_plan.arena_bytes}) if summary is not None else None
    with_offsets = with_addresses(profile, schedule, address_plan, buffers).model_copy(update={"summary": summary})
    try:
        simulate(profile, with_offsets, keep_timeline=False)
    except ScheduleRejected as rejection:
        raise PlannerBug(f"planned addresses the simulator rejects: {rejection}") from rejection
    return with_offsets
