"""A training workload from the user's own code: `path/to/file.py:build` or `package.module:build`.

`build()` returns what one training step needs: the model, its example inputs,
the targets and the loss, so that `loss = loss_fn(model(*inputs, **kwargs), targets)`
(or `loss_fn(model(...))` without targets). It may return

- a mapping with keys `model`, `inputs` (a tensor, a tuple or list of positional
  inputs), optionally `kwargs` (keyword inputs), `targets`, and `loss_fn` (or `loss`);
- a tuple `(model, inputs, targets, loss_fn)`;
- a `Workload`.

Commands that vary the batch (`mosos max-batch`) call `build(batch_size=N)`; a
`build` without that parameter serves one batch only, and asking it for another
is an error that says so. Every problem (missing file, no such function, an
exception inside `build`, a wrong return value) is a `WorkloadError` that names
the spec and what to change, never a bare traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from planner.errors import MososError
# Imports inside functions here are deferred for start-up time: the networks' registry (torch) loads when a network is
# built.


class WorkloadError(MososError):
    """A `file.py:build` spec that cannot give a training workload."""


@dataclass
class Workload:
    """One training step: `loss = loss_fn(model(*inputs, **kwargs), targets)` (targets left out when None)."""

    model: nn.Module
    inputs: tuple
    loss_fn: Callable
    targets: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = "workload"
    batch_size: int | None = None

    def loss(self, output=None):
        """The loss of one forward pass (runs the model when `output` is not given)."""
        if output is None:
            output = self.model(*self.inputs, **self.kwargs)
        return self.loss_fn(output, self.targets) if self.targets is not None else self.loss_fn(output)



def _a(noun: str) -> str:
    """'an int', 'a list': the article a type's name takes."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun

def split_spec(spec: str) -> tuple[str, str]:
    """'a/b.py:build' -> ('a/b.py', 'build'); 'pkg.mod:build' -> ('pkg.mod', 'build')."""
    target, sep, function = spec.rpartition(":")
    if not sep or not target or not function:
        raise WorkloadError(
            f"{spec!r} is not a workload spec: write path/to/file.py:build or package.module:build "
            "(the file or module, a colon, the function that returns the model, inputs, targets and loss)"
        )
    if not function.isidentifier():
        raise WorkloadError(f"{spec!r}: {function!r} after the colon is not a Python function name")
    return target, function


def looks_like_spec(text: str) -> bool:
    """True for 'x.py:f' and 'pkg.mod:f' (a reference network name has no colon)."""
    return ":" in text


def _import_target(target: str, spec: str):
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target)
        if not path.exists():
            raise WorkloadError(f"{spec!r}: the file {target} does not exist")
        if path.is_dir():
            raise WorkloadError(f"{spec!r}: {target} is a directory; give the .py file that defines the function")
        if path.suffix != ".py":
            raise WorkloadError(f"{spec!r}: {target} is not a Python file (.py)")
        module_name = f"_mosos_workload_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise WorkloadError(f"{spec!r}: cannot load {target} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        # the file's own folder first, so that it can import its neighbours as `python file.py` would
        sys.path.insert(0, str(path.resolve().parent))
        try:
            module_spec.loader.exec_module(module)
        except SystemExit as leaving:  # a script's top level run on import: an exit 0 read as success, silently
            sys.modules.pop(module_name, None)
            raise WorkloadError(f"{spec!r}: importing {target} called {_exit_call(leaving)}; keep the training "
                                "script's top level under `if __name__ == \"__main__\":`") from None
        except Exception as error:  # noqa: BLE001 - the user's module failed while importing
            sys.modules.pop(module_name, None)
            raise WorkloadError(f"{spec!r}: importing {target} failed: {_describe(error)}") from None
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        if error.name and target.startswith(error.name):
            raise WorkloadError(
                f"{spec!r}: no module named {target!r} (a file is written with its .py suffix: {target.replace('.', '/')}.py:...)"
            ) from None
        raise WorkloadError(f"{spec!r}: importing {target} failed: {_describe(error)}") from None
    except Exception as error:  # noqa: BLE001
        raise WorkloadError(f"{spec!r}: importing {target} failed: {_describe(error)}") from None


def _exit_call(leaving: SystemExit) -> str:
    code = leaving.code
    return "sys.exit()" if code is None else f"sys.exit({code!r})"


def _describe(error: BaseException) -> str:
    """The exception and the innermost frame of the user's code (not torch's, not ours, not importlib's)."""
    if isinstance(error, SyntaxError) and error.filename:  # where the parser stopped, not an importlib frame
        where = f"{os.path.basename(error.filename)}:{error.lineno}"
        line = (error.text or "").strip()
        return f"{type(error).__name__}: {error.msg} ({where}" + (f": {line})" if line else ")")
    torch_dir = os.path.dirname(torch.__file__)
    frames = [
        f for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(torch_dir) and not f.filename.endswith(os.path.join("models", "workload.py"))
        and not f.filename.startswith("<frozen")
    ]
    text = str(error).strip().splitlines()
    message = f"{type(error).__name__}: {text[0] if text else ''}"
    if frames:
        frame = frames[-1]
        message += f" (in {frame.name}, {os.path.basename(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()})"
    return message


