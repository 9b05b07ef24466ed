"""A quick recompute-only plan to start the search from, and to fall back on: evict on demand, recompute on demand.

Walk the stages in order. Before stage t computes node t, the set of missing
tensors it needs is closed over (a missing input of a recomputation is
missing too) and recomputed in a topological order; every tensor some
pending computation of the stage still reads is pinned. When memory would
overflow, an unpinned resident tensor is freed: one nobody reads again if
any, else the one with the best ratio of recompute cost (missing inputs
included) to size times distance to its next reader (the rule of Dynamic
Tensor Rematerialization, Kirisame et al. 2021). A few variants of the rule
and of the recompute order are tried and the fastest plan the simulator
accepts is kept. It is a hint for CP-SAT and a fallback, never a claim of
optimality.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.builder import ScheduleBuilder
from planner.errors import ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import simulate


class _Stuck(Exception):
    pass


class _OutOfTime(Exception):
    pass


@dataclass
class _Graph:
    ids: list[str]
    inputs: list[list[int]]
    users: list[list[int]]
    size: list[int]
    implementation: list[str]
    workspace: list[int]
    cost: list[float]
    recomputable: list[bool]


IMPLEMENTATION_CHOICES = ("fastest", "smallest-workspace")


def smallest_workspaces_differ(profile: GraphProfile) -> bool:
    """Whether the greedy pass on the smallest workspaces would run another step than on the fastest
    implementations (worth a try where that one finds nothing)."""
    return any(node.smallest_workspace.name != node.fastest.name for node in profile.nodes)


def stage_graph(profile: GraphProfile, order: list[str] | None = None, implementation: str = "fastest") -> _Graph:
    """Stage t computes ids[t]: the profile's order, or another topological order (`planner.cpsat.reorder`); each
    node by its fastest implementation, or by the one with the smallest workspace."""
    if implementation not in IMPLEMENTATION_CHOICES:
        raise ValueError(f"implementation is one of {', '.join(IMPLEMENTATION_CHOICES)}, not {implementation!r}")
    ids = list(profile.order if order is None else order)
    index = {node_id: i for i, node_id in enumerate(ids)}
    nodes = [profile.node_by_id[node_id] for node_id in ids]
    chosen = [node.fastest if implementation == "fastest" else node.smallest_workspace for node in nodes]
    inputs = [sorted({index[s] for s in node.inputs}) for node in nodes]
    users: list[list[int]] = [[] for _ in ids]
    for k, sources in enumerate(inputs):
        for j in sources:
            users[j].append(k)
    return _Graph(
        ids=ids,
        inputs=inputs,
        users=users,
        size=[node.size_bytes for node in nodes],
        implementation=[impl.name for impl in chosen],
        workspace=[impl.workspace_bytes for impl in chosen],
        cost=[impl.time_ms for impl in chosen],
        # the simulator lets any node run again (backward ones too) while its inputs are resident
        recomputable=[bool(users[k]) for k in range(len(nodes))],
    )


# (eviction rule, recompute order, keep dead tensors until memory is needed): the variants tried, cheapest plan wins.
VARIANTS = (
    ("dtr", "depth-first", False), ("dtr", "heavy-first", False), ("dtr", "index", False),
    ("cost", "depth-first", False), ("cost", "heavy-first", False), ("distance", "heavy-first", False),
    ("pressure", "heavy-first", False), ("pressure", "depth-first", False),
    # keeping dead tensors until memory is needed shortens later recomputation chains (a big win on some graphs)
    ("dtr", "depth-first", True), ("dtr", "index", True), ("cost", "depth-first", True), ("cost", "heavy-first", True),
)


def _run(
    graph: _Graph, capacity: int, rule: str, order: str, evictions_left: int, keep_dead: bool = False,
    deadline: float | None = None,
) -> list[list[tuple[str, int]]]:
    """Per stage, the operations ("compute" k / "free" j); raises _Stuck if the rule cannot make room.

    Raises _OutOfTime once `deadline` (time.monotonic()) has passed, checked at every stage.
    """
    n = len(graph.ids)
    inputs, users, size, cost = graph.inputs, graph.users, graph.size, graph.cost
    resident: set[int] = set()
    used = 0
    stages: list[list[tuple[str, int]]] = []
    next_user = [0] * n  # index into users[j] of the first user >= the current stage
    last_reader = [max(users[j], default=j) for j in range(n)]  # after this stage nobody reads j
    dies_after: list[list[int]] = [[] for _ in range(n)]
    for j in range(n):
        dies_after[last_reader[j]].append(j)

    def next_use(j: int, t: int) -> int:
        i = next_user[j]
        while i < len(users[j]) and users[j][i] <= t:
            i += 1
        next_user[j] = i
        return users[j][i] if i < len(users[j]) else n + 1

    def score(j: int, t: int) -> float:
        distance = next_use(j, t) - t
        if rule == "distance":
            return 1.0 / (max(size[j], 1) * distance)
        bring_back = cost[j] + sum(cost[i] for i in inputs[j] if i not in resident)
        if rule == "cost":
            return bring_back / max(size[j], 1)
        if rule == "pressure":  # bringing a tensor back where its reader already needs most of memory is hard
            reader = next_use(j, t)
            crowd = sum(size[i] for i in inputs[reader]) / max(capacity, 1) if reader < n else 0.0
            return (bring_back + 1.0) * (1.0 + 100.0 * crowd ** 4) / (max(size[j], 1) * distance)
        return bring_back / (max(size[j], 1) * distance)

    for t in range(n):
        if deadline is not None and time.monotonic() > deadline:
            raise _OutOfTime
        ops: list[tuple[str, int]] = []

        def missing_closure(targets: list[int]) -> list[int]:
            """The missing tensors `targets` need, inputs before readers, in the variant's order."""
            weight: dict[int, int] = {}
            planned: set[int] = set()
            found: list[int] = []

            def closure_bytes(j: int) -> int:
                """Bytes of j's missing closure (shared parts counted twice): how much room recomputing j takes.
                Without recursion: a chain of thousands of missing layers is one closure."""
                stack = [j]
                while stack:
                    k = stack[-1]
                    if k in resident or k in weight:
                        stack.pop()
                        continue
                    waiting = [i for i in inputs[k] if i not in resident and i not in weight]
                    if waiting:
                        stack.extend(waiting)
                        continue
                    stack.pop()
                    weight[k] = size[k] + sum(weight.get(i, 0) for i in inputs[k] if i not in resident)
                return 0 if j in resident else weight[j]

            def ordered(nodes: list[int]) -> list[int]:
                # Sethi-Ullman: the input needing most room first, while least is pinned
                return sorted(nodes, key=lambda i: -closure_bytes(i)) if order == "heavy-first" else nodes

            def visit(root: int) -> None:
                """Depth first, inputs before readers, each input in `ordered`'s order (without recursion)."""
                if root in resident or root in planned:
                    return
                if not graph.recomputable[root]:
                    raise _Stuck
                planned.add(root)
                stack = [(root, iter(ordered(inputs[root])))]
                while stack:
                    j, remaining = stack[-1]
                    i = next(remaining, None)
                    if i is None:
                        stack.pop()
                        found.append(j)
                    elif i not in resident and i not in planned:
                        if not graph.recomputable[i]:
                            raise _Stuck
                        planned.add(i)
                        stack.append((i, iter(ordered(inputs[i]))))

            for j in ordered(targets):
                visit(j)
            return sorted(found) if order == "index" else found

        queue = missing_closure(inputs[t]) + [t]
        pending: dict[int, int] = {}  # tensor -> reads still to come in this stage
        for x in queue:
            for j in inputs[x]:
                pending[j] = pending.get(j, 0) + 1
        position = 0
        while position < len(queue):
            x = queue[position]
            absent = [j for j in inputs[x] if j not in resident]
            if absent:  # an input was given up to make room: bring it back first
                again = missing_closure(absent)
                for y in again:
                    for j in inputs[y]:
                        pending[j] = pending.get(j, 0) + 1
                queue[position:position] = again
                continue
            needed = size[x] + graph.workspace[x]
            while used + needed > capacity:
                evictions_left -= 1
                if evictions_left < 0:
                    raise _Stuck
                candidates = [j for j in resident if not pending.get(j)]
                dead = [j for j in candidates if next_use(j, t) > n]
                live = [j for j in candidates if graph.recomputable[j]]
                if dead:
                    # a dead tensor still helps bring back an evicted reader; the useless ones go first
                    victim = min(dead, key=lambda j: (any(u not in resident and next_use(u, t) <= n for u in users[j]), j))
                elif live:
                    victim = min(live, key=lambda j: (score(j, t), -j))
                else:
                    # last resort: a tensor a later computation of this stage reads, not x's own inputs
                    soft = [j for j in resident if j not in inputs[x] and graph.recomputable[j]]
                    if not soft:
                        raise _Stuck

                    # Belady inside the stage: the one read last goes
                    read_again: dict[int, int] = {}
                    for p in range(position, len(queue)):
                        for j in inputs[queue[p]]:
                            read_again.setdefault(j, p)
                    victim = max(
                        soft, key=lambda j: (all(i in resident for i in inputs[j]), read_again.get(j, len(queue)), -j)
                    )
                resident.discard(victim)
                used -= size[victim]
                ops.append(("free", victim))
            ops.append(("compute", x))
            resident.add(x)
            used += size[x]
            for j in inputs[x]:
                pending[j] -= 1
            position += 1
        if not keep_dead:
            # nobody computed later reads these: the tensors whose last reader is this stage, and those this stage
            # computed (first time or again) that no later stage reads
            dying = {j for j in dies_after[t] if j in resident}
            dying.update(x for x in queue if x in resident and last_reader[x] <= t)
            for j in sorted(dying):
                resident.discard(j)
                used -= size[j]
                ops.append(("free", j))
        stages.append(ops)
    return stages


