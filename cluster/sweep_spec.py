"""The sweep spec (YAML): which profiles or estimated models, which budgets, which strategies.

```yaml
name: vgg-budgets                 # optional, shown in the results
profiles:                         # profile files, relative to this file
  - models/profiles/vgg19-small-cpu.json
models:                           # or estimated reference networks (torch on the workers)
  - {model: vgg19, gpu: v100, batches: [32, 64]}
budgets: [8GiB, device]           # sizes, or 'device' for the profile's device memory
memory_ratios: [0.5, 0.7]         # fractions of the keep-all peak
strategies: [mosos, checkmate-auto]
time_limit_s: 30                  # solver time limit per solve
workers: 1                        # solver threads per solve (the CPUs each Ray task asks for)
retries: 1                        # Ray re-runs a solve whose worker died this many times
plugins: [my_strategies.py]       # optional: modules or .py files that register extra strategies
```

Every mistake is reported at its place in the file (`strategies[1]`, line 9),
all at once, before anything runs; profile files are read and checked here too.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from planner.errors import BudgetError, DocumentError, Issue, MososError
from planner.planning import MAX_TIME_LIMIT_S
from planner.units import format_bytes, parse_bytes
from planner.validation import format_location, issues_from_validation_error
# Imports inside functions here are deferred for start-up time: the planner's strategies (OR-Tools) and the models'
# tables load when a spec names them.

MAX_SOLVES = 100_000
DEVICE_BUDGET = "device"


class SpecError(MososError):
    """A sweep spec that cannot run: one line per problem, with its YAML path and line."""

    def __init__(self, source: str, issues: list[tuple[str, int | None, str]]):
        self.source = source
        self.issues = sorted(issues, key=lambda issue: (issue[1] is None, issue[1] or 0))
        lines = [f"invalid sweep spec ({source}): {len(issues)} problem(s)"]
        for path, line, message in self.issues:
            where = f"line {line}, " if line is not None else ""
            lines.append(f"  - {where}{path or '<root>'}: {message}")
        super().__init__("\n".join(lines))


def _strict_number(value: Any) -> Any:
    """A quoted number or a boolean is a mistake in a spec, not a number to coerce."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"must be a number, not {type(value).__name__} {value!r}")
    return value


def _budget(value: Any) -> int | str:
    if value == DEVICE_BUDGET:
        return DEVICE_BUDGET
    if isinstance(value, (bool, float)) or not isinstance(value, (numbers.Integral, str)):
        raise ValueError(f"{value!r} is not a size: write bytes as a whole number, a size with its unit (10GiB) or 'device'")
    try:
        size = parse_bytes(value if isinstance(value, str) else int(value))
    except BudgetError as error:
        raise ValueError(str(error)) from None
    if size == 0:
        raise ValueError("a budget must be more than 0 bytes")
    return size


def _ratio(value: Any) -> Any:
    _strict_number(value)
    if isinstance(value, numbers.Real) and not (0 < value <= 1):
        raise ValueError(f"a memory ratio is in (0, 1], not {value}")
    return value


def _batch(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"a batch size is a whole number, not {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"a batch size is at least 1, not {value}")
    return value


def _strategy(value: str) -> str:
    from planner.strategies import load_all

    known = load_all()
    if value not in known:
        raise ValueError(f"unknown strategy {value!r}; known: {', '.join(sorted(known))}")
    return value


Budget = Annotated[int | str, BeforeValidator(_budget)]
Ratio = Annotated[float, BeforeValidator(_ratio)]
Batch = Annotated[int, BeforeValidator(_batch)]
StrategyName = Annotated[str, AfterValidator(_strategy)]


class ProfileFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, description="A profile JSON file, relative to the spec's folder.")


