"""Auto algorithm choice: what cuDNN-backed frameworks do when memory is tight.

Every compute takes the fastest implementation whose workspace fits in the
memory that is free at the moment it starts, given everything else the
schedule does. One pass in program order suffices: under the simulator's
rules every event caused by a later operation happens at or after the end of
the current compute (and events at equal times keep program order), so the
memory a compute sees at its start is fully decided by the operations before
it, and within its run memory only goes down (delayed frees).
"""

from __future__ import annotations

import heapq

from planner.profile import GraphProfile, Implementation, Node
from planner.schedule import Compute, Free, Offload, Prefetch, Schedule, Stage, Wait


def choose_implementation(node: Node, free_bytes: int | None) -> Implementation:
    """The fastest implementation whose workspace fits in `free_bytes` (after the output is allocated).

    None means no limit. If nothing fits, the smallest-workspace one, so that
    the simulator reports the violation rather than this choice hiding it.
    """
    if free_bytes is None:
        return node.fastest
    fitting = [impl for impl in node.implementations if impl.workspace_bytes <= free_bytes]
    if not fitting:
        return node.smallest_workspace
    return min(fitting, key=lambda impl: (impl.time_ms, impl.workspace_bytes))


class _Clock:
    """The simulator's stream clocks and memory, enough to know the free bytes at each compute start."""

    def __init__(self, profile: GraphProfile):
        self.profile = profile
        self.compute_ms = 0.0
        self.d2h_ms = 0.0
        self.h2d_ms = 0.0
        self.live_bytes = profile.fixed_bytes
        self.pending_releases: list[tuple[float, int, str]] = []  # (time, bytes, tensor) not yet reached by the compute clock
        self.offload_end_ms: dict[str, float] = {}
        self.prefetch_end_ms: dict[str, float] = {}

    def _size(self, tensor: str) -> int:
        node = self.profile.node_by_id.get(tensor)
        return node.size_bytes if node is not None else 0

    def advance(self) -> None:
        """Apply every release that has happened by the compute clock (issued earlier, so first at equal times)."""
        while self.pending_releases and self.pending_releases[0][0] <= self.compute_ms:
            _, size, _ = heapq.heappop(self.pending_releases)
            self.live_bytes -= size

    def make_room(self, needed_bytes: int, budget_bytes: int) -> list[str]:
        """Wait for in-flight offloads, oldest first, until `needed_bytes` fit: what an allocator does when full.

        Returns the tensors whose offloads were waited for.
        """
        waited = []
        while self.pending_releases and self.live_bytes + needed_bytes > budget_bytes:
            end, size, tensor = heapq.heappop(self.pending_releases)
            self.compute_ms = max(self.compute_ms, end)
            self.live_bytes -= size
            waited.append(tensor)
            self.advance()
        return waited

    def offload(self, tensor: str) -> None:
        hardware = self.profile.hardware
        if hardware.d2h_bandwidth_gb_per_s is None:
            return
        start = max(self.compute_ms, self.d2h_ms)
        self.d2h_ms = start + hardware.offload_time_ms(self._size(tensor))
        self.offload_end_ms[tensor] = self.d2h_ms

    def prefetch(self, tensor: str) -> None:
        hardware = self.profile.hardware
        if hardware.h2d_bandwidth_gb_per_s is None:
            return
        self.live_bytes += self._size(tensor)
        start = max(self.compute_ms, self.h2d_ms, self.offload_end_ms.get(tensor, 0.0))
        self.h2d_ms = start + hardware.prefetch_time_ms(self._size(tensor))
        self.prefetch_end_ms[tensor] = self.h2d_ms

    def wait(self, tensor: str, transfer: str) -> None:
        ends = self.prefetch_end_ms if transfer == "prefetch" else self.offload_end_ms
        end = ends.pop(tensor, None) if transfer == "prefetch" else ends.get(tensor)
        if end is not None and end > self.compute_ms:
            self.compute_ms = end

    def free(self, tensor: str) -> None:
        release = max(self.compute_ms, self.offload_end_ms.get(tensor, 0.0))
        if release <= self.compute_ms:
            self.live_bytes -= self._size(tensor)
        else:
            heapq.heappush(self.pending_releases, (release, self._size(tensor), tensor))


