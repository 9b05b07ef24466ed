"""Lower bounds on the step time of any plan that computes in the profile's order.

The trivial bound (every node once at its fastest, `keep_all_bound_ms`) says
nothing about memory. The peak-instant bound adds what a budget forces. Take
the moment node t finishes its first computation. Whatever the plan, its
inputs and output, its smallest workspace and the fixed memory are on the
device then; every other tensor made before t and read after t is either on
the device too, or comes back later: recomputed (at least its own fastest
time again) or prefetched, which needs its offload to have ended before that
moment. Offloads run one at a time on the device-to-host link after their
tensor was made, so the bytes offloaded among the tensors made after node k
fit in bandwidth x (time from k's end to t's end), where that time is at most
the fastest one plus the plan's extra time E (a plan may stall to move more).
The cheapest way to free the bytes that do not fit is a fractional knapsack:
offload capacity to the tensors dearest to recompute first (optimal for these
nested capacities, a polymatroid), the rest recomputed cheapest-per-byte first.
E is the smallest extra time that pays for itself (a fixed point, found by
bisection).

That knapsack takes a recomputation's inputs for free, which is far from true
where the cheapest tensors to recompute sit at the end of a chain whose middle
died before the moment (a ReLU after an addition: the sum is read by nothing
else, so recomputing the ReLU means recomputing the sum first). A linear
program (GLOP) per moment tightens it: an input of a recomputed tensor that was
dead at the moment (its last reader came before) must be back on the device
later, so it was kept through the moment (its bytes count there), offloaded
before it (the d2h link again), or recomputed after it (its own time, and the
same question for its inputs); one recomputation serves every reader. Tensors
live across the moment or read by node t itself need nothing more: they are
resident then, or their own return is already paid for. When the program
cannot be solved in time, the knapsack's value stands.

Each moment gives a valid bound; the largest over the moments where memory is
tightest is reported. Relaxations kept (each only lowers the bound): fractions
of tensors, transfer latency and the host-to-device link ignored, workspaces of
recomputations ignored, each tensor's return counted once.

Plans in another compute order (the memory-aware order) are not covered: such
a plan is compared against the trivial bound only.
"""

from __future__ import annotations

import time

import numpy as np
from ortools.linear_solver import pywraplp

from planner.profile import GraphProfile

MOMENTS = 8  # the moments of largest overflow that are evaluated
BISECTION_STEPS = 24


def keep_all_bound_ms(profile: GraphProfile) -> float:
    """Every node once with its fastest implementation: no plan is faster."""
    return sum(node.fastest.time_ms for node in profile.nodes)


class _Moment:
    """The tensors removable at one moment, in the two orders the knapsack needs."""

    def __init__(self, candidates, end_times, moment_end: float):
        self.by_made = sorted(candidates)  # (made position, size, recompute cost)
        self.made_end = np.array([end_times[made] for made, _, _ in self.by_made], dtype=float)
        self.moment_end = moment_end
        # offload: dearest to recompute per byte first; recompute: cheapest per byte first
        self.dearest = sorted(range(len(self.by_made)), key=lambda i: -self.by_made[i][2] / self.by_made[i][1])
        self.total_bytes = sum(size for _, size, _ in self.by_made)


def _removal_cost_ms(moment: _Moment, overflow: int, bytes_per_ms: float | None, extra_ms: float) -> float:
    """Least recompute time to free `overflow` bytes at the moment, offloads filling the link first."""
    remaining = float(overflow)
    left = [size for _, size, _ in moment.by_made]
    if bytes_per_ms:
        # the tensors made at or after the i-th (by making order) may move bytes_per_ms * (end - made_i + E)
        slack = bytes_per_ms * np.maximum(0.0, moment.moment_end - moment.made_end + extra_ms)
        for i in moment.dearest:
            if remaining <= 0:
                break
            room = slack[: i + 1].min()
            moved = min(left[i], room, remaining)
            if moved <= 0:
                continue
            slack[: i + 1] -= moved
            left[i] -= moved
            remaining -= moved
    if remaining <= 0:
        return 0.0
    total = 0.0
    for i in reversed(moment.dearest):  # cheapest per byte first
        if remaining <= 0:
            break
        size, cost = moment.by_made[i][1], moment.by_made[i][2]
        part = min(left[i], remaining)
        total += cost * part / size
        remaining -= part
    return total if remaining <= 1e-6 * overflow else float("inf")


_CACHE: dict[tuple, float] = {}


def order_bound_ms(profile: GraphProfile, budget_bytes: int | None, transfers: bool = True,
                   deadline: float | None = None) -> float:
    """The best lower bound known here for plans in the profile's order (cached per profile and budget).

    `transfers=False` for strategies that never move tensors (a stronger bound for them).
    """
    if budget_bytes is None:
        return keep_all_bound_ms(profile)
    key = (profile.digest(), budget_bytes, transfers)
    if key in _CACHE:
        return _CACHE[key]
    bound, complete = _peak_instant_bound(profile, budget_bytes, transfers, deadline)
    if complete:  # a bound cut short by a deadline is valid but weaker: not kept for later callers
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = bound
    return bound


