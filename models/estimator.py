"""Estimated profiles: a training step of a model on a GPU we do not have.

The graph comes from torch.fx (see `models.trace`): one forward node per fx
node that produces a tensor (id = the fx name), one `loss` node, then one
backward node per forward node that does gradient work (id = `<fx name>:bwd`),
in reverse order, except convolutions (plain and transposed), whose backward
is cuDNN's two calls as two nodes: `<fx name>:bwd_filter` (the filter and bias
gradients: reads the output gradient and the input, makes nothing the graph
reads, as parameter gradients are fixed memory), then `<fx name>:bwd_data`
(the input gradient: reads the output gradient only, the weights being fixed
memory), absent when the input needs no gradient. Both name the convolution
as `forward_node`. Which forward tensors a backward node reads follows what
PyTorch's autograd saves for that operator (conv/linear/GELU: the input; ReLU:
its output; max-pooling: the input and its own indices; batch/layer norm: the
input and its statistics; dropout: its mask; attention: q, k, v, its output
and log-sum-exp). An op whose backward reads only its statistics or mask
(batch/layer norm, dropout) while no other backward reads its output hands
them on through a node of their own, `<fx name>:saved` (what the executor's
capture does with a copy), so its output can go once the forward is done
with it, as in eager PyTorch. View-like nodes (flatten, view, transpose...) own no memory:
they are nodes of 0 bytes, and whoever reads one also reads the tensor it
views. Their backward nodes, and those of concatenations, hand on (slices
of) the incoming gradient: 0 bytes and 0 ms, and whoever reads one also
reads the gradient it shows. An add's backward node stands for the sum
autograd makes of the gradients reaching the add's output from its readers
(a residual stream): one tensor, handed to both inputs.

Times: the roofline model of `models.roofline`; convolutions get one
implementation per applicable cuDNN algorithm family (`models.cudnn`), their
filter- and data-gradient nodes the Pareto-optimal ones of theirs.
Constant memory: inputs and targets, parameters, gradients, buffers and the
optimizer's state (SGD with momentum by default: one buffer per parameter), and the temporaries of
its step (OPTIMIZER_STEP_COPIES).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from pydantic import ValidationError
from torch import nn

from models import cudnn
from models.gpus import GPU, get_gpu
from models.roofline import ATTENTION_EFFICIENCY, Device
from models.trace import TracedGraph, TracedOp, TraceFailure, trace
from planner.errors import MososError
from planner.profile import FixedMemory, GraphProfile, Hardware, Implementation, Node, Provenance
from planner.validation import issues_from_validation_error
# Imports inside functions here are deferred for start-up time: the networks' registry (torch) loads when a network is
# built.

ESTIMATOR = "mosos roofline + cuDNN-7 algorithm families"
ESTIMATOR_VERSION = "1.2"  # 1.1: a convolution's backward is two nodes (filter gradient, data gradient); 1.2: hand-offs
HAND_OFF_SUFFIX = ":saved"
# results read only by the backward are handed on apart when at most this fraction of the bytes they would
# otherwise hold; executor.capture.capture applies the same rule to captured graphs
HAND_OFF_MAX_FRACTION = 0.25
TRANSFER_LATENCY_MS = 0.01  # cudaMemcpyAsync launch and DMA setup
OPTIMIZER_STATE_BUFFERS = {"sgd": 0, "sgd-momentum": 1, "momentum": 1, "adam": 2, "adamw": 2}
# Temporaries of the optimizer's step, in copies of all the parameters at once, under the foreach kernels that
# PyTorch takes by default on a GPU: Adam's square root of its second moment (AdamW's decay is in place); SGD's
# updates are in place.
OPTIMIZER_STEP_COPIES = {"sgd": 0, "sgd-momentum": 0, "momentum": 0, "adam": 1, "adamw": 1}
ALIAS_BACKWARD = {"view", "cat"}  # backward hands on (slices of) the incoming gradient: no work, no new memory


class EstimateError(MososError):
    """Bad arguments to the estimator."""


@contextmanager
def _within_bounds(profile_name: str, where: str = "") -> Iterator[None]:
    """Name the profile and the node whose estimate leaves the profile's bounds (a batch beyond any device)."""
    try:
        yield
    except ValidationError as error:
        issues = issues_from_validation_error(error)
        raise EstimateError(
            f"the estimated profile of {profile_name} is out of bounds: {where}"
            + "; ".join(f"{issue.path or 'profile'}: {issue.message}" for issue in issues[:3])
            + (f" (and {len(issues) - 3} more)" if len(issues) > 3 else "")
        ) from None