class EstimatedModel(BaseModel):
    """A reference network estimated at each batch on a named GPU (`mosos estimate`), on the workers."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    gpu: str = Field(min_length=1)
    batches: list[Batch] = Field(min_length=1)
    image_size: int | None = Field(default=None, ge=1, le=1 << 16)
    tokens: int | None = Field(default=None, ge=1, le=1 << 24)
    small: bool = False
    math: Literal["fp32", "tf32"] = "fp32"
    optimizer: Literal["sgd", "sgd-momentum", "adam"] = "sgd-momentum"
    memory: str | int | None = Field(default=None, description="Device memory if not the GPU's own, e.g. 12GiB.")

    @field_validator("batches", mode="before")
    @classmethod
    def _batches(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        return value

    @field_validator("image_size", "tokens", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        return _strict_number(value)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        from models.gpus import get_gpu  # the GPU table needs no torch

        try:
            return get_gpu(value).key
        except KeyError as error:
            raise ValueError(str(error.args[0])) from None

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        if value is None:
            return None
        try:
            size = parse_bytes(value)
        except BudgetError as error:
            raise ValueError(str(error)) from None
        if size == 0:
            raise ValueError("device memory must be more than 0 bytes")
        return size

    def describe(self, batch: int) -> str:
        return f"{self.model}{' (small)' if self.small else ''} batch {batch} on {self.gpu}"


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    profiles: list[ProfileFile] = Field(default_factory=list)
    models: list[EstimatedModel] = Field(default_factory=list)
    budgets: list[Budget] = Field(default_factory=list, description="Sizes (10GiB, bytes) or 'device'.")
    memory_ratios: list[Ratio] = Field(default_factory=list)
    strategies: list[StrategyName] = Field(default_factory=lambda: ["mosos"], min_length=1)
    time_limit_s: float = Field(default=60.0, gt=0, le=MAX_TIME_LIMIT_S)
    workers: int = Field(default=1, ge=1, le=1024, description="Solver threads per solve: the CPUs its Ray task asks for.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    retries: int = Field(default=1, ge=0, le=10, description="Times Ray re-runs a solve whose worker process died.")
    timeout_s: float | None = Field(
        default=None, gt=0, description="Hard limit of one solve's wall time, past which it is stopped "
        "(default: the service's rule, 3 x time_limit_s + 60 s).",
    )
    plugins: list[str] = Field(
        default_factory=list, description="Modules or .py files (relative to the spec) that register extra "
        "strategies, imported here and on every worker (a cluster's nodes need them at the same path).",
    )

    @field_validator("profiles", mode="before")
    @classmethod
    def _profile_strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("time_limit_s", "workers", "seed", "retries", "timeout_s", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return _strict_number(value)

    @field_validator("time_limit_s", "timeout_s")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number of seconds")
        return value

    @model_validator(mode="after")
    def _something_to_solve(self) -> "SweepSpec":
        if not self.profiles and not self.models:
            raise ValueError("nothing to solve: list profile files under 'profiles' or estimated models under 'models'")
        from planner.strategies import load_all

        known = load_all()
        if any(known[name].uses_budget for name in self.strategies) and not self.budgets and not self.memory_ratios:
            raise ValueError("the strategies need a budget: give 'budgets' (sizes or 'device') or 'memory_ratios'")
        if self.timeout_s is not None and self.timeout_s < self.time_limit_s:
            raise ValueError(f"timeout_s ({self.timeout_s:g} s) is shorter than time_limit_s ({self.time_limit_s:g} s)")
        return self

    @property
    def hard_timeout_s(self) -> float:
        """Past this a solve is stopped: the service's overrun rule unless the spec says otherwise."""
        return self.timeout_s if self.timeout_s is not None else 3 * self.time_limit_s + 60.0


@dataclass(frozen=True)
class Solve:
    """One row of the sweep: a profile (file or estimated model), a budget, a strategy."""

    index: int
    source_key: str  # the profile it solves (one Ray object per profile, shared by its solves)
    source: str  # the file, or 'vgg19 batch 64 on v100'
    strategy: str
    budget: int | str | None  # bytes, 'device', or None (a strategy without budget, or a ratio)
    memory_ratio: float | None
    model: str | None = None
    gpu: str | None = None
    batch: int | None = None

    @property
    def budget_text(self) -> str:
        if self.memory_ratio is not None:
            return f"ratio {self.memory_ratio:g}"
        if self.budget == DEVICE_BUDGET:
            return "device memory"
        if self.budget is None:
            return "no budget"
        return format_bytes(self.budget)