def peak_instant_bound_ms(profile: GraphProfile, budget_bytes: int, transfers: bool = True,
                          deadline: float | None = None, dead_inputs: bool = True) -> float:
    """A lower bound on the step time of any plan in the profile's order within `budget_bytes` (see the module).

    Moments are evaluated largest overflow first until `deadline` (time.monotonic()); fewer moments only
    weaken the bound. Infinite when no plan in this order fits. `dead_inputs=False`: the knapsack alone.
    """
    return _peak_instant_bound(profile, budget_bytes, transfers, deadline, dead_inputs)[0]


def _peak_instant_bound(profile: GraphProfile, budget_bytes: int, transfers: bool, deadline: float | None,
                        dead_inputs: bool = True):
    """(the bound, whether every moment chosen was evaluated)."""
    order = list(profile.order)
    position = {node_id: i for i, node_id in enumerate(order)}
    nodes = [profile.node_by_id[node_id] for node_id in order]
    fastest = [node.fastest.time_ms for node in nodes]
    end_times, clock = [], 0.0
    for time_ms in fastest:
        clock += time_ms
        end_times.append(clock)
    last_reader = [i for i in range(len(order))]
    for i, node in enumerate(nodes):
        for source in node.inputs:
            j = position[source]
            last_reader[j] = max(last_reader[j], i)
    hardware = profile.hardware
    bytes_per_ms = None
    if transfers and hardware.can_transfer:
        bytes_per_ms = hardware.d2h_bandwidth_gb_per_s * 1e6  # offloads must end before the moment
    # live-across bytes at each moment: tensors made before t and read after t
    overflows = []
    live = 0
    dying: dict[int, int] = {}
    for t, node in enumerate(nodes):
        inputs = {position[s] for s in node.inputs}
        mandatory = profile.fixed_bytes + node.size_bytes + node.smallest_workspace.workspace_bytes
        mandatory += sum(nodes[j].size_bytes for j in inputs)
        optional = live - sum(nodes[j].size_bytes for j in inputs)  # live: made before t, read at t or later
        overflow = mandatory + optional - budget_bytes
        if overflow > 0:
            overflows.append((overflow, t))
        live += node.size_bytes if last_reader[t] > t else 0
        dying.setdefault(last_reader[t], 0)
        dying[last_reader[t]] += node.size_bytes if last_reader[t] > t else 0
        live -= dying.pop(t, 0)
    base = keep_all_bound_ms(profile)
    graph = _OrderGraph(nodes, position, fastest, end_times, last_reader)
    best = 0.0
    complete = True
    for overflow, t in sorted(overflows, reverse=True)[:MOMENTS]:
        if deadline is not None and time.monotonic() > deadline:
            complete = False
            break
        inputs = {position[s] for s in nodes[t].inputs}
        candidates = [
            (j, nodes[j].size_bytes, fastest[j])
            for j in range(t) if last_reader[j] > t and j not in inputs and nodes[j].size_bytes > 0
        ]
        knapsack = _fixed_point(_Moment(candidates, end_times, end_times[t]), overflow, bytes_per_ms)
        if dead_inputs and 0.0 < knapsack < float("inf"):
            tightened = _dead_inputs_lp_ms(graph, t, overflow, bytes_per_ms, deadline)
            if tightened is None:
                complete = False  # the knapsack's value stands, valid but not kept for later callers
            else:
                knapsack = max(knapsack, tightened)
        best = max(best, knapsack)
    return base + best, complete


class _OrderGraph:
    """The profile in its order, as the per-moment program reads it."""

    def __init__(self, nodes, position, fastest, end_times, last_reader):
        self.nodes, self.fastest, self.end_times, self.last_reader = nodes, fastest, end_times, last_reader
        self.inputs = [sorted({position[s] for s in node.inputs}) for node in nodes]


LP_MIN_TIME_S = 0.05  # below this much time left, the knapsack's value stands
LP_SAFETY = 1e-6  # relative margin below GLOP's optimum: its tolerances must never lift the bound above the truth