def _op_label(op: TracedOp) -> str:
    return f"node {op.name!r} ({op.module_path or op.name}, {op.op_type}): "


@dataclass
class _Saved:
    inputs: tuple[int, ...] = ()  # indices of the op's tensor inputs that backward reads
    self_output: bool = False  # backward reads the op's own output (or its extra saved bytes)
    extra_bytes: int = 0
    extra_only: bool = False  # of its own node, backward reads only the extra saved bytes (statistics, a mask)


def _saved(op: TracedOp) -> _Saved:
    """What autograd keeps for the backward of `op` (PyTorch's derivatives.yaml, simplified)."""
    kind = op.op_type
    if kind in ("conv2d", "conv_transpose2d", "linear", "gelu"):
        return _Saved((0,))
    if kind in ("relu", "softmax"):
        return _Saved(self_output=True)
    if kind == "max_pool2d":
        return _Saved((0,), True, op.output_numel * 8)  # int64 indices
    if kind == "batch_norm":
        return _Saved((0,), True, 2 * op.output_shape[1] * 4, extra_only=True)  # saved mean and inverse std, float32
    if kind == "layer_norm":
        rows = op.output_numel // op.output_shape[-1]
        return _Saved((0,), True, 2 * rows * 4, extra_only=True)
    if kind == "dropout":
        return _Saved(self_output=True, extra_bytes=op.output_numel, extra_only=True)  # bool mask
    if kind == "attention":
        batch, heads, tokens = op.output_shape[0], op.output_shape[1], op.output_shape[2]
        return _Saved((0, 1, 2), True, batch * heads * tokens * 4)  # log-sum-exp
    if kind in ("avg_pool2d", "add", "cat", "view"):
        return _Saved()
    return _Saved(tuple(range(len(op.inputs))))  # mul, matmul and unknown ops: all inputs, conservatively


def _numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def _conv_shape(op: TracedOp) -> cudnn.ConvShape:
    n, c, h, w = op.input_shapes[0]
    a = op.attributes
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    kh, kw = pair(a["kernel_size"])
    return cudnn.ConvShape(n, c, h, w, a["out_channels"], kh, kw, pair(a.get("stride", 1)), pair(a.get("padding", 0)),
                           pair(a.get("dilation", 1)), a.get("groups", 1), op.element_bytes)


def _implementations(algorithms: list[cudnn.Algorithm]) -> list[Implementation]:
    return [Implementation(name=a.family, time_ms=round(a.time_ms, 4), workspace_bytes=a.workspace_bytes)
            for a in algorithms]


def _default(time_ms: float) -> list[Implementation]:
    return [Implementation(name="default", time_ms=round(time_ms, 4), workspace_bytes=0)]


@dataclass
class _BackwardPart:
    """One backward node of an operator: most have one, a convolution two (filter gradient, then data gradient)."""

    suffix: str  # node id = <forward id><suffix>
    op_type: str
    implementations: list[Implementation]
    reads_saved: bool  # reads what autograd saves for the op (a convolution's input: the filter gradient does)
    input_gradient: bool  # produces the gradient of the op's inputs, which the backward of its producers reads


def _convolution_backward(kind: str, data: list[cudnn.Algorithm] | None, filters: list[cudnn.Algorithm]) -> list[_BackwardPart]:
    """cuDNN's two backward calls as two nodes, filter gradient first.

    The filter gradient reads the input x and the output gradient dy; the data
    gradient reads dy and the weights (fixed memory) and makes dx. In this order
    x can be freed before dx is allocated (MONeT's P100 profile runs them in the
    same order). The first convolution has no data gradient (its input needs none).
    Each keeps its Pareto-optimal algorithms (no other both faster and smaller).
    """
    parts = [_BackwardPart(":bwd_filter", f"{kind}_backward_filter", _implementations(cudnn.pareto(filters)), True, False)]
    if data is not None:
        parts.append(_BackwardPart(":bwd_data", f"{kind}_backward_data", _implementations(cudnn.pareto(data)), False, True))
    return parts


