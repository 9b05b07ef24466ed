"""Capture a model as a graph of module and function calls (torch.fx), one profile node per call.

Node ids are the fx node names, so a profile, a schedule and the executor
agree on what "conv1" is. Every node can be called on its own with values
from other nodes, which is what profiling per node and replaying a schedule
need. In-place variants are called out of place (same numbers), because a
node's input may still be needed by a later node or by a backward pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from executor.errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class Ref:
    """A reference to another fx node's value inside a node's arguments."""

    name: str


class _ScopeFailure(Exception):
    def __init__(self, path: str, type_name: str, error: BaseException):
        self.path, self.type_name, self.error = path, type_name, error
        super().__init__(str(error))


class _ScopeTracer(fx.Tracer):
    """A tracer that remembers which module it was inside when tracing failed."""

    def call_module(self, m: nn.Module, forward: Callable, args, kwargs):
        path = self.path_of_module(m) or "<root>"
        try:
            return super().call_module(m, forward, args, kwargs)
        except _ScopeFailure:
            raise
        except Exception as error:  # noqa: BLE001 - turned into a readable CaptureError
            raise _ScopeFailure(path, type(m).__name__, error) from error


def _user_frame(error: BaseException) -> str | None:
    """The innermost frame of the traceback that is not torch itself: the user's function."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if not f.filename.endswith(os.path.join("executor", "capture.py"))]
    if not frames:
        return None
    frame = frames[-1]
    return f"function {frame.name!r} ({os.path.basename(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def trace(model: nn.Module) -> fx.GraphModule:
    """Symbolically trace `model`; a model fx cannot handle raises CaptureError naming where."""
    tracer = _ScopeTracer()
    try:
        graph = tracer.trace(model)
    except _ScopeFailure as failure:
        where = _user_frame(failure.error)
        raise CaptureError(
            f"torch.fx cannot trace {type(model).__name__}: it failed inside module {failure.path!r} "
            f"({failure.type_name})" + (f", in {where}" if where else "") + f": {_first_line(failure.error)}. "
            "Data-dependent control flow or non-torch calls cannot be captured; make that part a leaf module "
            "or rewrite it with tensor operations."
        ) from None
    except Exception as error:  # noqa: BLE001
        where = _user_frame(error)
        raise CaptureError(
            f"torch.fx cannot trace {type(model).__name__}"
            + (f": it failed in {where}" if where else "")
            + f": {_first_line(error)}"
        ) from None
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


_INPLACE_METHOD_EXCEPTIONS = {"requires_grad_", "retain_grad", "share_memory_"}


@dataclass
class CapturedNode:
    """One call of the model (module, function or tensor method): one forward node of the profile."""

    id: str
    op: str  # call_module, call_function, call_method
    target: Any
    op_type: str
    module_path: str | None
    args: Any  # with Ref in place of fx nodes
    kwargs: dict
    inputs: list[str]  # ids of compute nodes read (no placeholders, no attributes), in first-use order
    module: nn.Module | None = None
    parameters: list[nn.Parameter] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    inplace_modules: list[nn.Module] = field(default_factory=list)

    @property
    def is_conv2d(self) -> bool:
        return (
            self.op == "call_module"
            and type(self.module) is nn.Conv2d
            and self.module.padding_mode == "zeros"
            and not isinstance(self.module.padding, str)
            and not self.kwargs
            and len(self.args) == 1
        )

    def call(self, args, kwargs, conv_algorithm: str | None = None, conv_backward: str | None = None):
        """Run this node eagerly on already resolved arguments."""
        if self.op == "call_module":
            if conv_algorithm is not None and self.is_conv2d:
                from executor.conv_algorithms import conv2d

                m = self.module
                return conv2d(args[0], m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups,
                              algorithm=conv_algorithm, backward_algorithm=conv_backward)
            with _out_of_place(self.inplace_modules):
                return self.module(*args, **kwargs)
        if self.op == "call_function":
            if kwargs.get("inplace"):
                kwargs = {**kwargs, "inplace": False}
            return self.target(*args, **kwargs)
        name = self.target
        if name.endswith("_") and not name.endswith("__") and name not in _INPLACE_METHOD_EXCEPTIONS:
            name = name[:-1]
        receiver, *rest = args
        return getattr(receiver, name)(*rest, **kwargs)


