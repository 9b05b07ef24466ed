"""Estimated cuDNN algorithms beside the only per-algorithm measurements we have.

`p100-vgg16-b176.json` (MONeT, Tesla P100 16 GB, VGG16 at batch 176, cuDNN 7)
lists time and workspace per algorithm for each convolution. Its forward
algorithm order is inferred from the workspaces (see the data's README); its
backward nodes come in (filter, data) pairs in reverse layer order, the last
layer's data gradient being a no-op. The shapes are taken from our own VGG16.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models import cudnn
from models.gpus import get_gpu
from models.registry import get_model
from models.roofline import Device
from models.trace import trace

MIB = 2**20
GIB = 2**30
BATCH = 176
FORWARD_ORDER = ("gemm", "fft", "fft_tiling", "implicit_gemm", "implicit_precomp_gemm", "direct", "winograd",
                 "winograd_nonfused")
TIME_FACTOR = 1.5  # acceptance: estimated fastest within this factor of the measured fastest
GEMM_WORKSPACE_TOLERANCE = 0.02
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cudnn-measurements" / "p100-vgg16-b176.json"


@dataclass
class LayerComparison:
    layer: str
    shape: cudnn.ConvShape
    measured: dict[str, tuple[float, float]]  # family -> (time ms, workspace MiB); algorithms that ran
    estimated: dict[str, cudnn.Algorithm]
    # fastest backward-filter and backward-data, each its own node (no data gradient for the first layer)
    measured_filter_ms: float | None = None
    estimated_filter_ms: float | None = None
    measured_data_ms: float | None = None
    estimated_data_ms: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def measured_fastest(self) -> tuple[str, float]:
        family = min(self.measured, key=lambda f: self.measured[f][0])
        return family, self.measured[family][0]

    @property
    def estimated_fastest(self) -> cudnn.Algorithm:
        return min(self.estimated.values(), key=lambda a: a.time_ms)

    @property
    def time_ratio(self) -> float:
        return self.estimated_fastest.time_ms / self.measured_fastest[1]

    @property
    def measured_over_1gib(self) -> set[str]:
        return {f for f, (_, ws) in self.measured.items() if ws * MIB > GIB}

    @property
    def estimated_over_1gib(self) -> set[str]:
        return {f for f, a in self.estimated.items() if a.workspace_bytes > GIB}

    @property
    def gemm_workspace(self) -> tuple[float | None, float | None]:
        measured = self.measured.get("gemm")
        estimated = self.estimated.get("gemm")
        return (measured[1] if measured else None, estimated.workspace_bytes / MIB if estimated else None)


def vgg16_convolutions() -> list[tuple[str, cudnn.ConvShape]]:
    """VGG16's 13 convolutions at batch 176, 224x224, from our own network (traced on the meta device)."""
    with torch.device("meta"):
        module = get_model("vgg16").build()
    traced = trace(module, torch.empty((BATCH, 3, 224, 224), device="meta"))
    convs = []
    for op in traced.ops:
        if op.op_type == "conv2d":
            n, c, h, w = op.input_shapes[0]
            kh, kw = op.attributes["kernel_size"]
            convs.append((op.module_path or op.name, cudnn.ConvShape(n, c, h, w, op.attributes["out_channels"], kh, kw,
                                                                      op.attributes["stride"], op.attributes["padding"])))
    return convs


def compare(data_path: Path = DEFAULT_DATA) -> list[LayerComparison]:
    data = json.loads(Path(data_path).read_text())
    forward = [n for n in data["nodes"] if n["n_algorithms"] == 8]
    backward = [n for n in data["nodes"] if n["n_algorithms"] == 6]
    convs = vgg16_convolutions()
    if len(forward) != len(convs):
        raise ValueError(f"{data_path}: expected {len(convs)} forward convolutions, found {len(forward)}")
    device = Device(get_gpu("p100"))
    pairs = [backward[i : i + 2] for i in range(0, len(backward), 2)][::-1]  # (filter, data), first layer first
    results = []
    for index, ((layer, shape), node) in enumerate(zip(convs, forward)):
        measured = {
            family: (t, ws)
            for family, t, ws in zip(FORWARD_ORDER, node["time_ms"], node["workspace_mib"])
            if t is not None
        }
        estimated = {a.family: a for a in cudnn.forward_algorithms(shape, device)}
        comparison = LayerComparison(layer, shape, measured, estimated)
        if index < len(pairs) and len(pairs[index]) == 2:
            filt, dat = pairs[index]
            best = lambda n: min(t for t in n["time_ms"] if t is not None)  # noqa: E731
            fastest = lambda algorithms: min(a.time_ms for a in algorithms)  # noqa: E731
            comparison.measured_filter_ms = best(filt)
            comparison.estimated_filter_ms = fastest(cudnn.backward_filter_algorithms(shape, device))
            if index > 0:  # no input gradient for the first layer: its 'data' entry is a no-op
                comparison.measured_data_ms = best(dat)
                comparison.estimated_data_ms = fastest(cudnn.backward_data_algorithms(shape, device))
        _check(comparison)
        results.append(comparison)
    return results


def _check(c: LayerComparison) -> None:
    if not (1 / TIME_FACTOR <= c.time_ratio <= TIME_FACTOR):
        c.problems.append(f"fastest time ratio {c.time_ratio:.2f} outside 1/{TIME_FACTOR}..{TIME_FACTOR}")
    measured_ws, estimated_ws = c.gemm_workspace
    if measured_ws is not None:
        if estimated_ws is None:
            c.problems.append("GEMM ran on the P100 but is not estimated")
        elif abs(estimated_ws - measured_ws) > GEMM_WORKSPACE_TOLERANCE * measured_ws:
            c.problems.append(f"GEMM workspace {estimated_ws:.1f} MiB vs measured {measured_ws:.1f} MiB")
    if c.measured_over_1gib != c.estimated_over_1gib:
        c.problems.append(
            f"algorithms over 1 GiB differ: measured {sorted(c.measured_over_1gib)}, "
            f"estimated {sorted(c.estimated_over_1gib)}"
        )
