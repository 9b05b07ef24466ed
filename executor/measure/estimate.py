"""Estimate a user's own training step on a GPU from the table (`models.gpus`), without that GPU and without a step.

The step is captured as for measuring (`executor.measure.profiler.plan_step`: torch.export
and AOTAutograd's joint ATen graph, grouped into the executor's planning nodes,
shapes and storages from a fake-tensor run): same node ids, sizes and edges as a
measured profile of the model. Nothing runs on real data and no activation is
allocated; only the model's parameters and the example inputs the caller made
exist as real tensors.

Each ATen operation of a planning node is priced on the GPU's figures with the
roofline of `models.roofline` (the reference estimator's, `models.estimator`):
FLOPs from `torch.utils.flop_counter`'s formulas applied to the operation's fake
arguments, bytes moved = the distinct elements it reads plus what it writes, a
launch overhead per operation. Two families follow the kernels a GPU runs for
them, as the reference estimator counts them: normalisation (batch / layer /
group norm and their backward) makes two passes over what it reads (statistics,
then normalise), and fused attention runs at the attention efficiency (FP32) and
its backward recomputes the score matrix. A node's time is the sum of its
operations'. A convolution (forward, filter-gradient or data-gradient half) is
priced per cuDNN algorithm family (`models.cudnn`): one implementation per
family, named as the reference estimator names them. A node's workspace is the
peak of its transient intermediates (what it makes and reads itself, from the
fake sizes) plus its convolution algorithm's workspace.

What this does not model: kernel fusion a compiler would do, operators that a
GPU dispatches differently from this machine (the graph is the one captured
here, e.g. PyTorch's CPU attention kernel stands for the GPU's fused one), FP64
rates (priced at the FP32 peak), caching-allocator rounding and fragmentation.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten

from executor.capture.planning_graph import (
    CONVOLUTION,
    Group,
    PlanningGraph,
    node_sizes,
    transient_peak_bytes,
)
from executor.measure.profiler import (
    ProfiledStep,
    _first_device,
    _Preserved,
    as_tuple,
    fixed_memory,
    optimizer_state_bytes,
    plan_step,
)
from models import cudnn
from models.estimator import TRANSFER_LATENCY_MS
from models.gpus import GPU, GPUS, get_gpu
from models.registry import get_model
from models.roofline import ATTENTION_EFFICIENCY, Device
from models.workload import load_workload
from planner.errors import MososError
from planner.profile import GraphProfile, parse_profile

ESTIMATOR = "mosos per-ATen-operation roofline + cuDNN-7 algorithm families"
ESTIMATOR_VERSION = "1.0"
TOOL = "mosos executor.measure.estimate 1.0 (torch.export joint graph, fake tensors)"
MATHS = ("fp32", "tf32")
ATEN = torch.ops.aten

# Operators whose kernels read their inputs twice: one pass for the statistics, one to normalise (or, backward,
# one for the reductions over the gradient, one for the input gradient).
TWO_PASS = {
    ATEN._native_batch_norm_legit_functional.default, ATEN._native_batch_norm_legit.default,
    ATEN._native_batch_norm_legit.no_stats, ATEN.native_batch_norm.default, ATEN.native_batch_norm_backward.default,
    ATEN.native_layer_norm.default, ATEN.native_layer_norm_backward.default, ATEN.native_group_norm.default,
    ATEN.native_group_norm_backward.default, ATEN._fused_rms_norm.default,
}
_CPU_ATTENTION = ATEN._scaled_dot_product_flash_attention_for_cpu.default
_CPU_ATTENTION_BACKWARD = ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default
ATTENTION = {
    _CPU_ATTENTION, ATEN._scaled_dot_product_flash_attention.default,
    ATEN._scaled_dot_product_efficient_attention.default, ATEN._scaled_dot_product_cudnn_attention.default,
    ATEN._flash_attention_forward.default, ATEN._efficient_attention_forward.default,
}
ATTENTION_BACKWARD = {
    _CPU_ATTENTION_BACKWARD, ATEN._scaled_dot_product_flash_attention_backward.default,
    ATEN._scaled_dot_product_efficient_attention_backward.default,
    ATEN._scaled_dot_product_cudnn_attention_backward.default, ATEN._flash_attention_backward.default,
    ATEN._efficient_attention_backward.default,
}


class EstimateError(MososError):
    """Bad arguments to the estimate (an unknown GPU, math or optimizer)."""


def gpu_of(gpu: str | GPU) -> GPU:
    """A GPU of the table by key; an unknown key is an error that lists the known ones."""
    if isinstance(gpu, GPU):
        return gpu
    try:
        return get_gpu(gpu)
    except KeyError:
        raise EstimateError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}") from None


# --- one ATen operation ------------------------------------------------------------------------------------


def _value(node, graph_module: fx.GraphModule):
    """The fake value of an fx node (a get_attr constant: the module's tensor; shapes are all that is read)."""
    if not isinstance(node, fx.Node):
        return node
    if "val" in node.meta:
        return node.meta["val"]
    if node.op == "get_attr":
        return getattr(graph_module, node.target)
    return None


def distinct_bytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel reads from a tensor: its distinct elements (a broadcast dimension, stride 0, is read once)."""
    if tensor.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            elements *= int(size)
    return elements * tensor.element_size()


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def op_flops(node: fx.Node, graph_module: fx.GraphModule) -> float:
    """FLOPs of one ATen operation from torch.utils.flop_counter's formulas (what FlopCounterMode counts), on the
    operation's fake arguments; PyTorch's CPU attention kernel counts as the fused attention it stands for."""
    target = node.target
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _value(n, graph_module))
    if target is _CPU_ATTENTION:
        query, key, value = args[:3]
        return float(flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape))
    if target is _CPU_ATTENTION_BACKWARD:
        grad, query, key, value = args[:4]
        return float(flop_counter.sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape))
    packet = getattr(target, "overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=_value(node, graph_module)))


def op_bytes(node: fx.Node, graph_module: fx.GraphModule) -> int:
    """Bytes one operation moves: the distinct elements of every tensor it reads, plus every tensor it writes."""
    read = {}
    for source in node.all_input_nodes:
        for tensor in _tensors(_value(source, graph_module)):
            read[id(tensor)] = distinct_bytes(tensor)
    written = sum(t.numel() * t.element_size() for t in _tensors(_value(node, graph_module)))
    return sum(read.values()) * (2 if node.target in TWO_PASS else 1) + written


def _math_of(node: fx.Node, math: str) -> str:
    """The math an operation runs in: half-precision tensors on the tensor cores, FP32 ones as asked."""
    outputs = _tensors(node.meta.get("val"))
    if outputs and outputs[0].dtype in (torch.float16, torch.bfloat16):
        return "bf16"
    return math


def op_time_ms(node: fx.Node, graph_module: fx.GraphModule, gpu: GPU, math: str) -> float:
    """Roofline time of one operation on the GPU, launch included."""
    device = Device(gpu, _math_of(node, math))
    flops = op_flops(node, graph_module)
    moved = op_bytes(node, graph_module)
    if node.target in ATTENTION or node.target in ATTENTION_BACKWARD:
        efficiency = ATTENTION_EFFICIENCY if device.math == "fp32" else device.compute_efficiency
        if node.target in ATTENTION_BACKWARD:
            flops *= 1.25  # the fused kernels recompute the scores Q.K^T (one more of the four products)
        return device.kernel_ms(flops, moved, efficiency)
    return device.kernel_ms(flops, moved, kernels=2 if node.target in TWO_PASS else 1)


# --- convolutions ----------------------------------------------------------------------------------------


def _pair(value) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    values = [int(v) for v in value]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def convolution_algorithms(node: fx.Node, graph_module: fx.GraphModule, gpu: GPU, math: str) -> list[cudnn.Algorithm] | None:
    """The cuDNN algorithm families of a 2-D convolution or one half of its backward (None: not a 2-D one).

    The direction follows the operation: forward; the filter-gradient half (weight and bias gradients); the
    data-gradient half (input gradient). A transposed convolution is its mirrored convolution's backward-data,
    as in the reference estimator. Backward halves keep the Pareto-optimal families, as there."""
    get = lambda n: _value(n, graph_module)  # noqa: E731
    if node.target is CONVOLUTION:
        x, w = get(node.args[0]), get(node.args[1])
        stride, padding, dilation, transposed, groups = node.args[3], node.args[4], node.args[5], node.args[6], node.args[8]
        out = node.meta["val"]
        direction = "forward"
    else:
        out, x, w = get(node.args[0]), get(node.args[1]), get(node.args[2])  # out: the output gradient, shaped as y
        stride, padding, dilation, transposed, groups = (node.args[4], node.args[5], node.args[6], node.args[7],
                                                         node.args[9])
        direction = "data" if node.args[10][0] else "filter"
    if x.dim() != 4 or w.dim() != 4:
        return None
    device = Device(gpu, _math_of(node, math))
    element = x.element_size()
    n, c, h, wd = (int(s) for s in x.shape)
    stride, padding, dilation, groups = _pair(stride), _pair(padding), _pair(dilation), int(groups)
    if not transposed:
        shape = cudnn.ConvShape(n, c, h, wd, int(w.shape[0]), int(w.shape[2]), int(w.shape[3]), stride, padding,
                                dilation, groups, element)
        if direction == "forward":
            return cudnn.forward_algorithms(shape, device)
        if direction == "data":
            return cudnn.pareto(cudnn.backward_data_algorithms(shape, device))
        return cudnn.pareto(cudnn.backward_filter_algorithms(shape, device))
    _, k, oh, ow = (int(s) for s in out.shape)
    mirror = cudnn.ConvShape(n, k, oh, ow, c, int(w.shape[2]), int(w.shape[3]), stride, padding, dilation, groups,
                             element)
    if direction == "forward":
        return cudnn.pareto(cudnn.backward_data_algorithms(mirror, device))
    if direction == "data":
        return cudnn.pareto(cudnn.forward_algorithms(mirror, device))
    return cudnn.pareto(cudnn.backward_filter_algorithms(mirror, device))


# --- a planning node -------------------------------------------------------------------------------------


def node_implementations(planning: PlanningGraph, group: Group, gpu: GPU, math: str) -> list[dict]:
    """`default` (every operation at its roofline time), or one per cuDNN family for a node with a convolution."""
    gm = planning.step.graph_module
    transient = transient_peak_bytes(planning, group)
    algorithms = None
    if group.convolution is not None:
        algorithms = convolution_algorithms(group.convolution, gm, gpu, math)
    others_ms = sum(op_time_ms(op, gm, gpu, math) for op in group.ops if algorithms is None or op is not group.convolution)
    if not algorithms:
        return [{"name": "default", "time_ms": round(others_ms, 6), "workspace_bytes": transient}]
    return [{"name": a.family, "time_ms": round(others_ms + a.time_ms, 6), "workspace_bytes": transient + a.workspace_bytes}
            for a in algorithms]


# --- the profile -----------------------------------------------------------------------------------------


def estimate_step(
    model: nn.Module,
    example_inputs,
    loss_fn: Callable,
    targets=None,
    *,
    kwargs: dict | None = None,
    gpu: str | GPU = "h100",
    math: str = "fp32",
    optimizer: str = "sgd-momentum",
    memory_bytes: int | None = None,
    name: str | None = None,
    notes: str = "",
) -> tuple[GraphProfile, ProfiledStep]:
    """The estimated profile and the captured step it was made from (see `estimate_profile`)."""
    gpu = gpu_of(gpu)
    if math not in MATHS:
        raise EstimateError(f"math must be {' or '.join(MATHS)} (half-precision tensors use the tensor cores by "
                            f"themselves), not {math!r}")
    optimizer_state_bytes(optimizer, 0)  # an unknown optimizer is refused before the capture
    if memory_bytes is not None and memory_bytes < 1:
        raise EstimateError(f"device memory must be at least 1 byte, not {memory_bytes}")
    if not isinstance(model, nn.Module):
        raise EstimateError(f"the model must be a torch.nn.Module, not {type(model).__name__}")
    if not callable(loss_fn):
        raise EstimateError("a loss function is needed: loss = loss_fn(model(*inputs), targets)")
    inputs = as_tuple(example_inputs)
    kwargs = dict(kwargs or {})
    leaves = tree_flatten(((inputs, kwargs, targets), {}))[0]
    with _Preserved(model, _first_device(model, leaves)):
        profiled = plan_step(model, inputs, kwargs, targets, loss_fn)
    planning, step = profiled.planning, profiled.step
    groups = planning.groups
    nodes = []
    for group in groups:
        output_bytes, extra_bytes = node_sizes(planning, group)
        document = {
            "id": group.id, "name": group.id, "kind": group.kind, "op_type": group.op_type,
            "output_bytes": output_bytes, "extra_saved_bytes": extra_bytes, "module": group.module,
            "inputs": [groups[i].id for i in group.inputs],
            "implementations": node_implementations(planning, group, gpu, math),
        }
        if group.forward_node is not None:
            document["forward_node"] = groups[group.forward_node].id
        nodes.append(document)
    loss = step.loss.meta["val"]
    operations = sum(1 for n in step.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    document = {
        "name": name or f"{type(model).__name__} {step.input_signature} on {gpu.name} (estimated)",
        "hardware": {
            "name": gpu.name,
            "memory_capacity_bytes": memory_bytes or gpu.memory_bytes,
            "d2h_bandwidth_gb_per_s": gpu.d2h_gb_per_s,
            "h2d_bandwidth_gb_per_s": gpu.h2d_gb_per_s,
            "transfer_latency_ms": TRANSFER_LATENCY_MS,
        },
        "fixed_memory": fixed_memory(profiled, leaves, optimizer, loss.numel() * loss.element_size(), "cuda"),
        "nodes": nodes,
        "provenance": {
            "source": "estimated",
            "device": gpu.name,
            "estimator": f"{ESTIMATOR} v{ESTIMATOR_VERSION}",
            "tool": f"{TOOL}, torch {torch.__version__}",
            # no structure hash: a replay needs a profile measured on the device (the implementations here are
            # cuDNN's families, which the executor does not run by name)
            "input_signature": step.input_signature,
            "target_signature": step.target_signature,
            "notes": "; ".join(filter(None, [
                f"{math} math (half-precision operations: the GPU's BF16 tensor-core peak)",
                f"{operations} ATen operations in {len(groups)} planning nodes, shapes from fake tensors: no step run",
                "time: per ATen operation, roofline of models/roofline.py (FLOPs: torch.utils.flop_counter formulas; "
                "bytes: distinct elements read plus elements written; normalisation reads twice; fused attention at "
                "the attention efficiency, its backward recomputing the scores) plus a launch each; convolutions: "
                "one implementation per cuDNN family (models/cudnn.py)",
                "workspace: peak of the node's transient intermediates (fake sizes) plus the convolution algorithm's",
                f"optimizer {optimizer}",
                f"GPU figures: {'; '.join(gpu.sources)}",
                notes,
            ])),
        },
    }
    return parse_profile(document, "estimated profile"), profiled


def estimate_profile(
    model: nn.Module,
    example_inputs,
    loss_fn: Callable,
    targets=None,
    *,
    kwargs: dict | None = None,
    gpu: str | GPU = "h100",
    math: str = "fp32",
    optimizer: str = "sgd-momentum",
    memory_bytes: int | None = None,
    name: str | None = None,
    notes: str = "",
) -> GraphProfile:
    """A GraphProfile of `loss_fn(model(*inputs, **kwargs), targets)`'s training step on `gpu` (a key of
    `models.gpus.GPUS`), estimated from its ATen operations: no step is run and no activation allocated.

    `math`: fp32, or tf32 for float32 GEMMs and convolutions on tensor cores (A100, H100). `optimizer`: the
    state counted as fixed memory (sgd, sgd-momentum, adam...). `memory_bytes`: device memory if not the GPU's.
    """
    return estimate_step(model, example_inputs, loss_fn, targets, kwargs=kwargs, gpu=gpu, math=math,
                         optimizer=optimizer, memory_bytes=memory_bytes, name=name, notes=notes)[0]


def estimate_workload(spec: str, gpu: str | GPU, *, batch_size: int | None = None, math: str = "fp32",
                      optimizer: str = "sgd-momentum", memory_bytes: int | None = None) -> GraphProfile:
    """Estimate a `file.py:build` / `package.module:build` workload (models/workload.py) on `gpu`."""

    gpu = gpu_of(gpu)  # an unknown GPU is refused before the user's build runs
    workload = load_workload(spec, batch_size=batch_size)
    batch = f" batch {batch_size}" if batch_size is not None else ""
    return estimate_profile(workload.model, workload.inputs, workload.loss_fn, workload.targets,
                            kwargs=workload.kwargs, gpu=gpu, math=math, optimizer=optimizer, memory_bytes=memory_bytes,
                            name=f"{workload.name}{batch} on {gpu.name} (estimated)", notes=f"workload {spec}")


def estimate_reference(name: str, batch_size: int, gpu: str | GPU, *, small: bool = False, image_size: int | None = None,
                       tokens: int | None = None, math: str = "fp32", optimizer: str = "sgd-momentum") -> GraphProfile:
    """A reference network of `models.registry` captured with its loss and estimated per operation: the same
    network and step `models.estimator.estimate` prices per layer, for comparing the two."""

    spec = get_model(name, small, image_size=image_size, tokens=tokens)
    with torch.device("meta"):
        model = spec.build()
    model = model.to_empty(device="cpu")  # real storage, never initialised: only shapes are read
    inputs, targets = spec.example_inputs(batch_size)
    return estimate_profile(model, (inputs,), spec.loss, targets, gpu=gpu, math=math, optimizer=optimizer,
                            name=f"{spec.name}{' (small)' if small else ''} batch {batch_size} on {gpu_of(gpu).name} "
                            "(estimated per operation)")


__all__ = ["estimate_reference", "estimate_profile", "estimate_step", "estimate_workload", "EstimateError", "gpu_of", "op_flops",
           "op_bytes", "op_time_ms", "convolution_algorithms", "transient_peak_bytes"]
