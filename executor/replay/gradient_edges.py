"""Which autograd edges a planned step's loss has, and how other uses of autograd are refused.

The step is one autograd Function that writes every parameter's gradient into `.grad` itself. Its inputs decide
what the engine does after it: with every parameter as an input, the engine runs each one's AccumulateGrad node
once the step's backward returns, with no gradient, which costs about 7 us a parameter on a CPU (a model of 600
small parameters: 4 ms of a 22 ms step, the whole of what the replay cost beyond eager's time). Those nodes are
needed only where something waits for them: DistributedDataParallel's reducer and post-accumulate-grad hooks.

Otherwise the step's one input is an empty leaf of our own (`edge_anchor`), and the engine runs nothing after
it. The edges also let the step refuse `torch.autograd.grad` and `backward(inputs=...)` over the parameters,
which it cannot answer (it writes every gradient into `.grad`); without them the engine would leave the step out
of such a call and answer None, or nothing, silently. The loss is then a `PlannedLoss`: a tensor whose
`__torch_function__` sees those calls (torch dispatches `Tensor.backward`, `torch.autograd.backward` and
`torch.autograd.grad` to it, and every result computed from the loss, `loss * 2` or `loss + aux`, is one too)
and refuses the ones that name a planned model's parameters.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_map_only

from executor.errors import ReplayError

_ANCHOR: torch.Tensor | None = None

# the models whose steps ran on the anchor: their parameters are what torch.autograd.grad or inputs= may not name
_ANCHORED_MODELS: "weakref.WeakSet" = weakref.WeakSet()

AUTOGRAD_GRAD_REFUSED = ("torch.autograd.grad on a planned step: the replay writes the parameters' gradients into "
                         ".grad, as loss.backward() does, and returns none; call loss.backward() and read p.grad")
INPUTS_REFUSED = ("backward(inputs=...) on a planned step over its parameters: the replay computes every parameter's "
                  "gradient into .grad; call loss.backward() without inputs= (and freeze parameters with "
                  "requires_grad_(False) before planning)")


def edge_anchor() -> torch.Tensor:
    """The one input of a step whose parameters need no edges: empty, so its AccumulateGrad is given nothing."""
    global _ANCHOR
    if _ANCHOR is None:
        _ANCHOR = torch.empty(0, requires_grad=True)
    return _ANCHOR


def hooks_wait_for_accumulation(parameters) -> bool:
    """DistributedDataParallel's reducer (and any post-accumulate-grad hook) acts when a parameter's AccumulateGrad
    runs; the replay has written `.grad` already, so the autograd engine must still run those nodes."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    return any([p._post_accumulate_grad_hooks for p in parameters])


def note_anchored(model: torch.nn.Module) -> None:
    _ANCHORED_MODELS.add(model)


def refuse_hooks_added_since_forward(parameters) -> None:
    """A step that ran on the anchor gives the engine no AccumulateGrad to run: a hook that waits for one, added
    between the forward and the backward, would never fire."""
    if hooks_wait_for_accumulation(parameters):
        raise ReplayError(
            "a post-accumulate-grad hook was registered (or torch.distributed initialised) after this step's forward "
            "began: the step was made without the parameters' AccumulateGrad nodes such hooks wait for, so they would "
            "never run. Register hooks before calling the planned module; no gradient of this step was written")


def refuse_other_backwards(edges: list) -> None:
    """The replay computes every parameter's gradient into `.grad`, as loss.backward() does; torch.autograd.grad,
    backward(inputs=...) over some parameters and create_graph=True ask for something else, which it cannot give.
    `edges`: the AccumulateGrad nodes the step's graph holds (every parameter's, or the anchor's alone, where
    PlannedLoss has refused those calls before the engine starts)."""
    if torch.is_grad_enabled():
        raise ReplayError(
            "backward(create_graph=True) (a double backward, e.g. a gradient penalty) on a planned step: the replay "
            "computes gradients outside autograd, so they cannot be differentiated again; compute such a loss with "
            "the model itself"
        )
    will_execute = torch._C._will_engine_execute_node
    for node in edges:
        if node is None:  # frozen
            continue
        try:
            runs = will_execute(node)
        except RuntimeError as error:
            if "autograd.grad" not in str(error):
                raise
            raise ReplayError(AUTOGRAD_GRAD_REFUSED) from None
        if not runs:
            raise ReplayError(INPUTS_REFUSED.replace("over its parameters", "that leaves out some parameters"))


def accumulation_signals(parameters) -> tuple:
    """Per parameter: None, or (when hooks wait for it) a gradient of negative zeros, broadcast from one element.
    Adding -0.0 leaves every float as it is, bit for bit (-0.0 and NaN included), and allocates nothing: the engine
    runs AccumulateGrad, which adds it in place to the `.grad` the replay wrote, and the hooks fire as in eager."""
    if not hooks_wait_for_accumulation(parameters):
        return (None,) * len(parameters)
    return tuple(
        torch.full((), -0.0, dtype=p.dtype, device=p.device).expand(p.shape)
        if p.requires_grad and p.grad is not None and p.dtype.is_floating_point else None
        for p in parameters
    )


def _names_planned_parameters(inputs) -> bool:
    if inputs is None:
        return False
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    elif isinstance(inputs, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        inputs = [inputs]
    inputs = list(inputs)
    if any(isinstance(item, torch.autograd.graph.GradientEdge) for item in inputs):
        return bool(_ANCHORED_MODELS)  # an edge cannot be told from a parameter's cheaply: refused while one exists
    named = {id(item) for item in inputs if isinstance(item, torch.Tensor)}
    return any(id(p) in named for model in list(_ANCHORED_MODELS) for p in model.parameters())


_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)


class PlannedLoss(torch.Tensor):
    """The loss of a planned step made on the anchor (see the module's doc). Everything but the refused calls
    behaves as on a plain tensor. A result computed from it that autograd can still differentiate (a scaled or
    summed loss: GradScaler, gradient accumulation, several losses) is a PlannedLoss too, so it keeps the check; one
    that cannot (`loss.detach()`, `loss.item()`, the gradients) is a plain tensor, and a PlannedLoss saves as one,
    so a checkpoint or a log holds nothing of mosos' (torch.load's weights_only refuses classes it does not know)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        grad = func is torch.autograd.grad
        backward = grad or func in _BACKWARDS
        if backward and _names_planned_parameters(args[1] if grad and len(args) > 1 else kwargs.get("inputs")):
            raise ReplayError(AUTOGRAD_GRAD_REFUSED if grad else INPUTS_REFUSED)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return result if backward else tree_map_only(torch.Tensor, _carried, result)

    def __reduce_ex__(self, protocol):
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _carried(value: torch.Tensor) -> torch.Tensor:
    return value.as_subclass(PlannedLoss) if value.requires_grad and type(value) is torch.Tensor else value
