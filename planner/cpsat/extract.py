"""From solver values to a Schedule the simulator accepts.

Stage by stage: at the stage start the offloads, the prefetches, then the
frees of copies that end there; then each computation in topological
order, preceded by a wait for any input whose prefetch has not been waited
for, and followed by the frees of the copies whose last position it is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from planner.builder import ScheduleBuilder
from planner.cpsat.data import ModelData
from planner.cpsat.variables import Variables
from planner.schedule import Schedule


@dataclass(frozen=True)
class SolvedCopy:
    tensor: int
    kind: str
    rank: int
    stage: int
    start: int
    end: int
    implementation: int | None
    early: bool = False  # a prefetch read before it lands (its whole transfer charged)


@dataclass
class Solution:
    copies: list[SolvedCopy] = field(default_factory=list)
    offload_stage: dict[int, int] = field(default_factory=dict)


def read_solution(data: ModelData, v: Variables, value: Callable, free_only: bool = False) -> Solution:
    """The solution's copies and offloads; a fixed tensor's come from the fixed part (or not at all: `free_only`)."""
    solution = Solution()
    for j, tensor_copies in enumerate(v.copies):
        if v.is_fixed(j):
            if not free_only:
                solution.copies.extend(v.fixed.copies[j])
                if j in v.fixed.offloads:
                    solution.offload_stage[j] = v.fixed.offloads[j]
            continue
        for copy in tensor_copies:
            if not value(copy.present):
                continue
            implementation = None
            if copy.computes:
                implementation = next(i for i, literal in enumerate(copy.implementations) if value(literal))
            stage = copy.stage if isinstance(copy.stage, int) else value(copy.stage)
            # the start as `copy.start` defines it (computed here, so `value` need only read variables)
            start = data.stage_slot(stage) if copy.kind == "prefetch" else data.pos(stage, copy.tensor)
            early = bool(value(copy.early)) if copy.early is not None else False
            solution.copies.append(
                SolvedCopy(copy.tensor, copy.kind, copy.rank, stage, start, value(copy.end), implementation, early)
            )
    for j, offload in v.offloads.items():
        if offload.fixed:
            continue
        if value(offload.present):
            solution.offload_stage[j] = value(offload.stage)
    return solution


def build_schedule(data: ModelData, solution: Solution) -> Schedule:
    computes: dict[int, SolvedCopy] = {}
    ends: dict[int, list[int]] = defaultdict(list)
    prefetches: dict[int, list[int]] = defaultdict(list)
    for copy in solution.copies:
        ends[copy.end].append(copy.tensor)
        if copy.kind == "prefetch":
            prefetches[copy.stage].append(copy.tensor)
        else:
            computes[copy.start] = copy
    offloads: dict[int, list[int]] = defaultdict(list)
    for j, stage in solution.offload_stage.items():
        offloads[stage].append(j)

    busy: dict[int, list[int]] = defaultdict(list)  # stage -> positions inside it where something happens
    for position in set(computes) | set(ends):
        if position % data.stride:
            busy[data.stage_of(position)].append(position)
    for positions in busy.values():
        positions.sort()

    builder = ScheduleBuilder(data.profile)
    ids = data.ids
    waiting: set[int] = set()  # prefetched tensors not yet waited for

    def free(position: int) -> None:
        for j in sorted(ends.get(position, ())):
            if j in waiting:
                builder.wait(ids[j], "prefetch")
                waiting.discard(j)
            builder.free(ids[j])

    for t in range(data.n):
        builder.stage(ids[t])
        slot = data.stage_slot(t)
        for j in sorted(offloads.get(t, ())):
            builder.offload(ids[j])
        for j in sorted(prefetches.get(t, ())):
            builder.prefetch(ids[j])
            waiting.add(j)
        free(slot)  # after the prefetches: a buffer may start and end here; releases precede allocations anyway
        # computations exist only for k <= t, but a copy may end at any position: visit the busy ones in order
        for position in busy.get(t, ()):
            copy = computes.get(position)
            if copy is not None:
                k = copy.tensor
                for j in data.inputs[k]:
                    if j in waiting:
                        builder.wait(ids[j], "prefetch")
                        waiting.discard(j)
                builder.compute(ids[k], data.impls[k][copy.implementation].name)
            free(position)
    return builder.build(data.budget_bytes)
