"""Schedules the executor's tests and examples need that no planner strategy makes.

`offload_everything_schedule`: every forward tensor that backward reads later
goes to host memory as soon as it is computed, leaves the device after its
last forward reader, and comes back one node before its first backward reader.
It exercises every transfer path of the executor.
"""

from __future__ import annotations

from planner.builder import ScheduleBuilder, certify
from planner.profile import GraphProfile
from planner.schedule import Schedule


def offload_everything_schedule(profile: GraphProfile, budget_bytes: int | None = None) -> Schedule:
    if not profile.hardware.can_transfer:
        raise ValueError(f"profile {profile.name!r} has no transfer bandwidth: nothing can be offloaded")
    order = profile.order
    position = profile.position
    kind = {node_id: profile.node_by_id[node_id].kind for node_id in order}
    last_forward_use: dict[str, int] = {}
    first_backward_use: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for node_id in order:
        readers = [position[r] for r in profile.consumers[node_id]]
        forward_readers = [p for r, p in zip(profile.consumers[node_id], readers) if kind[r] != "backward"]
        backward_readers = [p for r, p in zip(profile.consumers[node_id], readers) if kind[r] == "backward"]
        last_forward_use[node_id] = max(forward_readers, default=position[node_id])
        last_use[node_id] = max(readers, default=position[node_id])
        if backward_readers:
            first_backward_use[node_id] = min(backward_readers)
    offloaded = {
        t for t, first in first_backward_use.items()
        if kind[t] != "backward" and first - 1 > last_forward_use[t]
    }
    prefetch_at: dict[int, list[str]] = {}
    wait_at: dict[int, list[str]] = {}
    free_at: dict[int, list[str]] = {}
    for t in sorted(offloaded, key=position.__getitem__):
        prefetch_at.setdefault(first_backward_use[t] - 1, []).append(t)
        wait_at.setdefault(first_backward_use[t], []).append(t)
        free_at.setdefault(last_forward_use[t], []).append(t)
    for t in order:
        free_at.setdefault(last_use[t], []).append(t)
    builder = ScheduleBuilder(profile)
    for i, node_id in enumerate(order):
        builder.stage(node_id)
        for t in prefetch_at.get(i, []):
            builder.prefetch(t)
        for t in wait_at.get(i, []):
            builder.wait(t, "prefetch")
        builder.compute(node_id)
        if node_id in offloaded:
            builder.offload(node_id)
        for t in sorted(free_at.get(i, []), key=position.__getitem__):
            builder.free(t)
    return certify(profile, builder.build(budget_bytes), "offload-everything")


def recompute_everything_schedule(profile: GraphProfile, budget_bytes: int | None = None) -> Schedule:
    """Every forward tensor leaves the device after its last forward reader; backward recomputes
    what it needs from the nearest resident ancestors. Recomputes every node that backward reads
    (dropout masks and BatchNorm statistics included), which is what tests of recomputation need."""
    order = profile.order
    position = profile.position
    nodes = profile.node_by_id
    backward_phase = {node_id for node_id in order if nodes[node_id].kind == "backward"}
    remaining = {node_id: sorted(position[r] for r in profile.consumers[node_id]) for node_id in order}
    resident: set[str] = set()
    builder = ScheduleBuilder(profile)

    def ensure(t: str, at: int) -> None:
        if t in resident:
            return
        for source in dict.fromkeys(nodes[t].inputs):
            ensure(source, at)
        builder.compute(t)
        resident.add(t)

    for i, node_id in enumerate(order):
        builder.stage(node_id)
        if node_id in backward_phase:
            for source in dict.fromkeys(nodes[node_id].inputs):
                ensure(source, i)
        builder.compute(node_id)
        resident.add(node_id)
        in_forward = node_id not in backward_phase
        for t in sorted(resident, key=position.__getitem__):
            later = [p for p in remaining[t] if p > i]
            forward_later = [p for p in later if order[p] not in backward_phase]
            if not later or (in_forward and nodes[t].kind == "forward" and not forward_later):
                builder.free(t)
                resident.discard(t)
    return certify(profile, builder.build(budget_bytes), "recompute-everything")
