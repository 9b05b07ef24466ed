"""From an nn.Module to a list of operators with shapes: torch.fx tracing and shape propagation.

Shapes come from running the traced graph on the meta device, so a full-size
network at a large batch costs no memory. A model fx cannot trace raises
`TraceFailure`, a `MososError` whose message names the module (and the line)
that could not be handled.
"""

from __future__ import annotations

import operator
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from planner.errors import MososError

_TORCH_DIR = os.path.dirname(torch.__file__)


class TraceFailure(MososError):
    """The model cannot be turned into a graph of modules and functions."""


# Canonical operator types. Anything else is estimated as a memory-bound op that saves all its inputs.
MODULE_TYPES: dict[type, str] = {
    nn.Conv2d: "conv2d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.Linear: "linear",
    nn.BatchNorm2d: "batch_norm",
    nn.BatchNorm1d: "batch_norm",
    nn.LayerNorm: "layer_norm",
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.MaxPool2d: "max_pool2d",
    nn.AvgPool2d: "avg_pool2d",
    nn.AdaptiveAvgPool2d: "avg_pool2d",
    nn.Dropout: "dropout",
    nn.Softmax: "softmax",
    nn.Flatten: "view",
    nn.Identity: "view",
}
FUNCTION_TYPES: dict[Any, str] = {
    F.conv2d: "conv2d",
    F.linear: "linear",
    F.relu: "relu",
    torch.relu: "relu",
    F.gelu: "gelu",
    F.max_pool2d: "max_pool2d",
    F.avg_pool2d: "avg_pool2d",
    F.adaptive_avg_pool2d: "avg_pool2d",
    F.dropout: "dropout",
    F.batch_norm: "batch_norm",
    F.layer_norm: "layer_norm",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    F.scaled_dot_product_attention: "attention",
    operator.add: "add",
    operator.iadd: "add",
    torch.add: "add",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    torch.bmm: "matmul",
    torch.cat: "cat",
    torch.flatten: "view",
    torch.reshape: "view",
    torch.transpose: "view",
    torch.permute: "view",
    torch.unsqueeze: "view",
    torch.squeeze: "view",
    operator.getitem: "view",
}
METHOD_TYPES: dict[str, str] = {
    **{m: "view" for m in ("view", "reshape", "flatten", "unflatten", "transpose", "permute", "unsqueeze",
                           "squeeze", "expand", "t", "view_as", "reshape_as", "contiguous")},
    "relu": "relu",
    "softmax": "softmax",
    "add": "add",
    "mul": "mul",
    "matmul": "matmul",
}


@dataclass
class TracedOp:
    """One fx node that produces a tensor."""

    name: str  # the fx node name: the profile's node id
    op_type: str
    module_path: str | None
    module_type: str | None
    inputs: list[str]  # fx names of the tensors it reads (placeholders included, parameters not)
    input_shapes: list[tuple[int, ...]]
    output_shape: tuple[int, ...]
    element_bytes: int
    parameter_count: int = 0  # parameters of its own module, when it is a module call
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def output_numel(self) -> int:
        return _numel(self.output_shape)

    @property
    def output_bytes(self) -> int:
        return self.output_numel * self.element_bytes


@dataclass
class TracedGraph:
    placeholders: dict[str, tuple[tuple[int, ...], int]]  # name -> (shape, element bytes)
    ops: list[TracedOp]
    output: str  # fx name of the op whose tensor is the model's output
    parameter_bytes: int
    buffer_bytes: int


def _numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


class _NamingTracer(fx.Tracer):
    """Remembers which module it is inside, so a failure can say where."""

    def __init__(self):
        super().__init__()
        self.failed_in: tuple[str, str] | None = None  # the innermost module being traced when it failed

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = (self.path_of_module(m) or "<root>", type(m).__name__)
            raise


