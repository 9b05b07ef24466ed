"""Plans from per-tensor attributes: keep, swap (offload, prefetch back) or recompute.

The heuristic baselines (vDNN, Chen's checkpointing, the Chainer swap/recompute
work) all decide, per forward tensor that backward reads, one of three
attributes, and differ in when copies start. This module turns attributes into
a program in the profile's order:

- every node is computed once in order; before it, each input that is not on
  the device is brought back: prefetched (with a wait) if it was swapped, or
  recomputed, recursively, from what is on the device if it was dropped;
- a swapped tensor is offloaded after its last forward reader (or, vDNN's way,
  issued with that reader and waited for at its end);
- a tensor that is neither kept nor swapped is dropped after its last forward
  reader; frees are placed by `planner.liveness`.

Prefetch placement (how early a copy starts) is then the policy's business:
`move_prefetches_early` implements the Chainer paper's "as early as memory
allows", vDNN hooks `window_prefetches`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from planner.auto_algorithms import compute_peaks
from planner.builder import PlannerBug
from planner.errors import MososError
from planner.liveness import Step, build_schedule
from planner.profile import GraphProfile
from planner.schedule import Compute, Offload, Prefetch, Wait

Attribute = Literal["keep", "swap", "recompute"]
OffloadStyle = Literal["after_last_reader", "with_last_reader"]


class NoTransferBandwidth(MososError):
    """A strategy that moves tensors to host memory was asked to plan for a profile that cannot."""


def require_transfers(profile: GraphProfile, strategy: str) -> None:
    if not profile.hardware.can_transfer:
        raise NoTransferBandwidth(
            f"strategy {strategy!r} offloads tensors to host memory, but profile {profile.name!r} has no "
            "transfer bandwidth (hardware.d2h_bandwidth_gb_per_s / h2d_bandwidth_gb_per_s are not set); "
            "use a recompute-only strategy such as chen-sqrt or auto"
        )


def is_convolution(profile: GraphProfile, node_id: str) -> bool:
    return "conv" in profile.node_by_id[node_id].op_type.lower()


class GraphFacts:
    """What every attribute-based policy needs to know about a profile, computed once."""

    def __init__(self, profile: GraphProfile):
        self.profile = profile

    @cached_property
    def forward(self) -> list[str]:
        """Forward nodes (the loss excluded), in execution order."""
        return [n for n in self.profile.order if self.profile.node_by_id[n].kind == "forward"]

    @cached_property
    def backward_readers(self) -> dict[str, list[str]]:
        by_id = self.profile.node_by_id
        return {
            t: [r for r in readers if by_id[r].kind == "backward"] for t, readers in self.profile.consumers.items()
        }

    @cached_property
    def last_forward_reader(self) -> dict[str, str]:
        """For each tensor, the last non-backward node reading it (itself if none)."""
        by_id = self.profile.node_by_id
        last = {}
        for t, readers in self.profile.consumers.items():
            forward_readers = [r for r in readers if by_id[r].kind != "backward"]
            last[t] = forward_readers[-1] if forward_readers else t
        return last

    @cached_property
    def candidates(self) -> list[str]:
        """Forward tensors that backward reads: the ones a policy can keep, swap or recompute."""
        return [t for t in self.forward if self.backward_readers[t]]

    @cached_property
    def backward_of(self) -> dict[str, list[str]]:
        """For each forward node that backward nodes name as `forward_node`, those nodes in execution order.

        Usually one; a convolution's backward may be two (filter gradient, then data gradient)."""
        found: dict[str, list[str]] = {}
        for node_id in self.profile.order:
            forward_node = self.profile.node_by_id[node_id].forward_node
            if forward_node is not None:
                found.setdefault(forward_node, []).append(node_id)
        return found

    @cached_property
    def first_backward_position(self) -> int:
        positions = [self.profile.position[n] for n in self.profile.order if self.profile.node_by_id[n].kind == "backward"]
        return min(positions) if positions else len(self.profile.order)


