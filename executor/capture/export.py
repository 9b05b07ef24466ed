"""The one place that touches torch's export internals: a model and its loss, captured as one joint graph.

`torch.export.export(..., strict=False)` checks that the model can be captured
(and says where it cannot); AOTAutograd then traces the exported program's
forward together with PyTorch's own backward into one functionalised ATen
graph (`aot_export_joint_with_descriptors`). Nothing is decomposed: the graph
calls the same ATen operators, in the same order, as an eager training step,
which is why running it reproduces eager gradients bit for bit (dropout masks
included: the random operators draw from the global generator in the same
order). The one rewrite: an attention mask a library builds only while it is
traced (all true, or the causal triangle) is taken out, so that attention runs
as eager runs it (executor/capture/attention.py).

Each placeholder and output of the joint graph carries a descriptor that says
what it is (a parameter by name, a buffer, the i-th flattened user input, the
loss's incoming gradient; the loss, a parameter's gradient, a buffer or input
written back). Nodes carry `partitioner_tag` (forward or backward), the module
they came from (`nn_module_stack`, `fwd_nn_module_stack` for backward nodes)
and the user's source line (`stack_trace`), because the exported program is
traced through an fx Interpreter that hands its node metadata on.

These are private APIs; `require_supported_torch()` checks for them once, with
a message that names the torch version this was verified with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from executor.capture import attention, autocast, split_loss
from executor.errors import CaptureError

VERIFIED_TORCH = "2.13"

_PRIVATE = None


def require_supported_torch():
    """The private torch APIs this module needs, or a CaptureError naming the torch version to install."""
    global _PRIVATE
    if _PRIVATE is not None:
        return _PRIVATE
    try:
        from torch._functorch._aot_autograd import descriptors
        from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    except ImportError as error:
        raise CaptureError(
            f"the executor needs torch {VERIFIED_TORCH} or newer (torch.export plus AOTAutograd's "
            f"aot_export_joint_with_descriptors); this is torch {torch.__version__}: {error}"
        ) from None
    _PRIVATE = (aot_export_joint_with_descriptors, descriptors)
    return _PRIVATE


class WithLoss(nn.Module):
    """The model and its loss as one module, so that export captures the loss too (the joint graph needs it)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, autocast_state: tuple = ()):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.autocast_state = autocast_state

    def forward(self, args: tuple, kwargs: dict, targets):
        with autocast.entered(self.autocast_state):  # recorded as a region: its backward is traced outside it
            output = self.model(*args, **kwargs)
            return self.loss_fn(output, targets) if targets is not None else self.loss_fn(output)


class _Interpreted(nn.Module):
    """Runs an exported GraphModule node by node, so each traced operation inherits its node's metadata."""

    def __init__(self, graph_module: torch.fx.GraphModule):
        super().__init__()
        self.exported = graph_module

    def forward(self, *flat_inputs):
        return _NodeByNode(self.exported).run(*flat_inputs)


class _NodeByNode(torch.fx.Interpreter):
    """An interpreter that also runs the body of an autocast region (the `wrap_with_autocast` torch.export makes of
    it) node by node, under the same autocast, as the region itself runs it. Called whole, the body's operations
    all took the region's metadata, so under autocast every node lost its module (`loss/convolution`), and with it
    its name, and the blocks the per-block baseline is made of."""

    def call_function(self, target, args, kwargs):
        from torch._higher_order_ops.wrap import wrap_with_autocast

        if target is wrap_with_autocast and not kwargs and isinstance(args[4], torch.fx.GraphModule):
            device_type, dtype, enabled, cache_enabled, body, *operands = args
            with torch.autocast(device_type, dtype, enabled, cache_enabled):
                return _NodeByNode(body).run(*operands)
        return super().call_function(target, args, kwargs)


@dataclass
class Exported:
    """The exported program (its graph is what capture errors point into) and the joint graph."""

    program: Any  # torch.export.ExportedProgram
    joint: torch.fx.GraphModule
    flat_inputs: list  # the flattened (args, kwargs, targets) the joint graph's user inputs index into
    descriptors: Any  # the descriptors module (ParamAOTInput, ...)
    constants: dict[str, torch.Tensor]  # descriptor target -> tensor, for constants captured from the model
    attention_notes: list[tuple[str, str]]  # (module path, what became of its mask): executor.capture.attention
    loss_notes: list[str]  # each cross-entropy: split or computed whole, and why (executor.capture.split_loss)


_WRAPPER = "exported."


def owner_and_name(target: str) -> tuple[str | None, str]:
    """A descriptor's parameter/buffer name -> ('model' or 'loss_fn', the name there), or (None, target) for a
    tensor constant the capture turned into a buffer."""
    name = target[len(_WRAPPER):] if target.startswith(_WRAPPER) else target
    for owner in ("model", "loss_fn"):
        if name.startswith(owner + "."):
            return owner, name[len(owner) + 1:]
    return None, target


def export_program(model: nn.Module, args: tuple, kwargs: dict, targets, loss_fn: Callable, autocast_state: tuple = ()):
    """torch.export of the model with its loss (non-strict), inside the autocast regions of `autocast_state`.
    Errors propagate for capture.py to explain."""
    wrapper = WithLoss(model, loss_fn, autocast_state)
    return torch.export.export(wrapper, (tuple(args), dict(kwargs), targets), strict=False)


def _constants_as_buffers(module: torch.fx.GraphModule) -> None:
    """Tensor constants of the exported module (tensor attributes, tensors made in forward) become buffers, so
    that AOTAutograd lifts them into graph inputs instead of meeting real tensors among fake ones."""
    for node in module.graph.find_nodes(op="get_attr"):
        prefix, _, name = node.target.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        value = getattr(owner, name)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and name not in owner._buffers:
            delattr(owner, name)
            owner.register_buffer(name, value, persistent=False)


def joint_graph(program, args: tuple, kwargs: dict, targets, loss_split: bool = False) -> Exported:
    """Forward and backward of the exported program as one functionalised ATen graph; with `loss_split`, an
    LM head's cross-entropy is the split loss (executor.capture.split_loss)."""
    aot_export_joint_with_descriptors, descriptors = require_supported_torch()
    flat, _ = tree_flatten(((tuple(args), dict(kwargs), targets), {}))
    exported_module = program.module()
    attention_notes = attention.as_eager_runs_it(exported_module)
    loss_notes = split_loss.split_losses(exported_module) if loss_split else []
    _constants_as_buffers(exported_module)
    module = _Interpreted(exported_module)
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, module, tuple(flat))
        graph_module = joint.graph_module
    constants = {_WRAPPER + name: tensor for name, tensor in exported_module.named_buffers()}
    return Exported(program, graph_module, flat, descriptors, constants, attention_notes, loss_notes)
