"""Planned addresses: a place in one arena for every buffer a schedule allocates.

A plan's peak only says how many bytes are live at once. A device runs out of
memory at what its allocator holds, and an allocator asked for buffers of many
sizes, freed out of order, holds more than is live (fragmentation). The
schedule knows every buffer's size and lifetime (the simulator's memory
events), so it can say where each one lives too: an offset in one arena,
allocated once, that no two live buffers share. The step then holds the arena
and fixed memory, the same every step.

Placing intervals in an arena of least size is dynamic storage allocation
(NP-hard in general). The greedy passes here place buffers one at a time at
the tightest gap among those already placed that overlap them in time, as
TFLite's arena planner and Inductor's memory planning do; several orders are
tried, then passes that fill the arena from the bottom up (each buffer pressed
down onto those under it). Where they leave the arena above the lower bound, a
search that can undo its choices (`planner.canonical_placement`) asks for
smaller arenas, then CP-SAT from the best, and the smallest arena is kept. The
most bytes live at one instant is a lower bound, so every result says how far
it is from the best possible.
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass

import numpy as np

from planner.canonical_placement import CanonicalPlacer
from planner.profile import GraphProfile
from planner.schedule import Compute, Prefetch, Schedule
from planner.simulator import Allocation, allocations


# Every offset is a multiple of this, and every buffer takes a whole number of such units: a tensor placed in the
# arena starts where a vectorised kernel (AVX-512, a GPU's 128-bit loads) wants it, as an allocator's own would.
ALIGNMENT_BYTES = 64


def aligned(size_bytes: int) -> int:
    return -(-size_bytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


@dataclass(frozen=True)
class AddressPlan:
    arena_bytes: int
    lower_bound_bytes: int  # the most bytes live at one instant: no arena can be smaller
    offsets: list[int]  # one per allocation, in the order given
    order: str  # the placement order that gave this arena

    @property
    def overhead(self) -> float:
        """The arena over the lower bound, minus one (0.02: 2% more than live memory ever needs)."""
        return self.arena_bytes / self.lower_bound_bytes - 1 if self.lower_bound_bytes else 0.0


def most_live_bytes(buffers: list[Allocation]) -> int:
    """The largest sum of live buffer sizes (aligned) at one event: the arena's lower bound."""
    if not buffers:
        return 0
    horizon = _horizon(buffers)
    change = np.zeros(horizon + 1, dtype=np.int64)
    for buffer in buffers:
        change[buffer.start] += aligned(buffer.size_bytes)
        change[horizon if buffer.end is None else buffer.end] -= aligned(buffer.size_bytes)
    return int(np.cumsum(change).max())


def _horizon(buffers: list[Allocation]) -> int:
    return 1 + max(max(b.start for b in buffers), max((b.end for b in buffers if b.end is not None), default=0))


# Placement orders for the best-fit pass (keys sorted ascending), after the sweep in the step's own order: large
# first is the classic; long-lived first keeps the buffers that span the step at the bottom.
_ORDERS = {
    "largest first": lambda size, start, end: (-size, start, -end),
    "longest-lived first": lambda size, start, end: (-(end - start), -size, start),
    "largest area first": lambda size, start, end: (-size * (end - start), start),
}


# Priorities for the pressed-down passes (highest first among the buffers that can sit equally low)
_PRESSED_DOWN = {
    "pressed down, largest area first": lambda sizes, lifetimes: sizes * lifetimes,
    "pressed down, longest-lived first": lambda sizes, lifetimes: lifetimes * (int(sizes.max()) + 1) + sizes,
    "pressed down, largest first": lambda sizes, lifetimes: sizes * (int(lifetimes.max()) + 1) + lifetimes,
}