@contextlib.contextmanager
def _out_of_place(modules: list[nn.Module]):
    if not modules:
        yield
        return
    for m in modules:
        m.inplace = False
    try:
        yield
    finally:
        for m in modules:
            m.inplace = True


@dataclass
class CapturedGraph:
    model: nn.Module
    graph_module: fx.GraphModule
    placeholders: list[str]
    attributes: dict[str, Any]  # get_attr node name -> the tensor/parameter it reads
    nodes: list[CapturedNode]
    output: Any  # pytree of Ref: what the model returns

    @property
    def node_by_id(self) -> dict[str, CapturedNode]:
        return {node.id: node for node in self.nodes}

    def output_ids(self) -> list[str]:
        ids: list[str] = []
        fx.node.map_aggregate(self.output, lambda a: ids.append(a.name) if isinstance(a, Ref) and a.name in self.node_by_id else None)
        return list(dict.fromkeys(ids))

    def structure_sha256(self) -> str:
        """Hash of what the graph computes: ops, wiring, module settings and parameter shapes; not the input shapes."""
        digest = hashlib.sha256()
        for fx_node in self.graph_module.graph.nodes:
            args = fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: Ref(n.name))
            digest.update(f"{fx_node.op}|{fx_node.name}|{_target_name(fx_node.target)}|{args!r}\n".encode())
        for node in self.nodes:
            if node.module is not None:
                digest.update(f"module {node.id}: {node.module!r}\n".encode())
        for name, tensor in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{tensor.requires_grad}\n".encode())
        return digest.hexdigest()


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def _op_type(fx_node: fx.Node, gm: fx.GraphModule) -> str:
    if fx_node.op == "call_module":
        return type(gm.get_submodule(fx_node.target)).__name__
    if fx_node.op == "call_function":
        return getattr(fx_node.target, "__name__", str(fx_node.target))
    return str(fx_node.target)


def _scope(fx_node: fx.Node) -> str | None:
    if fx_node.op == "call_module":
        return str(fx_node.target)
    stack = fx_node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else path
        return str(path) or None
    return None


def capture(model: nn.Module) -> CapturedGraph:
    """Trace `model` and describe each call as a CapturedNode."""
    gm = trace(model)
    placeholders: list[str] = []
    attributes: dict[str, Any] = {}
    nodes: list[CapturedNode] = []
    output: Any = None
    compute_ids: set[str] = set()
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            placeholders.append(fx_node.name)
            continue
        if fx_node.op == "get_attr":
            attributes[fx_node.name] = _get_attr(gm, fx_node.target)
            continue
        if fx_node.op == "output":
            output = fx.node.map_arg(fx_node.args[0], lambda n: Ref(n.name))
            continue
        args, kwargs = fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: Ref(n.name))
        inputs = [n.name for n in fx_node.all_input_nodes if n.name in compute_ids]
        node = CapturedNode(
            id=fx_node.name,
            op=fx_node.op,
            target=fx_node.target,
            op_type=_op_type(fx_node, gm),
            module_path=_scope(fx_node),
            args=args,
            kwargs=dict(kwargs),
            inputs=list(dict.fromkeys(inputs)),
        )
        if fx_node.op == "call_module":
            node.module = gm.get_submodule(fx_node.target)
            node.parameters = list(node.module.parameters())
            node.buffers = list(node.module.buffers())
            node.inplace_modules = [m for m in node.module.modules() if getattr(m, "inplace", None) is True]
        for source in fx_node.all_input_nodes:
            if source.op == "get_attr" and isinstance(attributes[source.name], nn.Parameter):
                node.parameters.append(attributes[source.name])
        nodes.append(node)
        compute_ids.add(node.id)
    if not nodes:
        raise CaptureError(f"{type(model).__name__} has no operations to schedule: its forward returns its input")
    return CapturedGraph(model, gm, placeholders, attributes, nodes, output)


def _get_attr(gm: fx.GraphModule, target: str):
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def tensor_signature(values) -> str:
    """'float32[2,3,32,32],int64[2]': what a profile was measured with, to compare against real inputs."""
    leaves = []
    fx.node.map_aggregate(values, lambda v: leaves.append(v))
    parts = []
    for value in leaves:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).replace("torch.", "")
            parts.append(f"{dtype}[{','.join(str(s) for s in value.shape)}]")
        elif value is not None:
            parts.append(type(value).__name__)
    return ",".join(parts)
