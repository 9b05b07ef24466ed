"""The optimizer's state and the temporaries of its step, which the plan must leave room for.

After the backward every activation is gone, but the step itself allocates: single-tensor Adam holds two copies of
the parameter it is updating (the square root of the second moment, then the update), weight decay another, and
the foreach kernels (PyTorch's default on a GPU) a copy of every parameter at once. Counted nowhere, a step of a
model planned to its budget goes over it by that much. They are measured by running two steps of the same kind of
optimizer, with the same settings, on fake tensors of the parameters' shapes (nothing is allocated) and taking the
peak of the storage created during the second step; the state is what the fresh optimizer then keeps (so RMSprop's
centred average or Adam's amsgrad maximum count whenever the settings ask for them).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.errors import MososError

# `optimize(optimizer=...)` kinds, as the torch optimizer with its defaults that each stands for.
_KIND_CLASSES = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "rmsprop": lambda params: torch.optim.RMSprop(params),
    "adagrad": lambda params: torch.optim.Adagrad(params),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
    "nadam": lambda params: torch.optim.NAdam(params),
    "radam": lambda params: torch.optim.RAdam(params),
    "adamax": lambda params: torch.optim.Adamax(params),
}


class _CreatedStorage(TorchDispatchMode):
    """The peak of the storage created under it and still alive (what an operation writes in place, or views, is
    its input's and not counted)."""

    def __init__(self):
        super().__init__()
        self.live_bytes: dict[StorageWeakRef, int] = {}
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        read = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for ref in [ref for ref in self.live_bytes if ref.expired()]:
            del self.live_bytes[ref]
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in read and ref not in self.live_bytes:
                    self.live_bytes[ref] = storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, sum(self.live_bytes.values()))
        return result


def _foreach_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    except ImportError:  # pragma: no cover - an older or newer torch without it
        return ("cuda", "xpu")
    return tuple(_get_foreach_kernels_supported_devices())


def _as_torch_defaults(optimizer: torch.optim.Optimizer, device_type: str) -> None:
    """Fake tensors make torch's optimizers take the single-tensor path whatever the device; a real parameter on a
    GPU takes the foreach one unless told otherwise, so say which."""
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = device_type in _foreach_devices()


class StepMemory(NamedTuple):
    temporaries_bytes: int  # the peak of what the step creates and frees
    state_bytes: int  # the state it keeps on the parameters' device: moments, buffers, step counters


# What real kernels allocate that a fake step does not show: a Python number wrapped as a tensor for the
# operation that takes it (SGD's `mul_(momentum)`: 16 bytes), freed when it returns. On the CPU only: on a GPU the
# wrapped number stays in host memory.
WRAPPED_SCALARS_BYTES = 64


def optimizer_step_bytes(optimizer: str | torch.optim.Optimizer | None, parameters: list[torch.Tensor],
                         device_type: str) -> int:
    """Peak bytes the optimizer's step allocates beyond its parameters, gradients and state, for `parameters` on a
    device of `device_type` (`optimizer`: a kind `optimize()` takes, or the optimizer itself, whose class and
    settings are used)."""
    measured = _measured(optimizer, parameters, device_type)
    if measured is None:
        return 0
    return measured.temporaries_bytes + (WRAPPED_SCALARS_BYTES if device_type == "cpu" else 0)


def state_bytes(optimizer: str | torch.optim.Optimizer | None, parameters: list[torch.Tensor],
                device_type: str) -> int:
    """The state the optimizer keeps on the parameters' device, with its settings (RMSprop's momentum and centred
    average, Adam's amsgrad maximum), and Adam's step counter per parameter where that is the device (the CPU, or a
    GPU with capturable or fused Adam)."""
    measured = _measured(optimizer, parameters, device_type)
    return 0 if measured is None else measured.state_bytes


