"""Integers for CP-SAT: scaled times and bytes, positions, and the stage timing ss/sf.

The simulator, not the model, is the judge, so every rounding errs on the
safe side: tensor sizes and workspaces are rounded up and the capacity down
(a plan the model accepts fits in the real budget); stage durations are
rounded down and transfer durations up (a transfer the model hides is hidden);
computation times are rounded up, so the objective is never below the
simulated step of its plan and a lower bound on simulated steps (`planner.bounds`)
bounds the objective too.

Stage t computes node t (t = 0..n-1) and may first recompute earlier nodes.
Inside the model time is discrete: position `pos(t, k) = t*(n+1) + 1 + k` is
"node k computed in stage t", position `t*(n+1)` is the start of stage t,
where transfers start and prefetch buffers are allocated.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from functools import reduce

from planner.profile import GraphProfile

# Keep the memory coefficients below this many units: CP-SAT works in int64,
# but its linear relaxation prefers moderate numbers.
MAX_MEMORY_UNITS = 1 << 40
TIME_UNITS_PER_MS = 1000  # microseconds


@dataclass(frozen=True)
class Features:
    """What the model may decide; the strategies differ only here."""

    recompute: bool = True
    transfers: bool = True
    # "all": choose among every implementation (MO-SOS); "fastest": the fastest only (Checkmate, STR);
    # "framework": plan with the smallest-workspace one, timed as the fastest, and leave the
    # algorithm to the Auto pass afterwards (what Checkmate-Auto and STR-Auto do).
    implementations: str = "all"
    max_recomputes: int = 2  # extra computations per node
    max_prefetches: int = 1  # prefetches per offloaded tensor (MO-SOS's m)
    minimize_memory: bool = False  # minimize the peak instead of the time (the minimum-budget search)

    def describe(self) -> str:
        parts = []
        if self.recompute:
            parts.append(f"recompute<= {self.max_recomputes}")
        if self.transfers:
            parts.append(f"offload+prefetch<= {self.max_prefetches}")
        names = {
            "all": "algorithm choice", "fastest": "fastest algorithms", "framework": "smallest-workspace algorithms"
        }
        parts.append(names[self.implementations])
        return "intervals+cumulative (" + ", ".join(parts) + ")"


class BuildTimeout(Exception):
    """The deadline came while the model was being built (`ModelData.deadline`)."""


@dataclass(frozen=True)
class Impl:
    name: str
    time_units: int  # objective units, rounded up (so the objective never undercounts the simulated time)
    workspace_units: int  # rounded up


@dataclass
class ModelExtensions:
    """What some plan needs beyond the features' uniform limits, per node id, so the model can express it.

    A heuristic plan may recompute a tensor three times, prefetch it twice, or
    start a copy later than the few stages the model offers by default (its
    copy queued behind others). Each tensor gets the copies and stage choices
    such plans use, and only that tensor: the model stays small where nothing asks.
    """

    recomputes: dict[str, int] = field(default_factory=dict)
    prefetches: dict[str, int] = field(default_factory=dict)
    offload_stages: dict[str, set[int]] = field(default_factory=dict)
    prefetch_stages: dict[str, set[int]] = field(default_factory=dict)

    def merge(self, other: "ModelExtensions") -> None:
        for mine, theirs in ((self.recomputes, other.recomputes), (self.prefetches, other.prefetches)):
            for key, count in theirs.items():
                mine[key] = max(mine.get(key, 0), count)
        for mine, theirs in ((self.offload_stages, other.offload_stages), (self.prefetch_stages, other.prefetch_stages)):
            for key, stages in theirs.items():
                mine.setdefault(key, set()).update(stages)

    def __bool__(self) -> bool:
        return bool(self.recomputes or self.prefetches or self.offload_stages or self.prefetch_stages)


@dataclass
class ModelData:
    profile: GraphProfile
    budget_bytes: int | None
    features: Features
    ids: list[str] = field(default_factory=list)
    n: int = 0
    memory_unit_bytes: int = 1
    size_units: list[int] = field(default_factory=list)
    capacity_units: int = 0
    impls: list[list[Impl]] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    users: list[list[int]] = field(default_factory=list)
    recomputable: list[bool] = field(default_factory=list)
    stage_start: list[int] = field(default_factory=list)  # n+1 values, timing units (floor)
    offload_units: list[int] = field(default_factory=list)
    prefetch_units: list[int] = field(default_factory=list)
    transfers: bool = False
    extensions: ModelExtensions = field(default_factory=ModelExtensions)
    deadline: float | None = None  # time.monotonic() by which building must be done, else BuildTimeout

    def check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise BuildTimeout

    # stage timing sf, computed on demand (a table would be n^2) ----------------
    def offload_done(self, j: int, stage: int) -> int:
        """sf: the first stage at whose start an offload of j issued at `stage` has ended (n+1: never in the step)."""
        return _done_stage(self.stage_start, stage, self.offload_units[j])

    def prefetch_done(self, j: int, stage: int) -> int:
        """sf for a prefetch of j issued at `stage`."""
        return _done_stage(self.stage_start, stage, self.prefetch_units[j])

    # positions ---------------------------------------------------------------
    @property
    def stride(self) -> int:
        return self.n + 1

    def pos(self, stage: int, node: int) -> int:
        return stage * self.stride + 1 + node

    def stage_slot(self, stage: int) -> int:
        return stage * self.stride

    @property
    def horizon(self) -> int:
        return self.n * self.stride

    def stage_of(self, position: int) -> int:
        return position // self.stride

    # bounds used for pruning -------------------------------------------------
    def max_recomputes(self, j: int) -> int:
        return max(self.features.max_recomputes, self.extensions.recomputes.get(self.ids[j], 0))

    def max_prefetches(self, j: int) -> int:
        return max(self.features.max_prefetches, self.extensions.prefetches.get(self.ids[j], 0))

    def last_stage_of_copies(self, k: int) -> int:
        """The latest stage in which node k can be computed."""
        return self.n - 1 if self.recomputable[k] and self.features.recompute else k

    def last_use_position(self, j: int) -> int:
        """The latest position at which any computation reading j can happen (-1: never read)."""
        return max((self.pos(self.last_stage_of_copies(u), u) for u in self.users[j]), default=-1)

    def time_units_to_ms(self, units: float) -> float:
        return units / TIME_UNITS_PER_MS


def time_units(time_ms: float) -> int:
    """Objective units of a duration, rounded up (a float's last-digit noise, 1e-9 ms, aside)."""
    return math.ceil(time_ms * TIME_UNITS_PER_MS - 1e-6)


def _planned_implementations(node, mode: str) -> list[tuple[str, float, int]]:
    """(name, time, workspace) of the implementations the model may choose for `node`."""
    if mode == "all":
        return [(impl.name, impl.time_ms, impl.workspace_bytes) for impl in node.implementations]
    if mode == "fastest":
        return [(node.fastest.name, node.fastest.time_ms, node.fastest.workspace_bytes)]
    if mode == "framework":
        smallest = node.smallest_workspace
        return [(smallest.name, node.fastest.time_ms, smallest.workspace_bytes)]
    raise ValueError(f"unknown implementation mode {mode!r}")


def _memory_unit(values: list[int]) -> int:
    """The largest unit that keeps every size exact (their gcd), coarsened if numbers are huge."""
    nonzero = [v for v in values if v > 0]
    unit = reduce(math.gcd, nonzero, 0) or 1
    largest = max(nonzero, default=1)
    while largest // unit > MAX_MEMORY_UNITS:
        unit *= 2
    return unit


def _done_stage(stage_start: list[int], start: int, duration: int) -> int:
    """sf: the first stage b >= start whose start time is at least start's time + duration (n: the end)."""
    target = stage_start[start] + duration
    return bisect.bisect_left(stage_start, target, lo=start)  # len(stage_start): never within the step


def build_data(
    profile: GraphProfile, budget_bytes: int | None, features: Features, extensions: ModelExtensions | None = None
) -> ModelData:
    ids = list(profile.order)
    index = {node_id: i for i, node_id in enumerate(ids)}
    nodes = [profile.node_by_id[node_id] for node_id in ids]
    n = len(ids)
    data = ModelData(profile=profile, budget_bytes=budget_bytes, features=features, ids=ids, n=n)
    if extensions is not None:
        data.extensions = extensions
    data.inputs = [sorted({index[s] for s in node.inputs}) for node in nodes]
    data.users = [[] for _ in range(n)]
    for k, sources in enumerate(data.inputs):
        for j in sources:
            data.users[j].append(k)
    data.recomputable = [node.kind != "backward" and bool(data.users[k]) for k, node in enumerate(nodes)]

    chosen = [_planned_implementations(node, features.implementations) for node in nodes]
    sizes = [node.size_bytes for node in nodes]
    workspaces = [workspace for impls in chosen for _, _, workspace in impls]
    unit = _memory_unit(sizes + workspaces)
    data.memory_unit_bytes = unit
    data.size_units = [-(-size // unit) for size in sizes]
    data.impls = [
        [Impl(name, time_units(time_ms), -(-workspace // unit)) for name, time_ms, workspace in impls]
        for impls in chosen
    ]
    if budget_bytes is None:
        data.capacity_units = sum(data.size_units) + max((w for w in workspaces), default=0) // unit + 1
    else:
        data.capacity_units = max(-1, (budget_bytes - profile.fixed_bytes) // unit)

    # Stage timing with each stage's fastest implementation (rounded down).
    durations = [math.floor(node.fastest.time_ms * TIME_UNITS_PER_MS) for node in nodes]
    data.stage_start = [0]
    for duration in durations:
        data.stage_start.append(data.stage_start[-1] + duration)
    hardware = profile.hardware
    data.transfers = features.transfers and hardware.can_transfer
    if data.transfers:
        data.offload_units = [math.ceil(hardware.offload_time_ms(s) * TIME_UNITS_PER_MS) for s in sizes]
        data.prefetch_units = [math.ceil(hardware.prefetch_time_ms(s) * TIME_UNITS_PER_MS) for s in sizes]
    return data
