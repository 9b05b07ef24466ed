"""The Python-side state a capture freezes into the graph, and a cheap check that it is still what it was.

The replay runs the captured ATen graph, never the model's Python `forward`: what that forward read from Python
(a module's plain attributes such as a dropout probability or a curriculum scale, which submodules are where,
their train/eval flags, forward hooks, which parameters are trainable, the loss function's arguments) is baked
into the graph. A change to any of it after the capture would silently give another model, so the planned module
compares this fingerprint at every call and plans the step again when it differs, like a new input signature.

Two things the fingerprint cannot see are refused at the capture instead, since the graph would freeze them: a
forward that changes the model's Python state itself (a call counter) and one that draws from Python's or
NumPy's random generators (a layer drop decided by `random.random()`). Values read from outside the model and
the loss (a global configuration object) are beyond both; the plan cache re-captures before it trusts an entry.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable

import torch
from torch import nn

from executor.errors import CaptureError

_SIMPLE = (bool, int, float, str, type(None))
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _is_config(value: Any) -> bool:
    """A transformers configuration (PreTrainedConfig; PretrainedConfig before transformers 5), which its modules
    read at every forward (`config.sliding_window`, the attention implementation); found by class name, so
    transformers need not be imported."""
    return _is_config_class(type(value))


@functools.lru_cache(maxsize=None)
def _is_config_class(cls: type) -> bool:
    """Once per class, not per attribute and call: the fingerprint runs at every call of the planned module."""
    return any(base.__name__ in ("PretrainedConfig", "PreTrainedConfig") for base in cls.__mro__)


def _config(value: Any, configs: dict) -> Any:
    """A configuration's own fields (simple values and small containers; private fields but the attention
    implementation's), once per object in one fingerprint: every layer holds the same one."""
    key = id(value)
    if key not in configs:
        configs[key] = ("config", tuple(
            (name, _value(item, 1)) for name, item in sorted(value.__dict__.items())
            if not name.startswith("_") or name.startswith(("_attn_implementation", "_experts_implementation"))))
    return configs[key]


def _value(value: Any, depth: int = 0, configs: dict | None = None) -> Any:
    """An attribute as something to compare: simple values as themselves, small containers item by item, a tensor
    by identity (replacing it is a change; changed in place, the replay reads it as eager does), a transformers
    configuration field by field. Other objects are not compared: libraries rebuild equal ones of their own
    (transformers' tied-weight tables) on every call."""
    if isinstance(value, _SIMPLE):
        return value
    if configs is not None and _is_config(value):
        return _config(value, configs)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if depth < 2 and isinstance(value, (tuple, list, set, frozenset)) and len(value) <= 64:
        items = tuple(_value(item, depth + 1) for item in value)
        return (type(value).__name__, tuple(sorted(items, key=repr)) if isinstance(value, (set, frozenset)) else items)
    if depth < 2 and isinstance(value, dict) and len(value) <= 64:
        return ("dict", tuple(sorted(((repr(key), _value(item, depth + 1)) for key, item in value.items()),
                                     key=lambda pair: pair[0])))
    return _OBJECT


_OBJECT = ("object",)


_SIMPLE_CLASSES = frozenset(_SIMPLE)


# nn.Module's own entries in every module's __dict__ (its bookkeeping, and `training`, compared on its own): one set
# difference leaves what the module's class added, instead of a test per name, for every module at every call
_MODULE_OWN = frozenset(nn.Module().__dict__)


def _attributes(module: nn.Module, configs: dict) -> tuple:
    state = module.__dict__
    if state.keys() == _MODULE_OWN:  # compared in C without building a set: a module that added nothing
        return ()
    added = state.keys() - _MODULE_OWN
    # a plain value (most attributes) without the call; sorted by name: a set's order is not the dict's
    return tuple([(name, value if value.__class__ in _SIMPLE_CLASSES else _value(value, 0, configs))
                  for name in sorted(added) if name[:1] != "_" or name == "_attn_implementation"
                  for value in (state[name],)])