def _user_frame(error: BaseException) -> str | None:
    """The innermost traceback frame outside torch: the model line that fx tripped on."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if not f.filename.endswith(("models/trace.py",))]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.name}() at {os.path.basename(frame.filename)}:{frame.lineno}"


def trace(model: nn.Module, example_input: torch.Tensor) -> TracedGraph:
    """Trace `model` with fx and propagate the shapes of `example_input` (best on the meta device)."""
    tracer = _NamingTracer()
    try:
        graph = tracer.trace(model)
    except Exception as error:  # fx raises TraceError, TypeError, RuntimeError... all mean the same to the user
        where = tracer.failed_in or ("<root>", type(model).__name__)
        line = _user_frame(error)
        raise TraceFailure(
            f"cannot trace module {where[0]!r} ({where[1]})" + (f" in {line}" if line else "")
            + f": {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. "
            "torch.fx needs forward() code without data-dependent control flow; "
            "rewrite that part or make it a leaf module."
        ) from None
    gm = fx.GraphModule(tracer.root, graph)
    try:
        ShapeProp(gm).propagate(example_input)
    except Exception as error:
        cause = error.__cause__ or error
        node = str(error).split("node=")[1].split(" with meta")[0] if "node=" in str(error) else "?"
        raise TraceFailure(
            f"cannot compute shapes at node {node}: {type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}"
        ) from None
    return _collect(gm)


def _module_type_name(gm: fx.GraphModule, node: fx.Node) -> tuple[str | None, str | None]:
    if node.op == "call_module":
        return str(node.target), type(gm.get_submodule(node.target)).__name__
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, kind = list(stack.values())[-1]
        return path or None, getattr(kind, "__name__", str(kind))
    return None, None


def _op_type(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        for kind, name in MODULE_TYPES.items():
            if type(module) is kind:
                return name
        return type(module).__name__.lower()
    if node.op == "call_function":
        return FUNCTION_TYPES.get(node.target, getattr(node.target, "__name__", str(node.target)))
    return METHOD_TYPES.get(str(node.target), str(node.target))


def _tensor_meta(node: fx.Node) -> TensorMetadata | None:
    meta = node.meta.get("tensor_meta")
    return meta if isinstance(meta, TensorMetadata) else None


def _collect(gm: fx.GraphModule) -> TracedGraph:
    placeholders: dict[str, tuple[tuple[int, ...], int]] = {}
    ops: list[TracedOp] = []
    output = None
    for node in gm.graph.nodes:
        meta = _tensor_meta(node)
        if node.op == "placeholder":
            if meta is not None:
                placeholders[node.name] = (tuple(meta.shape), meta.dtype.itemsize)
            continue
        if node.op == "output":
            result = node.args[0]
            if not isinstance(result, fx.Node):
                raise TraceFailure("the model must return a single tensor (found a tuple, list or dict)")
            output = result.name
            continue
        if node.op == "get_attr":
            continue
        if meta is None:
            where = _module_type_name(gm, node)[0] or node.name
            raise TraceFailure(
                f"node {node.name!r} ({node.op} {node.target}, in {where}) does not produce one tensor; "
                "the estimator handles operators with one tensor output"
            )
        inputs, shapes = [], []
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                continue
            arg_meta = _tensor_meta(arg)
            if arg_meta is None:
                continue
            inputs.append(arg.name)
            shapes.append(tuple(arg_meta.shape))
        path, type_name = _module_type_name(gm, node)
        attributes: dict[str, Any] = {}
        parameter_count = 0
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            parameter_count = sum(p.numel() for p in module.parameters(recurse=False))
            for attr in ("kernel_size", "stride", "padding", "dilation", "groups", "in_channels", "out_channels",
                         "in_features", "out_features"):
                if hasattr(module, attr):
                    attributes[attr] = getattr(module, attr)
        elif node.op == "call_function" and node.target is F.conv2d:
            weight = node.args[1]
            weight_shape = tuple(_tensor_meta(weight).shape) if isinstance(weight, fx.Node) else ()
            attributes.update(_functional_conv_attributes(node, weight_shape))
        ops.append(
            TracedOp(node.name, _op_type(gm, node), path, type_name, inputs, shapes, tuple(meta.shape),
                     meta.dtype.itemsize, parameter_count, attributes)
        )
    if output is None:
        raise TraceFailure("the traced graph has no output")
    parameter_bytes = sum(p.numel() * p.element_size() for p in gm.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in gm.buffers())
    return TracedGraph(placeholders, ops, output, parameter_bytes, buffer_bytes)


def _functional_conv_attributes(node: fx.Node, weight_shape: tuple[int, ...]) -> dict[str, Any]:
    def pair(value):
        return tuple(value) if isinstance(value, (tuple, list)) else (value, value)

    args = list(node.args) + [None] * 7
    kwargs = node.kwargs
    return {
        "kernel_size": tuple(weight_shape[2:4]),
        "out_channels": weight_shape[0],
        "stride": pair(kwargs.get("stride", args[3] or 1)),
        "padding": pair(kwargs.get("padding", args[4] or 0)),
        "dilation": pair(kwargs.get("dilation", args[5] or 1)),
        "groups": kwargs.get("groups", args[6] or 1),
    }
