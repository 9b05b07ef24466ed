"""The cheapest Python entry to an ATen operator that still calls exactly that operator.

The generated step calls thousands of ATen operators per step from Python. An operator's own entry
(`torch.ops.aten.mul.Tensor._op`) parses its arguments against the schema in a general way; torch's public
bindings (`torch.mul`, `Tensor.view`, `torch._C._nn.*`) are generated argument parsers, 1-2.5 us faster a call
(`mul`: 4.5 us against 3.6; `sum.dim_IntList`: 7.4 against 5.0). On a step of many small operations that is most
of what the replay costs beyond eager.

A public binding chooses its overload from the arguments it is given, so it is used at a call site only where
calling it, on meta tensors shaped as the node's values, dispatches exactly the node's overload, once, with the
same arguments (the node's tensors themselves, and equal literals). Anything else, or any doubt, keeps the
operator's own entry. (`torch._C._nn.mse_loss(input, target)` is one refused: it dispatches mse_loss with
reduction 0, none, where the operator's default is 1, the mean.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_verdicts: dict[tuple, Callable | None] = {}


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _candidates(target: torch._ops.OpOverload) -> list[Callable]:
    name = target.overloadpacket.__name__
    found = []
    for owner in (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase):
        binding = getattr(owner, name, None)
        if binding is not None and callable(binding):
            found.append(binding)
    return found


def _kind(argument) -> Any:
    if isinstance(argument, fx.Node):
        value = argument.meta.get("val")
        return "tensor" if isinstance(value, torch.Tensor) else ("node", type(value).__name__)
    if isinstance(argument, (list, tuple)):
        return (type(argument).__name__, tuple(_kind(a) for a in argument))
    return type(argument).__name__


def _as_meta(argument):
    if isinstance(argument, fx.Node):
        value = argument.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise ValueError("no tensor value")
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return argument


def _same(recorded: tuple, expected: tuple, inputs: list) -> bool:
    """Two dispatched calls of one overload with the same arguments: tensors we handed in by identity, anything
    else by equality (a tensor made on the way, such as a wrapped number, is never taken as the same)."""
    left, _ = tree_flatten((recorded[1], recorded[2]))
    right, _ = tree_flatten((expected[1], expected[2]))
    if recorded[0] is not expected[0] or len(left) != len(right):
        return False
    ids = {id(t) for t in inputs}
    for a, b in zip(left, right):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (a is b and id(a) in ids):
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True


def public_binding(node: fx.Node) -> Callable | None:
    """A public torch binding that calls `node.target` with `node`'s arguments exactly as the operator's own
    entry does, or None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or node.meta.get("val") is None:
        return None
    key = (target, tuple(_kind(a) for a in node.args), tuple((k, _kind(v)) for k, v in node.kwargs.items()))
    if key in _verdicts:
        return _verdicts[key]
    verdict = None
    try:
        args = tree_map(_as_meta, node.args, is_leaf=lambda a: isinstance(a, fx.Node))
        kwargs = tree_map(_as_meta, dict(node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        with torch.no_grad():
            with _Recording() as own:
                target._op(*args, **kwargs)
            for binding in _candidates(target):
                try:
                    with _Recording() as public:
                        binding(*args, **kwargs)
                except Exception:  # noqa: BLE001 - a binding that does not take these arguments is not used
                    continue
                if len(own.calls) == 1 and len(public.calls) == 1 and _same(public.calls[0], own.calls[0], inputs):
                    verdict = binding
                    break
    except Exception:  # noqa: BLE001 - what cannot be checked on meta tensors keeps the operator's own entry
        verdict = None
    _verdicts[key] = verdict
    return verdict
