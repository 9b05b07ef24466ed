"""The per-operation estimate of a captured model (`executor.measure.estimate`) beside the reference estimator's per-layer
one (`models.estimator`) on the reference networks, and beside MONeT's measured P100 convolutions.

Run: `python benchmarks/estimate_agreement.py [--write]`. Prints, per network, the keep-all step time (fastest
algorithms) and keep-all peak memory of both estimates on a V100 and their difference, then VGG16's 13
convolutions at batch 176 on a P100: the fastest forward, filter-gradient and data-gradient algorithm times of the
new path, of the reference estimator and as measured. `--write` also writes benchmarks/results/estimate.md.
tests/test_estimate_workload.py checks the same figures (15% on the step time; the calibration's tolerances).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from executor.measure.estimate import convolution_algorithms, estimate_reference, estimate_step, gpu_of  # noqa: E402
from executor.capture.planning_graph import CONVOLUTION  # noqa: E402
from models import cudnn  # noqa: E402
from models.calibration import BATCH, DEFAULT_DATA, FORWARD_ORDER, vgg16_convolutions  # noqa: E402
from models.estimator import estimate  # noqa: E402
from models.registry import get_model  # noqa: E402
from models.roofline import Device  # noqa: E402
from planner.profile import GraphProfile  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.strategies.keep_all import keep_all_schedule  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "estimate.md"
GPU = "v100"
# full-size networks at small batches: the capture's cost does not depend on the batch, the comparison's meaning does
# not either (both estimates scale the same way); the transformer at 256 tokens keeps its capture short
NETWORKS = (("vgg19", 8, None), ("resnet50", 8, None), ("unet", 2, None), ("transformer", 2, 256))


@dataclass
class Agreement:
    network: str
    batch: int
    new_step_ms: float
    reference_step_ms: float
    new_peak_bytes: int
    reference_peak_bytes: int
    new_nodes: int
    reference_nodes: int
    seconds: float

    @property
    def step_difference(self) -> float:
        return self.new_step_ms / self.reference_step_ms - 1

    @property
    def peak_difference(self) -> float:
        return self.new_peak_bytes / self.reference_peak_bytes - 1


def keep_all(profile: GraphProfile) -> tuple[float, int]:
    result = simulate(profile, keep_all_schedule(profile), keep_timeline=False)
    return result.step_time_ms, result.peak_memory_bytes


def agreement(network: str, batch: int, tokens: int | None = None, gpu: str = GPU) -> Agreement:
    """Keep-all step time and peak of one reference network, estimated per operation and per layer."""
    started = time.monotonic()
    new = estimate_reference(network, batch, gpu, tokens=tokens)
    seconds = time.monotonic() - started
    reference = estimate(network, batch, gpu, tokens=tokens)
    (new_ms, new_peak), (ref_ms, ref_peak) = keep_all(new), keep_all(reference)
    return Agreement(network, batch, new_ms, ref_ms, new_peak, ref_peak, len(new.nodes), len(reference.nodes), seconds)


@dataclass
class ConvolutionRow:
    layer: str
    measured_ms: float  # fastest forward algorithm, MONeT's P100
    new_ms: float
    reference_ms: float
    measured_filter_ms: float
    new_filter_ms: float
    reference_filter_ms: float
    measured_data_ms: float | None  # none for the first layer (its input needs no gradient)
    new_data_ms: float | None
    reference_data_ms: float | None


def calibration(data_path: Path = DEFAULT_DATA) -> list[ConvolutionRow]:
    """VGG16 at batch 176 captured and its convolutions priced by the new path on a P100, beside the reference
    estimator's and MONeT's measured fastest times, layer by layer."""
    data = json.loads(Path(data_path).read_text())
    forward = [n for n in data["nodes"] if n["n_algorithms"] == 8]
    backward = [n for n in data["nodes"] if n["n_algorithms"] == 6]
    pairs = [backward[i: i + 2] for i in range(0, len(backward), 2)][::-1]  # (filter, data), first layer first
    gpu = gpu_of("p100")
    spec = get_model("vgg16")
    with torch.device("meta"):
        model = spec.build()
    model = model.to_empty(device="cpu")
    inputs, targets = spec.example_inputs(BATCH)
    _, profiled = estimate_step(model, (inputs,), spec.loss, targets, gpu=gpu)
    step, gm = profiled.step, profiled.step.graph_module
    by_layer: dict[str, dict[str, list[cudnn.Algorithm]]] = {}
    for group in profiled.planning.groups:
        conv = group.convolution
        if conv is None:
            continue
        layer = step.module_path[conv]
        kind = "forward" if conv.target is CONVOLUTION else ("data" if conv.args[10][0] else "filter")
        by_layer.setdefault(layer, {})[kind] = convolution_algorithms(conv, gm, gpu, "fp32")
    device = Device(gpu)
    fastest = lambda algorithms: min(a.time_ms for a in algorithms)  # noqa: E731
    measured_best = lambda node: min(t for t in node["time_ms"] if t is not None)  # noqa: E731
    rows = []
    layers = list(by_layer)
    for index, ((layer, shape), node, layer_key) in enumerate(zip(vgg16_convolutions(), forward, layers)):
        algorithms = by_layer[layer_key]
        measured = {f: t for f, t in zip(FORWARD_ORDER, node["time_ms"]) if t is not None}
        filt, dat = pairs[index]
        rows.append(ConvolutionRow(
            layer, min(measured.values()), fastest(algorithms["forward"]),
            fastest(cudnn.forward_algorithms(shape, device)),
            measured_best(filt), fastest(algorithms["filter"]), fastest(cudnn.backward_filter_algorithms(shape, device)),
            measured_best(dat) if index else None, fastest(algorithms["data"]) if "data" in algorithms else None,
            fastest(cudnn.backward_data_algorithms(shape, device)) if index else None,
        ))
    return rows


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args()
    lines = [
        "# The per-operation estimate of a captured model beside the reference estimator",
        "",
        "Generated by `python benchmarks/estimate_agreement.py --write` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, this project's 2-core "
        "machine. New: `executor.measure.estimate` (the model captured as the executor's joint ATen graph, each operation "
        "priced on the GPU's figures: FLOPs from `torch.utils.flop_counter`, bytes from the fake tensors' sizes, "
        "roofline of `models/roofline.py`, convolutions per cuDNN family of `models/cudnn.py`). Reference: "
        "`models.estimator` (torch.fx, one node per layer, per-layer formulas). Both on a "
        f"{gpu_of(GPU).name}, keep-all with the fastest algorithms, SGD with momentum, simulated by `planner`.",
        "",
        "| network | batch | nodes new / reference | step new | step reference | difference | keep-all peak new | "
        "peak reference | difference | capture + estimate |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines[-2:]))
    for network, batch, tokens in NETWORKS:
        a = agreement(network, batch, tokens)
        label = network + (f" ({tokens} tokens)" if tokens else "")
        lines.append(f"| {label} | {batch} | {a.new_nodes} / {a.reference_nodes} | {a.new_step_ms:.2f} ms | "
                     f"{a.reference_step_ms:.2f} ms | {_pct(a.step_difference)} | {a.new_peak_bytes / 2**20:.1f} MiB | "
                     f"{a.reference_peak_bytes / 2**20:.1f} MiB | {_pct(a.peak_difference)} | {a.seconds:.1f} s |")
        print(lines[-1])
    lines += [
        "",
        "The peaks agree within 0.1%: both count the same tensors (the reference estimator follows what autograd "
        "saves, the capture is what autograd saves) and the same fixed memory; the new path adds the loss and its "
        "incoming gradient (a few bytes) to fixed memory, as a measured profile does. The step times differ where "
        "the two price different kernels: the ATen graph has a kernel per operation (a linear layer's backward is two "
        "GEMMs and a bias reduction, a residual stream's gradient sum is its own add, each with its launch), the "
        "reference one formula per layer; normalisation is two passes over its input in both, and fused attention's "
        "backward recomputes the scores in both. Both use the same roofline efficiencies and cuDNN family formulas: "
        "this agreement shows that pricing the captured operations reproduces the per-layer estimate, not that "
        "either matches a real GPU; the table below is the check against measurements.",
        "",
    ]
    if DEFAULT_DATA.exists():
        rows = calibration()
        lines += [
            "## Convolutions against MONeT's measured P100 (VGG16, batch 176)",
            "",
            "Fastest algorithm time per layer (ms): measured (MONeT, cuDNN 7), new path (the captured graph's "
            "convolution and backward halves), reference estimator; ratio = new / measured. The reference "
            "estimator's acceptance: forward within 1.5x, each backward half within 2x "
            "(`tests/test_models_calibration.py`); the new path is held to the same "
            "(`tests/test_estimate_workload.py`).",
            "",
            "| layer | forward measured | new | reference | ratio | filter measured | new | ratio | data measured | "
            "new | ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            data = (f"{r.measured_data_ms:.2f} | {r.new_data_ms:.2f} | {r.new_data_ms / r.measured_data_ms:.2f}"
                    if r.measured_data_ms else "- | - | -")
            lines.append(f"| {r.layer} | {r.measured_ms:.2f} | {r.new_ms:.2f} | {r.reference_ms:.2f} | "
                         f"{r.new_ms / r.measured_ms:.2f} | {r.measured_filter_ms:.2f} | {r.new_filter_ms:.2f} | "
                         f"{r.new_filter_ms / r.measured_filter_ms:.2f} | {data} |")
            print(lines[-1])
    else:
        lines.append(f"(MONeT's measurements not found at {DEFAULT_DATA}: no calibration table)")
    command = ["estimate", "benchmarks/workloads.py:bert_base", "--gpu", "v100"]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", *command], cwd=ROOT, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    summary = " ".join(done.stdout.split()) if done.returncode == 0 else f"failed: {done.stderr.strip()}"
    lines += [
        "",
        "## A user's model: BERT-base",
        "",
        f"`mosos {' '.join(command)}` (12 layers, hidden 768, sequence 512, batch 1; a fresh process, torch's "
        f"import included) took {wall_s:.1f} s wall on this machine and printed: {summary}",
    ]
    print(lines[-1])
    if args.write:
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
