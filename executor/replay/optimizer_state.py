"""The optimizer's state and step against what the plan counted for them.

A plan holds the step to its budget with the optimizer's state counted as fixed memory, from what `optimize()` was
told (`optimizer=`, "sgd" by default: no state). A training loop that steps AdamW instead then holds twice the
parameters more than the plan allowed for, and the budget no longer holds, silently. So every optimizer step that
touches a planned module's parameters is checked once per optimizer: before the step, by the state the optimizer's
kind keeps (Adam's two moments, a momentum buffer) and by the temporaries its step takes (measured on fake
tensors, with its settings), and after its first step by the state it really holds (any optimizer, kinds we do not
know included). Too much is refused with what to pass to `optimize()`.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from executor.errors import ReplayError
from executor.measure.optimizer_step import optimizer_step_bytes
from executor.measure.profiler import STATE_PER_PARAMETER, distinct_storage_bytes, optimizer_state_bytes
from planner.errors import MososError
from planner.units import format_bytes

_PLANNED: "weakref.WeakSet" = weakref.WeakSet()  # PlannedModules whose budget holds
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its state was found to fit
_handles: list = []


def watch(planned) -> None:
    """Check the optimizers that step `planned`'s parameters (once the process-wide hooks are in place). A model
    planned again (another budget, another optimizer) is checked against its newest plan only: the older one,
    perhaps not yet collected, counted another optimizer."""
    for older in [other for other in _PLANNED if other.model is planned.model]:
        _PLANNED.discard(older)
    _PLANNED.add(planned)
    if not _handles:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _handles.append(register_optimizer_step_pre_hook(_before_step))
        _handles.append(register_optimizer_step_post_hook(_after_step))


def _planned_parameters(optimizer: torch.optim.Optimizer) -> list[tuple[object, list[torch.Tensor]]]:
    """(planned module, its trainable parameters this optimizer steps) for each planned module it touches."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = []
    for planned in list(_PLANNED):
        if planned.schedule.budget_bytes is None:
            continue  # no budget, no promise to keep
        mine = [p for p in planned.model.parameters() if p.requires_grad and id(p) in stepped]
        if mine:
            found.append((planned, mine))
    return found


def _refuse(planned, optimizer, kind_bytes: int, how: str) -> None:
    counted = planned.profile.fixed_memory.optimizer_state_bytes
    name = type(optimizer).__name__
    named = f" (or name its kind, optimizer='{name.lower()}')" if name.lower() in STATE_PER_PARAMETER else ""
    raise ReplayError(
        f"{name} {how} {kind_bytes} bytes ({format_bytes(kind_bytes)}) of state for the planned module's parameters, "
        f"but its plan counted {counted} bytes ({format_bytes(counted)}) of optimizer state (optimize()'s "
        f"optimizer=, 'sgd' by default: none), so the budget of {format_bytes(planned.schedule.budget_bytes)} would "
        f"not hold. Pass this optimizer to optimize(..., optimizer=opt){named}, and the plan counts its state")


def _before_step(optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    for planned, parameters in _planned_parameters(optimizer):
        try:
            expected = optimizer_state_bytes(optimizer, distinct_storage_bytes(parameters))
        except MososError:
            expected = None  # a kind we do not know: its state is measured after its first step
        if expected is not None and expected > planned.profile.fixed_memory.optimizer_state_bytes:
            _refuse(planned, optimizer, expected, "would keep")
        _check_step_temporaries(planned, optimizer, parameters)


def _check_step_temporaries(planned, optimizer, parameters: list[torch.Tensor]) -> None:
    counted = planned.profile.fixed_memory.optimizer_step_bytes
    try:
        needed = optimizer_step_bytes(optimizer, parameters, parameters[0].device.type)
    except MososError as error:
        warnings.warn(f"the budget of {format_bytes(planned.schedule.budget_bytes)} counts {counted} bytes for the "
                      f"optimizer step's temporaries, but those of {type(optimizer).__name__} are not known: {error}",
                      stacklevel=4)  # the caller of optimizer.step()
        return
    budget = planned.schedule.budget_bytes
    if needed > counted and planned.profile.fixed_bytes + needed > budget:  # the step comes after the activations
        name = type(optimizer).__name__
        raise ReplayError(
            f"{name}'s step would take {needed} bytes ({format_bytes(needed)}) of temporaries for the planned "
            f"module's parameters (with its settings: foreach, weight decay), but its plan counted {counted} bytes "
            f"({format_bytes(counted)}): with the fixed memory, {planned.profile.fixed_bytes + needed - budget} "
            f"bytes over the budget of {format_bytes(budget)}. Pass this optimizer to optimize(..., optimizer=opt), "
            "and the plan counts its step")


def _after_step(optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    for planned, parameters in _planned_parameters(optimizer):
        state = [value for p in parameters for value in optimizer.state.get(p, {}).values()
                 if isinstance(value, torch.Tensor) and value.dim() > 0]  # per-parameter tensors, not step counters
        held = distinct_storage_bytes(state)
        if held > planned.profile.fixed_memory.optimizer_state_bytes:
            _refuse(planned, optimizer, held, "keeps")
    _CHECKED[optimizer] = True
