"""Memory-aware compute orders: another topological order may need far less memory than the profile's.

The profile's order is one topological order among many; a recompute-only
plan may compute the nodes in any of them (the simulator only asks that
inputs be resident). On graphs with a wide join (one node reading dozens of
tensors, most read by nobody else) the given order computes those inputs long
before the join and keeps them all alive meanwhile. Two list-scheduling rules
pick, among the nodes ready to run, the one that grows memory least: forward
(its output minus the inputs it reads last) and backward from the sinks (the
inputs it newly makes live minus its output, so that inputs are computed just
in time). Each is run once plainly and then with seeded random tie-breaking
(a fixed sequence of seeds, so the answer does not depend on the machine),
and the order with the lowest keep-all peak wins. A keep-all plan in that
order needs no recomputation at all; when it does not fit, the greedy
evict-and-recompute pass runs on it instead.
"""

from __future__ import annotations

import random
import time

from planner.builder import ScheduleBuilder
from planner.cpsat.greedy import greedy_recompute_schedule, stage_graph
from planner.profile import GraphProfile
from planner.schedule import Schedule


def keep_all_peak_in_order(inputs, users, size, workspace, order: list[int]) -> int:
    """Peak bytes (fixed memory aside) of computing `order` once each, every tensor freed after its last reader."""
    position = {v: p for p, v in enumerate(order)}
    last = {v: max([position[u] for u in users[v]], default=position[v]) for v in order}
    live = peak = 0
    for p, v in enumerate(order):
        live += size[v]
        peak = max(peak, live + workspace[v])
        for j in set(inputs[v]) | {v}:
            if last[j] == p:
                live -= size[j]
    return peak


def order_pairs(profile: GraphProfile, index: dict[str, int]) -> list[tuple[int, int]]:
    """(earlier, later) beyond the data's edges, which every order keeps (the simulator rejects a plan that does
    not): the nodes that draw random numbers first run in the order they draw (else each draws other numbers than
    the step), and no backward node runs before the loss (the backward pass starts from it)."""
    drawing = [index[node_id] for node_id in profile.drawing_order]
    pairs = list(zip(drawing, drawing[1:]))
    backward = [index[node.id] for node in profile.nodes if node.kind == "backward"]
    pairs += [(index[loss], later) for loss in profile.loss_ids for later in backward]
    return pairs


def _with_order_pairs(inputs, users, pairs) -> tuple[list[list[int]], list[list[int]]]:
    """Predecessors and successors for the order alone (memory is still counted from `inputs` and `users`)."""
    before = [list(sources) for sources in inputs]
    after = [list(readers) for readers in users]
    for earlier, later in pairs:
        before[later].append(earlier)
        after[earlier].append(later)
    return before, after


def _forward(inputs, users, size, rng: random.Random | None, noise: float, pairs=()) -> list[int]:
    n = len(size)
    readers_left = [len(users[v]) for v in range(n)]
    before, after = _with_order_pairs(inputs, users, pairs)
    missing = [len(before[v]) for v in range(n)]
    ready = [v for v in range(n) if not missing[v]]
    order: list[int] = []
    while ready:
        def growth(v: int) -> float:
            freed = sum(size[j] for j in inputs[v] if readers_left[j] == 1)
            return size[v] - freed + (rng.random() * noise if rng else 0.0)

        v = min(ready, key=lambda v: (growth(v), v))
        ready.remove(v)
        order.append(v)
        for j in inputs[v]:
            readers_left[j] -= 1
        for u in after[v]:
            missing[u] -= 1
            if not missing[u]:
                ready.append(u)
    return order


def _backward(inputs, users, size, rng: random.Random | None, noise: float, pairs=()) -> list[int]:
    n = len(size)
    before, after = _with_order_pairs(inputs, users, pairs)
    placed_after = [len(after[v]) for v in range(n)]  # nodes that must come later, not yet placed
    ready = [v for v in range(n) if not placed_after[v]]
    live: set[int] = set()
    reversed_order: list[int] = []
    while ready:
        def growth(v: int) -> float:
            added = sum(size[j] for j in inputs[v] if j not in live)
            return added - size[v] + (rng.random() * noise if rng else 0.0)

        v = min(ready, key=lambda v: (growth(v), -v))
        ready.remove(v)
        reversed_order.append(v)
        live.discard(v)
        live.update(inputs[v])
        for j in before[v]:
            placed_after[j] -= 1
            if not placed_after[j]:
                ready.append(j)
    return reversed_order[::-1]


