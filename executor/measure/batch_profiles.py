"""Profiles at any batch size of a user's `file.py:build(batch_size=...)` workload, for `mosos max-batch` and
`planner.max_batch.max_batch` (which takes any `batch -> GraphProfile` function).

- `EstimatedWorkloadProfiles(spec, gpu)`: estimated for a GPU of the table at every batch asked for
  (`executor.measure.estimate`: the step is captured at that batch, nothing runs), and kept for the rest of the search.
  Each batch is exact; each costs a capture (seconds for a BERT-sized model).
- `MeasuredProfiles(spec)`: measured by the profiler on this machine's device at a few batches and scaled
  linearly in between and beyond (`models.batch_profiles.scale_profile`), checked against a further measurement.
  A measurement costs seconds to minutes and the batches a search reaches may not even run without a plan,
  hence the scaling; see `models.batch_profiles` for what is linear in the batch and what is not. With a budget,
  every measurement holds within it, as `mosos profile --budget` does: the user asking for the largest batch is
  the one whose model does not fit (measured at batch 16 under keep-all, a workload held 135 MB of a 40 MiB
  budget). A validation batch that no measuring pass fits is left out, and the report says so.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch

from executor.measure.estimate import estimate_workload, gpu_of
from executor.measure.measuring import measuring_pass_fits
from executor.measure.profiler import profile_step
from models.batch_profiles import (BatchProfileError, ScalingReport, check_same_graph, common_implementations,
                                   memory_peak_bytes, scale_profile)
from models.workload import load_workload
from planner.errors import BudgetError, MososError
from planner.units import format_bytes
from planner.profile import GraphProfile
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule


class EstimatedWorkloadProfiles:
    """`profile(batch)` for a user's workload on a GPU of the table, estimated exactly at every batch (cached)."""

    def __init__(self, spec: str, gpu: str, *, math: str = "fp32", optimizer: str = "sgd-momentum",
                 memory_bytes: int | None = None, progress: Callable[[str], None] | None = None):
        self.spec, self.gpu = spec, gpu_of(gpu)
        self.options = dict(math=math, optimizer=optimizer, memory_bytes=memory_bytes)
        self.say = progress or (lambda message: None)
        self._cache: dict[int, GraphProfile] = {}
        self.capture_seconds: list[float] = []
        try:
            self(1)  # a spec that does not load, a build without batch_size, a bad option: an error now
        except MososError as error:
            try:
                self(2)  # some models cannot train at batch 1 (batch norm over a single value); the search starts at 2
            except MososError:
                raise error from None

    def __call__(self, batch_size: int) -> GraphProfile:
        if batch_size not in self._cache:
            self.say(f"estimating {self.spec} at batch {batch_size} on {self.gpu.key}")
            started = time.monotonic()
            self._cache[batch_size] = estimate_workload(self.spec, self.gpu, batch_size=batch_size, **self.options)
            self.capture_seconds.append(time.monotonic() - started)
        return self._cache[batch_size]

    def describe(self) -> str:
        estimator = next(iter(self._cache.values())).provenance.estimator if self._cache else "executor.measure.estimate"
        seconds = sum(self.capture_seconds)
        return (f"estimated for {self.gpu.name} at every batch from the captured step ({estimator}; "
                f"{len(self.capture_seconds)} captures, {seconds:.1f} s)")


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


