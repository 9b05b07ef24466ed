"""Plans kept across runs: a restarted script, or eight ranks launched at once, start at their first step.

An entry holds the captured step (executor.capture.capture_store), the profile and
the schedule `optimize()` made, under a key that is known before anything is
captured: the model's structure (every module's class, plain attributes and
mode, every parameter's and buffer's name, shape and dtype), the source files
of the model's classes and the loss function, the input signature, the
device (on a CPU with its thread count: oneDNN keeps scratch per thread), the
budget, the strategy and the optimizer, and the versions of mosos, torch and
Python. The key is a promise only as far as it goes, so a
hit is checked again before it is used: the files the capture traced through
must be unchanged, the rebuilt graph must give every node the shape it had
and hash as it did with this model's parameters, and the profile must be
this graph's. A stale or corrupt entry is said, removed and made again; it
never fails the run.

Entries of one step made for other budgets share a step digest (the key less
the budget, the strategy, the measuring strategy and where it is solved). Their
profiles hold measured workspaces, where a new measuring pass would have to
bound every unrun kernel's scratch from above; so a budget no measuring pass
fits is planned on the newest such profile (`PlanCache.measured_profile`).

`MOSOS_CACHE_DIR` moves the cache (default: the user's cache directory,
`platformdirs.user_cache_dir("mosos")`); `mosos cache list` and
`mosos cache clear` show and empty it; `optimize(cache=False)` skips it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.utils._pytree import tree_flatten

from executor.capture.capture import capture, tensor_signature
from executor.capture.capture_store import StoreError, changed_files, dump_step, load_step
from executor.capture.python_state import HOOK_DICTS
from executor.measure.profiler import preserved
from planner import __version__ as MOSOS_VERSION
from planner.errors import MososError
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import simulate

ENTRY_VERSION = 1
# the compiled replay's kernels, raised when they compute otherwise, so that a plan measured and kept on the old
# ones is made again (2: batch norm computed as ATen's CPU kernel computes it, executor.engine.batch_norm_decomposition)
COMPILED_KERNELS_VERSION = 2
_PLANS = f"plans-v{ENTRY_VERSION}"
_STAGING = re.compile(r"\.[0-9a-f]{12}-.*")  # PlanCache.store's folder until it is whole: the cache's own too
_LATEST_TIMESTAMP_S = 32503680000.0  # year 3000: a later "created" is a corrupt number, and time.localtime refuses


def cache_directory(cache: str | os.PathLike | None = None) -> Path:
    """Where plans are kept: `cache` if given, else $MOSOS_CACHE_DIR, else the user's cache directory."""
    if cache is not None:
        return Path(cache).expanduser()
    configured = os.environ.get("MOSOS_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("mosos"))


# --- the key ---------------------------------------------------------------------------------------------


def _plain(value: Any, depth: int = 0) -> Any:
    """A module attribute as data, when it is data (flags, sizes, names, configs); None otherwise."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)) and depth < 3:
        items = [_plain(v, depth + 1) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value)) else None
    if depth == 0 and hasattr(value, "to_dict") and callable(value.to_dict):  # a transformers config
        try:
            return json.loads(json.dumps(value.to_dict(), sort_keys=True, default=str))
        except (TypeError, ValueError):
            return None
    return None


def _digest_file(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _code_digest(function) -> str | None:
    code = getattr(function, "__code__", None) or getattr(getattr(function, "__func__", None), "__code__", None)
    if code is None:
        return None
    return hashlib.sha256(code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode()).hexdigest()


def _hooks_identity(module: nn.Module) -> dict:
    """A module's hooks by what they run (their handles' numbers differ from run to run)."""
    found = {}
    for kind in HOOK_DICTS:
        hooks = getattr(module, kind, None) or {}
        if hooks:
            found[kind.strip("_")] = [[getattr(hook, "__qualname__", type(hook).__qualname__), _code_digest(hook)]
                                      for hook in hooks.values()]
    return found


def _callable_identity(function) -> dict:
    """A loss function: its code when it has some (a lambda's bytecode and constants too), its file's digest, the
    arguments a functools.partial binds and the plain values of a closure."""
    if isinstance(function, functools.partial):
        return {"partial": _callable_identity(function.func), "args": [_plain(arg) for arg in function.args],
                "keywords": {name: _plain(value) for name, value in sorted(function.keywords.items())}}
    target = function.forward if isinstance(function, nn.Module) else function
    identity: dict[str, Any] = {"name": getattr(function, "__qualname__", type(function).__qualname__)}
    code = _code_digest(target)
    if code is not None:
        identity["code"] = code
    identity["files"] = code_files([target])
    if isinstance(function, nn.Module):
        identity["module"] = module_structure(function)
    cells = []
    for cell in getattr(target, "__closure__", None) or ():
        try:
            cells.append(_plain(cell.cell_contents))
        except ValueError:  # a cell not yet filled
            cells.append(None)
    if cells:
        identity["closure"] = cells
    return identity


_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_SITE_DIRS = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def _is_library_file(path: str) -> bool:
    """torch and the standard library: covered by the versions in the key, and too many to read each run."""
    if path.startswith(_TORCH_DIR):
        return True
    return path.startswith(_STDLIB_DIR) and not path.startswith(_SITE_DIRS)


def code_files(objects: list, depth: int = 2) -> dict[str, str]:
    """The source files the model's code can run: the modules defining `objects` and, `depth` imports deep, the
    modules whose functions, classes or submodules they name (a helper function in another file of the user's
    project changes what the model computes as surely as its own forward does)."""
    seen_modules: set[str] = set()
    files: set[str] = set()
    frontier = {getattr(obj, "__module__", None) for obj in objects} - {None}
    for _ in range(depth + 1):
        next_frontier: set[str] = set()
        for name in frontier - seen_modules:
            seen_modules.add(name)
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            if module is None or not path or _is_library_file(path):
                continue
            files.add(os.path.abspath(path))
            for value in list(vars(module).values()):
                if isinstance(value, types.ModuleType):
                    next_frontier.add(value.__name__)
                elif isinstance(value, (types.FunctionType, type)):
                    owner = getattr(value, "__module__", None)
                    if isinstance(owner, str):
                        next_frontier.add(owner)
        frontier = next_frontier
    return {path: _digest_file(path) for path in sorted(files) if os.path.exists(path)}


def module_structure(model: nn.Module) -> dict:
    """What the model is, as far as it can be told without running it."""
    modules = []
    classes: set[type] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        attributes = {}
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") and name != "_attn_implementation":
                continue
            plain = _plain(value)
            if plain is not None or value is None:
                attributes[name] = plain
        modules.append([path, f"{type(module).__module__}.{type(module).__qualname__}", module.training, attributes,
                        _hooks_identity(module)])
        classes.update(type(module).__mro__)
    tensors = [[name, list(p.shape), str(p.dtype), str(p.device), p.requires_grad]
               for name, p in model.named_parameters(remove_duplicate=False)]
    tensors += [[name, list(b.shape), str(b.dtype), str(b.device), None]
                for name, b in model.named_buffers(remove_duplicate=False)]
    return {"modules": modules, "tensors": tensors, "files": code_files(sorted(classes, key=str))}


def _optimizer_identity(optimizer) -> Any:
    if optimizer is None or isinstance(optimizer, str):
        return optimizer
    # what its state's size depends on, not the learning rate a scheduler changes (a resumed run must hit)
    groups = [{"momentum": bool(group.get("momentum", 0)), "amsgrad": bool(group.get("amsgrad", False))}
              for group in optimizer.param_groups]
    return {"class": type(optimizer).__qualname__, "groups": groups}


@dataclass
class PlanKey:
    """What a kept plan was made for (`fields`, shown by `mosos cache list`) and its digest (the entry's name)."""

    fields: dict
    digest: str
    # the same without what only the plan depends on (the budget, the strategy, how the step is measured and where
    # it is solved): entries that share it hold profiles of the same step, each as good for a plan at any budget
    step_digest: str = ""

    @property
    def summary(self) -> dict:
        return self.fields["summary"]


def plan_key(model: nn.Module, loss_fn, inputs: tuple, kwargs: dict | None, targets, *, device: torch.device,
             budget: dict, strategy: str, optimizer, settings: dict, autocast_state: tuple = ()) -> PlanKey:
    """The key of the plan `optimize()` would make for these arguments, before anything is captured."""
    kwargs = dict(kwargs or {})
    leaves, spec = tree_flatten(((tuple(inputs), kwargs, targets), {}))
    constants = [[i, repr(leaf)] for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)]
    device_name = str(device)
    if device.type == "cuda":
        device_name += f" ({torch.cuda.get_device_name(device)})"
    input_signature = tensor_signature(tuple(inputs), kwargs)
    fields = {
        "versions": {"mosos": MOSOS_VERSION, "torch": torch.__version__, "python": platform.python_version(),
                     "entry": ENTRY_VERSION, "compiled kernels": COMPILED_KERNELS_VERSION},
        "model": module_structure(model),
        "loss_fn": _callable_identity(loss_fn),
        "inputs": {"signature": input_signature, "spec": str(spec), "constants": constants,
                   "targets": tensor_signature(targets) if targets is not None else None,
                   "autocast": [list(region) for region in autocast_state]},
        "device": device_name,
        "budget": budget,
        "strategy": strategy,
        "optimizer": _optimizer_identity(optimizer),
        "settings": settings,
    }
    if device.type == "cpu":
        # oneDNN's convolutions keep scratch per thread (im2col's columns): a workspace measured with one thread
        # count is not another's
        fields["threads"] = torch.get_num_threads()
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    step_fields = {name: value for name, value in fields.items() if name not in _PLAN_ONLY_FIELDS}
    step_fields["settings"] = {name: value for name, value in settings.items() if name not in _PLAN_ONLY_SETTINGS}
    step_digest = hashlib.sha256(json.dumps(step_fields, sort_keys=True, default=str).encode()).hexdigest()
    fields["summary"] = {
        "model": type(model).__qualname__,
        "inputs": input_signature + "".join(f" {device} {dtype}" for device, dtype, _ in autocast_state),
        "device": device_name,
        "budget": budget, "strategy": strategy,
    }
    return PlanKey(fields, digest, step_digest)


_PLAN_ONLY_FIELDS = ("budget", "strategy", "settings")
_PLAN_ONLY_SETTINGS = ("measuring", "planner")


# --- entries ---------------------------------------------------------------------------------------------


@dataclass
class CachedPlan:
    step: Any  # executor.capture.capture.CapturedStep, rebuilt for this model
    profile: GraphProfile
    schedule: Schedule
    created: float


@dataclass
class EntryInfo:
    digest: str
    path: Path
    summary: dict
    created: float
    last_used: float
    size_bytes: int
    predicted_step_time_ms: float | None
    peak_memory_bytes: int | None


class _Checked(BaseModel):
    """entry.json as far as it is read: the types it must have, no quoted, boolean or NaN numbers; the fields
    nothing reads are ignored (they are the rest of the key, which is compared whole through its digest)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class _Budget(_Checked):
    memory_ratio: float | None = Field(default=None, gt=0)
    bytes: int | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _names_one(cls, value: Any) -> Any:
        """plan_key writes one of the two, so an empty budget is a damaged one, not "no limit"."""
        if isinstance(value, dict) and not {"memory_ratio", "bytes"} & value.keys():
            raise ValueError("a budget names memory_ratio or bytes")
        return value


class _KeySummary(_Checked):
    model: str
    inputs: str
    device: str
    budget: _Budget
    strategy: str


class _Key(_Checked):
    summary: _KeySummary


class _EntryMeta(_Checked):
    key: _Key
    step_digest: str | None = None  # absent in entries kept before profiles were shared between budgets
    created: float = Field(ge=0, le=_LATEST_TIMESTAMP_S)
    last_used: float | None = Field(default=None, ge=0, le=_LATEST_TIMESTAMP_S)


def _read_meta(entry: Path) -> tuple[dict, _EntryMeta]:
    """entry.json as written (to write back) and as checked (to read): the one place its contents are checked.
    Raises OSError or ValueError (pydantic's ValidationError is one) when it is missing or malformed."""
    raw = json.loads((entry / "entry.json").read_bytes())
    return raw, _EntryMeta.model_validate(raw)


def _size_bytes(entry: Path) -> int:
    """What an entry takes on disk; 0 when its folder cannot be read (it is still listed, and still cleared)."""
    try:
        return sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
    except OSError:
        return 0


class PlanCache:
    """The plans under one directory. Every method that reads says what went wrong through `say` and carries on."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.root = cache_directory(directory)
        self.plans = self.root / _PLANS

    def _entry(self, key: PlanKey) -> Path:
        return self.plans / key.digest

    def load(self, key: PlanKey, model, loss_fn, inputs: tuple, kwargs: dict | None, targets,
             say: Callable[[str], None], autocast_state: tuple = ()) -> CachedPlan | None:
        entry = self._entry(key)
        if not entry.is_dir():
            return None
        try:
            meta, checked = _read_meta(entry)
            capture = json.loads((entry / "capture.json").read_text())
            stale = changed_files(capture)
            if stale:
                raise StoreError(f"{stale[0]} changed since the capture" + (f" (and {len(stale) - 1} more files)"
                                                                           if len(stale) > 1 else ""))
            tensors_file = entry / "tensors.pt"
            tensors = torch.load(tensors_file, weights_only=True) if tensors_file.exists() else {}
            leaves = tree_flatten(((tuple(inputs), dict(kwargs or {}), targets), {}))[0]
            step = load_step(capture, tensors, model, loss_fn, leaves)
            profile = GraphProfile.model_validate_json((entry / "profile.json").read_text())
            schedule = Schedule.model_validate_json((entry / "schedule.json").read_text())
            if profile.provenance.model_structure_sha256 != step.structure_sha256():
                raise StoreError("its profile was made for another graph")
            if schedule.profile_digest != profile.digest():
                raise StoreError("its schedule was made for another profile")
            asked_bytes = checked.key.summary.budget.bytes
            if asked_bytes is not None and schedule.budget_bytes != asked_bytes:
                raise StoreError(f"its schedule was made for a budget of {schedule.budget_bytes} bytes, not the "
                                 f"{asked_bytes} its key asks for")
            # replayed in the simulator as every plan is before anyone sees it: an entry edited or damaged into
            # another valid plan that breaks its budget or a rule is refused here, not found out by the step
            simulate(profile, schedule, keep_timeline=False)
            _check_fresh_capture(step, model, loss_fn, inputs, kwargs, targets, autocast_state, say)
        except Exception as error:  # noqa: BLE001 - a bad entry is never fatal: say so, drop it, plan again
            reason = error if isinstance(error, StoreError) else f"{type(error).__name__}: {error}"
            say(f"cached plan {key.digest[:12]} is not usable ({reason}): removed, planning again")
            shutil.rmtree(entry, ignore_errors=True)
            return None
        meta["last_used"] = time.time()
        try:
            _write_text(entry / "entry.json", json.dumps(meta, indent=1))
        except OSError:  # a cache this process may read but not write (shared, read-only): the plan is as good
            pass
        return CachedPlan(step, profile, schedule, checked.created)

    def store(self, key: PlanKey, step, profile: GraphProfile, schedule: Schedule,
              say: Callable[[str], None]) -> Path | None:
        """Keep a plan (replacing an older one under the same key); None, and a message, when it cannot be kept."""
        try:
            capture, tensors = dump_step(step)
        except StoreError as error:
            say(f"this plan is not kept across runs: {error}")
            return None
        now = time.time()
        meta = {"key": key.fields, "digest": key.digest, "step_digest": key.step_digest, "created": now,
                "last_used": now,
                "mosos": MOSOS_VERSION, "torch": torch.__version__}
        try:
            self.plans.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key.digest[:12]}-", dir=self.plans))
            (staging / "capture.json").write_text(json.dumps(capture))
            if tensors:
                torch.save(tensors, staging / "tensors.pt")
            (staging / "profile.json").write_text(profile.model_dump_json())
            (staging / "schedule.json").write_text(schedule.model_dump_json())
            (staging / "entry.json").write_text(json.dumps(meta, indent=1))  # last: an entry without it is torn
            entry = self._entry(key)
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
            try:
                os.rename(staging, entry)
            except OSError:  # another process kept the same plan first: theirs is as good
                shutil.rmtree(staging, ignore_errors=True)
            return entry
        except OSError as error:
            say(f"this plan is not kept across runs: cannot write {self.plans} ({error})")
            return None

    def measured_profile(self, key: PlanKey, step, say: Callable[[str], None]) -> tuple[GraphProfile, Path] | None:
        """The newest kept profile of this step made for another budget (or strategy), with its entry: every
        node's time and workspace measured within that plan's budget, which a plan at any budget can use (a
        workspace is what the allocator's events saw the kernel take, not a bound). `step` is this run's
        capture, which the profile must describe; an entry that does not, or whose files changed, is passed over
        (and left for `load` to judge)."""
        if not key.step_digest:
            return None
        candidates = []
        for entry in self._kept():
            try:
                _, meta = _read_meta(entry)
            except (OSError, ValueError):
                continue
            if meta.step_digest == key.step_digest and entry.name != key.digest:
                candidates.append((meta.created, entry))
        for _, entry in sorted(candidates, key=lambda found: found[0], reverse=True):
            try:
                if changed_files(json.loads((entry / "capture.json").read_text())):
                    continue
                profile = GraphProfile.model_validate_json((entry / "profile.json").read_text())
            except (OSError, ValueError) as error:
                say(f"the profile kept in {entry.name[:12]} is not usable ({type(error).__name__}): passed over")
                continue
            if profile.provenance.model_structure_sha256 == step.structure_sha256():
                return profile, entry
        return None

    def update(self, key: PlanKey, profile: GraphProfile, schedule: Schedule, say: Callable[[str], None]) -> None:
        """A re-plan on measured times replaces the kept profile and schedule."""
        entry = self._entry(key)
        if not (entry / "entry.json").exists():
            return
        try:
            _write_text(entry / "profile.json", profile.model_dump_json())
            _write_text(entry / "schedule.json", schedule.model_dump_json())
        except OSError as error:
            say(f"the re-plan is not kept across runs: {error}")

    def _kept(self) -> list[Path]:
        """The entries: the folders in plans-v1, read or not. Links and files there are not the cache's own."""
        if not self.plans.exists() and not self.plans.is_symlink():
            return []
        if not self.plans.is_dir():
            raise MososError(f"{self.plans} is not a folder: the plan cache keeps its plans in a folder of that name, "
                             "so move this away (mosos removes only what it wrote)")
        return sorted(entry for entry in self.plans.iterdir()
                      if not entry.name.startswith(".") and entry.is_dir() and not entry.is_symlink())

    def entries(self) -> list[EntryInfo]:
        """Every entry, the ones that cannot be read or are malformed in any way as "(unreadable entry)"."""
        found = []
        for entry in self._kept():
            size = _size_bytes(entry)
            try:
                _, meta = _read_meta(entry)
                schedule = Schedule.model_validate_json((entry / "schedule.json").read_bytes())
            except (OSError, ValueError):
                found.append(EntryInfo(entry.name, entry, {"model": "(unreadable entry)"}, 0.0, 0.0, size, None, None))
                continue
            summary = schedule.summary
            found.append(EntryInfo(entry.name, entry, meta.key.summary.model_dump(), meta.created,
                                   meta.last_used if meta.last_used is not None else meta.created, size,
                                   summary.predicted_step_time_ms if summary else None,
                                   summary.peak_memory_bytes if summary else None))
        return found

    def clear(self) -> int:
        """Remove every kept plan, without reading any (a damaged one goes as surely as a whole one), and the
        staging folders of stores cut short; anything else there is left. The number of plans removed."""
        kept = self._kept()
        if not self.plans.is_dir():
            return 0
        staging = [entry for entry in self.plans.iterdir()
                   if _STAGING.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()]
        failed = []
        for entry in kept + staging:
            try:
                shutil.rmtree(entry)
            except OSError as error:
                if entry.exists():
                    failed.append(f"{entry} ({error.strerror or error})")
        if failed:
            removed = len(kept) - sum(1 for entry in kept if entry.exists())
            raise MososError(f"removed {removed} kept plans from {self.plans}, but could not remove {len(failed)}: "
                             + ", ".join(failed))
        if self.plans.is_dir() and not self.plans.is_symlink():
            try:
                self.plans.rmdir()  # only when nothing else is left in it
            except OSError:
                pass
        return len(kept)


def _check_fresh_capture(step, model, loss_fn, inputs: tuple, kwargs: dict | None, targets, autocast_state: tuple,
                         say: Callable[[str], None]) -> None:
    """The key cannot see everything the step computes (a global configuration object read in forward, a value in
    a closure): the step is captured again (fake tensors, no memory) and must be the kept one, operation for
    operation. What a hit saves is the profile and the solve."""

    started = time.perf_counter()
    with preserved(model):
        fresh = capture(model, inputs, kwargs, targets, loss_fn, autocast_state, loss_split=step.loss_split)
    if fresh.structure_sha256() != step.structure_sha256():
        raise StoreError("a fresh capture of the step differs from the kept one: the model computes something else "
                         "now (a value it reads from outside its modules, such as a global or a closure, changed)")
    # the graph's tensor constants (tensor attributes that are not buffers, a loss's class weights) are this run's,
    # not the kept copies: their values are no part of any key or hash, and the fresh capture holds the live ones
    current = {node.name: source for node, source in fresh.sources.items() if source.kind == "constant"}
    for node, source in step.sources.items():
        if source.kind == "constant":
            if node.name not in current:
                raise StoreError(f"the kept step's constant {node.name} is not in a fresh capture")
            source.tensor = current[node.name].tensor
    say(f"checked the kept plan against a fresh capture of the step ({time.perf_counter() - started:.1f} s)")


def _write_text(path: Path, text: str) -> None:
    """Replace a file whole (a reader sees the old one or the new one, never half of one)."""
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(staging, path)


def open_cache(cache: bool | str | os.PathLike | None) -> PlanCache | None:
    """`optimize(cache=...)`: True or None the default directory, a path that directory, False no cache."""
    if cache is False:
        return None
    if os.environ.get("MOSOS_CACHE", "").lower() in ("0", "off", "false", "no"):
        return None
    return PlanCache(None if cache in (None, True) else cache)


__all__ = ["PlanCache", "PlanKey", "CachedPlan", "EntryInfo", "cache_directory", "open_cache", "plan_key",
           "module_structure"]
