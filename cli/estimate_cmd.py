"""`mosos estimate`: a profile of a training step on a GPU we do not have (roofline + cuDNN families).

Two kinds of model: a reference network by name (`--model vgg19`, priced per
layer by `models.estimator`), or the user's own `path/to/file.py:build` /
`package.module:build` workload (`models.workload`), captured here and priced
per ATen operation by `executor.measure.estimate`, without running a step. torch,
`models` and `executor` are imported only when the command runs, so the planner
stays importable without them.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import typer
from rich.table import Table

from cli.app import app, console, friendly, step_note
from cli.checks import distinct_files, whole_number_in, workload_file, writable_output, write_output
from planner.errors import MososError
from planner.units import format_bytes, parse_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.


def _load_estimator():
    if importlib.util.find_spec("torch") is None:
        raise MososError(
            "mosos estimate needs torch to trace the model (a CPU build is enough): pip install torch"
        )
    from models import estimator, gpus, registry

    return estimator, gpus, registry


def _listing(gpus, registry) -> None:
    table = Table(title="GPUs (--gpu)")
    for header in ("key", "name", "memory", "FP32 TFLOPS", "TF32/BF16", "bandwidth", "PCIe", "d2h / h2d GB/s"):
        table.add_column(header)
    for gpu in gpus.GPUS.values():
        tensor = f"{gpu.tf32_tflops or '-'} / {gpu.bf16_tflops or '-'}"
        table.add_row(gpu.key, gpu.name, format_bytes(gpu.memory_bytes), f"{gpu.fp32_tflops}", tensor,
                      f"{gpu.memory_bandwidth_gb_per_s} GB/s", gpu.pcie, f"{gpu.d2h_gb_per_s} / {gpu.h2d_gb_per_s}")
    console.print(table)
    console.print("models (--model): " + ", ".join(registry.list_models()))


def _summary(profile, output: Path | None) -> str:
    from planner.simulator import simulate
    from planner.strategies.keep_all import keep_all_schedule

    keep_all = simulate(profile, keep_all_schedule(profile), keep_timeline=False)
    fits = "fits" if keep_all.peak_memory_bytes <= profile.hardware.memory_capacity_bytes else "does NOT fit"
    where = f"wrote {output}: " if output else ""
    return (f"{where}{profile.name}, {len(profile.nodes)} nodes; keep-all (fastest algorithms): step "
            f"{keep_all.step_time_ms:.2f} ms, peak {format_bytes(keep_all.peak_memory_bytes)} of "
            f"{format_bytes(profile.hardware.memory_capacity_bytes)} ({fits}; fixed {format_bytes(profile.fixed_bytes)})")


def _estimate_workload(spec: str, gpu: str | None, batch: int | None, output: Path | None, *, math: str,
                       optimizer: str, memory_bytes: int | None, compact: bool) -> None:
    """Capture the user's workload here and estimate it per ATen operation on the GPU (no step is run)."""
    if gpu is None:
        raise MososError(f"mosos estimate {spec} needs --gpu (one of the table: mosos estimate --list)")
    whole_number_in(batch, "--batch", 1, 1 << 24)
    from executor.measure.estimate import estimate_workload, gpu_of

    gpu_of(gpu)  # an unknown GPU is refused, with the known keys, before the user's code runs
    started = time.monotonic()
    profile = estimate_workload(spec, gpu, batch_size=batch, math=math, optimizer=optimizer,
                                memory_bytes=memory_bytes)
    seconds = time.monotonic() - started
    if output is not None:
        write_output(output, profile.to_json(indent=None if compact else 1), "-o")
    console.print(_summary(profile, output) + f"; estimated in {seconds:.1f} s", highlight=False)


