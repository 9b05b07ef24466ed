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
bisection). Each moment gives a valid bound; the largest over the moments where
memory is tightest is reported. Relaxations made (each only lowers the bound):
fractions of tensors, a recomputation's inputs for free, transfer latency
ignored, the cost of the recomputation counted once.

Plans in another compute order (the memory-aware order) are not covered: such
a plan is compared against the trivial bound only.
"""

from __future__ import annotations

import time

import numpy as np

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
                          deadline: float | None = None) -> float:
    """A lower bound on the step time of any plan in the profile's order within `budget_bytes` (see the module).

    Moments are evaluated largest overflow first until `deadline` (time.monotonic()); fewer moments only
    weaken the bound. Infinite when no plan in this order fits.
    """
    return _peak_instant_bound(profile, budget_bytes, transfers, deadline)[0]


def _peak_instant_bound(profile: GraphProfile, budget_bytes: int, transfers: bool, deadline: float | None):
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
        best = max(best, _fixed_point(_Moment(candidates, end_times, end_times[t]), overflow, bytes_per_ms))
    return base + best, complete


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