def _replay(profile: GraphProfile, schedule: Schedule, on_compute, sync_budget_bytes: int | None = None) -> list:
    """Walk the program with the simulator's clocks; `on_compute(node, operation, live_bytes)` picks each implementation.

    With `sync_budget_bytes`, a compute or prefetch that would not fit even with
    the smallest workspace first waits for in-flight offloads whose buffers are
    waiting to be released (waits are inserted into the program).
    """
    clock = _Clock(profile)
    stages = []
    for stage in schedule.stages:
        operations = []
        for operation in stage.operations:
            if isinstance(operation, Compute):
                node = profile.node_by_id.get(operation.node)
                if node is None:  # not ours to judge: the simulator names it
                    operations.append(operation)
                    continue
                clock.advance()
                if sync_budget_bytes is not None:
                    needed = node.size_bytes + node.smallest_workspace.workspace_bytes
                    for tensor in clock.make_room(needed, sync_budget_bytes):
                        operations.append(Wait(tensor=tensor, transfer="offload"))
                implementation = on_compute(node, operation, clock.live_bytes)
                if implementation.name != operation.implementation:
                    operation = Compute(node=node.id, implementation=implementation.name)
                operations.append(operation)
                clock.live_bytes += node.size_bytes
                clock.compute_ms += implementation.time_ms
            else:
                if isinstance(operation, Prefetch) and sync_budget_bytes is not None:
                    clock.advance()
                    for tensor in clock.make_room(clock._size(operation.tensor), sync_budget_bytes):
                        operations.append(Wait(tensor=tensor, transfer="offload"))
                operations.append(operation)
                if isinstance(operation, Offload):
                    clock.offload(operation.tensor)
                elif isinstance(operation, Prefetch):
                    clock.advance()
                    clock.prefetch(operation.tensor)
                elif isinstance(operation, Wait):
                    clock.wait(operation.tensor, operation.transfer)
                elif isinstance(operation, Free):
                    clock.free(operation.tensor)
        stages.append(Stage.model_construct(index=stage.index, node=stage.node, operations=operations))
    return stages


def compute_peaks(profile: GraphProfile, schedule: Schedule) -> list[int]:
    """Peak memory (fixed included) during each compute, in program order, with the schedule's implementations."""
    peaks: list[int] = []

    def record(node: Node, operation: Compute, live_bytes: int) -> Implementation:
        try:
            implementation = node.implementation(operation.implementation)
        except KeyError:
            implementation = node.fastest
        peaks.append(live_bytes + node.size_bytes + implementation.workspace_bytes)
        return implementation

    _replay(profile, schedule, record)
    return peaks


def apply_auto(
    profile: GraphProfile, schedule: Schedule, budget_bytes: int | None, *, sync_offloads: bool = False
) -> Schedule:
    """A copy of `schedule` (uncertified, no summary) where every compute uses Auto's implementation.

    With `budget_bytes` None every compute takes its fastest implementation.
    With `sync_offloads`, the compute stream also waits for in-flight offloads
    when even the smallest workspace would not fit otherwise (the allocator's
    synchronize-and-retry), for plans whose swap-outs do not block.
    """

    def choose(node: Node, operation: Compute, live_bytes: int) -> Implementation:
        free_bytes = None if budget_bytes is None else budget_bytes - live_bytes - node.size_bytes
        return choose_implementation(node, free_bytes)

    stages = _replay(profile, schedule, choose, budget_bytes if sync_offloads else None)
    # other implementations take other workspaces: whatever addresses the schedule had no longer hold
    return schedule.model_copy(
        update={"stages": stages, "budget_bytes": budget_bytes, "summary": None, "arena_bytes": None}
    )


def with_smallest_workspaces(profile: GraphProfile, schedule: Schedule) -> Schedule:
    """The memory-optimal variant of a schedule: every compute takes its smallest-workspace implementation."""
    stages = _replay(profile, schedule, lambda node, operation, live_bytes: node.smallest_workspace)
    return schedule.model_copy(update={"stages": stages, "summary": None, "arena_bytes": None})
