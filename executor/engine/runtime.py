"""What the generated step calls: transfers, RNG states, parameter gradients, write-backs, the ledger.

One `StepRuntime` serves one PlannedModule (the profiler has its own, with
timing and memory hooks); `begin_step` resets what belongs to a single step.
"""

from __future__ import annotations

from typing import Callable

import torch

from executor.capture.planning_graph import span_elements
from executor.engine.accountant import Accountant
from executor.errors import ReplayError
from executor.engine.transfers import Transfers


def distinct_storage_bytes(tensors, arena_ptr: int = 0) -> int:
    """Bytes of the tensors' distinct storages; a tensor in the arena (its storage's address `arena_ptr`) counts
    its own bytes, the slot it was planned."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if arena_ptr and storage.data_ptr() == arena_ptr:
            seen[tensor.data_ptr()] = span_elements(tensor.shape, tensor.stride()) * tensor.element_size()
            continue
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def obeys_layout(gradient: torch.Tensor, parameter: torch.Tensor) -> bool:
    """What AccumulateGrad checks before it keeps a gradient as it is: the parameter's strides, and here also a
    storage exactly its size (so that a view never pins a larger buffer as .grad)."""
    return (gradient.stride() == parameter.stride() and gradient.storage_offset() == 0
            and gradient.untyped_storage().nbytes() == parameter.numel() * parameter.element_size()
            and gradient.dtype == parameter.dtype)


def accumulate(parameter: torch.Tensor, gradient: torch.Tensor) -> int:
    """`.grad` as plain PyTorch's AccumulateGrad leaves it (no grad mode): kept as it is, copied into the
    parameter's layout, or added in place. Returns the bytes of a transient (a gradient added to an existing one)."""
    current = parameter.grad
    if current is None:
        # obeys_layout, written out and cheapest test first (this runs for every parameter at every step); a view
        # becomes a tensor of its own on the same storage (detach: no base), as eager's `.grad` is: a view keeps its
        # base, which model.double() after a step left float32 under a float64 `.grad`, and the next capture failed
        if (gradient.dtype == parameter.dtype and gradient.storage_offset() == 0
                and gradient.stride() == parameter.stride()
                and gradient.untyped_storage().nbytes() == parameter.numel() * parameter.element_size()):
            parameter.grad = gradient.detach() if gradient._is_view() else gradient
        else:
            parameter.grad = torch.empty_strided(parameter.shape, parameter.stride(), dtype=parameter.dtype,
                                                 device=parameter.device).copy_(gradient)
        return 0
    current += gradient
    return gradient.untyped_storage().nbytes()