def _hooks(owner: Any, names: tuple[str, ...]) -> tuple:
    return tuple(tuple((getattr(owner, name, None) or {}).keys()) for name in names)


_NO_HOOKS = ((),) * len(HOOK_DICTS)


def _module_hooks(module: nn.Module) -> tuple:
    state = module.__dict__
    forward, forward_pre, backward, backward_pre = HOOK_DICTS
    if not (state.get(forward) or state.get(forward_pre) or state.get(backward) or state.get(backward_pre)):
        return _NO_HOOKS  # most modules: four empty dicts
    return tuple([tuple(state.get(name) or ()) for name in HOOK_DICTS])  # a dict's keys, () for none


def _walk(module: nn.Module, path: str, out: list) -> None:
    """(path, module) in named_modules(remove_duplicate=False)'s order: every use of a shared module, pre-order.
    Walked by hand: the fingerprint runs at every call, and named_modules' generators cost as much as the rest."""
    out.append((path, module))
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, f"{path}.{name}" if path else name, out)


def _modules_and_tensors(model: nn.Module, prefix: str) -> tuple[tuple, tuple]:
    """The modules' fingerprint, and every parameter's and buffer's (in parameters()' then buffers()' order, each
    once), in one walk of the module tree."""
    walked: list = []
    _walk(model, "", walked)
    configs: dict = {}
    modules = tuple([(prefix + path, type(module), module.training, _attributes(module, configs),
                      _module_hooks(module)) for path, module in walked])
    # each once, in the walk's order: keyed by identity in one comprehension each (a tensor's __hash__ is Python's)
    unique = list(dict.fromkeys([module for _, module in walked]))
    parameters = list({id(value): value for module in unique for value in module._parameters.values()
                       if value is not None}.values())
    buffers = list({id(value): value for module in unique for value in module._buffers.values()
                    if value is not None}.values())
    return modules, _tensors_state(parameters, buffers)


def _tensors_state_in_python(parameters: list, buffers: list) -> tuple:
    return tuple([(value.requires_grad, value.dtype, value.device, value.shape, value.stride())
                  for value in parameters] +
                 [(None, value.dtype, value.device, value.shape, value.stride()) for value in buffers])


# The last states made, by tensor count, each with a guard that checks in C++ what they were made from: the
# fingerprint runs at every call, and reading five properties of 600 parameters in Python took 0.3-0.7 ms of it
_TENSOR_STATES: dict[tuple[int, int], tuple] = {}


def _tensors_state(parameters: list, buffers: list) -> tuple:
    """Each parameter's (requires_grad, dtype, device, shape, stride), then each buffer's (requires_grad None). Where
    torch's TensorGuards (Dynamo's C++ check of exactly those, dispatch keys besides) passes on these tensors, the
    state is the one it was made beside, so it is given again without reading them one by one."""
    key = (len(parameters), len(buffers))
    cached = _TENSOR_STATES.get(key)
    tensors = parameters + buffers
    if cached is not None:
        try:
            if cached[0].check(*tensors):
                return cached[1]
        except Exception:  # noqa: BLE001 - a tensor the guard cannot check is read in Python
            pass
    state = _tensors_state_in_python(parameters, buffers)
    try:
        from torch._C._dynamo.guards import TensorGuards

        guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
        if guard.check(*tensors):
            _TENSOR_STATES[key] = (guard, state)
    except Exception:  # noqa: BLE001 - without Dynamo's guards (or for tensors it cannot guard) every call reads them
        _TENSOR_STATES.pop(key, None)
    return state


def _modules(model: nn.Module, prefix: str) -> tuple:
    return _modules_and_tensors(model, prefix)[0]