# where memory_aware_order keeps its answer on a profile (listed in planner.profile._DERIVED_VIEWS)
MEMORY_AWARE_VIEW = "_memory_aware_order"


def memory_aware_order(
    profile: GraphProfile, tries: int = 64, deadline: float | None = None
) -> tuple[list[str], int]:
    """(node ids in the order of lowest keep-all peak found, that peak with fixed memory); the given order competes.

    The seeded tries stop at `deadline` (time.monotonic()); the plain forward and backward rules always run. A
    search that ran all its tries is kept on the profile (a derived view, `planner.profile._DERIVED_VIEWS`): the
    strategies and the smallest-budget search after them ask for the same order.
    """
    known = profile.__dict__.get(MEMORY_AWARE_VIEW)
    if known is not None and known[0] == tries:
        return list(known[1]), known[2]
    graph = stage_graph(profile)
    ids, inputs, users, size, workspace = graph.ids, graph.inputs, graph.users, graph.size, graph.workspace
    noise = sum(size) / max(len(size), 1) / 2  # tie-breaking noise: half a mean tensor
    pairs = order_pairs(profile, {node_id: v for v, node_id in enumerate(ids)})
    candidates = [list(range(len(ids)))]
    candidates += [_forward(inputs, users, size, None, 0.0, pairs), _backward(inputs, users, size, None, 0.0, pairs)]
    complete = True
    for seed in range(tries):
        if deadline is not None and time.monotonic() > deadline:
            complete = False
            break
        candidates.append(_forward(inputs, users, size, random.Random(seed), noise, pairs))
        candidates.append(_backward(inputs, users, size, random.Random(seed), noise, pairs))
    best = min(candidates, key=lambda order: keep_all_peak_in_order(inputs, users, size, workspace, order))
    answer = [ids[v] for v in best], keep_all_peak_in_order(inputs, users, size, workspace, best) + profile.fixed_bytes
    if complete:
        profile.__dict__[MEMORY_AWARE_VIEW] = (tries, tuple(answer[0]), answer[1])
    return answer


def keep_all_in_order(profile: GraphProfile, order: list[str], budget_bytes: int | None) -> Schedule:
    """Each node computed once in `order` (a topological order), each tensor freed after its last reader."""
    position = {node_id: p for p, node_id in enumerate(order)}
    last_reader = {node_id: node_id for node_id in order}
    for node_id in order:
        for source in profile.node_by_id[node_id].inputs:
            if position[node_id] > position[last_reader[source]]:
                last_reader[source] = node_id
    freed_after: dict[str, list[str]] = {node_id: [] for node_id in order}
    for tensor, reader in last_reader.items():
        freed_after[reader].append(tensor)
    builder = ScheduleBuilder(profile)
    for node_id in order:
        builder.stage(node_id).compute(node_id)
        for tensor in sorted(freed_after[node_id], key=position.__getitem__):
            builder.free(tensor)
    return builder.build(budget_bytes)


def reordered_schedule(
    profile: GraphProfile, budget_bytes: int, tries: int = 64, deadline: float | None = None
) -> Schedule | None:
    """A plan in a memory-aware order: keep-all if it fits, else the greedy recompute pass on that order; or None.

    Both passes stop at `deadline` (time.monotonic()) with what they have.
    """
    order, peak_bytes = memory_aware_order(profile, tries, deadline)
    if peak_bytes <= budget_bytes:
        return keep_all_in_order(profile, order, budget_bytes)
    if order == list(profile.order):
        return None  # the caller's greedy pass has tried this order already
    return greedy_recompute_schedule(profile, budget_bytes, order=order, deadline=deadline)


def in_profile_order(profile: GraphProfile, schedule: Schedule | None) -> bool:
    """Whether the stages follow the profile's order: only such plans can warm-start the CP-SAT models."""
    if schedule is None:
        return False
    nodes = [stage.node for stage in schedule.stages if stage.node is not None]
    present = set(nodes)
    return nodes == [node_id for node_id in profile.order if node_id in present]