def _single(kind: str, implementations: list[Implementation]) -> list[_BackwardPart]:
    return [_BackwardPart(":bwd", f"{kind}_backward", implementations, True, True)]


def _op_implementations(op: TracedOp, device: Device, input_grad: bool) -> tuple[list[Implementation], list[_BackwardPart]]:
    """Forward implementations of one operator, and its backward nodes in execution order."""
    forward, backward = _forward_and_backward(op, device, input_grad)
    if all(isinstance(item, Implementation) for item in backward):
        backward = _single(op.op_type, backward)  # one backward node with these implementations
    return forward, backward


def _forward_and_backward(op: TracedOp, device: Device, input_grad: bool) -> tuple[list[Implementation], list]:
    """Forward implementations, and either the backward nodes (convolutions) or the one backward node's implementations."""
    kind = op.op_type
    out = op.output_bytes
    inp = sum(_numel(s) for s in op.input_shapes) * op.element_bytes
    if kind == "conv2d":
        shape = _conv_shape(op)
        data = cudnn.backward_data_algorithms(shape, device) if input_grad else None
        return (_implementations(cudnn.forward_algorithms(shape, device)),
                _convolution_backward(kind, data, cudnn.backward_filter_algorithms(shape, device)))
    if kind == "conv_transpose2d":
        # the mirrored convolution maps this op's output back to its input: our forward is its backward-data,
        # our data gradient its forward, our filter gradient its filter gradient
        n, c, h, w = op.input_shapes[0]
        _, k, oh, ow = op.output_shape
        base = _conv_shape(op)
        mirror = cudnn.ConvShape(n, k, oh, ow, c, base.kh, base.kw, base.stride, base.padding, base.dilation,
                                 base.groups, op.element_bytes)
        forward = cudnn.backward_data_algorithms(mirror, device)
        data = cudnn.forward_algorithms(mirror, device) if input_grad else None
        return (_implementations(cudnn.pareto(forward)),
                _convolution_backward(kind, data, cudnn.backward_filter_algorithms(mirror, device)))
    if kind in ("linear", "matmul"):
        if kind == "linear":
            reduction, columns = op.input_shapes[0][-1], op.output_shape[-1]
            rows = _numel(op.input_shapes[0]) // reduction
        else:
            reduction, columns = op.input_shapes[0][-1], op.output_shape[-1]
            rows = op.output_numel // columns
        flops = 2.0 * rows * reduction * columns
        weight = reduction * columns * op.element_bytes
        forward = device.kernel_ms(flops, inp + out + weight)
        backward = device.kernel_ms(2 * flops, 2 * (inp + out + weight), kernels=2)
        return _default(forward), _default(backward)
    if kind == "attention":
        batch, heads, tokens, width = op.output_shape
        keys = op.input_shapes[1][2]
        flops = 4.0 * batch * heads * tokens * keys * width
        eff = ATTENTION_EFFICIENCY if device.math == "fp32" else device.compute_efficiency
        forward = device.kernel_ms(flops, inp + out, eff)
        backward = device.kernel_ms(2.5 * flops, 2 * (inp + out), eff)  # recomputes the scores, two more GEMMs
        return _default(forward), _default(backward)
    if kind == "view":
        return _default(0.0), _default(0.0)
    if kind == "cat":
        return _default(device.memory_ms(inp + out)), _default(0.0)  # backward: slices of the gradient
    if kind in ("batch_norm", "layer_norm"):
        return _default(device.memory_ms(2 * inp + out, kernels=2)), _default(device.memory_ms(3 * out + inp, kernels=2))
    if kind == "max_pool2d":
        return _default(device.memory_ms(inp + 3 * out)), _default(device.memory_ms(2 * inp + 3 * out))
    if kind == "dropout":
        return _default(device.memory_ms(inp + out + op.output_numel)), _default(device.memory_ms(2 * out + op.output_numel))
    # elementwise, pooling, concatenation, unknown: memory-bound, backward reads the gradient and what it saved
    return _default(device.memory_ms(inp + out)), _default(device.memory_ms(inp + 2 * out))


