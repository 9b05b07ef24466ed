"""Programs without frees, and the frees that make them tight.

Heuristic baselines describe a plan as computes, offloads, prefetches and
waits; writing the frees by hand is where such plans go wrong. Here a device
copy of a tensor lives from its materialization (a compute or a prefetch)
until its last read (a compute reading it, or an offload copying it) before
the next materialization, and is freed right after that read. A copy nobody
reads is freed right after it is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.profile import GraphProfile
from planner.schedule import Compute, Free, Offload, Prefetch, Schedule, Stage, Wait

Operation = Compute | Offload | Prefetch | Wait


@dataclass
class Step:
    """One operation of a program and the stage (index into the profile's order) it belongs to."""

    stage: int
    operation: Operation


def reads(profile: GraphProfile, operation: Operation) -> list[str]:
    if isinstance(operation, Compute):
        return list(dict.fromkeys(profile.node_by_id[operation.node].inputs))
    if isinstance(operation, Offload):
        return [operation.tensor]
    return []


def materializes(operation: Operation) -> str | None:
    if isinstance(operation, Compute):
        return operation.node
    if isinstance(operation, Prefetch):
        return operation.tensor
    return None


def free_positions(profile: GraphProfile, steps: list[Step]) -> dict[int, list[str]]:
    """For each step index, the tensors to free right after it."""
    frees: dict[int, list[str]] = {}
    made_at: dict[str, int] = {}  # tensor -> step index of its live materialization
    last_read: dict[str, int] = {}

    def close(tensor: str) -> None:
        position = last_read.get(tensor, made_at[tensor])
        frees.setdefault(position, []).append(tensor)

    for index, step in enumerate(steps):
        for tensor in reads(profile, step.operation):
            if tensor in made_at:
                last_read[tensor] = index
        made = materializes(step.operation)
        if made is not None:
            if made in made_at:
                close(made)
            made_at[made] = index
            last_read.pop(made, None)
    for tensor in made_at:
        close(tensor)
    return frees


_FREES: dict[str, Free] = {}


def _free(tensor: str) -> Free:
    """Free operations are never changed once made, so one object per tensor serves every schedule."""
    operation = _FREES.get(tensor)
    if operation is None:
        operation = _FREES[tensor] = Free(tensor=tensor)
    return operation


def build_schedule(profile: GraphProfile, steps: list[Step], budget_bytes: int | None) -> Schedule:
    """The schedule of `steps` with frees inserted; one stage per node of the profile's order.

    Heuristics build thousands of these, so stages are assembled without
    re-validating operations that are already valid models.
    """
    frees = free_positions(profile, steps)
    operations: list[list] = [[] for _ in profile.order]
    order: list[str] = []
    for index, step in enumerate(steps):
        stage_operations = operations[step.stage]
        stage_operations.append(step.operation)
        if isinstance(step.operation, Compute):
            order.append(step.operation.node)
        for tensor in sorted(frees.get(index, ()), key=profile.position.__getitem__):
            stage_operations.append(_free(tensor))
    stages = [Stage.model_construct(index=i, node=n, operations=operations[i]) for i, n in enumerate(profile.order)]
    return Schedule(
        profile_name=profile.name,
        profile_digest=profile.digest(),
        budget_bytes=budget_bytes,
        stages=stages,
        compute_order=order,
    )