class MeasuredProfiles:
    """`profile(batch)` for a user's workload: measured at a few batches on this machine, scaled in between."""

    def __init__(
        self,
        spec: str,
        *,
        device: str = "cpu",
        measure_batches: tuple[int, ...] = (4, 8),
        validate_batch: int | None = 16,
        threads: int | None = None,
        optimizer: str = "sgd",
        repeats: int = 3,
        warmup: int = 1,
        d2h_gb_per_s: float | None = None,
        h2d_gb_per_s: float | None = None,
        budget_bytes: int | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        batches = sorted(set(measure_batches))
        if len(batches) < 2 or batches[0] < 1:
            raise BatchProfileError(f"measure at least two different batch sizes of 1 or more, not {measure_batches}")
        if validate_batch is not None and (validate_batch < 1 or validate_batch in batches):
            raise BatchProfileError(f"the validation batch {validate_batch} must be 1 or more and not one of the "
                                    f"measured batches {batches}")
        if device not in ("cpu", "cuda"):
            raise BatchProfileError(f"the device is cpu or cuda, not {device!r}")
        if threads is not None:
            if threads < 1:
                raise BatchProfileError(f"threads must be at least 1, not {threads}")
            torch.set_num_threads(threads)  # 1 avoids thread-barrier stalls that make CPU timings noisy under load
        self.spec, self.device = spec, device
        self.options = dict(optimizer=optimizer, repeats=repeats, warmup=warmup, d2h_gb_per_s=d2h_gb_per_s,
                            h2d_gb_per_s=h2d_gb_per_s, budget_bytes=budget_bytes)
        self.say = progress or (lambda message: None)
        self.measured: dict[int, GraphProfile] = {}
        self._scaled: dict[int, GraphProfile] = {}
        # the upper estimates each measurement's passes were planned on, scaled as the profiles are: whether a batch
        # nobody measured can be measured in a budget, as optimize() and `mosos profile` do before anything else
        self.provisional: dict[int, GraphProfile] = {}
        self._common_provisional: dict[int, GraphProfile] | None = None  # the implementations every batch offers
        self._scaled_provisional: dict[int, GraphProfile] = {}
        self.label = spec
        started = time.monotonic()
        for batch in batches:
            self.measured[batch] = self._measured_within_budget(batch)
        first = self.measured[batches[0]]
        for batch in batches[1:]:
            check_same_graph(first, self.measured[batch], (batches[0], batch))
        self.measured = common_implementations(self.measured)
        self.report = ScalingReport(measured_batches=list(batches), validate_batch=validate_batch)
        if validate_batch is not None:
            try:
                actual = self.measure(validate_batch)
            except BudgetError as error:
                self.report.validate_batch = None
                self.report.notes.append(f"batch {validate_batch} was not measured to check the scaling: "
                                         f"{_budget_reason(error, budget_bytes)}")
                self.report.measure_seconds = time.monotonic() - started
                return
            check_same_graph(first, actual, (batches[0], validate_batch))
            restricted = common_implementations({**self.measured, validate_batch: actual})
            actual = restricted.pop(validate_batch)
            self.measured, self._scaled = restricted, {}
            self._compare(self(validate_batch), actual)
            self.measured[validate_batch] = actual
            self._scaled.clear()
            self.report.measured_batches = sorted(self.measured)
        self.report.measure_seconds = time.monotonic() - started

    def measure(self, batch: int) -> GraphProfile:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BatchProfileError("device cuda: no CUDA device is available here")
        # the last batch's model goes before this one is built: its capture's graphs hold it in reference cycles,
        # which only the collector frees (two models at once went 6% over a budget the measurements kept)
        gc.collect()
        workload = load_workload(self.spec, batch_size=batch)
        self.label = workload.name
        model = workload.model.to(self.device)
        inputs, targets = _to(workload.inputs, self.device), _to(workload.targets, self.device)
        kwargs = {key: _to(value, self.device) for key, value in workload.kwargs.items()}
        self.say(f"measuring {self.spec} at batch {batch} on {self.device}")
        profile, profiled = profile_step(model, inputs, workload.loss_fn, targets, kwargs=kwargs,
                                         name=f"{workload.name} batch {batch} on {self.device} (measured)",
                                         progress=lambda message: self.say(f"batch {batch}: {message}"),
                                         **self.options)
        self.provisional[batch] = profiled.provisional
        self._common_provisional = None
        self._scaled_provisional.clear()
        return profile

    def _measured_within_budget(self, batch: int) -> GraphProfile:
        try:
            return self.measure(batch)
        except BudgetError as error:
            raise BatchProfileError(
                f"cannot measure {self.spec} at batch {batch} within the budget "
                f"{format_bytes(self.options['budget_bytes'])}: {error}; measure at smaller batches "
                "(--measure-batches) or give a larger budget") from error

    def __call__(self, batch_size: int) -> GraphProfile:
        if batch_size in self.measured:
            return self.measured[batch_size]
        if batch_size not in self._scaled:
            a, b = _ends(sorted(self.measured), batch_size)
            name = f"{self.label} batch {batch_size} on {self.device} (scaled from batches {a} and {b})"
            self._scaled[batch_size] = scale_profile(self.measured[a], self.measured[b], a, b, batch_size, name)
        return self._scaled[batch_size]

    def below_measuring_floor(self, batch_size: int, budget_bytes: int) -> str | None:
        """Why `batch_size` cannot be measured within `budget_bytes` (None if it can): a plan that fits is no use
        when optimize() and `mosos profile` cannot measure the step first (their passes run on upper estimates of
        each kernel's scratch). max-batch asks it of every batch it would solve."""
        known = {batch: profile for batch, profile in self.provisional.items() if profile is not None}
        if len(known) < 2:
            return None
        if batch_size in known:
            provisional = known[batch_size]
        else:
            if batch_size not in self._scaled_provisional:
                if self._common_provisional is None:  # once per set of measurements, not once per batch asked
                    self._common_provisional = common_implementations(known)
                common = self._common_provisional
                a, b = _ends(sorted(common), batch_size)
                self._scaled_provisional[batch_size] = scale_profile(
                    common[a], common[b], a, b, batch_size, f"{self.label} batch {batch_size} (provisional, scaled)")
            provisional = self._scaled_provisional[batch_size]
        if measuring_pass_fits(provisional, budget_bytes):
            return None
        return (f"a plan may fit, but no quick measuring pass does at batch {batch_size}: optimize() and mosos "
                f"profile measure the step first, on upper estimates of each kernel's scratch, and would refuse "
                f"{format_bytes(budget_bytes)} there")

    def _compare(self, predicted: GraphProfile, actual: GraphProfile) -> None:
        differences = [p.size_bytes - q.size_bytes for p, q in zip(predicted.nodes, actual.nodes)]
        differences += [
            i.workspace_bytes - actual.node_by_id[p.id].implementation(i.name).workspace_bytes
            for p in predicted.nodes for i in p.implementations
        ]
        differences.append(predicted.fixed_bytes - actual.fixed_bytes)
        self.report.size_error_bytes = max(abs(d) for d in differences)
        self.report.size_underestimate_bytes = max(0, -min(differences))
        measured_peak = memory_peak_bytes(actual)
        self.report.peak_error = (memory_peak_bytes(predicted) - measured_peak) / measured_peak
        step = simulate(actual, keep_all_schedule(actual), keep_timeline=False).step_time_ms
        scaled_step = simulate(predicted, keep_all_schedule(predicted), keep_timeline=False).step_time_ms
        self.report.step_time_error = (scaled_step - step) / step if step > 0 else 0.0
        relative = [
            abs(p.fastest.time_ms - q.fastest.time_ms) / q.fastest.time_ms
            for p, q in zip(predicted.nodes, actual.nodes) if q.fastest.time_ms >= 0.01 * step and q.fastest.time_ms > 0
        ]
        self.report.node_time_error_median = statistics.median(relative) if relative else 0.0

    def describe(self) -> str:
        return self.report.describe()


def _ends(known: list[int], batch: int) -> tuple[int, int]:
    """The two measured batches whose line predicts `batch`: around it, else the nearest two."""
    above = [b for b in known if b > batch]
    below = [b for b in known if b < batch]
    if below and above:
        return below[-1], above[0]
    if above:
        return above[0], above[1]
    return below[-2], below[-1]


def _budget_reason(error: BudgetError, budget_bytes: int | None) -> str:
    """Why a batch was not measured, with the smallest budget it would take where known."""
    if error.minimum_budget_bytes is None:
        return str(error)
    return (f"no measuring pass fits {format_bytes(budget_bytes)} there; it needs "
            f"{format_bytes(error.minimum_budget_bytes)} ({error.minimum_budget_bytes} bytes)")