def build_profile(
    traced: TracedGraph,
    gpu: GPU,
    *,
    name: str,
    target_bytes: int = 0,
    math: str = "fp32",
    optimizer: str = "sgd-momentum",
    memory_bytes: int | None = None,
    notes: str = "",
) -> GraphProfile:
    """Turn a traced graph into an estimated GraphProfile for `gpu`."""
    if optimizer not in OPTIMIZER_STATE_BUFFERS:
        raise EstimateError(f"unknown optimizer {optimizer!r}; use {', '.join(OPTIMIZER_STATE_BUFFERS)}")
    if math not in ("fp32", "tf32"):
        raise EstimateError(f"math must be fp32 or tf32 (tensors are float32), not {math!r}")
    device = Device(gpu, math)
    ops = {op.name: op for op in traced.ops}
    order = [op.name for op in traced.ops]

    requires_grad: dict[str, bool] = {}
    for op in traced.ops:
        requires_grad[op.name] = op.parameter_count > 0 or any(requires_grad.get(i, False) for i in op.inputs)

    storage_cache: dict[str, list[str]] = {}

    def storage(node_id: str) -> list[str]:
        """The non-view producers whose memory `node_id` shows."""
        if node_id not in storage_cache:
            op = ops[node_id]
            if op.op_type != "view":
                storage_cache[node_id] = [node_id]
            else:
                found: list[str] = []
                for source in op.inputs:
                    if source in ops:
                        found += [s for s in storage(source) if s not in found]
                storage_cache[node_id] = found
        return storage_cache[node_id]

    def reads(sources: list[str]) -> list[str]:
        found: list[str] = []
        for source in sources:
            if source not in ops:
                continue  # a model input: fixed memory
            for item in [source, *storage(source)]:
                if item not in found:
                    found.append(item)
        return found

    consumers: dict[str, list[str]] = {name_: [] for name_ in order}
    for op in traced.ops:
        for source in dict.fromkeys(op.inputs):
            if source in consumers:
                consumers[source].append(op.name)

    input_grad = {op.name: any(requires_grad.get(source, False) for source in op.inputs) for op in traced.ops}
    implementations = {}
    for op in traced.ops:
        with _within_bounds(name, _op_label(op)):
            implementations[op.name] = _op_implementations(op, device, input_grad[op.name])
    # The backward node that makes the gradient of an op's inputs (a convolution's data gradient), and back.
    input_gradient_node: dict[str, str] = {}
    for op in traced.ops:
        for part in implementations[op.name][1]:
            if part.input_gradient:
                input_gradient_node[op.name] = op.name + part.suffix
    forward_of_gradient = {node_id: forward_id for forward_id, node_id in input_gradient_node.items()}

    # Which ops get backward nodes: those on the gradient path whose output reaches the loss.
    gradients_of: dict[str, list[str]] = {}
    for op in reversed(traced.ops):
        found: list[str] = ["loss"] if op.name == traced.output else []
        for consumer in consumers[op.name]:
            if gradients_of.get(consumer) and consumer in input_gradient_node:
                found.append(input_gradient_node[consumer])
        gradients_of[op.name] = found if requires_grad[op.name] else []

    grad_storage_cache: dict[str, list[str]] = {}

    def grad_storage(node_id: str) -> list[str]:
        """The gradient producers whose memory a backward node's output shows (itself, unless an alias)."""
        if node_id not in grad_storage_cache:
            forward_id = forward_of_gradient.get(node_id)
            if forward_id is None or ops[forward_id].op_type not in ALIAS_BACKWARD:
                grad_storage_cache[node_id] = [node_id]
            else:
                found: list[str] = []
                for source in gradients_of[forward_id]:
                    found += [s for s in grad_storage(source) if s not in found]
                grad_storage_cache[node_id] = found
        return grad_storage_cache[node_id]

    def grad_reads(sources: list[str]) -> list[str]:
        found: list[str] = []
        for source in sources:
            for item in [source, *grad_storage(source)]:
                if item not in found:
                    found.append(item)
        return found

    # outputs some backward node reads as a saved tensor: an op whose backward reads only its statistics (or mask)
    # hands them on through a node of their own unless its output is saved anyway, as the executor does
    saved_elsewhere: set[str] = set()
    for op in traced.ops:
        if gradients_of[op.name]:
            saved = _saved(op)
            saved_elsewhere.update(reads([op.inputs[i] for i in saved.inputs if i < len(op.inputs)]))

    def hands_off(op: TracedOp, saved: _Saved) -> bool:
        return (saved.extra_only and op.name not in saved_elsewhere and op.output_bytes > 0
                and 0 < saved.extra_bytes <= HAND_OFF_MAX_FRACTION * op.output_bytes)

    forward_nodes: list[Node] = []
    backward_nodes: list[Node] = []
    for op in traced.ops:
        with _within_bounds(name, _op_label(op)):
            gradients = gradients_of[op.name]
            saved = _saved(op) if gradients else _Saved()
            forward_impls, backward_parts = implementations[op.name]
            label = op.module_path or op.name
            forward_nodes.append(
                Node(
                    id=op.name,
                    name=f"{label} ({op.op_type})",
                    kind="forward",
                    op_type=op.op_type,
                    output_bytes=0 if op.op_type == "view" else op.output_bytes,
                    extra_saved_bytes=saved.extra_bytes,
                    module=op.module_path,
                    inputs=reads(op.inputs),
                    implementations=forward_impls,
                )
            )
            if not gradients:
                continue  # no gradient reaches it (it does not depend on a parameter, or does not reach the loss)
            forward_reads = reads([op.inputs[i] for i in saved.inputs if i < len(op.inputs)])
            differentiates = op.name
            if hands_off(op, saved):
                differentiates = op.name + HAND_OFF_SUFFIX
                forward_nodes.append(
                    Node(
                        id=differentiates,
                        name=f"{label} ({op.op_type} saved for the backward)",
                        kind="forward",
                        op_type="clone",
                        output_bytes=saved.extra_bytes,
                        module=op.module_path,
                        inputs=[op.name],
                        implementations=_default(device.memory_ms(2 * saved.extra_bytes, kernels=1)),
                    )
                )
                forward_reads.append(differentiates)
            elif saved.self_output and op.name not in forward_reads:
                forward_reads.append(op.name)
            grad_bytes = 0
            seen: set[str] = set()
            for source, shape in zip(op.inputs, op.input_shapes):
                if source in seen or not requires_grad.get(source, False):
                    continue
                seen.add(source)
                grad_bytes += _numel(shape) * op.element_bytes
            if op.op_type == "add":
                grad_bytes = min(grad_bytes, op.output_bytes)  # one gradient tensor, handed to both inputs
            if op.op_type in ALIAS_BACKWARD:
                grad_bytes = 0  # (slices of) the incoming gradient: whoever reads it also reads that gradient
            reads_forward = bool(forward_reads)
            for part in reversed(backward_parts):  # the list is reversed below: parts end up in execution order
                backward_nodes.append(
                    Node(
                        id=op.name + part.suffix,
                        name=f"{label} ({op.op_type} {part.op_type.removeprefix(op.op_type + '_').replace('_', ' ')})",
                        kind="backward",
                        op_type=part.op_type,
                        output_bytes=grad_bytes if part.input_gradient else 0,  # parameter gradients: fixed memory
                        module=op.module_path,
                        # every part differentiates the op, provided one of them reads a forward tensor (the contract)
                        forward_node=differentiates if reads_forward else None,
                        inputs=grad_reads(gradients) + (forward_reads if part.reads_saved else []),
                        implementations=part.implementations,
                    )
                )
    with _within_bounds(name):
        return _whole_profile(traced, gpu, device, name=name, forward_nodes=forward_nodes,
                              backward_nodes=backward_nodes, reads=reads, target_bytes=target_bytes,
                              math=math, optimizer=optimizer, memory_bytes=memory_bytes, notes=notes)


