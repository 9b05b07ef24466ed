"""The optimizer's state and step against what the plan counted for them.

A plan holds the step to its budget with the optimizer's state counted as fixed memory, from what `optimize()` was
told (`optimizer=`, "sgd" by default: no state). A training loop that steps AdamW instead then holds twice the
parameters more than the plan allowed for, and the budget no longer holds, silently. So every optimizer step that
touches a planned module's parameters is checked: before the step, by the state the optimizer's kind keeps (Adam's
two moments, a momentum buffer) and by the temporaries its step takes (measured on fake tensors, with its settings),
and after it by the state it really holds (any optimizer, kinds we do not know included), together with what the
other optimizers stepping the module hold. Too much is refused with what to pass to `optimize()`. An optimizer is
checked again when what decides its state changes (a param group added, momentum turned on, parameters frozen or
new state), not on every step.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from executor.errors import ReplayError
from executor.measure.optimizer_step import held_state, optimizer_step_bytes, state_bytes
from executor.measure.profiler import STATE_PER_PARAMETER, distinct_storage_bytes
from planner.errors import MososError
from planner.units import format_bytes

_PLANNED: "weakref.WeakSet" = weakref.WeakSet()  # PlannedModules whose budget holds
# optimizer -> (plan (schedule), the optimizer's fingerprint) pairs it was checked against: a module planned again
# (another input signature, parameters frozen) is checked again, and so is an optimizer whose fingerprint changed
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# planned module -> {optimizer: the state bytes it held for the module's parameters after its last checked step}
_HELD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
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


def _fingerprint(optimizer: torch.optim.Optimizer) -> tuple:
    """What decides the state an optimizer keeps: the parameters it steps (frozen or not, with a gradient or not),
    its settings as far as they switch state on or off (a momentum of 0 keeps none; a learning rate that a scheduler
    moves changes nothing here while it stays above 0), and how many parameters hold state now."""
    groups = tuple((tuple((id(p), p.requires_grad, p.grad is not None) for p in group["params"]),
                    tuple(sorted((key, _switch(value)) for key, value in group.items() if key != "params")))
                   for group in optimizer.param_groups)
    return groups, len(optimizer.state)


def _switch(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, (tuple, list)):
        return tuple(_switch(item) for item in value)
    return type(value).__name__  # a tensor learning rate, a callable: its value does not decide the state


def _unchecked(optimizer: torch.optim.Optimizer, fingerprint: tuple) -> list:
    checked = _CHECKED.get(optimizer, ())
    return [planned for planned in list(_PLANNED)
            if planned.schedule.budget_bytes is not None  # no budget, no promise to keep
            and not any(schedule is planned.schedule and seen == fingerprint for schedule, seen in checked)]


def _held_by_others(planned, optimizer) -> int:
    """The state the other optimizers stepping `planned`'s parameters held at their last checked step (those
    collected since hold none)."""
    return sum(held for other, held in _HELD.get(planned, {}).items() if other is not optimizer)


def _planned_parameters(optimizer: torch.optim.Optimizer, unchecked: list) -> list[tuple[object, list[torch.Tensor]]]:
    """(planned module, the parameters of it this optimizer steps or holds state for) for each of the `unchecked`
    planned modules it touches. A frozen parameter's state, kept from before it was frozen, stays resident; a
    parameter with no gradient (used under no_grad only) is skipped by the step and gets none."""
    if not unchecked:
        return []
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = []
    for planned in unchecked:
        mine = [p for p in planned.model.parameters()
                if id(p) in stepped and ((p.requires_grad and p.grad is not None) or optimizer.state.get(p))]
        if mine:
            found.append((planned, mine))
    return found


_STATE_SETTINGS = ("momentum", "centered", "amsgrad", "nesterov")  # settings that decide how much state is kept


def _refuse_state(planned, optimizer, parameters: list[torch.Tensor], kept_bytes: int, how: str) -> None:
    """More state than counted is resident all step long: refused where the plan's peak leaves no room for it.
    What the other optimizers stepping the module hold is resident too (an optimizer per part of a model)."""
    counted = planned.profile.fixed_memory.optimizer_state_bytes
    budget = planned.schedule.budget_bytes
    others = _held_by_others(planned, optimizer)
    total = kept_bytes + others
    over = planned.simulated_peak_bytes + total - counted - budget
    if total <= counted or over <= 0:
        return
    name = type(optimizer).__name__
    named = ""
    trainable = [p for p in parameters if p.requires_grad]  # what a kind is counted for
    if not others and name.lower() in STATE_PER_PARAMETER and trainable:
        try:
            if state_bytes(name.lower(), trainable, parameters[0].device.type) >= kept_bytes:
                named = f" (or name its kind, optimizer='{name.lower()}')"
        except MososError:
            pass
    frozen = len(parameters) - len(trainable)
    settings = [key for key in _STATE_SETTINGS if key in optimizer.defaults]
    described = "; ".join(filter(None, [
        f"with its settings now: {', '.join(settings)}" if settings else "",
        f"{frozen} of them frozen, whose state it still holds" if frozen else ""]))
    with_others = (f", and the other optimizers stepping the module hold {others} bytes ({format_bytes(others)})"
                   if others else "")
    advice = (f"Pass this optimizer, as it is now, to optimize(..., optimizer=opt){named}, and the plan counts its "
              f"state: {total - counted} bytes more fixed memory"
              if not others else
              "optimize() takes one optimizer: where several step the module, name a kind whose state covers all "
              "of them (optimize(..., optimizer='adamw') counts AdamW's for every trainable parameter), and the plan "
              f"counts it: {total - counted} bytes more fixed memory")
    raise ReplayError(
        f"{name} {how} {kept_bytes} bytes ({format_bytes(kept_bytes)}) of state for the planned module's parameters"
        + (f" ({described})" if described else "") + with_others
        + f", but its plan counted {counted} bytes ({format_bytes(counted)}) from optimize(optimizer=...): with the "
        f"plan's peak, {over} bytes over the budget of {format_bytes(budget)}. {advice}, which the budget may have "
        "to grow by (optimize() then names the smallest budget that works)")


def _before_step(optimizer, args, kwargs) -> None:
    for planned, parameters in _planned_parameters(optimizer, _unchecked(optimizer, _fingerprint(optimizer))):
        device_type = parameters[0].device.type
        try:
            kept = state_bytes(optimizer, parameters, device_type)
            stepped = [p for p in parameters if p.requires_grad]  # a frozen parameter's state is not updated
            needed = optimizer_step_bytes(optimizer, stepped, device_type) if stepped else 0
        except MososError as error:
            warnings.warn(f"the budget of {format_bytes(planned.schedule.budget_bytes)} counts "
                          f"{planned.profile.fixed_memory.optimizer_step_bytes} bytes for the optimizer step's "
                          f"temporaries, but those of {type(optimizer).__name__} are not known (its state is checked "
                          f"after its first step): {error}", stacklevel=4)  # the caller of optimizer.step()
            continue
        _refuse_state(planned, optimizer, parameters, kept, "would keep")
        _refuse_step_temporaries(planned, optimizer, kept, needed)


def _refuse_step_temporaries(planned, optimizer, kept_bytes: int, needed: int) -> None:
    """The step's temporaries come after the backward, on the fixed memory (and any state beyond what was counted,
    which _refuse_state let through because the budget had room for it)."""
    fixed = planned.profile.fixed_memory
    counted = fixed.optimizer_step_bytes
    budget = planned.schedule.budget_bytes
    during = (planned.profile.fixed_bytes + max(0, kept_bytes + _held_by_others(planned, optimizer)
                                                - fixed.optimizer_state_bytes) + needed)
    if needed > counted and during > budget:
        name = type(optimizer).__name__
        raise ReplayError(
            f"{name}'s step would take {needed} bytes ({format_bytes(needed)}) of temporaries for the planned "
            f"module's parameters (with its settings: foreach, weight decay), but its plan counted {counted} bytes "
            f"({format_bytes(counted)}): with the fixed memory, {during - budget} bytes over the budget of "
            f"{format_bytes(budget)}. Pass this optimizer to optimize(..., optimizer=opt), and the plan counts its "
            "step (the budget may have to grow: optimize() then names the smallest budget that works)")


def _after_step(optimizer, args, kwargs) -> None:
    fingerprint = _fingerprint(optimizer)
    unchecked = _unchecked(optimizer, fingerprint)
    for planned, parameters in _planned_parameters(optimizer, unchecked):
        kept_bytes = distinct_storage_bytes(held_state(optimizer, parameters))
        _HELD.setdefault(planned, weakref.WeakKeyDictionary())[optimizer] = kept_bytes
        _refuse_state(planned, optimizer, parameters, kept_bytes, "keeps")
    if unchecked:  # those it does not touch too: not looked at again each step, until the fingerprint changes
        current = {id(planned.schedule) for planned in _PLANNED}
        kept = [(schedule, seen) for schedule, seen in _CHECKED.get(optimizer, ())
                if id(schedule) in current and seen == fingerprint]
        _CHECKED[optimizer] = [*kept, *((planned.schedule, fingerprint) for planned in unchecked)]
