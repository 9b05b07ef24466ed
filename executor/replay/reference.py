"""Profile a workload: a reference network from `models` by name, or the user's own `file.py:build`.

What `mosos profile` runs, kept out of planner/ and cli/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from executor.measure import profiler
from models.workload import Workload, load_workload, reference_workload
from planner.errors import MososError
from planner.profile import GraphProfile

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class ReferenceProfile:
    profile: GraphProfile
    label: str
    nodes_ms: float  # node times with native algorithms, added up
    plain_ms: float | None  # a plain PyTorch step, timed the same way (None: it would not fit the budget)
    repeats: int
    measured_under: str = "keep-all"  # the schedule the profile was measured under
    compiled: object = None  # compile=True: executor.engine.compiled_nodes.CompiledNodes

    @property
    def ratio(self) -> float | None:
        return self.nodes_ms / self.plain_ms if self.plain_ms else None


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise MososError(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MososError("--device cuda: no CUDA device is available here (this torch build or machine has none)")


def _dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise MososError(f"--dtype must be float32 or float64, not {dtype!r}")
    return DTYPES[dtype]


def load(
    model: str | None = None,
    spec: str | None = None,
    batch: int | None = None,
    *,
    device: str = "cpu",
    small: bool = False,
    image_size: int | None = None,
    tokens: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
) -> Workload:
    """The workload to profile: `model` (a reference network, with `batch`) or `spec` (file.py:build)."""
    _check_device(device)
    target_dtype = _dtype(dtype)
    if (model is None) == (spec is None):
        raise MososError("give either a workload (path/to/file.py:build or package.module:build) or --model NAME")
    if model is not None:
        if batch is None:
            raise MososError("--batch is needed with --model")
        if batch < 1:
            raise MososError(f"--batch must be at least 1, got {batch}")
        return reference_workload(model, batch, small=small, image_size=image_size, tokens=tokens, device=device,
                                  dtype=target_dtype or torch.float32, seed=seed)
    if small or image_size is not None or tokens is not None:
        raise MososError("--small, --image-size and --tokens are for reference networks (--model); a workload's "
                         "build() decides its own sizes")
    torch.manual_seed(seed)
    workload = load_workload(spec, batch_size=batch)

    def move(value):
        if not isinstance(value, torch.Tensor):
            return value
        if target_dtype is not None and value.is_floating_point():
            value = value.to(target_dtype)
        return value.to(device)

    workload.model = workload.model.to(device=device)
    if target_dtype is not None:
        workload.model = workload.model.to(dtype=target_dtype)
    workload.inputs = tree_map(move, workload.inputs)
    workload.kwargs = tree_map(move, workload.kwargs)
    workload.targets = tree_map(move, workload.targets)
    return workload


def profile_workload(
    workload: Workload,
    *,
    optimizer: str = "sgd",
    repeats: int = 5,
    warmup: int = 2,
    d2h_gb_per_s: float | None = None,
    h2d_gb_per_s: float | None = None,
    threads: int | None = None,
    budget_bytes: int | None = None,
    measuring: str = "auto",
    progress: Callable[[str], None] | None = None,
    compile: bool = False,
    deadline: float | None = None,
    split_loss: bool = False,
) -> ReferenceProfile:
    """Measure one training step of a workload and check the node times against a plain step; within
    `budget_bytes` the plain step is run only where keep-all fits (executor.measure.measuring)."""
    if threads is not None:
        if threads < 1:
            raise MososError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    say = progress or (lambda message: None)
    label = workload.name
    profile, profiled = profiler.profile_step(
        workload.model, workload.inputs, workload.loss_fn, workload.targets, kwargs=workload.kwargs,
        name=label, optimizer=optimizer, repeats=repeats, warmup=warmup,
        d2h_gb_per_s=d2h_gb_per_s, h2d_gb_per_s=h2d_gb_per_s, budget_bytes=budget_bytes, measuring=measuring,
        progress=lambda message: say(f"profiling {label}: {message}"), compile=compile, deadline=deadline,
        split_loss=split_loss,
    )
    measured_under = profiled.measuring.describe() if profiled.measuring else "keep-all"
    nodes_ms = profiler.plain_equivalent_time_ms(profile)
    if profiled.measuring is not None and profiled.measuring.strategy != "keep-all":
        notes = (profile.provenance.notes + "; " if profile.provenance.notes else "") + (
            f"check: node times with native algorithms add up to {nodes_ms:.3f} ms; no plain step was timed (it "
            "does not fit the budget)")
        profile = profile.model_copy(update={"provenance": profile.provenance.model_copy(update={"notes": notes})})
        return ReferenceProfile(profile, label, nodes_ms, None, repeats, measured_under, profiled.compiled)
    say(f"timing plain PyTorch steps of {label}")
    # a whole step is short and noisy on a busy machine: at least 10 repeats for its median
    plain_repeats = max(repeats, 10)
    plain_ms = profiler.plain_step_time_ms(workload.model, workload.inputs, workload.loss_fn, workload.targets,
                                           kwargs=workload.kwargs, repeats=plain_repeats, warmup=max(warmup, 2))
    notes = (profile.provenance.notes + "; " if profile.provenance.notes else "") + (
        f"check: node times with native algorithms add up to {nodes_ms:.3f} ms, a plain PyTorch step "
        f"(median of {plain_repeats}) took {plain_ms:.3f} ms, ratio {nodes_ms / plain_ms:.2f}"
    )
    profile = profile.model_copy(update={"provenance": profile.provenance.model_copy(update={"notes": notes})})
    return ReferenceProfile(profile, label, nodes_ms, plain_ms, repeats, measured_under, profiled.compiled)