@dataclass
class LoadedSpec:
    spec: SweepSpec
    path: Path
    profile_files: dict[str, Path]  # source key -> resolved file
    models: dict[str, tuple[EstimatedModel, int]]  # source key -> (model entry, batch)
    solves: list[Solve]


# YAML with line numbers --------------------------------------------------------------


def _read_yaml(path: Path) -> tuple[Any, dict[str, int]]:
    """The document and the line (1-based) of every path in it; duplicate keys and bad YAML are SpecErrors."""
    try:
        import yaml
    except ImportError:
        raise MososError("reading a sweep spec needs PyYAML: pip install 'mosos[ray]'") from None
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(path), [("", None, "file not found")]) from None
    except UnicodeDecodeError as error:
        raise SpecError(str(path), [("", None, f"not UTF-8 text (byte offset {error.start})")]) from None
    except OSError as error:
        raise SpecError(str(path), [("", None, f"cannot read it: {error.strerror or error}")]) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        duplicates: list[tuple[str, int | None, str]] = []
        if node is not None:
            _walk(node, (), lines, duplicates)
        if duplicates:
            raise SpecError(str(path), duplicates)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = " ".join(part for part in (error.context, error.problem) if part)
        raise SpecError(str(path), [("", line, f"not valid YAML: {problem}")]) from None
    except yaml.YAMLError as error:
        raise SpecError(str(path), [("", None, f"not valid YAML: {error}")]) from None
    finally:
        loader.dispose()
    return data, lines


