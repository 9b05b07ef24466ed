"""Placing buffers within a given arena by a search over canonical placements.

The greedy passes of `planner.addresses` place each buffer once and never look
back; on plans that free and prefetch out of the step's order they leave 5-15%
of the arena unused. This is a depth-first search that can undo a choice, in
the spirit of MiniMalloc (Moffitt, ASPLOS 2023): it only builds placements in
which the buffers are placed from the bottom of the arena up, each resting on a
buffer under it or on the floor (every placement can be pressed down into such
a one, so nothing is lost), and it prunes a branch as soon as some instant of
the step cannot hold what is still to be placed there:

- each buffer not yet placed can go no lower than the highest buffer placed
  under it in time (its lowest offset);
- at every instant (a section: a stretch of events with the same live
  buffers), the buffers still to be placed need their sizes' sum above the
  higher of what is placed there and the lowest offset among them, and that
  must fit the arena.

The branch taken first at every level is the pressed-down greedy pass, so the
search is never worse than that pass with the same priority. A work limit (the
nodes visited), not the clock, ends each try, so the same buffers get the same
addresses on a loaded machine; the clock only guards the caller's deadline.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

# The priority orders among buffers that can sit equally low (each tried once, then perturbed at random): most live
# bytes around the buffer first, then its length in time, then its area; and the same keys in other orders. A
# buffer in the busiest section is the hardest to place late.
PRIORITY_ORDERS = ("busiest, longest, largest area", "largest area, longest, busiest",
                   "busiest, largest area, longest")


@dataclass
class _Instance:
    sizes: np.ndarray  # int64, every size > 0
    starts: np.ndarray
    ends: np.ndarray
    first_section: np.ndarray  # each buffer lives in sections [first_section, last_section)
    last_section: np.ndarray
    overlaps: list[np.ndarray]  # for each buffer, the others live at some same instant
    pair_buffer: np.ndarray  # (buffer, section) pairs sorted by section: who lives where
    section_first_pair: np.ndarray  # where each section's pairs begin in pair_buffer
    section_total: np.ndarray  # the bytes live in each section


def _instance(sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> _Instance:
    boundaries = np.unique(np.concatenate((starts, ends)))
    first = np.searchsorted(boundaries, starts)
    last = np.searchsorted(boundaries, ends)
    count = len(sizes)
    overlaps = []
    for buffer in range(count):  # a row at a time: no count x count matrix on thousands of buffers
        row = (starts < ends[buffer]) & (ends > starts[buffer])
        row[buffer] = False
        overlaps.append(np.flatnonzero(row))
    spans = last - first
    pair_buffer = np.repeat(np.arange(count), spans)
    pair_section = np.concatenate([np.arange(f, l) for f, l in zip(first, last)]) if count else np.zeros(0, int)
    by_section = np.argsort(pair_section, kind="stable")
    pair_buffer, pair_section = pair_buffer[by_section], pair_section[by_section]
    sections = len(boundaries)
    section_first_pair = np.searchsorted(pair_section, np.arange(sections))
    section_total = np.bincount(pair_section, weights=sizes[pair_buffer], minlength=sections).astype(np.int64)
    return _Instance(sizes, starts, ends, first, last, overlaps, pair_buffer, section_first_pair, section_total)


def _keys(instance: _Instance, name: str) -> list[np.ndarray]:
    """The keys of the priority order `name`, most significant first (the largest first)."""
    busiest = np.array([instance.section_total[f:l].max() for f, l in
                        zip(instance.first_section, instance.last_section)], dtype=np.int64)
    longest = instance.ends - instance.starts
    area = instance.sizes * longest
    keys = {"busiest": busiest, "longest": longest, "largest area": area}
    return [keys[key].astype(np.float64) for key in name.split(", ")]


def _rank(columns: list[np.ndarray]) -> np.ndarray:
    """A rank per buffer (0 first): the largest keys first, the first key most significant."""
    order = np.lexsort([-column for column in reversed(columns)])
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank


class _Search:
    """One depth-first search for offsets within `capacity`, the buffers of equal lowest offset taken in `rank`'s
    order. Its state is changed in place as a buffer is placed and restored as the search backs up."""

    def __init__(self, instance: _Instance, capacity: int, rank: np.ndarray):
        self.instance, self.capacity, self.rank = instance, capacity, rank
        count = len(instance.sizes)
        self.offsets = np.full(count, -1, dtype=np.int64)
        self.lowest = np.zeros(count, dtype=np.int64)  # the lowest offset each waiting buffer can take
        sections = len(instance.section_total)
        self.floor = np.zeros(sections, dtype=np.int64)  # the top of what is placed in each section
        self.waiting_bytes = instance.section_total.copy()  # what is still to be placed in each section
        self.lowest_waiting = np.zeros(sections, dtype=np.int64)  # the least lowest offset there (0: none)
        self.log: list[tuple] = []  # what each placement changed, to undo it
        self.nodes = 0
        self.node_limit = 0
        self.deadline: float | None = None

    def candidates(self, group: np.ndarray, last_offset: int, last_rank: int) -> np.ndarray:
        """The buffers of `group` (all waiting) that may come next, lowest first: canonical (offsets never go down,
        and at one offset the rank rises), and none placed above the top of another that could still go under it
        (a gap no placement needs)."""
        low = self.lowest[group]
        tallest = int((low + self.instance.sizes[group]).min())
        rank = self.rank[group]
        allowed = (low < tallest) & ((low > last_offset) | ((low == last_offset) & (rank > last_rank)))
        chosen = group[allowed]
        return chosen[np.lexsort((self.rank[chosen], self.lowest[chosen]))]

    def place(self, buffer: int) -> None:
        instance = self.instance
        offset = int(self.lowest[buffer])
        top = offset + int(instance.sizes[buffer])
        self.offsets[buffer] = offset
        first, last = int(instance.first_section[buffer]), int(instance.last_section[buffer])
        undo_floor = self.floor[first:last].copy()
        self.floor[first:last] = top
        self.waiting_bytes[first:last] -= instance.sizes[buffer]
        others = instance.overlaps[buffer]
        raised = others[(self.offsets[others] < 0) & (self.lowest[others] < top)]
        undo_lowest = self.lowest[raised].copy()
        self.lowest[raised] = top
        # the least lowest offset changes only where this buffer or a raised one lives
        if raised.size:
            first = min(first, int(instance.first_section[raised].min()))
            last = max(last, int(instance.last_section[raised].max()))
        undo_waiting = self.lowest_waiting[first:last].copy()
        self._refresh_lowest_waiting(first, last)
        self.log.append((buffer, raised, undo_lowest, undo_floor, first, undo_waiting))

    def rewind(self, mark: int) -> None:
        """Undo every placement made since the log had `mark` entries, the last first."""
        while len(self.log) > mark:
            self._unplace(self.log.pop())

    def _unplace(self, record: tuple) -> None:
        buffer, raised, undo_lowest, undo_floor, first, undo_waiting = record
        instance = self.instance
        self.offsets[buffer] = -1
        own_first, own_last = int(instance.first_section[buffer]), int(instance.last_section[buffer])
        self.floor[own_first:own_last] = undo_floor
        self.waiting_bytes[own_first:own_last] += instance.sizes[buffer]
        self.lowest[raised] = undo_lowest
        self.lowest_waiting[first:first + len(undo_waiting)] = undo_waiting

    def _refresh_lowest_waiting(self, first: int, last: int) -> None:
        instance = self.instance
        begin, end = int(instance.section_first_pair[first]), int(instance.section_first_pair[last]) \
            if last < len(instance.section_first_pair) else len(instance.pair_buffer)
        if begin == end:
            return
        buffers = instance.pair_buffer[begin:end]
        values = np.where(self.offsets[buffers] < 0, self.lowest[buffers], _NEVER)
        starts = instance.section_first_pair[first:last] - begin
        occupied = starts < np.append(starts[1:], end - begin)
        least = np.zeros(last - first, dtype=np.int64)
        least[occupied] = np.minimum.reduceat(values, starts[occupied])
        least[least == _NEVER] = 0
        self.lowest_waiting[first:last] = least

    def holds(self, offset: int, first: int, last: int) -> bool:
        """Whether every section of a group's stretch [first, last) can still hold what is to be placed in it:
        above what is placed there, the group's current offset (its offsets never go down) and the least lowest
        offset of its waiting buffers. Nothing changes outside the stretch of the group a buffer was placed in."""
        base = np.maximum(np.maximum(self.floor[first:last], offset), self.lowest_waiting[first:last])
        return bool((base + self.waiting_bytes[first:last] <= self.capacity).all())

    def _groups(self, waiting: np.ndarray) -> list[np.ndarray]:
        """`waiting` split where no buffer of it spans from one stretch of the step into the next: what is placed
        in one group changes nothing in another, so each is searched on its own and a dead end in one never sends
        the search back through the choices of another (MiniMalloc's dynamic decomposition)."""
        if waiting.size <= 1:
            return [waiting]
        order = np.argsort(self.instance.first_section[waiting], kind="stable")
        waiting = waiting[order]
        reach = np.maximum.accumulate(self.instance.last_section[waiting])
        breaks = np.flatnonzero(self.instance.first_section[waiting][1:] >= reach[:-1]) + 1
        return np.split(waiting, breaks) if breaks.size else [waiting]

    def _solve(self, group: np.ndarray) -> bool:
        """Places every buffer of `group` (a stretch of the step no other waiting buffer enters), or undoes
        whatever it placed and says no placement of it exists on top of what is placed."""
        first = int(self.instance.first_section[group].min())
        last = int(self.instance.last_section[group].max())
        return self._descend(group, first, last, -1, -1)

    def _descend(self, group: np.ndarray, first: int, last: int, last_offset: int, last_rank: int) -> bool:
        if not group.size:
            return True
        sizes = self.instance.sizes
        for buffer in self.candidates(group, last_offset, last_rank).tolist():
            self.nodes += 1
            if self.nodes > self.node_limit or (self.deadline is not None and self.nodes % 64 == 0
                                                and time.monotonic() > self.deadline):
                raise _OutOfNodes
            mark = len(self.log)
            self.place(buffer)
            offset = int(self.offsets[buffer])
            if offset + sizes[buffer] <= self.capacity and self.holds(offset, first, last):
                rest = group[group != buffer]
                parts = self._groups(rest)
                if len(parts) == 1:
                    if self._descend(rest, first, last, offset, int(self.rank[buffer])):
                        return True
                elif all(self._solve(part) for part in parts):
                    return True
            self.rewind(mark)
        return False

    def run(self, node_limit: int, deadline: float | None) -> np.ndarray | None | bool:
        """Offsets, False where none exist (the search was exhaustive), None where the node limit or the deadline
        ended it first."""
        instance = self.instance
        count = len(instance.sizes)
        self._refresh_lowest_waiting(0, len(instance.section_total))
        self.nodes, self.node_limit, self.deadline = 0, node_limit, deadline
        # a frame per buffer placed and per group: deeper than Python's default limit on a thousand buffers
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * count + 1000))
        try:
            solved = all(self._solve(part) for part in self._groups(np.arange(count)))
        except _OutOfNodes:
            return None
        return self.offsets.copy() if solved else False


