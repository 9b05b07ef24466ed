"""`mosos profile`: measure a workload on this machine (CPU or CUDA) into a profile.

The workload is the user's own (`mosos profile path/to/file.py:build`, or
`package.module:build`: see models/workload.py) or a reference network
(`--model NAME --batch N`).

torch, `models` and `executor` are imported only when the command runs, so the
planner stays importable without them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer

from cli.app import app, console, error_console, friendly, step_note
from cli.checks import (distinct_files, positive_finite, time_limit_within, whole_number_in, workload_file,
                        writable_output, write_output)
from cli.time_limit import command_started, time_limited
from planner.errors import MososError
from planner.units import format_bytes, parse_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.


def _load():
    if importlib.util.find_spec("torch") is None:
        raise MososError("mosos profile needs torch to run the model: pip install torch")
    from executor.replay import reference

    return reference


@app.command("profile")
@friendly
def profile_command(
    workload: str = typer.Argument(None, help="your workload: path/to/file.py:build or package.module:build, where "
                                   "build() returns the model, inputs, targets and loss (see models/workload.py)"),
    model: str = typer.Option(None, "--model", help="a reference network instead: vgg19, resnet50, unet, transformer, ..."),
    batch: int = typer.Option(None, "--batch", help="batch size (needed with --model; a workload's build(batch_size=N))"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    small: bool = typer.Option(False, "--small", help="the small variant of the network (for CPU tests)"),
    image_size: int = typer.Option(None, help="input image size (images) instead of the network's default"),
    tokens: int = typer.Option(None, help="sequence length (transformer) instead of the default"),
    dtype: str = typer.Option(None, help="float32 or float64 (reference networks: float32; a workload: as built)"),
    optimizer: str = typer.Option("sgd", help="optimizer whose state counts as fixed memory: sgd, momentum, adam, adamw, "
                                   "rmsprop, adagrad, nadam, radam, adamax"),
    repeats: int = typer.Option(5, help="timed runs per node (the median is kept)"),
    warmup: int = typer.Option(2, help="untimed runs per node before timing"),
    d2h_gb_per_s: float = typer.Option(None, "--d2h-gb-per-s", help="device-to-host bandwidth, 1e9 B/s (CPU: none unless given; CUDA: measured unless given)"),
    h2d_gb_per_s: float = typer.Option(None, "--h2d-gb-per-s", help="host-to-device bandwidth, 1e9 B/s"),
    seed: int = typer.Option(0, help="seed for the parameters"),
    threads: int = typer.Option(None, help="torch CPU threads (default: torch's); 1 avoids thread-barrier stalls on a busy machine"),
    budget: str = typer.Option(None, "--budget", help="device memory the profiling may hold, fixed memory included, "
                               "e.g. 6GiB: measured under a schedule that fits it (keep-all only where it fits)"),
    measuring: str = typer.Option("auto", "--measuring", help="auto (keep-all where it fits the budget), frugal "
                                  "(a frugal schedule even then) or keep-all"),
    compile: bool = typer.Option(False, "--compile", help="measure the planning nodes as Inductor kernels (what "
                                 "optimize(compile=True) runs): fusion changes their times and workspaces"),
    split_loss: bool = typer.Option(False, "--split-loss", help="a language model's cross-entropy over chunks of "
                                    "rows, its logits never whole (what optimize(split_loss=True) runs)"),
    time_limit: float = typer.Option(
        None, "--time-limit", help="time limit of the whole command, seconds (loading, capture, compiling, "
        "measuring): at the limit it stops, says what it was doing and writes nothing (exit code 4)"),
    output: Path = typer.Option(..., "-o", "--output", help="write the profile here"),
) -> None:
    """Profile one training step of your model (or a reference network), planning node by node, on this machine."""
    started = command_started()  # --time-limit counts from here: from the start of `mosos` itself
    writable_output(output, "-o")
    distinct_files({"the workload's file": workload_file(workload)}, {"-o": output})
    time_limit_within(time_limit)
    if batch is not None and batch < 1:
        raise MososError(f"--batch must be at least 1, got {batch}")
    whole_number_in(image_size, "--image-size", 1, 1 << 16)
    whole_number_in(tokens, "--tokens", 1, 1 << 24)
    if repeats < 1 or warmup < 0:
        raise MososError("--repeats must be at least 1 and --warmup at least 0")
    positive_finite(d2h_gb_per_s, "--d2h-gb-per-s")
    positive_finite(h2d_gb_per_s, "--h2d-gb-per-s")
    budget_bytes = parse_bytes(budget) if budget is not None else None
    if measuring not in ("auto", "frugal", "keep-all"):
        raise MososError(f"--measuring is auto, frugal or keep-all, not {measuring!r}")
    with time_limited(time_limit, started) as watch, console.status(f"loading {workload or model}") as status:
        def progress(message: str) -> None:
            watch.note(message)
            status.update(message)

        watch.note(f"loading {workload or model}")
        reference = _load()
        loaded = reference.load(model, workload, batch, device=device, small=small, image_size=image_size,
                                tokens=tokens, dtype=dtype, seed=seed)
        if model is not None:
            loaded.name = f"{loaded.name} {dtype or 'float32'} on {device}"
        measured = reference.profile_workload(
            loaded, optimizer=optimizer, repeats=repeats, warmup=warmup, d2h_gb_per_s=d2h_gb_per_s,
            h2d_gb_per_s=h2d_gb_per_s, threads=threads, budget_bytes=budget_bytes, measuring=measuring,
            progress=progress, compile=compile, deadline=watch.deadline, split_loss=split_loss,
        )
    profile, label, nodes_ms, plain_ms, ratio = (
        measured.profile, measured.label, measured.nodes_ms, measured.plain_ms, measured.ratio
    )
    write_output(output, profile.to_json(), "-o")
    total_ms = sum(node.fastest.time_ms for node in profile.nodes)
    activations = sum(node.size_bytes for node in profile.nodes if node.kind != "backward")
    console.print(
        f"{label}: {len(profile.nodes)} nodes, fastest compute {total_ms:.2f} ms, forward tensors "
        f"{format_bytes(activations)}, fixed memory {format_bytes(profile.fixed_bytes)}{step_note(profile)}, "
        f"spread {profile.provenance.spread_percent}% over {repeats} repeats"
    )
    backward_nodes = sum(1 for node in profile.nodes if node.kind == "backward")
    plain = (f"a plain PyTorch step takes {plain_ms:.2f} ms (ratio {ratio:.2f})" if plain_ms is not None
             else "no plain step was timed (it does not fit the budget)")
    console.print(
        f"measured under {measured.measured_under}; node times with native algorithms add up to {nodes_ms:.2f} ms; "
        f"{plain}; {len(profile.nodes) - backward_nodes} forward and {backward_nodes} backward planning nodes"
    )
    if measured.compiled is not None:
        console.print(f"compiled: {measured.compiled.describe()}")
    if profile.hardware.d2h_bandwidth_gb_per_s is None:
        error_console.print("note: no transfer bandwidth (give --d2h-gb-per-s/--h2d-gb-per-s): plans cannot offload")
    console.print(f"wrote {output}")