def place(buffers: list[Allocation], search_time_s: float = 0.0, deadline: float | None = None,
          room_bytes: int | None = None) -> AddressPlan:
    """The smallest arena the greedy passes find (stopping at the lower bound), and each buffer's offset; with
    `search_time_s`, the canonical search and then CP-SAT look for a smaller one for about that long in all, the
    search first for an arena within `room_bytes` (what the budget leaves beside fixed memory) where that is above
    the lower bound. `deadline` (time.monotonic()): the sweep always runs (it is fast), a further pass only where the
    last one's time is still left before it."""
    bound = most_live_bytes(buffers)
    if not buffers:
        return AddressPlan(0, 0, [], "none")
    horizon = _horizon(buffers)
    sizes = np.array([aligned(b.size_bytes) for b in buffers], dtype=np.int64)
    starts = np.array([b.start for b in buffers], dtype=np.int64)
    ends = np.array([horizon if b.end is None else b.end for b in buffers], dtype=np.int64)
    began = time.monotonic()
    offsets = _place_sweeping(sizes.tolist(), starts.tolist(), ends.tolist())
    best = AddressPlan(max(o + z for o, z in zip(offsets, sizes.tolist())), bound, offsets, "step order")
    pass_s = 3 * (time.monotonic() - began)  # a best-fit pass takes a few sweeps' time (numpy over all placed)
    lifetimes = ends - starts
    # best fit in each order, then the pressed-down passes by each priority
    passes = [(name, lambda key=key: _place_in_order(
        sorted(range(len(buffers)), key=lambda i: key(int(sizes[i]), int(starts[i]), int(ends[i]))),
        sizes, starts, ends)) for name, key in _ORDERS.items()]
    passes += [(name, lambda priority=priority: _place_pressed_down(priority(sizes, lifetimes), sizes, starts, ends))
               for name, priority in _PRESSED_DOWN.items()]
    for name, placed in passes:
        if best.arena_bytes <= bound:
            return best
        if deadline is not None and time.monotonic() + pass_s > deadline:
            return best
        began = time.monotonic()
        found = placed()
        arena = int((found + sizes).max())
        if arena < best.arena_bytes:
            best = AddressPlan(arena, bound, [int(o) for o in found], name)
        pass_s = time.monotonic() - began
    if best.arena_bytes <= bound or (deadline is not None and time.monotonic() + pass_s > deadline):
        return best
    if search_time_s > 0:
        best = _canonical(best, sizes, starts, ends, CANONICAL_SHARE * search_time_s, deadline, room_bytes)
        search_time_s *= 1 - CANONICAL_SHARE
        if best.arena_bytes <= bound:
            return best
    # the work limit decides where the search ends (the same addresses on a loaded machine); the clock only as a
    # guard, and never past the deadline
    wall_s = 3 * search_time_s if deadline is None else min(3 * search_time_s, deadline - time.monotonic())
    if search_time_s > 0 and wall_s > 0.01:
        improved = _search(sizes, starts, ends, best, search_time_s, wall_s)
        if improved is not None:
            return improved
    return best


def _stop_at(time_s: float, deadline: float | None) -> float:
    """When a search given `time_s` stops (time.monotonic()), never past the caller's deadline."""
    stop = time.monotonic() + time_s
    return stop if deadline is None else min(stop, deadline)


# What the canonical search gets of the search's time (CP-SAT the rest). It is given a number of nodes, estimated
# from the time and the buffers, so that the same buffers get the same addresses on a loaded machine.
CANONICAL_SHARE = 2 / 3