class _OutOfNodes(Exception):
    pass


_NEVER = np.iinfo(np.int64).max // 4


# A perturbed order scales each buffer's first key by a random factor in [1 - this, 1 + this] (seeded)
PERTURBATION = 0.5


def _luby(index: int) -> int:
    """The Luby sequence (1, 1, 2, 1, 1, 2, 4, 1, ...), 0-based: restart lengths within a constant factor of the
    best fixed length for any search, which is not known in advance."""
    size, power = 1, 0
    while size < index + 1:
        power += 1
        size = 2 * size + 1
    while size - 1 != index:
        size = (size - 1) // 2
        power -= 1
        index %= size
    return 2 ** power


class CanonicalPlacer:
    """The canonical search over one set of buffers (empty ones take offset 0), asked for placements within
    arenas of several sizes."""

    def __init__(self, sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        sizes = np.asarray(sizes, dtype=np.int64)
        self.count = len(sizes)
        self.keep = np.flatnonzero(sizes > 0)
        self.instance = _instance(sizes[self.keep], np.asarray(starts, dtype=np.int64)[self.keep],
                                  np.asarray(ends, dtype=np.int64)[self.keep])
        self.keys = [_keys(self.instance, name) for name in PRIORITY_ORDERS]

    @property
    def node_s(self) -> float:
        """About what a node takes, to turn a time into a node count: it grows with the (buffer, section) pairs
        (measured here: 22-32 us on 3,000-30,000 pairs, 90-180 us on 70,000-140,000, 200 us on 760,000)."""
        return min(20e-6 + 1.2e-9 * len(self.instance.pair_buffer), 300e-6)

    def within(self, capacity: int, node_limit: int, deadline: float | None = None,
               seed: int = 0) -> np.ndarray | None:
        """Offsets (one per buffer) that place every buffer within `capacity` bytes, or None where the searches
        find none within `node_limit` nodes in all (or by the deadline). Many short searches rather than one long
        one, their lengths the Luby sequence times twice the buffers' count: a depth-first search that went wrong near
        the root spends its nodes near the leaves. The fixed priority orders first, then orders perturbed at
        random."""
        offsets = np.zeros(self.count, dtype=np.int64)
        if not self.keep.size:
            return offsets
        if (self.instance.section_total > capacity).any():
            return None
        rng = np.random.default_rng(seed)
        spent = 0
        attempt = 0
        while spent < node_limit and (deadline is None or time.monotonic() <= deadline):
            columns = self.keys[attempt % len(self.keys)]
            if attempt >= len(self.keys):
                columns = [columns[0] * rng.uniform(1 - PERTURBATION, 1 + PERTURBATION, len(self.keep))] + \
                    columns[1:]
            limit = min(2 * _luby(attempt) * len(self.keep), node_limit - spent)
            search = _Search(self.instance, capacity, _rank(columns))
            found = search.run(limit, deadline)
            spent += search.nodes
            attempt += 1
            if found is False:
                return None  # a search that ran out of choices proves there is no placement within the capacity
            if found is not None:
                offsets[self.keep] = found
                return offsets
        return None
