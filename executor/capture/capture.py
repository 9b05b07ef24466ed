"""Capture one training step of a model, its loss included, as the ATen graph PyTorch itself runs.

`capture(model, inputs, kwargs, targets, loss_fn)` exports the model with its
loss (`torch.export`, non-strict) and traces forward and backward into one
functionalised joint graph (executor.capture.export). In-place operations arrive as
their out-of-place forms; a mutated buffer or input (BatchNorm statistics,
`torch.relu_(x)` on an input) is a graph output written back once per step.

What cannot be captured is refused with a CaptureError that names the module,
the user's source line and what to change: data-dependent control flow,
`.item()` and other data-dependent values or shapes, operations export cannot
trace, a backward that fails in plain PyTorch too. Never a bare traceback,
never a silently different model.

A forward operation with several results, some read only later in the forward
pass and some small ones read only by the backward (batch norm's statistics,
dropout's mask), hands the small ones on through a copy of their own
(`_hand_off_saved_results`), so the planner can free the large result once the
forward pass is done with it, as eager autograd does.

Each `aten.convolution_backward` is split here into a filter-gradient call
(weight and bias) and a data-gradient call (input), run in that order, so the
planner can free a convolution's input before its input gradient exists;
the two calls give bitwise the same numbers as the combined one (ATen computes
each requested gradient independently).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import operator
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from executor.capture import export
from executor.capture import autocast
from executor.capture import python_state
from executor.errors import CaptureError
from models.estimator import HAND_OFF_MAX_FRACTION  # one rule for the capture and the per-layer estimator

_TORCH_DIR = os.path.dirname(torch.__file__)
_EXECUTOR_DIR = os.path.dirname(os.path.abspath(__file__))

LOSS_MODULE = "loss"  # the module path of operations the loss function runs outside the model
ROOT_FORWARD = "the model's forward"  # where an operation of the model's own forward is, in messages


@dataclass
class Source:
    """Where a graph input's value comes from at each step."""

    kind: str  # parameter | buffer | constant | input | tangent
    name: str | None = None  # parameters and buffers: the name in the model (or the loss module)
    index: int | None = None  # inputs: position among the flattened (args, kwargs, targets) leaves
    tensor: torch.Tensor | None = None  # constants: the captured tensor
    owner: str = "model"  # parameters and buffers: "model" or "loss_fn"

    def describe(self) -> str:
        if self.kind in ("parameter", "buffer"):
            return f"{self.kind} {self.name!r}" + (" of the loss module" if self.owner == "loss_fn" else "")
        if self.kind == "input":
            return f"input leaf {self.index}"
        return self.kind


@dataclass
class CapturedStep:
    """The joint forward+backward graph of one training step and what its inputs and outputs mean."""

    model: nn.Module
    loss_fn: Callable
    graph_module: fx.GraphModule  # the joint graph (convolution backward split in two)
    sources: dict[fx.Node, Source]  # every placeholder
    loss: fx.Node  # the loss value
    gradients: list[tuple[fx.Node, str, str]]  # (value, parameter name, owner)
    mutations: list[tuple[fx.Node, fx.Node]]  # (new value, placeholder it is written back into)
    input_spec: Any  # pytree spec of ((args, kwargs, targets), {})
    constant_leaves: dict[int, Any]  # leaves that are not tensors (flags, sizes): baked into the graph
    input_signature: str
    target_signature: str | None
    module_path: dict[fx.Node, str] = field(default_factory=dict)  # module a node comes from ('' root, 'loss')
    source_line: dict[fx.Node, str] = field(default_factory=dict)
    backward: set = field(default_factory=set)  # nodes of the backward pass
    export_seconds: float = 0.0
    joint_seconds: float = 0.0
    autocast: tuple = ()  # the autocast regions it was captured under (executor.capture.autocast.autocast_state())
    attention_notes: list[str] = field(default_factory=list)  # each attention mask: taken out as eager, or kept and why
    loss_split: bool = False  # captured with the split loss asked for (executor.capture.split_loss)
    loss_notes: list[str] = field(default_factory=list)  # each cross-entropy: split, or computed whole and why

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def parameter(self, name: str, owner: str = "model") -> nn.Parameter:
        root = self.model if owner == "model" else self.loss_fn
        return dict(root.named_parameters(remove_duplicate=False))[name]

    def buffer(self, name: str, owner: str = "model") -> torch.Tensor:
        root = self.model if owner == "model" else self.loss_fn
        return dict(root.named_buffers(remove_duplicate=False))[name]

    def structure_sha256(self) -> str:
        """What the graph computes: every operation, its arguments and wiring, and what each input is.
        Shapes are part of the operations' arguments, so other input shapes are another structure (the
        input signature is checked first, for a clearer message)."""
        digest = hashlib.sha256()
        for node in self.graph.nodes:
            if node.op == "placeholder":
                source = self.sources[node]
                digest.update(f"input {node.name} {source.kind} {source.name} {source.index}\n".encode())
                continue
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
            digest.update(f"{node.op} {node.name} {_target_name(node.target)} {args!r}\n".encode())
        for name, parameter in self.model.named_parameters():
            digest.update(f"{name}|{tuple(parameter.shape)}|{parameter.dtype}|{parameter.requires_grad}\n".encode())
        return digest.hexdigest()


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) and f"{getattr(target, '__module__', '')}.{target.__name__}" or str(target)