def _whole_profile(traced: TracedGraph, gpu: GPU, device: Device, *, name: str, forward_nodes: list[Node],
                   backward_nodes: list[Node], reads, target_bytes: int, math: str, optimizer: str,
                   memory_bytes: int | None, notes: str) -> GraphProfile:
    ops = {op.name: op for op in traced.ops}
    output_op = ops[traced.output]
    output_bytes = output_op.output_bytes
    with _within_bounds(name, "node 'loss': "):
        loss = Node(
            id="loss",
            name="loss (forward and gradient of the output)",
            kind="loss",
            op_type="loss",
            output_bytes=output_bytes + output_op.element_bytes,  # the output's gradient and the scalar loss
            inputs=reads([traced.output]),
            implementations=_default(device.memory_ms(3 * output_bytes + target_bytes, kernels=3)),
        )
    backward_nodes.reverse()
    input_bytes = sum(_numel(shape) * size for shape, size in traced.placeholders.values())
    params = traced.parameter_bytes
    fixed = FixedMemory(
        inputs_bytes=input_bytes + target_bytes,
        parameters_bytes=params,
        gradients_bytes=params,
        optimizer_state_bytes=params * OPTIMIZER_STATE_BUFFERS[optimizer],
        other_bytes=traced.buffer_bytes,
        optimizer_step_bytes=params * OPTIMIZER_STEP_COPIES[optimizer],
    )
    hardware = Hardware(
        name=gpu.name,
        memory_capacity_bytes=memory_bytes or gpu.memory_bytes,
        d2h_bandwidth_gb_per_s=gpu.d2h_gb_per_s,
        h2d_bandwidth_gb_per_s=gpu.h2d_gb_per_s,
        transfer_latency_ms=TRANSFER_LATENCY_MS,
    )
    provenance = Provenance(
        source="estimated",
        device=gpu.name,
        estimator=f"{ESTIMATOR} v{ESTIMATOR_VERSION}",
        tool="mosos estimate (models.estimator)",
        notes=(
            f"{math} math; roofline efficiencies: see models/roofline.py and models/cudnn.py; "
            f"optimizer {optimizer} ({OPTIMIZER_STATE_BUFFERS[optimizer]} state buffer(s) per parameter); "
            f"GPU figures: {'; '.join(gpu.sources)}" + (f"; {notes}" if notes else "")
        ),
    )
    return GraphProfile(name=name, hardware=hardware, fixed_memory=fixed, nodes=forward_nodes + [loss] + backward_nodes,
                        provenance=provenance)


