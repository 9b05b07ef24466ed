"""A quick recompute-only plan to start the search from: evict on demand, recompute on demand.

Walk the nodes in order. Before a computation, any missing input is
recomputed first (recursively); when memory would overflow, the resident
tensor with the best ratio of recompute cost (missing ancestors included) to
size times distance to its next reader is freed (the rule of Dynamic Tensor
Rematerialization, Kirisame et al. 2021). The plan is checked by the simulator like any other; it is a
hint for CP-SAT and a fallback, never a claim of optimality.
"""

from __future__ import annotations

import sys

from planner.builder import ScheduleBuilder
from planner.errors import ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import simulate


class _Stuck(Exception):
    pass


def greedy_recompute_schedule(
    profile: GraphProfile, budget_bytes: int, max_evictions: int | None = None
) -> Schedule | None:
    """The plan, or None if the rule gets stuck or needs more than `max_evictions` frees.

    The limit is a count, not a clock, so that the answer does not depend on the machine's load.
    """
    evictions_left = max_evictions if max_evictions is not None else 20 * len(profile.nodes)
    ids = list(profile.order)
    index = {node_id: i for i, node_id in enumerate(ids)}
    nodes = [profile.node_by_id[node_id] for node_id in ids]
    inputs = [sorted({index[s] for s in node.inputs}) for node in nodes]
    users = [[] for _ in ids]
    for k, sources in enumerate(inputs):
        for j in sources:
            users[j].append(k)
    size = [node.size_bytes for node in nodes]
    workspace = [node.fastest.workspace_bytes for node in nodes]
    cost = [node.fastest.time_ms for node in nodes]
    capacity = budget_bytes - profile.fixed_bytes
    builder = ScheduleBuilder(profile)
    resident: set[int] = set()
    used = 0
    stage = 0

    def next_use(j: int) -> int:
        later = [u for u in users[j] if u >= stage]
        return min(later) if later else len(ids) + 1

    def free(j: int) -> None:
        nonlocal used
        resident.discard(j)
        used -= size[j]
        builder.free(ids[j])

    def make_room(needed: int, pinned: set[int], soft: set[int]) -> None:
        nonlocal evictions_left
        while used + needed > capacity:
            evictions_left -= 1
            if evictions_left < 0:
                raise _Stuck
            candidates = [j for j in resident if j not in pinned]
            if not candidates:
                raise _Stuck
            free(min(candidates, key=lambda j: (j in soft, _score(j), -j)))

    def missing_cost(j: int, seen: set[int]) -> float:
        """What recomputing j would cost now, its missing ancestors included."""
        total = cost[j]
        for i in inputs[j]:
            if i not in resident and i not in seen:
                seen.add(i)
                total += missing_cost(i, seen)
        return total

    def _score(j: int) -> float:
        """DTR's rule: cheap to bring back, big, and not needed soon goes first."""
        if next_use(j) > len(ids):
            return -1.0
        return missing_cost(j, {j}) / (max(size[j], 1) * (next_use(j) - stage + 1))

    def compute(k: int, soft: set[int], depth: int = 0) -> None:
        """Compute k; its own inputs may not be evicted meanwhile, the callers' inputs only if nothing else fits."""
        nonlocal used
        if depth > len(ids):
            raise _Stuck
        pinned = set(inputs[k])
        for _ in range(4 * len(inputs[k]) + 1):
            missing = [j for j in inputs[k] if j not in resident]
            if not missing:
                break
            compute(missing[0], soft | pinned, depth + 1)
        else:
            raise _Stuck
        make_room(size[k] + workspace[k], pinned, soft)
        builder.compute(ids[k])
        resident.add(k)
        used += size[k]

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(ids) + 100))
    try:
        for stage in range(len(ids)):
            builder.stage(ids[stage])
            compute(stage, set())
            for j in sorted(resident):
                if all(u <= stage for u in users[j]):  # nobody computed later reads it
                    free(j)
    except _Stuck:
        return None
    finally:
        sys.setrecursionlimit(limit)
    schedule = builder.build(budget_bytes)
    try:
        simulate(profile, schedule, keep_timeline=False)
    except ScheduleRejected:
        return None
    return schedule