# --- signatures ------------------------------------------------------------------------------------


def _leaf(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}[{','.join(str(s) for s in value.shape)}]"
    return type(value).__name__ if value is not None else ""


def tensor_signature(values, kwargs: dict | None = None) -> str:
    """'float32[2,3,32,32]', with keyword inputs as 'name=int64[2,16]': what a profile was measured with."""
    parts = [part for part in (_leaf(v) for v in tree_flatten(values)[0]) if part]
    for name in sorted(kwargs or {}):
        leaves = [part for part in (_leaf(v) for v in tree_flatten(kwargs[name])[0]) if part]
        parts.extend(f"{name}={leaf}" for leaf in leaves)
    return ",".join(parts)


# --- errors ----------------------------------------------------------------------------------------


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_TORCH_DIR) and not filename.startswith(_EXECUTOR_DIR) and "<" not in filename


def _module_names(model: nn.Module, loss_fn) -> dict[int, str]:
    names = {id(m): name for name, m in model.named_modules()}
    names[id(model)] = names.get(id(model), "") or ""
    if isinstance(loss_fn, nn.Module):
        for name, m in loss_fn.named_modules():
            names.setdefault(id(m), f"{LOSS_MODULE}.{name}" if name else LOSS_MODULE)
    return names


def _user_frames(error: BaseException) -> list:
    """Frames of the user's code (not torch's, not ours) in the tracebacks of the error and its causes."""
    return [(frame, lineno) for frame, lineno in _frames(error) if _is_user_file(frame.f_code.co_filename)]


def _frames(error: BaseException) -> list:
    """Every frame of the deepest exception, in the error's chain of causes, whose traceback passed through the
    user's code (torch's modules' frames with them: the user's model may be made of them); of the error itself where
    none did (a model made of torch's modules alone)."""
    frames: list = []
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        chain = []
        while tb is not None:
            chain.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        if current is error or any(_is_user_file(frame.f_code.co_filename) for frame, _ in chain):
            frames = chain  # the deepest exception that passed through user code wins
        current = current.__cause__ or current.__context__
    return frames


def _torch_module_advice(error: BaseException) -> str | None:
    """What to change where the value-dependent decision is one of torch's own modules', with an argument the user
    gives it."""
    for frame, _ in reversed(_frames(error)):
        name, owner = frame.f_code.co_name, frame.f_locals.get("self")
        if name == "_detect_is_causal_mask":
            return ("nn.Transformer's layers compare a mask given without is_causal with a causal mask, value by "
                    "value, to choose a kernel: pass is_causal=True with a causal mask (mask=causal, is_causal=True), "
                    "which computes the same")
        if isinstance(owner, nn.modules.batchnorm._BatchNorm) and owner.momentum is None and owner.training:
            return ("a batch norm with momentum=None (a cumulative average of the statistics) divides by its batch "
                    "count read as a Python number, which cannot be captured: give it a momentum (0.1 is PyTorch's "
                    "default), or train this model without the plan")
    return None


def _describe_frame(frame, lineno: int, names: dict[int, str]) -> tuple[str | None, str]:
    """(module path or None, 'file.py:12: code') for a frame of the user's code."""
    import linecache

    code = linecache.getline(frame.f_code.co_filename, lineno).strip()
    where = f"{os.path.basename(frame.f_code.co_filename)}:{lineno} `{code}`"
    owner = frame.f_locals.get("self") if isinstance(frame.f_locals, dict) else None
    module = None
    if isinstance(owner, nn.Module) and id(owner) in names:
        path = names[id(owner)]
        module = f"{path or '<root>'} ({type(owner).__name__})"
    return module, where


def _first_line(error: BaseException) -> str:
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _advice(error: BaseException) -> str:
    text = f"{type(error).__name__} {error}"
    torch_module = _torch_module_advice(error)
    if torch_module is not None:
        return torch_module
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        return ("control flow or a shape that depends on tensor values cannot be captured: compute both branches "
                "and select with torch.where, or move the decision out of the model")
    if "item" in text or "_local_scalar_dense" in text:
        return "a Python number read from a tensor (.item(), float(t), int(t)) cannot be captured: keep it a tensor"
    if "nonzero" in text or "DynamicOutputShape" in text:
        return ("an output shape that depends on tensor values (boolean-mask indexing, nonzero, unique) cannot be "
                "captured: use torch.where or masking that keeps the shape")
    if "inplace operation" in text or "modified by an inplace" in text:
        return "plain PyTorch's backward fails on this model too: an in-place operation overwrites a tensor backward needs"
    return _GENERIC_ADVICE