def held_state(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state tensors `optimizer` holds now for `parameters`, each on its parameter's device (Adam's step counters,
    on the CPU beside a GPU's parameters, left out)."""
    return [value for parameter in parameters for value in optimizer.state.get(parameter, {}).values()
            if isinstance(value, torch.Tensor) and value.device == parameter.device]


def _measured(optimizer: str | torch.optim.Optimizer | None, parameters: list[torch.Tensor],
              device_type: str) -> StepMemory | None:
    if optimizer is None or (isinstance(optimizer, str) and optimizer.lower() == "none"):
        return None
    distinct = list({id(t): t for t in parameters}.values())  # a tied parameter is stepped once
    if not distinct:
        return None
    key = _key(optimizer, distinct, device_type)
    if key not in _MEASURED:
        if len(_MEASURED) >= 64:
            _MEASURED.pop(next(iter(_MEASURED)))
        _MEASURED[key] = _measure(optimizer, distinct, device_type)
    return _MEASURED[key]


# (kind or class and settings, parameter layouts, device type) -> what it takes: optimize() and the first step's
# check measure the same optimizer
_MEASURED: dict[tuple, StepMemory] = {}


def _key(optimizer: str | torch.optim.Optimizer, parameters: list[torch.Tensor], device_type: str) -> tuple:
    layouts = {id(t): (tuple(t.shape), t.stride(), t.dtype) for t in parameters}
    if isinstance(optimizer, str):
        return optimizer.lower(), tuple(layouts.values()), device_type
    groups = tuple((repr(sorted((k, v) for k, v in group.items() if k != "params")),
                    tuple(layouts[id(p)] for p in group["params"] if id(p) in layouts))
                   for group in optimizer.param_groups)
    return type(optimizer), groups, tuple(layouts.values()), device_type


def _measure(optimizer: str | torch.optim.Optimizer, distinct: list[torch.Tensor], device_type: str) -> StepMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode

    name = optimizer.lower() if isinstance(optimizer, str) else type(optimizer).__name__
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fakes = {id(t): nn.Parameter(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device_type))
                     for t in distinct}
            for fake in fakes.values():
                fake.grad = torch.zeros_like(fake)
            fresh = _fresh(optimizer, fakes)
            _as_torch_defaults(fresh, device_type)
            fresh.step()  # the first step makes the state
            created = _CreatedStorage()
            with created:
                fresh.step()
    except MososError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever a step on fake tensors cannot do
        raise MososError(f"cannot tell how much memory {name}'s step takes (a step of a fresh one on fake tensors "
                         f"of the parameters' shapes failed: {type(error).__name__}: {error}); pass optimizer= the "
                         "torch kind it matches (sgd, momentum, adam, adamw, rmsprop, adagrad)") from None
    kept = {StorageWeakRef(value.untyped_storage()): value.untyped_storage().nbytes()
            for state in fresh.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and value.device.type == device_type}
    return StepMemory(created.peak_bytes, sum(kept.values()))


def _fresh(optimizer: str | torch.optim.Optimizer, fakes: dict[int, nn.Parameter]) -> torch.optim.Optimizer:
    if isinstance(optimizer, str):
        make = _KIND_CLASSES.get(optimizer.lower())
        if make is None:
            raise MososError(f"unknown optimizer {optimizer!r}: say {', '.join(_KIND_CLASSES)} or none, or pass the "
                             "optimizer itself")
        return make(list(fakes.values()))
    groups = []
    for group in optimizer.param_groups:
        mine = [fakes[id(p)] for p in group["params"] if id(p) in fakes]
        if mine:
            groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": mine})
    if not groups:  # the optimizer steps none of them: its own settings on all of them
        groups = [{"params": list(fakes.values())}]
    return type(optimizer)(groups, **constructor_defaults(type(optimizer), optimizer.defaults))


def constructor_defaults(kind: type, defaults: dict) -> dict:
    """The defaults its constructor takes (AdamW keeps `decoupled_weight_decay` among them but takes no such
    argument)."""
    parameters = inspect.signature(kind.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in parameters}