class StepRuntime:
    """The runtime of generated steps: one per PlannedModule."""

    def __init__(self, device: torch.device, staging: list[torch.Tensor], node_ids: list[str]):
        self.device = device
        self.cuda = device.type == "cuda"
        self.transfers = Transfers(device)
        self.staging = staging  # one buffer per written-back value, allocated once (fixed memory)
        self.node_ids = node_ids
        self.rng: dict[int, tuple] = {}
        self.parameters: list[torch.Tensor] = []  # this step's parameters, by gradient index
        self.ledger: Accountant | None = None
        self.implementation_of: Callable[[int, str], tuple[float, int]] | None = None
        self.expected_bytes: list[int] | None = None  # strict mode: the profile's size of each node
        self.planned_bytes: list[int] | None = None  # the profile's size of each node (a region's inner nodes)
        self.accumulated_bytes = 0
        self.watch: list = []
        self.loss_storage = 0  # data_ptr of the loss's storage once the forward part returned it
        # with planned addresses: the arena's views the program writes (executor.engine.arena), None until bound
        self.slots: list[torch.Tensor] | None = None
        self.arena_ptr = 0
        self.slot_dtypes: list = []
        self.bound_layouts: list | None = None  # the layouts `slots` were made from
        # nodes whose results the step kept outside the arena because the run's dtype was not the trace's (a copy
        # into the slot would have cast them): the arena's bound beside it does not count them
        self.kept_outside: set[int] = set()

    def bind_arena(self, arena, layouts: list, size_bytes: int) -> None:
        """`layouts` (a program's slots) as views of `arena`, grown to `size_bytes` where smaller: made again only
        where the layouts or the arena's buffer changed (the arena drops `slots` when its buffer goes)."""
        if self.slots is None or self.bound_layouts is not layouts or self.arena_ptr != arena.buffer.data_ptr():
            self.slots = arena.views(self, layouts, size_bytes)
            self.slot_dtypes = [layout.dtype for layout in layouts]
            self.bound_layouts = layouts
            self.transfers.arena = arena.buffer
            self.arena_ptr = arena.buffer.data_ptr()

    # -- per step ------------------------------------------------------------------------------------

    def begin_step(self, parameters: list[torch.Tensor], ledger: Accountant | None) -> None:
        self.parameters = parameters
        self.ledger = ledger
        self.rng.clear()
        self.accumulated_bytes = 0

    def end_step(self) -> None:
        self.transfers.settle()
        self.rng.clear()
        self.parameters = []

    # -- RNG -----------------------------------------------------------------------------------------

    def get_rng(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.cuda else None
        return torch.get_rng_state(), cuda

    def set_rng(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    # -- graph outputs -------------------------------------------------------------------------------

    def gradient(self, index: int, value: torch.Tensor) -> None:
        transient = accumulate(self.parameters[index], value)
        if transient and self.ledger is not None:
            # a gradient added to one that was already there lives next to it until the addition ends
            self.ledger.transient(f"gradient accumulation {index}", transient)
        self.accumulated_bytes += transient

    def stage(self, index: int, value: torch.Tensor) -> None:
        self.staging[index].copy_(value)

    # -- transfers -----------------------------------------------------------------------------------

    def offload(self, group: int, tensors: tuple) -> None:
        self.transfers.offload(group, tensors)
        if self.ledger is not None:
            self.ledger.offload(self.node_ids[group])

    def prefetch(self, group: int, offsets_bytes: tuple | None = None) -> tuple:
        try:
            tensors = self.transfers.prefetch(group, offsets_bytes)
        except KeyError:
            raise ReplayError(f"{self.node_ids[group]!r} is prefetched but was never offloaded in this step") from None
        if self.ledger is not None:
            self.ledger.prefetch(self.node_ids[group], distinct_storage_bytes(tensors, self.arena_ptr))
        return tensors

    def wait(self, group: int, transfer: str) -> None:
        self.transfers.wait(group, transfer)
        if self.ledger is not None:
            self.ledger.wait(self.node_ids[group], transfer)

    def kept_out(self, group: int, value: torch.Tensor) -> torch.Tensor:
        """`value`, kept where it was computed: its dtype is not its slot's (the trace's), which a copy would cast."""
        self.kept_outside.add(group)
        return value

    def reclaim(self, groups: tuple, stream: str) -> None:
        self.transfers.reclaim(groups, stream)

    def release(self, group: int, tensors: tuple) -> None:
        self.transfers.release(group, tensors)
        if self.ledger is not None:
            self.ledger.free(self.node_ids[group])
        if self.expected_bytes is not None:
            from torch.multiprocessing.reductions import StorageWeakRef

            # the loss handed to the caller stays alive, as it should
            # the arena stays: its slots are the plan's to reuse
            self.watch = [StorageWeakRef(t.untyped_storage()) for t in tensors
                          if t.untyped_storage().data_ptr() not in (self.loss_storage, self.arena_ptr or -1)]

    def released(self, group: int) -> None:
        """Strict mode, after a free: nothing else may hold the freed storages (else the plan's memory is fiction)."""
        if any(not ref.expired() for ref in self.watch):
            raise ReplayError(f"{self.node_ids[group]!r} was freed but its memory is still referenced elsewhere")
        self.watch = []

    # -- ledger and strict checks --------------------------------------------------------------------

    def computed(self, group: int, implementation: str, tensors: tuple | None) -> None:
        """`tensors` None: a node computed and freed inside one compiled region, whose outputs were never made
        apart; the ledger counts what the schedule let it hold, the profile's size."""
        size = distinct_storage_bytes(tensors, self.arena_ptr) if tensors is not None else self.planned_bytes[group]
        if self.expected_bytes is not None and size != self.expected_bytes[group]:
            raise ReplayError(
                f"{self.node_ids[group]!r} holds {size} bytes but the profile says {self.expected_bytes[group]}: the "
                "profile does not describe this model and these inputs"
            )
        if self.ledger is not None:
            time_ms, workspace = self.implementation_of(group, implementation)
            self.ledger.compute(self.node_ids[group], time_ms, size, workspace)


class TimedStepRuntime(StepRuntime):
    """The runtime of a planned step timed node by node (the first steps, to compare with the plan): the clock
    around each computation, as the profiler's passes time them, and the clock around the step's two parts."""

    def __init__(self, device: torch.device, staging: list[torch.Tensor], node_ids: list[str], clock):
        super().__init__(device, staging, node_ids)
        self.clock = clock
        self.elapsed_ns: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.started = None
        self.reset_timing()

    def begin_step(self, parameters, ledger) -> None:
        super().begin_step(parameters, ledger)
        self.reset_timing()

    def reset_timing(self) -> None:
        self.elapsed_ns, self.counts, self.step_ns = {}, {}, 0.0
        self._spans: list = []

    def tick(self, group: int) -> None:
        if self.cuda:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = self.clock()

    def tock(self, group: int) -> None:
        self.counts[group] = self.counts.get(group, 0) + 1
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((group, self.started, end))
        else:
            self.elapsed_ns[group] = self.elapsed_ns.get(group, 0) + self.clock() - self.started

    def part(self, started_ns: float) -> None:
        """Add one part of the step (forward or backward) from `started_ns` (the clock's value when it began)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.step_ns += self.clock() - started_ns

    def node_times_ms(self) -> dict[int, float]:
        """Per planning node: its mean time per computation in this step."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for group, start, end in self._spans:
                self.elapsed_ns[group] = self.elapsed_ns.get(group, 0) + start.elapsed_time(end) * 1e6
            self._spans = []
        return {g: ns / 1e6 / self.counts.get(g, 1) for g, ns in self.elapsed_ns.items()}