_GENERIC_ADVICE = "rewrite that part with tensor operations torch.export can trace (see the torch.export documentation)"


def _module_and_line(error: BaseException, model: nn.Module, loss_fn) -> tuple[str | None, str | None]:
    """The innermost module of the user's code the error passed through, and the user's source line."""
    names = _module_names(model, loss_fn)
    module = where = None
    for frame, lineno in reversed(_frames(error)):
        user = _is_user_file(frame.f_code.co_filename)
        found, line = _describe_frame(frame, lineno, names)
        if user:
            where = where or line
        module = module or found  # the innermost module, torch's own (a batch norm, an encoder) included
        if module and where:
            break
    return module, where


def capture_error(error: BaseException, model: nn.Module, loss_fn, stage: str) -> CaptureError:
    """A CaptureError naming the module, the user's source line and what to change."""
    module, where = _module_and_line(error, model, loss_fn)
    message = f"cannot capture {type(model).__name__} ({stage})"
    if module:
        message += f" in module {module}"
    if where:
        message += f" at {where}"
    message += f": {_first_line(error).rstrip('.')}. {_advice(error)}"
    return CaptureError(message)


@contextlib.contextmanager
def _recording_custom_functions(found: list[type]):
    """Note each torch.autograd.Function the forward applies while it is traced (the export runs its forward)."""
    function_class = torch.autograd.Function
    original = function_class.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls not in found:
            found.append(cls)
        return original.__func__(cls, *args, **kwargs)

    function_class.apply = classmethod(apply)
    try:
        yield
    finally:
        function_class.apply = original


@contextlib.contextmanager
def _recording_tensor_hooks(found: list[str]):
    """Note where the step registers a hook on one of its tensors (Tensor.register_hook), still registering it."""
    original = torch.Tensor.register_hook
    torch_folder = os.path.dirname(torch.__file__) + os.sep

    def register_hook(tensor, hook):
        caller = sys._getframe(1)
        if not caller.f_code.co_filename.startswith(torch_folder):  # torch's own dispatch calls it again
            found.append(f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} ({caller.f_code.co_name})")
        return original(tensor, hook)

    torch.Tensor.register_hook = register_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = original


def _refuse_tensor_hooks(found: list[str], model: nn.Module) -> None:
    """Eager calls a hook registered on an activation or an output with its gradient in backward and uses what it
    returns; the captured backward never calls it: a hook that scales or clips trains another model, one that
    logs is silent. Refused, as hooks on parameters are."""
    if not found:
        return
    raise CaptureError(
        f"cannot capture {type(model).__name__}: its step registers a hook on a tensor (Tensor.register_hook at "
        f"{', '.join(dict.fromkeys(found))}), which eager calls in backward with the tensor's gradient, using what it "
        "returns; the replay runs the captured backward, which would never call it (another gradient where the hook "
        "changes it, silence where it logs). Take the hook out of the model and the loss function (read parameters' "
        ".grad after backward() to log, register_post_accumulate_grad_hook on a parameter, which the replay runs), "
        "or train this model without the plan")


def _refuse_custom_functions(found: list[type], model: nn.Module) -> None:
    """The joint graph differentiates what a Function's forward traced to, not what its backward says (a
    straight-through estimator, a hand-written gradient), and a forward run under no_grad (torch.utils.checkpoint's
    reentrant variant) traces to no gradient at all: either would train another model."""
    # a torch.library custom op's autograd (`register_autograd`, Mixtral's grouped matmul) is kept as the op itself in
    # the joint graph, its registered backward with it: the replay runs what eager runs
    found = [cls for cls in found if not cls.__module__.startswith("torch._library")]
    if not found:
        return
    cls = found[0]
    if cls.__module__.startswith("torch.utils.checkpoint"):
        raise CaptureError(
            f"cannot capture {type(model).__name__}: it uses torch.utils.checkpoint with use_reentrant=True, whose "
            "forward runs without autograd and cannot be captured with its gradients; pass use_reentrant=False, or "
            "leave the checkpointing out (the plan decides what to recompute)")
    import inspect

    try:
        where = f" ({os.path.basename(inspect.getsourcefile(cls) or '')}:{inspect.getsourcelines(cls)[1]})"
    except (OSError, TypeError):
        where = ""
    raise CaptureError(
        f"cannot capture {type(model).__name__}: it applies the custom autograd.Function "
        f"{cls.__qualname__}{where}, whose own backward the captured step would replace with the derivative of its "
        "forward; the executor cannot reproduce it (train this model without the plan, or write the Function's "
        "forward so that its derivative is the gradient you want)")