def _walk(node: Any, location: tuple, lines: dict[str, int], duplicates: list) -> None:
    import yaml

    lines.setdefault(format_location(location), node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                duplicates.append((format_location(location + (key,)), key_node.start_mark.line + 1,
                                   "this key appears twice; keep one"))
            seen.add(key)
            lines[format_location(location + (key,))] = key_node.start_mark.line + 1
            _walk(value_node, location + (key,), lines, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, location + (index,), lines, duplicates)


def _line_of(path: str, lines: dict[str, int]) -> int | None:
    """The line of `path`, else of its nearest ancestor in the file (a missing field: its entry's line)."""
    while True:
        if path in lines:
            return lines[path]
        if not path:
            return None
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""


def _issue(path: str, message: str, lines: dict[str, int]) -> tuple[str, int | None, str]:
    return (path, _line_of(path, lines), message)


# Loading and expanding ---------------------------------------------------------------------


def load_spec(path: str | Path) -> LoadedSpec:
    """Read, validate and expand a sweep spec; every profile file is read and checked here."""
    path = Path(path)
    data, lines = _read_yaml(path)
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(str(path), [("", 1, f"a sweep spec is a mapping of fields (profiles, budgets, ...), not {kind}")])
    issues: list[tuple[str, int | None, str]] = []
    plugins, plugin_issues = _load_plugins(data.get("plugins"), path.parent)
    issues += [_issue(where, message, lines) for where, message in plugin_issues]
    spec: SweepSpec | None = None
    try:
        spec = SweepSpec.model_validate({**data, "plugins": plugins} if "plugins" in data and not plugin_issues else data)
    except ValidationError as error:
        issues += [_issue(issue.path, issue.message, lines) for issue in issues_from_validation_error(error)]
    profile_files, file_issues = _check_profile_files(data.get("profiles"), path.parent)
    issues += [_issue(where, message, lines) for where, message in file_issues]
    if spec is None:
        raise SpecError(str(path), issues)
    known_models = _known_models() if spec.models else None
    models: dict[str, tuple[EstimatedModel, int]] = {}
    for index, entry in enumerate(spec.models):
        if known_models is not None and entry.model.lower().replace("-", "") not in known_models:
            issues.append(_issue(f"models[{index}].model", f"unknown model {entry.model!r}; known: "
                                 f"{', '.join(sorted(known_models))}", lines))
            continue
        for batch in dict.fromkeys(entry.batches):
            key = (f"model:{entry.model}|{entry.gpu}|{batch}|{entry.image_size}|{entry.tokens}|{entry.small}|"
                   f"{entry.math}|{entry.optimizer}|{entry.memory}")
            models[key] = (entry, batch)
    if issues:
        raise SpecError(str(path), issues)
    solves = _expand(spec, profile_files, models)
    if len(solves) > MAX_SOLVES:
        raise SpecError(str(path), [("", None, f"the spec expands to {len(solves)} solves, more than {MAX_SOLVES}")])
    return LoadedSpec(spec=spec, path=path, profile_files=profile_files, models=models, solves=solves)


def _load_plugins(entries: Any, base: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Import the spec's plugins here (their strategies become known); .py paths made absolute for the workers."""
    from planner.plugins import PluginError, load_plugins

    resolved: list[str] = []
    problems: list[tuple[str, str]] = []
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(entry, str) or not entry:
            continue  # the schema's message covers it
        plugin = entry
        if entry.endswith(".py"):
            plugin = str(Path(entry) if Path(entry).is_absolute() else (base / entry).resolve())
            if not Path(plugin).is_file():
                problems.append((f"plugins[{index}]", f"{entry}: file not found"))
                continue
        try:
            load_plugins([plugin])
        except PluginError as error:  # names the plugin, the error and where
            problems.append((f"plugins[{index}]", str(error)))
            continue
        except Exception as error:  # the user's code: any error is a message at its place
            problems.append((f"plugins[{index}]", f"cannot import {entry}: {type(error).__name__}: {error}"))
            continue
        resolved.append(plugin)
    return resolved, problems


def _check_profile_files(entries: Any, base: Path) -> tuple[dict[str, Path], list[tuple[str, str]]]:
    """Read and check every profile file the spec lists (even when other fields are wrong: all problems at once)."""
    from planner.profile import load_profile

    files: dict[str, Path] = {}
    problems: list[tuple[str, str]] = []
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        name = entry.get("path") if isinstance(entry, dict) else entry
        if not isinstance(name, str) or not name:
            continue  # the schema's message covers it
        where = f"profiles[{index}]" if isinstance(entry, str) else f"profiles[{index}].path"
        file = Path(name) if Path(name).is_absolute() else (base / name).resolve()
        try:
            load_profile(file)
        except DocumentError as error:
            shown = "; ".join(f"{item.path}: {item.message}" if item.path else item.message for item in error.issues[:3])
            more = f" (and {len(error.issues) - 3} more)" if len(error.issues) > 3 else ""
            problems.append((where, f"{name}: {shown}{more}"))
            continue
        except OSError as error:
            problems.append((where, f"{name}: cannot read it: {error.strerror or error}"))
            continue
        files[f"file:{file}"] = file
    return files, problems


def _known_models() -> set[str] | None:
    """Reference network names when torch is here to list them; else the workers say (their estimate fails)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    from models.registry import list_models

    return {name.lower().replace("-", "") for name in list_models()}


def _expand(spec: SweepSpec, profile_files: dict[str, Path], models: dict[str, tuple[EstimatedModel, int]]) -> list[Solve]:
    """Sources x budgets x strategies; a strategy that takes no budget is solved once per source."""
    from planner.strategies import load_all

    known = load_all()
    budgets: list[tuple[int | str | None, float | None]] = [(budget, None) for budget in dict.fromkeys(spec.budgets)]
    budgets += [(None, ratio) for ratio in dict.fromkeys(spec.memory_ratios)]
    sources: list[tuple[str, dict]] = [(key, {"source": str(file)}) for key, file in profile_files.items()]
    sources += [
        (key, {"source": entry.describe(batch), "model": entry.model, "gpu": entry.gpu, "batch": batch})
        for key, (entry, batch) in models.items()
    ]
    solves: list[Solve] = []
    for key, fields in sources:
        for strategy in dict.fromkeys(spec.strategies):
            pairs = budgets if known[strategy].uses_budget else [(None, None)]
            for budget, ratio in pairs:
                solves.append(Solve(index=len(solves), source_key=key, strategy=strategy, budget=budget,
                                    memory_ratio=ratio, **fields))
    return solves


def issue_list(error: SpecError) -> list[Issue]:
    """The problems as path + sentence issues (for JSON output)."""
    return [Issue(path, f"line {line}: {message}" if line else message) for path, line, message in error.issues]