def _accepts_batch_size(function: Callable) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "batch_size" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def load_workload(spec: str, batch_size: int | None = None) -> Workload:
    """Import the spec's module, call its function (with `batch_size=` when given) and check what it returns."""
    target, function_name = split_spec(spec)
    module = _import_target(target, spec)
    function = getattr(module, function_name, None)
    if function is None:
        defined = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))
        raise WorkloadError(
            f"{spec!r}: {target} defines no {function_name!r}"
            + (f" (it defines: {', '.join(defined[:12])})" if defined else "")
        )
    if not callable(function):
        raise WorkloadError(f"{spec!r}: {function_name!r} in {target} is {_a(type(function).__name__)}, not a function")
    if batch_size is not None and batch_size < 1:
        raise WorkloadError(f"batch size must be at least 1, not {batch_size}")
    if batch_size is not None and not _accepts_batch_size(function):
        raise WorkloadError(
            f"{spec!r}: {function_name}() takes no batch_size parameter, so it serves one batch only; "
            f"define it as def {function_name}(batch_size=...) to let mosos choose the batch"
        )
    try:
        result = function(batch_size=batch_size) if batch_size is not None else function()
    except SystemExit as leaving:  # sys.exit(0) in build() ended mosos with success and no output
        raise WorkloadError(f"{spec!r}: {function_name}() called {_exit_call(leaving)} instead of returning the "
                            "model and its inputs") from None
    except Exception as error:  # noqa: BLE001 - the user's build failed
        raise WorkloadError(f"{spec!r}: {function_name}() raised {_describe(error)}") from None
    return as_workload(result, spec, batch_size)


def as_workload(result: Any, spec: str, batch_size: int | None = None) -> Workload:
    """Check what a build function returned and turn it into a Workload."""
    where = f"{spec!r}: the build function returned"
    if isinstance(result, Workload):
        workload = result
    elif isinstance(result, Mapping):
        known = {"model", "inputs", "kwargs", "targets", "loss_fn", "loss", "name"}
        unknown = sorted(str(key) for key in result if key not in known)
        if unknown:
            raise WorkloadError(f"{where} unknown key(s) {unknown}; the keys are {sorted(known)}")
        missing = [key for key in ("model", "inputs") if key not in result]
        if "loss_fn" not in result and "loss" not in result:
            missing.append("loss_fn")
        if missing:
            raise WorkloadError(f"{where} a mapping without {', '.join(missing)}")
        workload = Workload(
            model=result["model"], inputs=result["inputs"], loss_fn=result.get("loss_fn", result.get("loss")),
            targets=result.get("targets"), kwargs=result.get("kwargs") or {}, name=result.get("name") or spec,
        )
    elif isinstance(result, tuple) and len(result) == 4:
        model, inputs, targets, loss_fn = result
        workload = Workload(model=model, inputs=inputs, loss_fn=loss_fn, targets=targets, name=spec)
    else:
        raise WorkloadError(
            f"{where} {_a(type(result).__name__)}; return a dict with model, inputs, targets and loss_fn "
            "(or the tuple (model, inputs, targets, loss_fn))"
        )
    if not isinstance(workload.model, nn.Module):
        raise WorkloadError(f"{where} a model that is {_a(type(workload.model).__name__)}, not a torch.nn.Module")
    if not callable(workload.loss_fn):
        raise WorkloadError(f"{where} a loss that is not callable ({type(workload.loss_fn).__name__})")
    inputs = workload.inputs
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        raise WorkloadError(
            f"{where} inputs of type {type(inputs).__name__}; give a tensor or a tuple or list of positional "
            "inputs (keyword inputs go in 'kwargs')"
        )
    if not isinstance(workload.kwargs, Mapping) or not all(isinstance(k, str) for k in workload.kwargs):
        raise WorkloadError(f"{where} kwargs that are not a mapping from names to values")
    if not inputs and not workload.kwargs:
        raise WorkloadError(f"{where} no inputs at all: give the example inputs the model is called with")
    workload.inputs = inputs
    workload.kwargs = dict(workload.kwargs)
    workload.batch_size = batch_size if batch_size is not None else workload.batch_size
    return workload


def reference_workload(
    name: str, batch_size: int, *, small: bool = False, image_size: int | None = None, tokens: int | None = None,
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
) -> Workload:
    """A reference network from `models.registry` as a Workload (same shape as a user's build)."""
    from models.registry import get_model

    try:
        spec = get_model(name, small=small, image_size=image_size, tokens=tokens)
    except (KeyError, ValueError) as error:
        raise WorkloadError(str(error).strip("'\"")) from None
    torch.manual_seed(seed)
    model = spec.build().to(device=device, dtype=dtype)
    inputs, targets = spec.example_inputs(batch_size, device=device, dtype=dtype)
    label = f"{spec.name}{' (small)' if small else ''} batch {batch_size}"
    return Workload(model=model, inputs=(inputs,), loss_fn=spec.loss, targets=targets, name=label, batch_size=batch_size)