SPLIT_SUFFIXES = (":bwd_filter", ":bwd_data")


def fold_split_backward(nodes: list[Node]) -> list[Node]:
    """The nodes with each convolution's filter- and data-gradient nodes folded back into one `<id>:bwd` node.

    What estimator v1.0 made, and what a profiler that measures a convolution's backward as one node sees:
    the folded node reads what either part reads and makes what they make together; each (data, filter)
    pair of their implementations runs one after the other (time = sum, workspace = max), and the
    Pareto-optimal pairs are kept, named `data=<name>+filter=<name>`. Readers of a data-gradient node read
    the folded node. For comparisons (the split's effect, measured profiles that do not split).
    """
    def base(node_id: str) -> str:
        for suffix in SPLIT_SUFFIXES:
            if node_id.endswith(suffix):
                return node_id.removesuffix(suffix) + ":bwd"
        return node_id

    folded: dict[str, Node] = {}
    parts: dict[str, dict[str, Node]] = {}
    for node in nodes:
        node_id = base(node.id)
        inputs = list(dict.fromkeys(base(source) for source in node.inputs))
        if node_id == node.id:
            folded[node_id] = node.model_copy(update={"inputs": inputs})
            continue
        parts.setdefault(node_id, {})[node.id.rsplit("_", 1)[1]] = node
        previous = folded.get(node_id)
        folded[node_id] = node.model_copy(update={
            "id": node_id,
            "name": node.name.replace(" backward filter", " backward").replace(" backward data", " backward"),
            "op_type": node.op_type.removesuffix("_filter").removesuffix("_data"),
            "inputs": list(dict.fromkeys((previous.inputs if previous else []) + inputs)),
            "output_bytes": (previous.output_bytes if previous else 0) + node.output_bytes,
            "forward_node": (previous.forward_node if previous else None) or node.forward_node,
        })
    for node_id, pair in parts.items():
        filters = [cudnn.Algorithm(i.name, i.time_ms, i.workspace_bytes) for i in pair["filter"].implementations]
        if "data" in pair:
            combined = [cudnn.Algorithm(f"data={d.name}+filter={f.family}", d.time_ms + f.time_ms,
                                        max(d.workspace_bytes, f.workspace_bytes))
                        for d in pair["data"].implementations for f in filters]
        else:
            combined = [cudnn.Algorithm(f"filter={f.family}", f.time_ms, f.workspace_bytes) for f in filters]
        implementations = [Implementation(name=a.family, time_ms=round(a.time_ms, 4), workspace_bytes=a.workspace_bytes)
                           for a in cudnn.pareto(combined)]
        folded[node_id] = folded[node_id].model_copy(update={"implementations": implementations})
    return list(folded.values())