def _dead_inputs_lp_ms(graph: _OrderGraph, t: int, overflow: int, bytes_per_ms: float | None,
                       deadline: float | None) -> float | None:
    """The least extra time E at moment t when recomputing a tensor also brings back its dead inputs (None when
    unsolved in time: the caller keeps the knapsack's value, which this program never undercuts)."""
    time_left_s = None if deadline is None else deadline - time.monotonic()
    if time_left_s is not None and time_left_s < LP_MIN_TIME_S:
        return None
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:
        return None
    if time_left_s is not None:
        solver.SetTimeLimit(int(time_left_s * 1000))
    infinity, per_mb = solver.infinity(), 1e-6  # bytes in MB keep the coefficients near 1
    nodes, fastest, last_reader = graph.nodes, graph.fastest, graph.last_reader
    extra_ms = solver.NumVar(0.0, infinity, "extra_ms")
    pays = solver.Constraint(0.0, infinity)  # extra_ms >= every recomputation after the moment
    pays.SetCoefficient(extra_ms, 1.0)
    freed = solver.Constraint(overflow * per_mb, infinity)  # removed bytes - dead bytes kept >= overflow
    offloaded: list[tuple[int, object, float]] = []  # (made position, fraction, MB) for the link's capacity
    dead_options: dict[int, list] = {}
    t_inputs = set(graph.inputs[t])
    recomputations: list[tuple[object, int]] = []  # (fraction recomputed, node): their dead inputs still to tie

    def dead_option(a: int) -> list:
        if a in dead_options:
            return dead_options[a]
        size_mb = nodes[a].size_bytes * per_mb
        recomputed, kept = solver.NumVar(0.0, 1.0, ""), solver.NumVar(0.0, 1.0, "")
        pays.SetCoefficient(recomputed, -fastest[a])
        freed.SetCoefficient(kept, -size_mb)
        options = [recomputed, kept]
        if bytes_per_ms:
            moved = solver.NumVar(0.0, 1.0, "")
            offloaded.append((a, moved, size_mb))
            options.append(moved)
        dead_options[a] = options
        recomputations.append((recomputed, a))
        return options

    def tie_dead_inputs() -> None:
        while recomputations:  # a worklist, not recursion: dead chains can be thousands of nodes long
            recomputed, j = recomputations.pop()
            for a in graph.inputs[j]:
                if last_reader[a] < t:  # dead at the moment: back only if kept, offloaded before or recomputed after
                    row = solver.Constraint(-infinity, 0.0)
                    row.SetCoefficient(recomputed, 1.0)
                    for option in dead_option(a):
                        row.SetCoefficient(option, -1.0)

    for j in range(t):
        if last_reader[j] <= t or j in t_inputs or nodes[j].size_bytes <= 0:
            continue
        size_mb = nodes[j].size_bytes * per_mb
        recomputed = solver.NumVar(0.0, 1.0, "")
        pays.SetCoefficient(recomputed, -fastest[j])
        freed.SetCoefficient(recomputed, size_mb)
        recomputations.append((recomputed, j))
        if bytes_per_ms:
            moved = solver.NumVar(0.0, 1.0, "")
            freed.SetCoefficient(moved, size_mb)
            offloaded.append((j, moved, size_mb))
            once = solver.Constraint(-infinity, 1.0)
            once.SetCoefficient(recomputed, 1.0)
            once.SetCoefficient(moved, 1.0)
    tie_dead_inputs()
    _link_capacity(solver, graph, t, offloaded, bytes_per_ms, extra_ms, per_mb)
    solver.Objective().SetCoefficient(extra_ms, 1.0)
    solver.Objective().SetMinimization()
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return extra_ms.solution_value() * (1.0 - LP_SAFETY)


def _link_capacity(solver, graph: _OrderGraph, t: int, offloaded, bytes_per_ms, extra_ms, per_mb) -> None:
    """The bytes offloaded among the tensors made at or after each one fit the d2h link from its end to t's
    (+ extra_ms); suffix sums keep the program linear in size."""
    if not bytes_per_ms or not offloaded:
        return
    infinity = solver.infinity()
    suffix = None
    for made, moved, size_mb in sorted(offloaded, key=lambda item: item[0], reverse=True):
        total = solver.NumVar(0.0, infinity, "")
        row = solver.Constraint(0.0, 0.0)  # total = size * moved + the next suffix
        row.SetCoefficient(total, 1.0)
        row.SetCoefficient(moved, -size_mb)
        if suffix is not None:
            row.SetCoefficient(suffix, -1.0)
        window_mb = bytes_per_ms * per_mb * (graph.end_times[t] - graph.end_times[made])
        capacity = solver.Constraint(-infinity, window_mb)
        capacity.SetCoefficient(total, 1.0)
        capacity.SetCoefficient(extra_ms, -bytes_per_ms * per_mb)
        suffix = total


def _fixed_point(moment: _Moment, overflow: int, bytes_per_ms: float | None) -> float:
    """The least E >= 0 with removal cost (given E of extra time for offloads) <= E; a lower estimate of it."""
    if moment.total_bytes < overflow:
        return float("inf")  # freeing every tensor is not enough: no plan in this order fits
    cost = _removal_cost_ms(moment, overflow, bytes_per_ms, 0.0)
    if cost <= 0:
        return 0.0
    low, high = 0.0, cost  # cost(cost) <= cost(0) = cost: the fixed point lies below
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if _removal_cost_ms(moment, overflow, bytes_per_ms, middle) <= middle:
            high = middle
        else:
            low = middle
    return low  # cost(low) > low: every E <= low pays less than it needs