def _build(profile: GraphProfile, graph: _Graph, stages, budget_bytes: int) -> Schedule:
    builder = ScheduleBuilder(profile)
    for t, ops in enumerate(stages):
        builder.stage(graph.ids[t])
        for kind, j in ops:
            if kind == "compute":
                builder.compute(graph.ids[j], graph.implementation[j])
            else:
                builder.free(graph.ids[j])
    return builder.build(budget_bytes)


def greedy_recompute_schedule(
    profile: GraphProfile, budget_bytes: int, max_evictions: int | None = None, order: list[str] | None = None,
    deadline: float | None = None, first_plan_deadline: float | None = None, implementation: str = "fastest",
) -> Schedule | None:
    """The fastest plan of the variants, or None if every variant gets stuck or needs more than `max_evictions` frees.

    The limit is a count, not a clock, so that the answer does not depend on the machine's load; `deadline`
    (time.monotonic()) is the caller's clock on top: the variants not finished by then are skipped. Until one
    variant has given a plan, they run on until `first_plan_deadline` instead (a caller's whole time limit, when
    `deadline` is a phase's share of it): on a loaded machine a share can pass before the first plan, and a
    strategy left with no plan that fits fails where a slower plan would have done. `implementation`: every node
    runs its fastest implementation, or the one with the smallest workspace (a schedule that only has to fit).
    """
    graph = stage_graph(profile, order, implementation)
    limit = max_evictions if max_evictions is not None else 3 * len(graph.ids)
    capacity = budget_bytes - profile.fixed_bytes
    best: tuple[float, Schedule] | None = None
    seen: set[tuple] = set()
    for rule, order, keep_dead in VARIANTS:
        try:
            clock = deadline
            if best is None and deadline is not None and first_plan_deadline is not None:
                clock = max(deadline, first_plan_deadline)
            stages = _run(graph, capacity, rule, order, limit, keep_dead, clock)
        except _Stuck:
            continue
        except _OutOfTime:
            break
        key = tuple(tuple(ops) for ops in stages)
        if key in seen:
            continue
        seen.add(key)
        schedule = _build(profile, graph, stages, budget_bytes)
        try:
            step = simulate(profile, schedule, budget_bytes, keep_timeline=False).step_time_ms
        except ScheduleRejected:
            continue
        if best is None or step < best[0] - 1e-9:
            best = (step, schedule)
    return None if best is None else best[1]