def estimate_module(
    module: nn.Module,
    input_shape: tuple[int, ...],
    gpu: str | GPU,
    *,
    name: str | None = None,
    target_bytes: int = 0,
    dtype: torch.dtype = torch.float32,
    math: str = "fp32",
    optimizer: str = "sgd-momentum",
    memory_bytes: int | None = None,
) -> GraphProfile:
    """Estimate any nn.Module taking one input tensor of `input_shape` (batch included).

    The module is traced on the meta device; a module with real weights is
    copied there first, so the caller's weights are untouched.
    """
    gpu = _gpu(gpu)
    if any(p.device.type != "meta" for p in module.parameters()):
        module = copy.deepcopy(module).to("meta")
    example = torch.empty(input_shape, dtype=dtype, device="meta")
    traced = trace(module, example)
    return build_profile(traced, gpu, name=name or f"{type(module).__name__} on {gpu.name} (estimated)",
                         target_bytes=target_bytes, math=math, optimizer=optimizer, memory_bytes=memory_bytes)


def estimate(
    model: str,
    batch_size: int,
    gpu: str | GPU,
    *,
    image_size: int | None = None,
    tokens: int | None = None,
    small: bool = False,
    math: str = "fp32",
    optimizer: str = "sgd-momentum",
    memory_bytes: int | None = None,
) -> GraphProfile:
    """Estimate a reference network (see `models.list_models()`) at `batch_size` on `gpu`.

    `small=True` estimates the tiny test variant (same layer kinds, few channels).
    """
    from models.registry import get_model

    if batch_size < 1:
        raise EstimateError(f"batch size must be at least 1, not {batch_size}")
    gpu = _gpu(gpu)
    try:
        spec = get_model(model, small, image_size=image_size, tokens=tokens)
    except (KeyError, ValueError) as error:
        raise EstimateError(str(error.args[0] if error.args else error)) from None
    with torch.device("meta"):
        module = spec.build()
    target_shape, target_kind = spec.target_shape(batch_size)
    target_bytes = _numel(target_shape) * (8 if target_kind == "int64" else 4)
    size = "x".join(str(d) for d in spec.input_shape[1:]) if len(spec.input_shape) == 3 else f"{spec.input_shape[0]} tokens"
    profile_name = f"{spec.name}{' (small)' if small else ''} batch {batch_size} {size} on {gpu.name} (estimated)"
    example = torch.empty((batch_size, *spec.input_shape), device="meta")
    traced = trace(module, example)
    return build_profile(traced, gpu, name=profile_name, target_bytes=target_bytes, math=math,
                         optimizer=optimizer, memory_bytes=memory_bytes, notes=f"model: {spec.description}")


def _gpu(gpu: str | GPU) -> GPU:
    if isinstance(gpu, GPU):
        return gpu
    try:
        return get_gpu(gpu)
    except KeyError as error:
        raise EstimateError(str(error.args[0])) from None


__all__ = ["estimate", "estimate_module", "build_profile", "fold_split_backward", "EstimateError", "TraceFailure"]