def _callable(function: Callable) -> tuple:
    if isinstance(function, nn.Module):
        return ("module", _modules(function, "loss."))
    if isinstance(function, functools.partial):
        return ("partial", _callable(function.func), _value(function.args),
                tuple(sorted((name, _value(value)) for name, value in function.keywords.items())))
    cells = tuple(_value(cell.cell_contents) for cell in (getattr(function, "__closure__", None) or ())
                  if _cell_filled(cell))
    return ("function", id(function), cells, _value(getattr(function, "__defaults__", None)),
            tuple(sorted((getattr(function, "__kwdefaults__", None) or {}).items(), key=lambda item: item[0])))


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def python_state(model: nn.Module, loss_fn: Callable) -> tuple:
    """What of the model's and the loss's Python state the captured graph depends on (see the module's doc)."""
    # a parameter's layout too: a checkpoint loaded with assign=True may hold it transposed, and the graph's matrix
    # products were traced for the old strides (gradients 2.8e-9 off eager's, silently); and every parameter's and
    # buffer's type, device and shape: after model.to(torch.float64) the float32 plan ran on, 1.58x over its budget
    modules, tensors = _modules_and_tensors(model, "")
    return (modules, tensors, _callable(loss_fn), _hooks(nn.modules.module, _GLOBAL_HOOKS))


def describe_change(before: tuple, after: tuple) -> str:
    """The first difference between two fingerprints, in the model's terms."""
    modules_before, tensors_before, loss_before, hooks_before = before
    modules_after, tensors_after, loss_after, hooks_after = after
    paths_before = {entry[0]: entry for entry in modules_before}
    paths_after = {entry[0]: entry for entry in modules_after}
    for path, entry in paths_after.items():
        old = paths_before.get(path)
        shown = path or "<root>"
        if old is None:
            return f"module {shown} ({entry[1].__name__}) is new"
        if old[1] is not entry[1]:
            return f"module {shown} is now a {entry[1].__name__}, was a {old[1].__name__}"
        if old[2] != entry[2]:
            return f"module {shown} is now in {'training' if entry[2] else 'eval'} mode"
        if old[3] != entry[3]:
            return f"module {shown}: {_attribute_change(dict(old[3]), dict(entry[3]))}"
        if old[4] != entry[4]:
            return f"module {shown}: its hooks changed"
    for path in paths_before.keys() - paths_after.keys():
        return f"module {path or '<root>'} is gone"
    if [t[0] for t in tensors_before if t[0] is not None] != [t[0] for t in tensors_after if t[0] is not None]:
        return "which parameters are trainable changed (requires_grad)"
    for before_entry, after_entry in zip(tensors_before, tensors_after):
        kind = "a parameter's" if after_entry[0] is not None else "a buffer's"
        for index, what in ((1, "type"), (2, "device"), (3, "shape")):
            if before_entry[index] != after_entry[index]:
                old, new = _tensor_fact(before_entry[index]), _tensor_fact(after_entry[index])
                return f"{kind} {what} changed ({old} -> {new})"
    if len(tensors_before) != len(tensors_after):
        return "the model's parameters or buffers changed"
    if tensors_before != tensors_after:
        return "a parameter's memory layout changed (its strides)"
    if loss_before != loss_after:
        return "the loss function or its arguments changed"
    if hooks_before != hooks_after:
        return "the global module hooks changed"
    return "its Python state changed"


def _tensor_fact(value) -> str:
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value).removeprefix("torch.")


def _attribute_change(before: dict, after: dict) -> str:
    found = _first_change(before, after)
    if found is None:
        return "an attribute changed"
    name, old, new = found
    return f"attribute {name!r} {_shown(old)} -> {_shown(new)}"


def _first_change(before: dict, after: dict) -> tuple[str, Any, Any] | None:
    """(name, old, new) of the first attribute that differs, into a configuration's fields ('config.sliding_window')."""
    for name in list(after) + [name for name in before if name not in after]:
        if before.get(name, _MISSING) != after.get(name, _MISSING):
            old, new = before.get(name, _MISSING), after.get(name, _MISSING)
            if _is_config_value(old) and _is_config_value(new):
                inner = _first_change(dict(old[1]), dict(new[1]))
                if inner is not None:
                    return (f"{name}.{inner[0]}",) + inner[1:]
            return name, old, new
    return None