def _canonical(best: AddressPlan, sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray, time_s: float,
               deadline: float | None, room_bytes: int | None = None) -> AddressPlan:
    """The canonical search (`planner.canonical_placement`) asked for smaller arenas than `best`: first within the
    room the budget leaves (where the greedy passes did not fit it and it is above the lower bound: what the plan
    needs comes first), else the lower bound itself, then halfway between the smallest arena it failed to find and
    the smallest found, each try with a share of the nodes. On the zoo's BERT at half its peak, 1.000 of the bound
    where the greedy passes gave 1.088 and the squeaky-wheel, perturbed and CP-SAT passes 1.056. A plan of ResNet-50
    at batch 256 made again within less (its live peak 0.88 of the room): the greedy passes 1.03 of the room, the
    search 0.95."""
    placer = CanonicalPlacer(sizes, starts, ends)
    nodes_left = int(time_s / placer.node_s)
    # a guard only: the node count ends the search (its estimate is 1.3-2x what a node takes on an idle machine)
    stop = _stop_at(5 * time_s, deadline)
    failed = best.lower_bound_bytes - ALIGNMENT_BYTES  # the largest arena the search did not find
    target = best.lower_bound_bytes
    if room_bytes is not None and best.lower_bound_bytes < room_bytes < best.arena_bytes:
        target = max(room_bytes // ALIGNMENT_BYTES * ALIGNMENT_BYTES, best.lower_bound_bytes)
    first = True
    while nodes_left > 2 * len(sizes) and best.arena_bytes - failed > ALIGNMENT_BYTES and time.monotonic() < stop:
        nodes = nodes_left // 3 if first else nodes_left // 2
        first = False
        found = placer.within(target, nodes, stop)
        nodes_left -= nodes
        if found is None:
            failed = target
        else:
            arena = int((found + sizes).max())
            best = AddressPlan(arena, best.lower_bound_bytes, [int(o) for o in found], "canonical search")
        target = (failed + best.arena_bytes) // 2 // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        if target <= failed:
            break
    return best


def _search(sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray, greedy: AddressPlan,
            time_limit_s: float, max_wall_s: float) -> AddressPlan | None:
    """CP-SAT on the rectangles (time fixed, offset free) from the greedy arena down towards the lower bound; None
    where it finds nothing smaller in time."""
    from ortools.sat.python import cp_model  # only where a search runs: plan()'s import stays light

    unit = ALIGNMENT_BYTES
    top = greedy.arena_bytes // unit
    model = cp_model.CpModel()
    arena = model.new_int_var(greedy.lower_bound_bytes // unit, top, "arena")
    times, places = [], []
    offsets: dict[int, object] = {}
    for i, size in enumerate(sizes):
        if size == 0:
            continue
        height = int(size) // unit
        offset = model.new_int_var(0, top - height, f"offset_{i}")
        model.add_hint(offset, greedy.offsets[i] // unit)
        model.add(offset + height <= arena)
        offsets[i] = offset
        times.append(model.new_fixed_size_interval_var(int(starts[i]), int(ends[i] - starts[i]), f"t_{i}"))
        places.append(model.new_fixed_size_interval_var(offset, height, f"a_{i}"))
    model.add_no_overlap_2d(times, places)
    model.add_hint(arena, top)
    model.minimize(arena)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max_wall_s
    solver.parameters.num_workers = 1  # deterministic where the work limit, not the clock, ends it
    solver.parameters.max_deterministic_time = time_limit_s
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or solver.value(arena) >= top:
        return None
    placed = [solver.value(offsets[i]) * unit if i in offsets else 0 for i in range(len(sizes))]
    return AddressPlan(int(solver.value(arena)) * unit, greedy.lower_bound_bytes, placed, "CP-SAT")


def _place_sweeping(sizes: list[int], starts: list[int], ends: list[int]) -> list[int]:
    """Best fit in the step's own order, as an allocator would place the buffers, but knowing every size: each goes
    into the smallest gap between the buffers live at its start where it fits, else on top. Pure Python over the
    live buffers only, so it is fast on thousands of buffers."""
    offsets = [0] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: (starts[i], -sizes[i]))
    ending: list[tuple[int, int]] = []  # heap of (end, buffer) for live buffers
    live: list[tuple[int, int]] = []  # (offset, end offset) of live buffers, sorted by offset
    for i in order:
        while ending and ending[0][0] <= starts[i]:
            _, gone = heapq.heappop(ending)
            live.remove((offsets[gone], offsets[gone] + sizes[gone]))
        size = sizes[i]
        if size == 0:
            continue
        best_gap, best_at, reached = None, None, 0
        for low, high in live:
            gap = low - reached
            if gap >= size and (best_gap is None or gap < best_gap):
                best_gap, best_at = gap, reached
            reached = max(reached, high)
        offset = reached if best_at is None else best_at
        offsets[i] = offset
        bisect.insort(live, (offset, offset + size))
        heapq.heappush(ending, (ends[i], i))
    return offsets


def _place_pressed_down(priority: np.ndarray, sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Buffers placed from the bottom of the arena up, in the order of their offsets: at each step the buffers not
    yet placed that can sit lowest (on the highest buffer placed under them in time, or on the floor) compete, and
    the one of highest priority takes that place. Every buffer rests on another, as in an arena pressed down;
    best fit fills the tightest gap instead, and on fragmented plans the two find different arenas (the large
    U-Net at 0.7 of its peak: 1.07 of the lower bound pressed down; 1.24 by best fit's orders, 1.10 after its
    searches)."""
    count = len(sizes)
    lowest = np.zeros(count, dtype=np.int64)  # the lowest offset each waiting buffer can take
    waiting = sizes > 0
    offsets = np.zeros(count, dtype=np.int64)
    never = np.iinfo(np.int64).max
    for _ in range(int(waiting.sum())):
        candidates = np.where(waiting, lowest, never)
        level = candidates.min()
        contenders = np.flatnonzero(candidates == level)
        chosen = contenders[np.argmax(priority[contenders])]
        offsets[chosen] = level
        waiting[chosen] = False
        under = waiting & (starts < ends[chosen]) & (ends > starts[chosen])
        np.maximum(lowest, np.where(under, level + sizes[chosen], 0), out=lowest)
    return offsets


def _place_in_order(order: list[int], sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Best fit: each buffer goes into the smallest gap, between buffers placed before it that overlap it in time,
    where it fits; else on top of them."""
    count = len(order)
    offsets = np.zeros(count, dtype=np.int64)
    placed_start = np.empty(count, dtype=np.int64)
    placed_end = np.empty(count, dtype=np.int64)
    placed_low = np.empty(count, dtype=np.int64)
    placed_high = np.empty(count, dtype=np.int64)
    m = 0
    for i in order:
        size = sizes[i]
        if size == 0:
            continue
        overlapping = (placed_start[:m] < ends[i]) & (placed_end[:m] > starts[i])
        offset = 0
        if overlapping.any():
            low = placed_low[:m][overlapping]
            high = placed_high[:m][overlapping]
            by_low = np.argsort(low, kind="stable")
            low, high = low[by_low], high[by_low]
            reached = np.maximum.accumulate(high)  # the top of everything below each buffer, in address order
            gap_start = np.concatenate(([0], reached[:-1]))
            gaps = low - gap_start
            fitting = np.flatnonzero(gaps >= size)
            if fitting.size:
                tightest = fitting[np.argmin(gaps[fitting])]
                offset = int(gap_start[tightest])
            else:
                offset = int(reached[-1])
        offsets[i] = offset
        placed_start[m], placed_end[m] = starts[i], ends[i]
        placed_low[m], placed_high[m] = offset, offset + size
        m += 1
    return offsets


def plan_addresses(profile: GraphProfile, schedule: Schedule, search_time_s: float = 0.0,
                   deadline: float | None = None) -> AddressPlan:
    return place(allocations(profile, schedule), search_time_s, deadline)



def with_addresses(profile: GraphProfile, schedule: Schedule, plan: AddressPlan | None = None,
                   buffers: list[Allocation] | None = None) -> Schedule:
    """`schedule` with its buffers' offsets and arena (planned now unless given; `buffers`: its allocations, where
    the caller has them already)."""
    buffers = allocations(profile, schedule) if buffers is None else buffers
    plan = plan or place(buffers)
    output: dict[int, int] = {}
    workspace: dict[int, int] = {}
    for buffer, offset in zip(buffers, plan.offsets):
        (workspace if buffer.workspace else output)[buffer.operation_index] = offset
    stages = []
    position = 0
    for stage in schedule.stages:
        operations = []
        for operation in stage.operations:
            if isinstance(operation, (Compute, Prefetch)):
                update = {"offset_bytes": output.get(position)}
                if isinstance(operation, Compute):
                    update["workspace_offset_bytes"] = workspace.get(position)
                operation = operation.model_copy(update=update)
            operations.append(operation)
            position += 1
        stages.append(stage.model_copy(update={"operations": operations}))
    return schedule.model_copy(update={"stages": stages, "arena_bytes": plan.arena_bytes})


def without_addresses(schedule: Schedule) -> Schedule:
    stages = [stage.model_copy(update={"operations": [
        operation.model_copy(update={"offset_bytes": None, "workspace_offset_bytes": None})
        if isinstance(operation, Compute) else
        operation.model_copy(update={"offset_bytes": None}) if isinstance(operation, Prefetch) else operation
        for operation in stage.operations]}) for stage in schedule.stages]
    return schedule.model_copy(update={"stages": stages, "arena_bytes": None})