@app.command("estimate")
@friendly
def estimate_command(
    workload: str = typer.Argument(None, help="your own workload, path/to/file.py:build or package.module:build "
                                   "(build() returns model, inputs, targets, loss; it may take batch_size=)"),
    model: str = typer.Option(None, "--model", "-m", help="reference network, e.g. vgg19, unet, resnet50 (see --list); "
                              "or your file.py:build"),
    batch: int = typer.Option(None, "--batch", "-b", help="batch size"),
    gpu: str = typer.Option(None, "--gpu", "-g", help="GPU key: titanx, p40, p100, v100, a100, h100"),
    output: Path = typer.Option(None, "-o", "--output", help="where to write the profile (JSON)"),
    image_size: int = typer.Option(None, help="image height and width (default 224; U-Net 256)"),
    tokens: int = typer.Option(None, help="sequence length for the transformer (default 1024)"),
    small: bool = typer.Option(False, help="the tiny test variant of the model (same layer kinds, few channels)"),
    math: str = typer.Option("fp32", help="fp32, or tf32 to use the tensor cores of A100/H100"),
    optimizer: str = typer.Option("sgd-momentum", help="sgd, sgd-momentum (or momentum), adam or adamw (sets the "
                                  "optimizer state and its step's temporaries)"),
    memory: str = typer.Option(None, help="device memory if not the GPU's own, e.g. 12GiB"),
    compact: bool = typer.Option(False, help="write the JSON on one line (smaller files)"),
    list_: bool = typer.Option(False, "--list", help="list the GPUs and models and exit"),
) -> None:
    """Estimate a training-step profile of a reference MODEL at BATCH, or of your WORKLOAD, on GPU, without that GPU."""
    estimator, gpus, registry = _load_estimator()
    if list_:
        _listing(gpus, registry)
        return
    if workload is not None and model is not None:
        raise MososError(f"give your workload ({workload}) or --model, not both")
    spec = workload if workload is not None else model
    from models.workload import looks_like_spec

    if spec is not None and (workload is not None or looks_like_spec(spec)):
        if not looks_like_spec(spec):
            raise MososError(f"{spec!r} is not a workload spec: write path/to/file.py:build or package.module:build "
                             f"(a reference network goes in --model: {', '.join(registry.list_models())})")
        for flag, value in (("--image-size", image_size), ("--tokens", tokens), ("--small", small or None)):
            if value is not None:
                raise MososError(f"{flag} is for reference networks; your build() sets its own inputs")
        writable_output(output, "-o")
        distinct_files({"the workload's file": workload_file(spec)}, {"-o": output})
        memory_bytes = parse_bytes(memory) if memory else None
        if memory_bytes == 0:
            raise MososError("--memory must be more than 0 bytes")
        _estimate_workload(spec, gpu, batch, output, math=math, optimizer=optimizer, memory_bytes=memory_bytes,
                           compact=compact)
        return
    missing = [flag for flag, value in (("--model", model), ("--batch", batch), ("--gpu", gpu)) if value is None]
    if missing:
        raise MososError(f"mosos estimate needs {', '.join(missing)} (or --list to see models and GPUs)")
    writable_output(output, "-o")
    whole_number_in(image_size, "--image-size", 1, 1 << 16)
    whole_number_in(tokens, "--tokens", 1, 1 << 24)
    memory_bytes = parse_bytes(memory) if memory else None
    if memory_bytes == 0:
        raise MososError("--memory must be more than 0 bytes")
    if math not in ("fp32", "tf32"):
        raise MososError(f"--math must be fp32 or tf32, not {math!r}")
    profile = estimator.estimate(
        model,
        batch,
        gpu,
        image_size=image_size,
        tokens=tokens,
        small=small,
        math=math,
        optimizer=optimizer,
        memory_bytes=memory_bytes,
    )
    if output is None:  # as for a workload: the keep-all figures, nothing written
        console.print(_summary(profile, None), highlight=False)
        return
    write_output(output, profile.to_json(indent=None if compact else 1), "-o")
    fastest_ms = sum(node.fastest.time_ms for node in profile.nodes)
    tensors = sum(node.size_bytes for node in profile.nodes)
    console.print(
        f"wrote {output}: {profile.name}, {len(profile.nodes)} nodes, "
        f"{sum(len(node.inputs) for node in profile.nodes)} edges; fastest compute {fastest_ms:.1f} ms; "
        f"tensors {format_bytes(tensors)}, fixed {format_bytes(profile.fixed_bytes)}{step_note(profile)}, "
        f"device {format_bytes(profile.hardware.memory_capacity_bytes)}"
    )