class AttributeProgram:
    """Builds the steps of one plan. Subclass hooks change when copies start."""

    offload_style: OffloadStyle = "after_last_reader"

    def __init__(
        self,
        profile: GraphProfile,
        attributes: dict[str, Attribute],
        implementations: dict[str, str] | None = None,
        facts: GraphFacts | None = None,
    ):
        self.profile = profile
        self.facts = facts or GraphFacts(profile)
        self.attributes = attributes
        self.implementations = implementations or {}
        self.steps: list[Step] = []
        self.resident: set[str] = set()
        self.on_host: set[str] = set()
        self.prefetched: set[str] = set()
        self.awaiting: set[str] = set()  # prefetched, not yet waited for
        self.offloaded_at: dict[str, list[str]] = {}  # layer -> tensors offloaded with it

    def attribute(self, tensor: str) -> Attribute:
        """Unlisted tensors: kept if backward reads them, else dropped after their last forward reader."""
        if tensor in self.attributes:
            return self.attributes[tensor]
        if self.profile.node_by_id[tensor].kind == "forward" and not self.facts.backward_readers[tensor]:
            return "recompute"
        return "keep"

    def _emit(self, stage: int, operation) -> None:
        self.steps.append(Step(stage, operation))

    def _compute(self, stage: int, node_id: str) -> None:
        implementation = self.implementations.get(node_id) or self.profile.node_by_id[node_id].fastest.name
        self._emit(stage, Compute(node=node_id, implementation=implementation))
        self.resident.add(node_id)

    def prefetch(self, stage: int, tensor: str) -> None:
        self._emit(stage, Prefetch(tensor=tensor))
        self.prefetched.add(tensor)
        self.resident.add(tensor)
        self.awaiting.add(tensor)

    def wait(self, stage: int, tensor: str) -> None:
        if tensor in self.awaiting:
            self._emit(stage, Wait(tensor=tensor, transfer="prefetch"))
            self.awaiting.discard(tensor)

    def ensure(self, stage: int, tensor: str) -> None:
        """Make `tensor` readable on the device: prefetch it back, or recompute it from what is there."""
        pending = [(tensor, False)]
        while pending:
            current, expanded = pending.pop()
            if current in self.resident:
                self.wait(stage, current)
                continue
            if current in self.on_host:
                self.prefetch(stage, current)
                self.wait(stage, current)
                continue
            if expanded:
                self._compute(stage, current)
                continue
            pending.append((current, True))
            inputs = list(dict.fromkeys(self.profile.node_by_id[current].inputs))
            for source in sorted(inputs, key=self.profile.position.__getitem__, reverse=True):
                pending.append((source, False))

    def window_prefetches(self, node_id: str) -> list[str]:
        """Tensors to prefetch while `node_id` computes, waited for at the end of `window_end(node_id)` (vDNN).

        None by default."""
        return []

    def window_end(self, node_id: str) -> str:
        """The node after whose compute the prefetches issued with `node_id` are waited for: itself by default."""
        return node_id

    def build_steps(self) -> list[Step]:
        profile, facts = self.profile, self.facts
        drop_after: dict[str, list[str]] = {}
        for t in profile.order:
            if profile.node_by_id[t].kind == "backward":
                continue
            attribute = self.attribute(t)
            if attribute != "keep":
                drop_after.setdefault(facts.last_forward_reader[t], []).append(t)
        window_waits: dict[str, list[str]] = {}  # node -> prefetches to wait for at its end
        for stage, node_id in enumerate(profile.order):
            node = profile.node_by_id[node_id]
            for source in dict.fromkeys(node.inputs):
                self.ensure(stage, source)
            window = [t for t in self.window_prefetches(node_id) if t not in self.resident and t in self.on_host]
            for t in window:
                self.prefetch(stage, t)
            if window:
                window_waits.setdefault(self.window_end(node_id), []).extend(window)
            leaving = drop_after.get(node_id, [])
            with_reader = [t for t in leaving if self.attribute(t) == "swap" and self.offload_style == "with_last_reader" and t != node_id]
            for t in with_reader:
                self._emit(stage, Offload(tensor=t))
            if node_id in self.resident:
                raise PlannerBug(f"{node_id!r} would be computed while its output is on the device")
            self._compute(stage, node_id)
            for t in with_reader:
                self._emit(stage, Wait(tensor=t, transfer="offload"))
            for t in leaving:
                if self.attribute(t) == "swap" and t not in with_reader:
                    self._emit(stage, Offload(tensor=t))
                if self.attribute(t) == "swap":
                    self.on_host.add(t)
                    self.offloaded_at.setdefault(node_id, []).append(t)
                self.resident.discard(t)
            for t in window_waits.pop(node_id, []):
                self.wait(stage, t)
        return self.steps


def move_prefetches_early(
    profile: GraphProfile, steps: list[Step], budget_bytes: int | None, earliest_stage: int
) -> list[Step]:
    """The Chainer paper's swap-in scheduling: start each swap-in as early as free memory allows.

    Prefetches keep their order (the copy stream is first come, first served);
    each moves before the earliest compute, at or after `earliest_stage`, from
    which every compute up to its old place still fits with the tensor added.
    Free memory is read off the plan as it stands (as the paper reads it off a
    profiling run); the caller verifies the result in the simulator.
    """
    steps = list(steps)
    peaks = compute_peaks(profile, build_schedule(profile, steps, None))
    compute_index = [index for index, step in enumerate(steps) if isinstance(step.operation, Compute)]
    next_compute = []  # for each step index: the number of the first compute at or after it
    count = 0
    for step in steps:
        next_compute.append(count)
        if isinstance(step.operation, Compute):
            count += 1
    next_compute.append(count)
    offload_floor: dict[str, int] = {}
    for index, step in enumerate(steps):
        if isinstance(step.operation, Offload):
            offload_floor[step.operation.tensor] = next_compute[index + 1]
    moves: list[tuple[int, int]] = []  # (prefetch step index, compute number to move before)
    floor = 0
    for index, step in enumerate(steps):
        if not isinstance(step.operation, Prefetch):
            continue
        tensor = step.operation.tensor
        size = profile.node_by_id[tensor].size_bytes
        lowest = max(floor, offload_floor.get(tensor, 0))
        target = next_compute[index]
        while target - 1 >= lowest and steps[compute_index[target - 1]].stage >= earliest_stage:
            if budget_bytes is not None and peaks[target - 1] + size > budget_bytes:
                break
            target -= 1
        for c in range(target, next_compute[index]):
            peaks[c] += size
        floor = target
        if target < next_compute[index]:
            moves.append((index, target))
    moved = {index for index, _ in moves}
    before: dict[int, list[Step]] = {}
    for index, target in moves:
        at = compute_index[target]
        before.setdefault(at, []).append(Step(steps[at].stage, steps[index].operation))
    result: list[Step] = []
    for index, step in enumerate(steps):
        result.extend(before.get(index, []))
        if index not in moved:
            result.append(step)
    return result