def _is_config_value(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == "config"


_MISSING = ("missing",)


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(none)"
    if isinstance(value, tuple) and value and value[0] in ("object", "tensor"):
        return f"(a{'nother' if value[0] == 'tensor' else 'n'} {value[0]})"
    if isinstance(value, tuple) and value and value[0] == "config":
        return "(a configuration)"
    return repr(value)


class StateChanged(CaptureError):
    """A forward changed the model's Python state while it was captured. `put_back()` returns the model (hooks,
    attributes, configurations) and the generators to where they were before the capture began."""

    def __init__(self, message: str, change: str, put_back: Callable[[], None], keep: Callable[[], None]):
        super().__init__(message)
        self.change, self.put_back, self.keep = change, put_back, keep


class ForwardSideEffects:
    """Around a capture: refuse a forward whose Python effects the replay could not repeat (see the module's doc).

    The model's state is read again as its forward returns, inside the capture: torch.export puts back the
    attributes a forward changed once it has traced it, but not the hooks it registered, the attributes it added or
    what it set in a configuration; a change raises StateChanged with the model as the forward left it, so that the
    caller may capture once more from there (a one-time set-up: transformers sets `config.problem_type`, and
    registers the hooks that record its outputs, at the first forward) or put it all back. The plain attributes
    torch.export put back are set, by `keep()`, to what the forward left: Funnel's `pooling_mult` is None before
    the first call and 2 after every call, as a first eager call leaves it."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        self.model, self.loss_fn = model, loss_fn
        self.change: str | None = None
        self.member_change: str | None = None
        self.left: dict[nn.Module, dict[str, Any]] = {}

    def _before_forward(self, module, args) -> None:
        self.traced_members = _members(self.model)  # as torch.export's tracing set them (fake tensors)

    def _after_forward(self, module, args, output) -> None:
        if self.member_change is None:  # here, before torch.export puts back a buffer the forward replaced
            self.member_change = self._member_change(self.traced_members)
        if self.change is None:
            after = python_state(self.model, self.loss_fn)
            if after != self.state:
                self.change = describe_change(self.state, after)
                self.left = _simple_attributes(self.model)

    def __enter__(self) -> "ForwardSideEffects":
        self.handles = [self.model.register_forward_pre_hook(self._before_forward),
                        self.model.register_forward_hook(self._after_forward)]
        self.state = python_state(self.model, self.loss_fn)
        self.random_state = random.getstate()
        self.numpy_state = _numpy_state()
        self.attribute_names = {module: set(vars(module)) for module in self.model.modules()}
        self.hook_keys = {(module, name): set(getattr(module, name, None) or {})
                          for module in self.model.modules() for name in HOOK_DICTS}
        self.configs = {id(value): (value, dict(vars(value))) for module in self.model.modules()
                        for value in vars(module).values() if _is_config(value)}
        self.simple = _simple_attributes(self.model)
        self.members = _members(self.model)
        return self

    def _keep(self) -> None:
        """The plain attributes as the forward left them, where torch.export put them back."""
        for module, fields in self.left.items():
            for name, value in fields.items():
                if vars(module).get(name, _MISSING) != value:
                    setattr(module, name, value)

    def _put_back(self) -> None:
        """A refused capture leaves the model and the generators as they were: torch.export restores the attributes
        a forward changed, not the ones it added, nor the hooks it registered or a configuration's fields (left in
        place, transformers' output recorders were registered again at the next forward, twice over), and neither
        generator."""
        random.setstate(self.random_state)
        if self.numpy_state is not None:
            import numpy

            numpy.random.set_state(self.numpy_state)
        for module, names in self.attribute_names.items():
            for added in set(vars(module)) - names:
                delattr(module, added)
        for (module, name), keys in self.hook_keys.items():
            hooks = getattr(module, name, None)
            for key in [key for key in (hooks or {}) if key not in keys]:
                del hooks[key]
        for config, fields in self.configs.values():
            for name in set(vars(config)) - set(fields):
                delattr(config, name)
            for name, value in fields.items():
                if vars(config).get(name, _MISSING) is not value:
                    setattr(config, name, value)
        for module, fields in self.simple.items():
            for name, value in fields.items():
                if vars(module).get(name, _MISSING) is not value:
                    setattr(module, name, value)
        self._members_put_back()

    def _members_put_back(self) -> None:
        for module, kinds in self.members.items():
            for kind, members in zip(_MEMBER_DICTS, kinds):
                now = getattr(module, kind)
                for name in [name for name in now if name not in members]:
                    del now[name]
                for name, value in members.items():
                    if now.get(name, _MISSING) is not value:
                        now[name] = value

    def _member_change(self, before: dict | None = None) -> str | None:
        """A parameter, buffer or submodule the forward added or replaced since `before` (default: the capture's
        start), described; None if none."""
        for module, kinds in (before or self.members).items():
            for kind, members in zip(_MEMBER_DICTS, kinds):
                for name, value in getattr(module, kind).items():
                    if members.get(name, _MISSING) is not value:
                        verb = "replaces" if name in members else "registers"
                        path = next((path or "<root>" for path, other in self.model.named_modules(
                            remove_duplicate=False) if other is module), "?")
                        return f"{verb} {kind.strip('_').rstrip('s')} {name!r} of module {path}"
        return None

    def __exit__(self, kind, error, traceback) -> None:
        for handle in self.handles:
            handle.remove()
        if kind is not None:
            return
        name = type(self.model).__name__
        if random.getstate() != self.random_state:
            self._put_back()
            raise CaptureError(
                f"cannot capture {name}: its forward draws from Python's random module, and the captured graph would "
                "keep the one draw made while capturing at every step; draw with torch (torch.rand, "
                "torch.bernoulli), which the replay repeats as eager does")
        if not _same_numpy_state(self.numpy_state, _numpy_state()):
            self._put_back()
            raise CaptureError(
                f"cannot capture {name}: its forward draws from NumPy's random generator, and the captured graph "
                "would keep the one draw made while capturing at every step; draw with torch instead")
        member_change = self.member_change or self._member_change()
        if member_change is not None:
            self._put_back()
            if member_change.startswith("registers"):
                why = ("and the capture runs the forward on fake tensors, whose values the model would keep; call "
                       "the model once before optimize() (one sample under torch.no_grad() is enough) so that it "
                       "exists, or make it in __init__")
            else:
                why = ("which the replay, running the captured graph instead of forward, would not do (the model "
                       "would keep the old one); update it in place (copy_, add_) instead, or keep it outside the "
                       "model")
            raise CaptureError(f"cannot capture {name}: its forward {member_change}, {why}")
        if self.change is not None:
            raise StateChanged(
                f"cannot capture {name}: its forward changes the model's Python state ({self.change}) at every call, "
                "which the replay, running the captured graph instead of forward, would not do; keep such state "
                "outside the model, or in a buffer (a tensor the graph updates)", self.change, self._put_back,
                self._keep)


_MEMBER_DICTS = ("_parameters", "_buffers", "_modules")


def _members(model: nn.Module) -> dict[nn.Module, tuple[dict, ...]]:
    """Each module's parameters, buffers and submodules: what a lazy forward adds at its first call."""
    return {module: tuple(dict(getattr(module, kind)) for kind in _MEMBER_DICTS) for module in model.modules()}


def _simple_attributes(model: nn.Module) -> dict[nn.Module, dict[str, Any]]:
    """Each module's attributes of simple values (a flag, a count): the ones a forward may set for the next."""
    return {module: {name: value for name, value in vars(module).items() if isinstance(value, _SIMPLE)}
            for module in model.modules()}


def _numpy_state():
    import sys

    numpy = sys.modules.get("numpy")  # only if something imported it: a model that never does draws nothing
    return numpy.random.get_state() if numpy is not None else None


def _same_numpy_state(before, after) -> bool:
    if before is None or after is None:
        return before is after
    return before[0] == after[0] and before[2:] == after[2:] and bool((before[1] == after[1]).all())
