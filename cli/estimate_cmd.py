"""`mosos estimate`: a profile for a reference network on a GPU we do not have (roofline + cuDNN families).

torch and the `models` package are imported only when the command runs, so the
planner stays importable without them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer
from rich.table import Table

from cli.app import app, console, friendly
from cli.checks import whole_number_in, writable_output, write_output
from planner.errors import MososError
from planner.units import format_bytes, parse_bytes


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


@app.command("estimate")
@friendly
def estimate_command(
    model: str = typer.Option(None, "--model", "-m", help="reference network, e.g. vgg19, unet, resnet50 (see --list)"),
    batch: int = typer.Option(None, "--batch", "-b", help="batch size"),
    gpu: str = typer.Option(None, "--gpu", "-g", help="GPU key: titanx, p40, p100, v100, a100, h100"),
    output: Path = typer.Option(None, "-o", "--output", help="where to write the profile (JSON)"),
    image_size: int = typer.Option(None, help="image height and width (default 224; U-Net 256)"),
    tokens: int = typer.Option(None, help="sequence length for the transformer (default 1024)"),
    small: bool = typer.Option(False, help="the tiny test variant of the model (same layer kinds, few channels)"),
    math: str = typer.Option("fp32", help="fp32, or tf32 to use the tensor cores of A100/H100"),
    optimizer: str = typer.Option("sgd-momentum", help="sgd, sgd-momentum or adam (sets the optimizer state)"),
    memory: str = typer.Option(None, help="device memory if not the GPU's own, e.g. 12GiB"),
    compact: bool = typer.Option(False, help="write the JSON on one line (smaller files)"),
    list_: bool = typer.Option(False, "--list", help="list the GPUs and models and exit"),
) -> None:
    """Estimate a training-step profile of MODEL at BATCH on GPU, without that GPU."""
    estimator, gpus, registry = _load_estimator()
    if list_:
        _listing(gpus, registry)
        return
    missing = [flag for flag, value in (("--model", model), ("--batch", batch), ("--gpu", gpu), ("-o", output))
               if value is None]
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
    write_output(output, profile.to_json(indent=None if compact else 1), "-o")
    fastest_ms = sum(node.fastest.time_ms for node in profile.nodes)
    tensors = sum(node.size_bytes for node in profile.nodes)
    console.print(
        f"wrote {output}: {profile.name}, {len(profile.nodes)} nodes, "
        f"{sum(len(node.inputs) for node in profile.nodes)} edges; fastest compute {fastest_ms:.1f} ms; "
        f"tensors {format_bytes(tensors)}, fixed {format_bytes(profile.fixed_bytes)}, "
        f"device {format_bytes(profile.hardware.memory_capacity_bytes)}"
    )
