"""Profile a reference network from `models` by name: what `mosos profile` runs, kept out of planner/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from executor import profiler
from models import get_model
from planner.errors import MososError
from planner.profile import GraphProfile

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class ReferenceProfile:
    profile: GraphProfile
    label: str
    nodes_ms: float  # node times with native algorithms, added up
    plain_ms: float  # a plain PyTorch step, timed the same way
    repeats: int

    @property
    def ratio(self) -> float:
        return self.nodes_ms / self.plain_ms


def profile_reference_network(
    model: str,
    batch: int,
    *,
    device: str = "cpu",
    small: bool = False,
    image_size: int | None = None,
    tokens: int | None = None,
    dtype: str = "float32",
    optimizer: str = "sgd",
    repeats: int = 5,
    warmup: int = 2,
    d2h_gb_per_s: float | None = None,
    h2d_gb_per_s: float | None = None,
    seed: int = 0,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReferenceProfile:
    """Measure one training step of a named network and check the node times against a plain step."""
    if device not in ("cpu", "cuda"):
        raise MososError(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MososError("--device cuda: no CUDA device is available here (this torch build or machine has none)")
    if dtype not in DTYPES:
        raise MososError(f"--dtype must be float32 or float64, not {dtype!r}")
    try:
        spec = get_model(model, small=small, image_size=image_size, tokens=tokens)
    except (KeyError, ValueError) as error:
        raise MososError(str(error).strip("'\"")) from None
    if threads is not None:
        if threads < 1:
            raise MososError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    say = progress or (lambda message: None)
    torch.manual_seed(seed)
    network = spec.build().to(device=device, dtype=DTYPES[dtype])
    inputs, targets = spec.example_inputs(batch, device=device, dtype=DTYPES[dtype])
    label = f"{spec.name}{' (small)' if small else ''} batch {batch} {dtype} on {device}"
    profile = profiler.profile_model(
        network, inputs, spec.loss, targets,
        name=label, optimizer=optimizer, repeats=repeats, warmup=warmup,
        d2h_gb_per_s=d2h_gb_per_s, h2d_gb_per_s=h2d_gb_per_s,
        progress=lambda message: say(f"profiling {label}: {message}"),
    )
    say(f"timing plain PyTorch steps of {label}")
    # a whole step is short and noisy on a busy machine: at least 10 repeats for its median
    plain_repeats = max(repeats, 10)
    plain_ms = profiler.plain_step_time_ms(network, inputs, spec.loss, targets, repeats=plain_repeats, warmup=max(warmup, 2))
    nodes_ms = profiler.plain_equivalent_time_ms(profile)
    notes = (profile.provenance.notes + "; " if profile.provenance.notes else "") + (
        f"check: node times with native algorithms add up to {nodes_ms:.3f} ms, a plain PyTorch step "
        f"(median of {plain_repeats}) took {plain_ms:.3f} ms, ratio {nodes_ms / plain_ms:.2f}"
    )
    profile = profile.model_copy(update={"provenance": profile.provenance.model_copy(update={"notes": notes})})
    return ReferenceProfile(profile, label, nodes_ms, plain_ms, repeats)
