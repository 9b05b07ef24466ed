"""PlannedModule: a training step that follows a schedule, operation by operation.

The whole step runs under one custom autograd Function: its forward walks
the schedule up to the first backward computation (forward nodes and the
loss), its backward walks the rest. Each node computes on detached inputs
with a local autograd graph (executor.local), so the schedule alone decides
what stays resident, what is offloaded and prefetched, and what is
recomputed. Parameters' `.grad` are accumulated as plain PyTorch does, so any
optimizer works unchanged.

- Recomputation restores the RNG state of the node's first computation
  (dropout draws the same mask) and restores the node's buffers afterwards
  (BatchNorm running statistics are updated once per step, as in plain PyTorch).
- Convolutions run the algorithm the schedule names, forward and backward.
- Offload and prefetch go through executor.transfers (CUDA streams, pinned
  host buffers, events; plain copies on the CPU).
- executor.accountant keeps a byte-exact ledger of what is held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from executor import conv_algorithms
from executor.accountant import Accountant
from executor.capture import CapturedGraph, capture, tensor_signature
from executor.errors import ProfileMismatch, ReplayError
from executor.local import Entry, ForwardRun, distinct_bytes, own_storage, run_backward, storage_ptr
from executor.profiler import (
    LOSS_ID,
    StepContext,
    forward_node,
    gradient_outputs,
    gradient_sources,
    loss_node,
    step_context,
)
from executor.transfers import HostCopy, Transfers
from planner.profile import GraphProfile
from planner.schedule import Compute, Free, Offload, Prefetch, Schedule, Wait
from planner.simulator import simulate


def check_model(graph: CapturedGraph, profile: GraphProfile) -> None:
    """Refuse a profile measured on another model, saying what differs."""
    expected = profile.provenance.model_structure_sha256
    if expected is None:
        raise ProfileMismatch(
            f"profile {profile.name!r} carries no model structure hash (provenance.model_structure_sha256): "
            "only profiles measured by executor.profile_model / `mosos profile` can be replayed on a model"
        )
    actual = graph.structure_sha256()
    if actual == expected:
        return
    profiled = [(n.id, n.op_type) for n in profile.nodes if n.kind == "forward"]
    here = [(n.id, n.op_type) for n in graph.nodes]
    for position, (a, b) in enumerate(zip(profiled, here)):
        if a != b:
            raise ProfileMismatch(
                f"profile {profile.name!r} was made for another model: operation {position} is {a[0]!r} ({a[1]}) "
                f"in the profile but {b[0]!r} ({b[1]}) in this model"
            )
    if len(profiled) != len(here):
        raise ProfileMismatch(
            f"profile {profile.name!r} was made for another model: it has {len(profiled)} forward operations, "
            f"this model has {len(here)}"
        )
    raise ProfileMismatch(
        f"profile {profile.name!r} was made for another model: same operations, but module settings or "
        f"parameter shapes differ (structure hash {expected[:12]} in the profile, {actual[:12]} here)"
    )


def check_inputs(profile: GraphProfile, inputs: tuple, targets) -> None:
    signatures = (
        ("inputs", inputs, profile.provenance.input_signature),
        ("targets", targets, profile.provenance.target_signature),
    )
    for what, values, expected in signatures:
        if expected is None and (what == "inputs" or values is None):
            continue
        actual = tensor_signature(values) if values is not None else ""
        if actual != (expected or ""):
            raise ProfileMismatch(
                f"profile {profile.name!r} was measured with {what} {expected or '(none)'}, "
                f"but this step got {actual or '(none)'}: profile the model again for these shapes"
            )


@dataclass
class _Step:
    """Everything one training step holds."""

    ctx: StepContext
    accountant: Accountant
    entries: dict[str, Entry] = field(default_factory=dict)
    runs: dict[str, ForwardRun] = field(default_factory=dict)
    host: dict[str, HostCopy] = field(default_factory=dict)
    rng_states: dict[str, tuple] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    backward_done: bool = False

    def entry(self, node_id: str) -> Entry:
        entry = self.entries.get(node_id)
        if entry is None:
            raise ReplayError(f"the schedule reads {node_id!r}, which has not been computed in this step")
        return entry


class PlannedModule(nn.Module):
    """`model` trained as `schedule` says: `loss = planned(*inputs, targets=...)`, then `loss.backward()`."""

    def __init__(
        self,
        model: nn.Module,
        profile: GraphProfile,
        schedule: Schedule,
        loss_fn: Callable | None = None,
        *,
        strict: bool = False,
    ):
        super().__init__()
        self.model = model
        self.profile = profile
        self.schedule = schedule
        self.loss_fn = loss_fn or (lambda output: output)
        self.strict = strict
        self.graph = capture(model)
        check_model(self.graph, profile)
        if schedule.profile_digest != profile.digest():
            raise ProfileMismatch(
                f"the schedule was made for profile {schedule.profile_name!r} (digest {schedule.profile_digest[:12]}), "
                f"not for {profile.name!r} (digest {profile.digest()[:12]})"
            )
        simulated = simulate(profile, schedule, keep_timeline=False)  # raises ScheduleRejected on a bad plan
        self.simulated_peak_bytes = simulated.peak_memory_bytes
        self.simulated_step_time_ms = simulated.step_time_ms
        operations = [op for _, _, op in schedule.operations()]
        split = next(
            (i for i, op in enumerate(operations)
             if isinstance(op, Compute) and profile.node_by_id[op.node].kind == "backward"),
            len(operations),
        )
        self._forward_ops, self._backward_ops = operations[:split], operations[split:]
        counts: dict[str, int] = {}
        self._remaining_after: list[int] = []  # for each operation: later computes of the same node
        for op in reversed(operations):
            if isinstance(op, Compute):
                self._remaining_after.append(counts.get(op.node, 0))
                counts[op.node] = counts.get(op.node, 0) + 1
            else:
                self._remaining_after.append(0)
        self._remaining_after.reverse()
        self._recomputed = {node for node, count in counts.items() if count > 1}
        self._node = self.graph.node_by_id
        self._readers: dict[str, list] | None = None
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.transfers = Transfers(self.device)
        self.last_step: _Step | None = None

    # -- the step ---------------------------------------------------------------------------

    def forward(self, *args, targets=None):
        expected_inputs = len(self.graph.placeholders)
        if targets is None and len(args) == expected_inputs + 1:
            *args, targets = args
        inputs = tuple(args)
        if not torch.is_grad_enabled():  # evaluation: no backward, so no schedule to follow
            output = self.model(*inputs)
            return self.loss_fn(output, targets) if targets is not None else self.loss_fn(output)
        check_inputs(self.profile, inputs, targets)
        wanting = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor) and value.requires_grad]
        if wanting:
            raise ReplayError(
                f"input {wanting[0]} requires a gradient, but the replay computes the parameters' gradients only "
                "and would leave the input's .grad empty: pass it without requires_grad (or .detach() it)"
            )
        ctx = step_context(self.graph, inputs, targets, self.loss_fn)
        step = _Step(ctx, Accountant(self.profile, self.profile.fixed_bytes))
        self.last_step = step
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        if not parameters:
            raise ReplayError("the model has no trainable parameters: there is nothing to plan a backward for")
        return _ScheduleFunction.apply(self, step, *parameters)

    def _run(self, step: _Step, operations, offset: int) -> None:
        for k, op in enumerate(operations):
            if isinstance(op, Compute):
                self._compute(step, op, self._remaining_after[offset + k])
            elif isinstance(op, Offload):
                self._offload(step, op.tensor)
            elif isinstance(op, Prefetch):
                self._prefetch(step, op.tensor)
            elif isinstance(op, Wait):
                self.transfers.wait(op.tensor, op.transfer)
                step.accountant.wait(op.tensor, op.transfer)
            elif isinstance(op, Free):
                self._free(step, op.tensor)

    def _compute(self, step: _Step, op: Compute, later_computes: int) -> None:
        node = self.profile.node_by_id[op.node]
        implementation = node.implementation(op.implementation)
        if node.kind == "forward":
            entry = self._compute_forward(step, op.node, op.implementation)
        elif node.kind == "loss":
            entry, run = loss_node(step.ctx, step)
            step.entries[op.node] = entry
            step.runs[op.node] = run
            step.loss = entry.leaves[0].clone()  # returned to the caller; the entry stays the schedule's
        else:
            entry = self._compute_backward(step, op.node, op.implementation, later_computes)
        step.computed[op.node] = step.computed.get(op.node, 0) + 1
        size = distinct_bytes(entry.tensors(), step.ctx.fixed_ptrs)
        if self.strict and size != node.size_bytes:
            raise ReplayError(
                f"{op.node!r} holds {size} bytes but the profile says {node.size_bytes}: the profile does not "
                "describe this model and these inputs"
            )
        step.accountant.compute(op.node, implementation.time_ms, size, implementation.workspace_bytes)

    def _compute_forward(self, step: _Step, node_id: str, implementation: str) -> Entry:
        node = self._node[node_id]
        algorithm = implementation if node.is_conv2d else None
        first = node_id not in step.computed
        recompute = not first
        cuda = self.device.type == "cuda"
        if node_id in self._recomputed and first:
            step.rng_states[node_id] = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        if recompute:
            current = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
            saved_cpu, saved_cuda = step.rng_states[node_id]
            torch.set_rng_state(saved_cpu)
            if cuda:
                torch.cuda.set_rng_state(saved_cuda, self.device)
            buffers = [(b, b.clone()) for b in node.buffers]
        try:
            entry, run = forward_node(step.ctx, node, step, algorithm)
        finally:
            if recompute:
                torch.set_rng_state(current[0])
                if cuda:
                    torch.cuda.set_rng_state(current[1], self.device)
                with torch.no_grad():
                    for buffer, before in buffers:
                        buffer.copy_(before)
        step.entries[node_id] = entry
        step.runs[node_id] = run
        return entry

    def _readers_of(self, step: _Step, node_id: str):
        if self._readers is None:
            order = [n.id for n in self.graph.nodes] + [LOSS_ID]
            self._readers = {n.id: gradient_sources(n.id, step.runs, order) for n in self.graph.nodes}
        return self._readers[node_id]

    def _compute_backward(self, step: _Step, node_id: str, implementation: str, later_computes: int) -> Entry:
        forward_id = node_id[: -len(":bwd")]
        node = self._node[forward_id]
        run = step.runs.get(forward_id)
        if run is None:
            raise ReplayError(f"{node_id!r} runs before {forward_id!r} was computed")
        allowed = {source for source in self.profile.node_by_id[node_id].inputs if source.endswith(":bwd") or source == LOSS_ID}
        grad_entries = {gid: step.entry(gid) for gid in allowed}
        if step.grad_scale is not None and LOSS_ID in grad_entries:
            loss_entry = grad_entries[LOSS_ID]
            grad_entries[LOSS_ID] = Entry(
                leaves=[], grads=[g * step.grad_scale if g is not None else None for g in loss_entry.grads]
            )
        leaves = len(step.entries[forward_id].leaves)
        grads, _ = gradient_outputs(forward_id, leaves, self._readers_of(step, forward_id), grad_entries)
        algorithm = implementation if node.is_conv2d else None
        with conv_algorithms.backward_algorithm(algorithm):
            input_grads, parameter_grads = run_backward(run, grads, retain_graph=later_computes > 0)
        foreign = step.ctx.fixed_ptrs | {storage_ptr(g) for g in grads if g is not None}
        for parameter, grad in zip(run.parameters, parameter_grads):
            if grad is None:
                continue
            if storage_ptr(grad) in foreign or grad.stride() != parameter.stride():
                grad = torch.empty_like(parameter).copy_(grad)
            if parameter.grad is None:
                parameter.grad = grad
            else:
                parameter.grad += grad
        entry = Entry(leaves=[], grads=own_storage(input_grads, foreign))
        step.entries[node_id] = entry
        if later_computes == 0:
            step.runs.pop(forward_id, None)  # its local graph is spent; a recomputation would build a new one
        return entry

    def _offload(self, step: _Step, node_id: str) -> None:
        entry = step.entry(node_id)
        step.host[node_id] = self.transfers.offload(node_id, entry, step.ctx.fixed_ptrs)
        step.accountant.offload(node_id)

    def _prefetch(self, step: _Step, node_id: str) -> None:
        copy = step.host.get(node_id)
        if copy is None:
            raise ReplayError(f"{node_id!r} is prefetched but was never offloaded in this step")
        entry = step.entry(node_id)
        self.transfers.prefetch(node_id, entry, copy)
        step.accountant.prefetch(node_id, copy.size_bytes)

    def _free(self, step: _Step, node_id: str) -> None:
        entry = step.entry(node_id)
        watch = []
        if self.strict and self.device.type == "cpu":
            from torch.multiprocessing.reductions import StorageWeakRef

            watch = [StorageWeakRef(t.untyped_storage()) for t in entry.tensors() if storage_ptr(t) not in step.ctx.fixed_ptrs]
        self.transfers.release(node_id, entry, step.ctx.fixed_ptrs)
        step.accountant.free(node_id)
        if any(not ref.expired() for ref in watch):
            raise ReplayError(f"{node_id!r} was freed but its memory is still referenced elsewhere")

    def finish(self, step: _Step) -> None:
        """Drop whatever the schedule left (local graphs, entries): nothing leaks into the next step."""
        self.transfers.settle()
        step.runs.clear()
        step.entries.clear()
        step.host.clear()

    # -- figures -------------------------------------------------------------------------------

    @property
    def peak_memory_bytes(self) -> int | None:
        """The accountant's peak of the last step (fixed memory included)."""
        return self.last_step.accountant.peak_bytes() if self.last_step is not None else None


class _ScheduleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, planned: PlannedModule, step: _Step, *parameters):
        planned._run(step, planned._forward_ops, 0)
        if step.loss is None:
            raise ReplayError("the schedule's forward part never computed the loss")
        ctx.planned, ctx.step = planned, step
        return step.loss

    @staticmethod
    def backward(ctx, grad_loss):
        planned, step = ctx.planned, ctx.step
        if step.backward_done:
            raise ReplayError(
                "this step's backward has already run and its saved tensors are freed as the plan says "
                "(retain_graph is not supported): call the planned module again for another step"
            )
        step.backward_done = True
        # scaling by the incoming gradient is exact when it is 1, and checking for 1 would synchronize
        step.grad_scale = grad_loss
        try:
            planned._run(step, planned._backward_ops, len(planned._forward_ops))
        finally:
            planned.finish(step)
        return (None, None) + (None,) * (len(ctx.needs_input_grad) - 2)
