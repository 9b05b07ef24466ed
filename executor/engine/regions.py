"""Which consecutive planning-node computations of a schedule may run as one compiled region.

Inside a region, Inductor fuses across node boundaries (a bias, an activation and a residual add that were three
nodes), and a value the schedule frees inside the region is never made at all. What the schedule does between
those computations must not need a real tensor at a boundary: so a region spans only computations and frees
(an offload, a prefetch or a wait ends it), and the code generator says which computations can join one (not
random, not the loss, no convolution algorithm of our own; a batch norm's new running statistics are written after
the region's call). A region also stays inside one layer of a repeated module (`transformer.h.3`): the layers'
regions are then alike and share one kernel, so the compile time grows with the kinds of layer, not with their
number.

The budget keeps its promise: a region holds every tensor it reads until it returns (the caller's references),
so a freed input goes only after it. A region is allowed only where the worst case, everything live when it
starts plus every output of its computations plus the largest workspace among them, stays within the step's
own peak as the schedule counts it (which is within the budget). A run that would exceed it is cut there.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

MAX_REGION_NODES = 48  # a longer region compiles longer for little more fusion


class _Operation(Protocol):
    kind: str
    group: int
    implementation: str


def live_bytes_before(operations: Sequence[_Operation], size_bytes: Sequence[int],
                      workspace_bytes: Callable[[int, str], int]) -> tuple[list[int], int]:
    """Bytes of planning-node outputs held before each operation, and the step's peak counted the same way
    (outputs held plus the running computation's workspace)."""
    live, on_device, before = 0, set(), []
    peak = 0
    for op in operations:
        before.append(live)
        if op.kind in ("compute", "prefetch") and op.group not in on_device:
            on_device.add(op.group)
            live += size_bytes[op.group]
        if op.kind == "compute":
            peak = max(peak, live + workspace_bytes(op.group, op.implementation))
        elif op.kind == "free" and op.group in on_device:
            on_device.discard(op.group)
            live -= size_bytes[op.group]
        peak = max(peak, live)
    return before, peak


def regions(operations: Sequence[_Operation], can_join: Callable[[int], bool], size_bytes: Sequence[int],
            workspace_bytes: Callable[[int, str], int], bounds: Sequence[tuple[int, int]] = (),
            layer_of: Callable[[int], str | None] = lambda group: None,
            max_nodes: int = MAX_REGION_NODES) -> list[tuple[int, int]]:
    """Regions as half-open ranges of operation indices, each starting and ending with a computation, of two
    computations or more. `can_join(k)`: may the computation at index k be in a region; `bounds`: ranges no region
    crosses (the step's two parts); `layer_of(group)`: the repeated layer a node belongs to, if any."""
    before, peak = live_bytes_before(operations, size_bytes, workspace_bytes)
    limits = list(bounds) or [(0, len(operations))]
    found: list[tuple[int, int]] = []
    for low, high in limits:
        k = low
        while k < high:
            if operations[k].kind != "compute" or not can_join(k):
                k += 1
                continue
            start, end, computes, groups = k, k + 1, 1, {operations[k].group}
            freed_before: set[int] = set()  # freed inside before any computation of theirs there (an earlier one's)
            layer = layer_of(operations[k].group)
            outputs = size_bytes[operations[k].group]
            workspace = workspace_bytes(operations[k].group, operations[k].implementation)
            j = k + 1
            while j < high and computes < max_nodes:
                op = operations[j]
                if op.kind == "free":
                    if op.group not in groups:
                        freed_before.add(op.group)
                    j += 1
                    continue
                # a node computed again after its earlier outputs were freed inside: the region's call would make
                # the new outputs before the code after it frees the old ones under the same names
                if op.kind != "compute" or not can_join(j) or op.group in groups or op.group in freed_before \
                        or layer_of(op.group) != layer:
                    break
                grown_outputs = outputs + size_bytes[op.group]
                grown_workspace = max(workspace, workspace_bytes(op.group, op.implementation))
                if before[start] + grown_outputs + grown_workspace > peak:
                    break
                outputs, workspace = grown_outputs, grown_workspace
                groups.add(op.group)
                computes += 1
                j += 1
                end = j
            if computes >= 2:
                found.append((start, end))
            k = max(end, k + 1)
    return found