def _plain_pytorch_failure(error: BaseException, model: nn.Module, inputs: tuple, kwargs: dict, targets,
                           loss_fn: Callable, autocast_state: tuple) -> tuple[BaseException | None, str | None]:
    """Plain PyTorch's error if the step, run without torch.export (on fake tensors: no memory), fails the same
    way, and in which module: then the model and its inputs disagree (a shape, a dtype), and advice on export
    would mislead. The same way: the same first line, or the same module with an error of the same kind that is
    not one of fake tensors' own limits (export words a shape mismatch in an MSELoss as "Attempting to broadcast a
    dimension", plain PyTorch as "The size of tensor a (2) must match")."""
    if _advice(error) != _GENERIC_ADVICE:
        return None, None
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode, UnsupportedOperatorException)

    names = _module_names(model, loss_fn)
    running: list[nn.Module] = []

    def entered(module, args):
        running.append(module)

    def left(module, args, output):
        if running and running[-1] is module:
            running.pop()

    hooks = [nn.modules.module.register_module_forward_pre_hook(entered),
             nn.modules.module.register_module_forward_hook(left)]
    wrapper = export.WithLoss(model, loss_fn, autocast_state)
    try:
        with _quiet_torch(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
            # fake parameters and buffers in place of the model's: the model's own (running statistics,
            # counters) stay as they were, and no memory is taken
            state = {name: fake.from_tensor(tensor) for name, tensor in
                     [*wrapper.named_parameters(remove_duplicate=False), *wrapper.named_buffers(remove_duplicate=False)]}
            torch.func.functional_call(wrapper, state, (tuple(inputs), dict(kwargs or {}), targets))
    except Exception as plain:  # noqa: BLE001 - compared, not raised
        failing = next((m for m in reversed(running) if id(m) in names), None)
        module = None if failing is None else f"{names[id(failing)] or '<root>'} ({type(failing).__name__})"
        if _first_line(plain) == _first_line(error):
            return plain, module
        fake_limit = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
        if (module is not None and type(plain) is type(error) and not isinstance(plain, fake_limit)
                and module == _module_and_line(error, model, loss_fn)[0]):
            return plain, module
        return None, None
    finally:
        for hook in hooks:
            hook.remove()
    return None, None


def _inputs_error(error: BaseException, plain: BaseException, model: nn.Module, loss_fn, module: str | None,
                  inputs: tuple, kwargs: dict, targets) -> CaptureError:
    """The step fails in plain PyTorch too: plain PyTorch's words, which the user would see without mosos."""
    found, where = _module_and_line(error, model, loss_fn)
    module = module or found
    place = (f" in module {module}" if module else "") + (f" at {where}" if where else "")
    return CaptureError(
        f"{type(model).__name__} fails on these inputs{place}, in plain PyTorch as well: "
        f"{_first_line(plain).rstrip('.')}. Inputs {tensor_signature(inputs, kwargs) or 'none'}, targets "
        f"{tensor_signature(targets) or 'none'}: check the shapes and dtypes given to the model and its loss"
    )


def _node_place(node: fx.Node) -> tuple[str, str]:
    """(module path, source line) of an exported-program node, from its metadata."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    module = ""
    if stack:
        path, kind = list(stack.values())[-1]
        module = f"{_model_path(path) or '<root>'} ({kind.rsplit('.', 1)[-1]})"
    trace = node.meta.get("stack_trace") or ""
    line = ""
    lines = trace.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if text.startswith("File ") and _is_user_file(text.split('"')[1] if '"' in text else ""):
            filename = text.split('"')[1]
            lineno = text.split("line ")[1].split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            line = f"{os.path.basename(filename)}:{lineno} `{code}`"
            break
    return module, line


# Recurrent layers whose eager kernel is fused (nn.LSTM, nn.GRU, nn.RNN): tracing the backward decomposes them into
# per-step operations, which round otherwise (gradients 7e-8 apart) and leave out the dropout between layers.
_FUSED_RECURRENT = {
    _aten_op: kind for kind, names in (("LSTM", ("lstm",)), ("GRU", ("gru",)), ("RNN", ("rnn_tanh", "rnn_relu")))
    for name in names for overload in ("input", "data")
    if (_aten_op := getattr(getattr(torch.ops.aten, name), overload, None)) is not None
}


def _refuse_unreproducible_operations(program, model: nn.Module) -> None:
    """Operations the captured step would run otherwise than eager does: refused with where and why."""
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _FUSED_RECURRENT:
            module, line = _node_place(node)
            raise CaptureError(
                f"cannot capture {type(model).__name__}: "
                + (f"module {module} " if module else "")
                + f"is a fused recurrent layer (torch.nn.{_FUSED_RECURRENT[node.target]}), which tracing its backward "
                "breaks into per-step operations that round otherwise than eager's kernel and drop the dropout "
                "between its layers: the replay would train another model. Train it without the plan, or build the "
                "recurrence from cells (nn.LSTMCell in a loop), which is captured as eager runs it"
                + (f" (at {line})" if line else ""))
        if node.target is torch.ops.aten.embedding.default and len(node.args) > 4 and node.args[4]:
            module, line = _node_place(node)
            raise CaptureError(
                f"cannot capture {type(model).__name__}: "
                + (f"module {module} " if module else "")
                + "makes sparse gradients (nn.Embedding(sparse=True)); the executor writes dense gradients into .grad. "
                "Use sparse=False (the optimizer then sees a dense gradient, as with most optimizers anyway)"
                + (f" (at {line})" if line else ""))


def _model_path(path: str) -> str:
    """Module path in the exported wrapper ('model.layer1.0') -> in the user's model ('layer1.0')."""
    if path == "model" or path.startswith("model."):
        return path[len("model."):] if path != "model" else ""
    if path == "loss_fn" or path.startswith("loss_fn."):
        return LOSS_MODULE + path[len("loss_fn"):]
    return LOSS_MODULE if path == "" else path


def _check_static(program, model: nn.Module) -> None:
    """Refuse values and shapes that depend on tensor data (export allows them as unbacked symbols)."""
    for node in program.graph_module.graph.nodes:
        values = tree_flatten(node.meta.get("val"))[0]
        dynamic = any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in values) or any(
            isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape) for v in values
        )
        if not dynamic:
            continue
        module, line = _node_place(node)
        target = getattr(node.target, "__name__", str(node.target))
        what = ("reads a Python number from a tensor (.item(), float(t), int(t))" if "item" in target or "scalar" in target
                else f"makes a shape that depends on tensor values ({target})")
        raise CaptureError(
            f"cannot capture {type(model).__name__}: "
            + (f"module {module} " if module else "")
            + what + (f", at {line}" if line else "")
            + ". The executor plans fixed shapes: keep values as tensors and shapes independent of the data "
            "(torch.where instead of boolean indexing or branching on values)"
        )
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    unused = [symbol for symbol in getattr(program, "range_constraints", {})
              if symbol_is_type(symbol, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))]
    if unused:
        # read for Python alone (a print, a log line, a metric): the capture saw a symbol in place of the value,
        # and the replay never runs that Python; refused as docs/executor.md promises for .item(), not left to go quiet
        raise CaptureError(
            f"cannot capture {type(model).__name__}: its step reads a Python number from a tensor (.item(), float(t), "
            "int(t)) that no tensor of the step uses, e.g. to print or log it: Python code in forward runs once, at "
            "the capture (where it saw a symbol, not a number), and never in the planned step, so the log would "
            "stop silently; compute it from the loss or the output after the planned call, outside the model")


