"""Profiles at any batch size, for `mosos max-batch` and `planner.max_batch`: estimated, or measured and scaled.

- `EstimatedProfiles(model, gpu)`: the estimator (`models.estimator`) at each
  batch asked for. An estimate costs tens of milliseconds, so every batch is
  estimated exactly, and kept for the rest of the search.
- Scaling measured profiles across batches (`scale_profile`, `check_same_graph`,
  `ScalingReport`), for `executor.measure.batch_profiles.MeasuredProfiles`: a user's
  `file.py:build(batch_size=...)` workload measured by the executor's profiler
  on this machine's device (the measuring lives with the profiler: `models/`
  never imports `executor/`). A measurement
  costs seconds to minutes and the batches a search reaches may not even run
  without a plan, so only a few batches are measured (`measure_batches`,
  default 4 and 8) and every other batch is scaled from them: each tensor
  size, workspace and fixed-memory figure and each operation time is taken as
  linear in the batch, through the two measured batches around it (or the
  nearest two beyond them). Sizes of ordinary operations are exactly linear in
  the batch; times are not quite (per-call overheads, kernels that use the
  device better at larger batches). `validate_batch` (default 16) is measured
  too, and compared with what scaling the others predicts for it, before it
  joins them: `report` says how far off the sizes, the keep-all peak and the
  step time were. A graph that differs between measured batches (control flow
  on the batch size) cannot be scaled and is refused; implementations offered at
  one batch only (a convolution algorithm whose workspace did not fit a budget at
  the larger batch) are left out of all (`common_implementations`). Sizes that step with the
  batch rather than grow with it (the executor's im2col-chunked workspace
  works on a quarter of the batch, rounded up) are exact only at batches
  aligned with the steps: hence measured batches that are multiples of 4, and
  the report's `size_underestimate_bytes`.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field

from planner.errors import MososError
from planner.profile import GraphProfile, parse_profile
from planner.auto_algorithms import with_smallest_workspaces
from planner.strategies.keep_all import keep_all_schedule
from planner.simulator import simulate
# Imports inside functions here are deferred for start-up time: the estimator loads when a profile is estimated.


class BatchProfileError(MososError):
    """A workload whose profiles cannot be made or scaled across batch sizes."""


class EstimatedProfiles:
    """`profile(batch)` for a reference network on a named GPU, estimated at every batch (and cached)."""

    def __init__(self, model: str, gpu: str, *, image_size: int | None = None, tokens: int | None = None,
                 small: bool = False, math: str = "fp32", optimizer: str = "sgd-momentum",
                 memory_bytes: int | None = None):
        from models.estimator import estimate

        self._estimate = estimate
        self.options = dict(image_size=image_size, tokens=tokens, small=small, math=math, optimizer=optimizer,
                            memory_bytes=memory_bytes)
        self.model, self.gpu = model, gpu
        self._cache: dict[int, GraphProfile] = {}
        try:
            self(1)  # a wrong model, GPU or option is an error now, before any search
        except MososError as error:
            try:
                self(2)  # some models cannot train at batch 1 (batch norm over a single value); the search starts at 2
            except MososError:
                raise error from None

    def __call__(self, batch_size: int) -> GraphProfile:
        if batch_size not in self._cache:
            # torch.fx's shape propagation prints a traceback before raising (batch norm over one value at batch 1):
            # the error that follows says it, so the printout is kept off the terminal
            with contextlib.redirect_stderr(io.StringIO()):
                self._cache[batch_size] = self._estimate(self.model, batch_size, self.gpu, **self.options)
        return self._cache[batch_size]

    def describe(self) -> str:
        estimator = next(iter(self._cache.values())).provenance.estimator if self._cache else "the estimator"
        return f"estimated at every batch ({estimator})"


@dataclass
class ScalingReport:
    """How well scaling from the measured batches predicted a batch that was then measured."""

    measured_batches: list[int]
    validate_batch: int | None
    size_error_bytes: int | None = None  # largest difference of any tensor, workspace or fixed-memory figure
    size_underestimate_bytes: int | None = None  # largest amount by which scaling predicted less than was measured
    peak_error: float | None = None  # keep-all peak with the smallest workspaces, (scaled - measured) / measured
    step_time_error: float | None = None  # keep-all step time, the same
    node_time_error_median: float | None = None  # per node with time >= 1% of the step: |scaled - measured| / measured
    measure_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        base = (f"measured at batches {', '.join(map(str, self.measured_batches))}; every other batch scaled "
                "linearly in the batch from the two measured batches around it (or the nearest two)")
        if self.validate_batch is None or self.size_error_bytes is None:
            return base + "; not validated against a further measurement" + "".join(f" ({n})" for n in self.notes)
        under = (f" (under by up to {self.size_underestimate_bytes} bytes: plans at scaled batches may need that much "
                 "more)") if self.size_underestimate_bytes else ""
        return (
            f"{base}; checked at batch {self.validate_batch} before it joined them: sizes off by at most "
            f"{self.size_error_bytes} bytes{under}, keep-all peak (smallest workspaces) {100 * self.peak_error:+.2f}%, "
            f"keep-all step time "
            f"{100 * self.step_time_error:+.1f}%, node times (median) {100 * self.node_time_error_median:.1f}%"
        )

    def as_dict(self) -> dict:
        return {
            "measured_batches": self.measured_batches, "validate_batch": self.validate_batch,
            "size_error_bytes": self.size_error_bytes, "size_underestimate_bytes": self.size_underestimate_bytes,
            "peak_error": self.peak_error,
            "step_time_error": self.step_time_error, "node_time_error_median": self.node_time_error_median,
            "measure_seconds": self.measure_seconds, "notes": self.notes, "description": self.describe(),
        }


def _structure(profile: GraphProfile) -> list[tuple]:
    return [(n.id, n.kind, n.op_type, tuple(n.inputs), n.forward_node) for n in profile.nodes]


def common_implementations(profiles: dict[int, GraphProfile]) -> dict[int, GraphProfile]:
    """The profiles (same graph) with only the implementations every one of them offers at each node: the profiler
    offers an algorithm only where its workspace fits the budget at that moment, which at a larger batch it may not,
    and scaling needs each implementation at both ends of a line."""
    shared: dict[str, set[str]] = {}
    for profile in profiles.values():
        for node in profile.nodes:
            names = {implementation.name for implementation in node.implementations}
            shared[node.id] = shared[node.id] & names if node.id in shared else names
    for node_id, names in shared.items():
        if not names:
            raise BatchProfileError(f"node {node_id!r} has no implementation measured at every batch "
                                    f"({', '.join(map(str, sorted(profiles)))}): its profiles cannot be scaled")
    restricted = {}
    for batch, profile in profiles.items():
        if all(len(node.implementations) == len(shared[node.id]) for node in profile.nodes):
            restricted[batch] = profile
            continue
        data = profile.model_dump(mode="json")
        for node in data["nodes"]:
            node["implementations"] = [i for i in node["implementations"] if i["name"] in shared[node["id"]]]
        restricted[batch] = parse_profile(data, f"profile at batch {batch}")
    return restricted


def check_same_graph(first: GraphProfile, second: GraphProfile, batches: tuple[int, int]) -> None:
    """Scaling needs the same nodes and edges at every batch (implementations: `common_implementations`)."""
    a, b = _structure(first), _structure(second)
    if a == b:
        return
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise BatchProfileError(
                f"the training graph measured at batch {batches[0]} differs from the one at batch {batches[1]} at node "
                f"{position} ({x[0]!r} / {y[0]!r}): the model does not run the same operations at every batch, so its "
                "profile cannot be scaled across batch sizes"
            )
    raise BatchProfileError(
        f"the training graph has {len(a)} nodes at batch {batches[0]} but {len(b)} at batch {batches[1]}: it cannot "
        "be scaled across batch sizes"
    )


def _line(x0: int, y0: float, x1: int, y1: float, x: int) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _size(x0, y0, x1, y1, x) -> int:
    return max(0, int(round(_line(x0, y0, x1, y1, x))))


def _time(x0, y0, x1, y1, x) -> float:
    """Linear, but never below zero, and never decreasing with the batch (a noisy pair of timings can slope down)."""
    if y1 < y0:
        return round(max(0.0, (y0 + y1) / 2), 6)
    return round(max(0.0, _line(x0, y0, x1, y1, x)), 6)


def _signature(low: str | None, high: str | None, a: int, b: int, batch: int) -> str | None:
    """Rewrite a tensor signature such as 'float32[4,3,32,32]' for another batch: the dimensions that grow in
    proportion between batches a and b are the batch's."""
    if low is None or high is None:
        return None
    numbers_low, numbers_high = re.findall(r"\d+", low), re.findall(r"\d+", high)
    if re.sub(r"\d+", "#", low) != re.sub(r"\d+", "#", high) or len(numbers_low) != len(numbers_high):
        return None
    parts = re.split(r"(\d+)", low)
    out, index = [], 0
    for part in parts:
        if part.isdigit():
            x, y = int(numbers_low[index]), int(numbers_high[index])
            index += 1
            if x == y:
                out.append(part)
            elif x * b == y * a and (x * batch) % a == 0:
                out.append(str(x * batch // a))
            else:
                return None
        else:
            out.append(part)
    return "".join(out)


def scale_profile(low: GraphProfile, high: GraphProfile, a: int, b: int, batch: int, name: str) -> GraphProfile:
    """The profile at `batch` on the line through the profiles measured at batches a and b (same graph)."""
    data = low.model_dump(mode="json")
    high_nodes = {n.id: n for n in high.nodes}
    for node in data["nodes"]:
        other = high_nodes[node["id"]]
        node["output_bytes"] = _size(a, node["output_bytes"], b, other.output_bytes, batch)
        node["extra_saved_bytes"] = _size(a, node["extra_saved_bytes"], b, other.extra_saved_bytes, batch)
        for implementation in node["implementations"]:
            twin = other.implementation(implementation["name"])
            implementation["time_ms"] = _time(a, implementation["time_ms"], b, twin.time_ms, batch)
            implementation["workspace_bytes"] = _size(a, implementation["workspace_bytes"], b, twin.workspace_bytes, batch)
            part = implementation.pop("arena_workspace_bytes", None)
            if part is not None and twin.arena_workspace_bytes is not None:  # the arena's part of it, on its own line
                implementation["arena_workspace_bytes"] = min(
                    _size(a, part, b, twin.arena_workspace_bytes, batch), implementation["workspace_bytes"])
    for key, value in list(data["fixed_memory"].items()):
        data["fixed_memory"][key] = _size(a, value, b, getattr(high.fixed_memory, key), batch)
    provenance = data["provenance"]
    device = provenance.get("device") or low.hardware.name
    provenance.update(
        source="estimated",
        estimator=f"linear in the batch size from profiles measured at batches {a} and {b} on {device} (mosos max-batch)",
        input_signature=_signature(low.provenance.input_signature, high.provenance.input_signature, a, b, batch),
        target_signature=_signature(low.provenance.target_signature, high.provenance.target_signature, a, b, batch),
        notes=f"scaled to batch {batch}; measured profiles' notes: {low.provenance.notes or '-'}",
        # the executor's structure hash covers the captured graph's shapes (batch included): no measured graph has
        # this batch, so the replay refuses a scaled profile and asks for one measured at the batch chosen
        model_structure_sha256=None,
    )
    data["name"] = name
    try:
        return parse_profile(data, f"profile scaled to batch {batch}")
    except MososError as error:
        raise BatchProfileError(f"the profile scaled to batch {batch} is out of bounds: {error}") from None


def memory_peak_bytes(profile: GraphProfile) -> int:
    """Keep-all's peak with the smallest workspaces: sizes only (the fastest algorithm follows noisy timings)."""
    schedule = with_smallest_workspaces(profile, keep_all_schedule(profile))
    return simulate(profile, schedule, keep_timeline=False).peak_memory_bytes