# --- the capture ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_torch():
    """torch's own logging and warnings while it traces (graph dumps, symbolic-shape notes, anomaly-mode
    tracebacks): what went wrong reaches the user once, as a CaptureError."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # export prints partial graphs
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def capture(model: nn.Module, inputs: tuple, kwargs: dict | None, targets, loss_fn: Callable,
            autocast_state: tuple | None = None, loss_split: bool = False) -> CapturedStep:
    """Capture `loss_fn(model(*inputs, **kwargs), targets)` and its backward as one ATen graph, under the autocast
    regions of `autocast_state` (default: those in force here); with `loss_split`, a language model's
    cross-entropy over its LM head is the split loss (executor.capture.split_loss), except under autocast."""
    import time

    if autocast_state is None:
        autocast_state = autocast.autocast_state()
    autocast.refuse_value_dependent_masks(kwargs, autocast_state)
    kwargs = dict(kwargs or {})
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError("the model has no trainable parameters: there is no backward pass to plan")
    export.require_supported_torch()
    started = time.perf_counter()
    custom_functions: list[type] = []
    tensor_hooks: list[str] = []

    def exported():
        custom_functions.clear()
        tensor_hooks.clear()
        with python_state.ForwardSideEffects(model, loss_fn), _quiet_torch(), autocast.disabled(), \
                autocast.eager_mask_branch(), _recording_custom_functions(custom_functions), \
                _recording_tensor_hooks(tensor_hooks):
            return export.export_program(model, inputs, kwargs, targets, loss_fn, autocast_state)

    try:
        try:
            program = exported()
        except python_state.StateChanged as changed:
            # once more from the state the forward left: a set-up done at the first call only (transformers'
            # config.problem_type, its output recorders' hooks, Funnel's pooling_mult) is then the model's state,
            # as after a first eager call
            changed.keep()
            try:
                program = exported()
            except python_state.StateChanged as again:
                changed.put_back()  # a forward that changes its state at every call: the model as it was
                raise again from None  # what changes at every call, not the first call's set-up
            except BaseException:
                changed.put_back()
                raise
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 - every export failure becomes a message
        plain, module = _plain_pytorch_failure(error, model, inputs, kwargs, targets, loss_fn, autocast_state)
        if plain is not None:
            raise _inputs_error(error, plain, model, loss_fn, module, inputs, kwargs, targets) from None
        raise capture_error(error, model, loss_fn, "torch.export") from None
    _refuse_tensor_hooks(tensor_hooks, model)
    _refuse_custom_functions(custom_functions, model)
    _refuse_unreproducible_operations(program, model)
    _check_static(program, model)
    exported_at = time.perf_counter()
    try:
        with _quiet_torch(), autocast.disabled():
            exported = export.joint_graph(program, inputs, kwargs, targets,
                                          loss_split=loss_split and not autocast_state)
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001
        raise capture_error(error, model, loss_fn, "tracing its backward") from None
    joint_at = time.perf_counter()
    step = _describe(exported, model, loss_fn, inputs, kwargs, targets, autocast_state)
    if not step.gradients:
        raise CaptureError(
            f"the loss of {type(model).__name__} depends on none of its trainable parameters (detached, computed "
            "from the targets alone, or not a float): there is no backward to plan, and plain PyTorch's backward "
            "fails on it too")
    step.attention_notes = [f"attention at {_model_path(path) or ROOT_FORWARD}: {note}"
                            for path, note in exported.attention_notes]
    step.loss_split = loss_split
    step.loss_notes = list(exported.loss_notes)
    if loss_split and autocast_state:
        step.loss_notes.append(f"the loss is computed whole: it runs under {autocast.describe(autocast_state)}, and "
                               "the split loss computes its logits in float32 where eager's are half precision")
    elif loss_split and not step.loss_notes:
        step.loss_notes.append("the loss is computed whole: the step has no cross-entropy (torch's "
                               "cross_entropy over a linear layer's logits) to split")
    step.export_seconds = exported_at - started
    step.joint_seconds = joint_at - exported_at
    return step


def _describe(exported: export.Exported, model, loss_fn, inputs, kwargs, targets, autocast_state: tuple = ()) -> CapturedStep:
    d = exported.descriptors
    gm = exported.joint
    graph = gm.graph
    wrapper_constants = dict(exported.constants)
    buffers = {"model": dict(model.named_buffers(remove_duplicate=False)),
               "loss_fn": dict(loss_fn.named_buffers(remove_duplicate=False)) if isinstance(loss_fn, nn.Module) else {}}
    sources: dict[fx.Node, Source] = {}
    for node in graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, d.ParamAOTInput):
            owner, name = export.owner_and_name(desc.target)
            sources[node] = Source("parameter", name, owner=owner)
        elif isinstance(desc, d.BufferAOTInput):
            owner, name = export.owner_and_name(desc.target)
            if owner is not None and name in buffers[owner]:
                sources[node] = Source("buffer", name, owner=owner)
            else:
                sources[node] = Source("constant", desc.target, tensor=wrapper_constants[desc.target])
        elif isinstance(desc, d.PlainAOTInput):
            sources[node] = Source("input", index=desc.idx)
        elif isinstance(desc, d.TangentAOTInput):
            sources[node] = Source("tangent")
        else:
            raise CaptureError(_unsupported_input(desc, model))
    output = graph.output_node()
    loss = None
    gradients, mutations = [], []
    placeholder_of = {}
    for node, source in sources.items():
        if source.kind in ("buffer", "input", "constant"):
            placeholder_of[(source.kind, source.owner, source.name, source.index)] = node
    for desc, value in zip(output.meta["desc"], output.args[0]):
        if desc is None or value is None:
            continue
        if isinstance(desc, d.PlainAOTOutput):
            loss = value
        elif isinstance(desc, d.GradAOTOutput):
            grad_of = desc.grad_of
            if isinstance(grad_of, d.ParamAOTInput):
                owner, name = export.owner_and_name(grad_of.target)
                gradients.append((value, name, owner))
            else:
                # a gradient for a user input or a buffer: nobody asked for it (inputs are refused if they need one)
                continue
        elif isinstance(desc, d.InputMutationAOTOutput):
            mutated = desc.mutated_input
            if isinstance(mutated, d.BufferAOTInput):
                owner, name = export.owner_and_name(mutated.target)
                if owner is not None and name in buffers[owner]:
                    key = ("buffer", owner, name, None)
                else:
                    key = ("constant", "model", mutated.target, None)
            elif isinstance(mutated, d.PlainAOTInput):
                key = ("input", "model", None, mutated.idx)
            elif isinstance(mutated, d.ParamAOTInput):
                owner, name = export.owner_and_name(mutated.target)
                raise CaptureError(
                    f"cannot capture {type(model).__name__}: its forward changes the parameter {name!r} in place (as "
                    "nn.Embedding(max_norm=...) renormalises the rows it reads), which the executor cannot repeat "
                    "inside the planned step; change parameters outside the forward (after the optimizer's step), or "
                    "leave max_norm out")
            else:
                raise CaptureError(f"cannot capture {type(model).__name__}: it mutates {mutated}, which the executor "
                                   "cannot write back")
            mutations.append((value, placeholder_of[key]))
        else:
            raise CaptureError(f"cannot capture {type(model).__name__}: its graph returns {desc}, which the executor "
                               "does not handle (outputs that alias each other or tensor subclasses)")
    if loss is None:
        raise CaptureError(f"cannot capture {type(model).__name__}: the loss is not part of the graph")
    loss_value = loss.meta.get("val") if isinstance(loss, fx.Node) else None
    if isinstance(loss_value, torch.Tensor) and loss_value.numel() != 1:
        # plain PyTorch's loss.backward() refuses it ("grad can be implicitly created only for scalar outputs");
        # the joint graph would seed it with ones and train on the sum, a different step
        shape = "[" + ",".join(str(size) for size in loss_value.shape) + "]"
        raise CaptureError(
            f"cannot capture {type(model).__name__}: the loss function returned a {str(loss_value.dtype)[6:]}{shape} "
            "tensor, not a single number; backward needs a scalar loss: reduce it (.mean() or .sum(), as your "
            "training loop would), or use a loss module's default reduction")
    if autocast_state and autocast_state[0][2]:
        # eager's autocast cache (on unless cache_enabled=False; one flag for every device) casts a parameter once
        # per region; without it eager casts at every use, as the trace does
        parameters = {node: source.name for node, source in sources.items()
                      if source.kind == "parameter" and source.owner == "model"}
        by_name = {name: value for value, name, owner in gradients if owner == "model"}
        backward = {node for node in graph.nodes if node.meta.get("partitioner_tag") == "is_backward"}
        rewritten = autocast.share_parameter_casts(gm, parameters, by_name, backward, type(model).__name__)
        gradients = [(rewritten.get(name, value) if owner == "model" else value, name, owner)
                     for value, name, owner in gradients]
    autocast.eager_half_dropout(gm)
    _check_operations(graph, model)
    _split_convolution_backward(gm)
    _hand_off_saved_results(graph)
    graph.lint()
    gm.recompile()
    flat, spec = tree_flatten(((tuple(inputs), dict(kwargs), targets), {}))
    step = CapturedStep(
        model=model, loss_fn=loss_fn, graph_module=gm, sources=sources, loss=loss, gradients=gradients,
        mutations=mutations, input_spec=spec,
        constant_leaves={i: leaf for i, leaf in enumerate(flat) if not isinstance(leaf, torch.Tensor)},
        input_signature=tensor_signature(tuple(inputs), kwargs),
        target_signature=tensor_signature(targets) if targets is not None else None,
        autocast=autocast_state,
    )
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("partitioner_tag") == "is_backward":
            step.backward.add(node)
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        # no module at all: PyTorch's own sums of gradients (a tensor read twice); the model's root has path ''
        step.module_path[node] = _model_path(list(stack.values())[-1][0]) if stack else ""
        step.source_line[node] = _node_place(node)[1]
    return step


def _unsupported_input(desc, model) -> str:
    text = type(desc).__name__
    if "ViewBase" in text or "SyntheticBase" in text:
        return (f"cannot capture {type(model).__name__}: two of its inputs (or an input and a parameter) share memory; "
                "pass separate tensors (clone one of them)")
    if "Subclass" in text:
        return f"cannot capture {type(model).__name__}: tensor subclasses among the inputs or parameters are not supported"
    if "Token" in text:
        return (f"cannot capture {type(model).__name__}: it calls an operation with a side effect the graph must order "
                "(torch.linalg's checked solvers such as cholesky or solve, whose error check is an effect; prints, "
                "asserts on tensors), which the executor does not replay: use the _ex variants "
                "(torch.linalg.cholesky_ex, solve_ex) and check their info yourself, or move it out of the model")
    return f"cannot capture {type(model).__name__}: its graph takes an input the executor does not handle ({desc})"


def _check_operations(graph: fx.Graph, model) -> None:
    """Only ATen operators (and getitem on their tuples) can be replayed; none of them may mutate an input."""
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            continue
        if node.op != "call_function":
            raise CaptureError(f"cannot capture {type(model).__name__}: its graph calls {node.op} {node.target}, which "
                               "the executor cannot replay")
        if node.target is operator.getitem:
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            module, line = _node_place(node)
            raise CaptureError(
                f"cannot capture {type(model).__name__}: "
                + (f"module {module} " if module else "")
                + f"uses {node.target}, which is not an ATen operator the executor can replay"
                + (f" (at {line})" if line else "")
            )
        if node.target._schema.is_mutable:
            module, line = _node_place(node)
            raise CaptureError(
                f"cannot capture {type(model).__name__}: its functionalised graph still mutates a tensor with "
                f"{node.target} ({module or 'unknown module'}{', ' + line if line else ''})"
            )


_ATEN = torch.ops.aten


def _split_convolution_backward(gm: fx.GraphModule) -> None:
    """convolution_backward(..., [input, weight, bias]) -> a weight+bias call, then an input call (same numbers).

    The input call needs the forward input's shape only, not its values: when that input is contiguous it gets a
    stand-in of the same shape backed by one element (bitwise the same result, checked in the tests), so the
    planner may free the input once the filter gradient is done.
    """
    graph = gm.graph
    for k, node in enumerate(list(graph.find_nodes(op="call_function", target=_ATEN.convolution_backward.default))):
        args = list(node.args)
        mask = list(args[10])
        if not mask[0] or not (mask[1] or mask[2]):
            continue
        with graph.inserting_before(node):
            weight_half = graph.call_function(_ATEN.convolution_backward.default,
                                              tuple(args[:10]) + ([False, mask[1], mask[2]],))
            input_args = list(args[:10])
            meta = args[1].meta.get("val") if isinstance(args[1], fx.Node) else None
            if isinstance(meta, torch.Tensor) and meta.is_contiguous():
                name = f"_mosos_shape_only_{k}"
                gm.register_buffer(name, torch.zeros((), dtype=meta.dtype, device=meta.device), persistent=False)
                scalar = graph.get_attr(name)
                stand_in = graph.call_function(_ATEN.expand.default, (scalar, list(meta.shape)))
                stand_in.meta["val"] = meta
                stand_in.meta.update({key: value for key, value in node.meta.items() if key != "val"})
                stand_in.meta[SHAPE_ONLY] = True
                input_args[1] = stand_in
            input_half = graph.call_function(_ATEN.convolution_backward.default,
                                             tuple(input_args) + ([True, False, False],))
        for half, tag in ((weight_half, "weight"), (input_half, "input")):
            half.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            half.meta["convolution_half"] = tag
            if "val" in node.meta:
                value = node.meta["val"]
                half.meta["val"] = (None, value[1], value[2]) if tag == "weight" else (value[0], None, None)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_input_with(node, input_half if user.args[1] == 0 else weight_half)
            else:
                raise CaptureError(f"convolution_backward result used as a whole by {user}; cannot split it")
        graph.erase_node(node)


SHAPE_ONLY = "mosos_shape_only"  # meta key of a convolution input's stand-in (its shape, one element's storage)
HAND_OFF = "mosos_hand_off_of"  # meta key of a copy made by _hand_off_saved_results: the operation it copies from


def _value_bytes(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return value.numel() * value.element_size()


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None


def _readers(node: fx.Node) -> list[fx.Node]:
    """The operations reading `node`'s value, through views (the graph's output node included)."""
    found: list[fx.Node] = []
    for user in node.users:
        if user.op == "call_function" and _is_view(user):
            found.extend(_readers(user))
        else:
            found.append(user)
    return found


def _hand_off_saved_results(graph: fx.Graph) -> None:
    """A forward operation whose results split into some read only by forward operations and small ones read
    only by backward operations: the small ones go to the backward through `aten.clone` (an exact copy, made right
    after the operation), so a planning node holding them no longer holds the large ones.

    Without it a batch norm's planning node keeps its whole output to the backward for the sake of two vectors of
    statistics (the ReLU after it saves its own output), and a dropout's keeps its output for its mask. Results
    that are graph outputs (new running statistics) stay graph outputs, their backward readers read the copy; an
    operation with a result read in both passes is left whole (that result is kept anyway)."""
    for op in list(graph.nodes):
        if op.op != "call_function" or op.target is operator.getitem or op.meta.get("partitioner_tag") == "is_backward":
            continue
        items = [u for u in op.users if u.op == "call_function" and u.target is operator.getitem]
        if len(items) < 2 or len(items) != len(op.users):
            continue
        forward_only, backward_only = [], []
        mixed = False
        for item in items:
            readers = _readers(item)
            operations = [r for r in readers if r.op != "output"]
            if len(readers) - len(operations) > sum(u.op == "output" for u in item.users):
                mixed = True  # a view of the result is a graph output: left alone
                continue
            passes = {r.meta.get("partitioner_tag") == "is_backward" for r in operations}
            if passes == {False}:
                forward_only.append(item)
            elif passes == {True}:
                backward_only.append(item)  # a graph output too (new running statistics) keeps its own value
            elif passes:
                mixed = True
        if mixed or not forward_only or not backward_only:
            continue
        sizes = [_value_bytes(n) for n in forward_only + backward_only]
        if any(size is None for size in sizes):
            continue
        held_bytes = sum(sizes[:len(forward_only)])
        handed_bytes = sum(sizes[len(forward_only):])
        if handed_bytes > HAND_OFF_MAX_FRACTION * held_bytes:
            continue
        for item in backward_only:
            with graph.inserting_after(item):
                copy = graph.call_function(_ATEN.clone.default, (item,))
            copy.meta.update({key: value for key, value in op.meta.items() if key != "val"})
            if "val" in item.meta:
                copy.meta["val"] = item.meta["val"]
            copy.meta[HAND_OFF] = op.name  # the planning graph makes one node of an operation's copies
            item.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy
                                       and user.op != "output")
