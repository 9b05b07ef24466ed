"""The executor against plain PyTorch, on the device it runs on: memory, step time, gradients, copy overlap.

For one reference network (or a workload, `file.py:build`) it profiles a training step on the device, plans it at
each memory ratio, replays the plan and measures, next to a plain PyTorch step
from the same weights, batch and random numbers:

- peak memory: torch.cuda.max_memory_allocated on a GPU (everything else moved
  off the device first, so the figure is this step's), against the budget plus
  the allowed slack; on the CPU, the executor's byte-exact ledger stands in;
- step time: the median of the timed steps against the simulated step time of
  the same measured profile and plan;
- gradients: the largest difference from plain PyTorch's, relative to the
  largest gradient;
- overlap (GPU): one planned step under torch.profiler; copies on streams of
  their own, and how much of their time ran while the compute stream ran kernels.

    python3 benchmarks/executor_acceptance.py --model vgg19 --batch 64
    python3 benchmarks/executor_acceptance.py --model resnet50 --batch 128 --ratios 0.8 0.6 0.4
    python3 benchmarks/executor_acceptance.py --model vgg19 --small --batch 4 --device cpu --no-write
    python3 benchmarks/executor_acceptance.py --model benchmarks/workloads.py:bert_small --batch 8   # BERT

Writes a section of benchmarks/results/executor.md named after the device and date.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from benchmarks.results_file import write_section  # noqa: E402
from executor.engine.runtime import distinct_storage_bytes as distinct_bytes  # noqa: E402
from executor.measure.profiler import profile_model  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from executor.replay.reference import load  # noqa: E402
from models import get_model  # noqa: E402
from models.workload import looks_like_spec  # noqa: E402
from planner.errors import MososError  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402
from planner.units import format_bytes  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "executor.md"
MIB = 2**20


@dataclass
class Row:
    ratio: float
    budget_bytes: int | None = None
    feasible: bool = False
    note: str = ""
    strategy: str = ""
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    simulated_step_ms: float | None = None
    measured_step_ms: float | None = None
    step_ms_spread: tuple[float, float] | None = None
    gradient_error: float | None = None
    loss_error: float | None = None
    offloaded_bytes: int = 0
    recompute_ms: float = 0.0
    overlap: dict | None = None
    outside_plan_bytes: int = 0  # GPU: allocated between steps beyond weights and batch (cuBLAS workspaces, ...)

    @property
    def plan_peak_bytes(self) -> int | None:
        """The measured peak less what lives on the device outside any plan."""
        return None if self.measured_peak_bytes is None else self.measured_peak_bytes - self.outside_plan_bytes

    @property
    def time_ratio(self) -> float | None:
        if self.measured_step_ms is None or not self.simulated_step_ms:
            return None
        return self.measured_step_ms / self.simulated_step_ms


@dataclass
class Report:
    model: str
    batch: int
    device: str
    device_name: str
    torch_version: str
    profile_nodes: int = 0
    profile_seconds: float = 0.0
    keep_all_peak_bytes: int = 0
    plain_step_ms: float | None = None
    plain_peak_bytes: int | None = None
    rows: list[Row] = field(default_factory=list)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.grad is not None}


def gradient_error(reference: dict[str, torch.Tensor], model: torch.nn.Module) -> float:
    """max |g - g_ref| over every parameter, relative to the largest |g_ref| (1.0 if a gradient is missing)."""
    scale = max((g.abs().max().item() for g in reference.values()), default=0.0) or 1.0
    worst = 0.0
    for name, parameter in model.named_parameters():
        expected = reference.get(name)
        if expected is None:
            continue
        if parameter.grad is None:
            return 1.0
        worst = max(worst, (parameter.grad.detach().cpu().double() - expected.double()).abs().max().item() / scale)
    return worst


def _step(run, model: torch.nn.Module, seed: int, device: torch.device) -> tuple[float, float]:
    """One forward + backward from zeroed gradients: (loss, milliseconds)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    _synchronize(device)
    started = time.perf_counter()
    loss = run()
    loss.backward()
    _synchronize(device)
    return loss.item(), (time.perf_counter() - started) * 1e3


def _timed_steps(run, model, device, steps: int, warmup: int, seed: int,
                 resident_bytes: int = 0) -> tuple[list[float], int | None, int]:
    """Milliseconds of `steps` steps after `warmup`, the device's peak over them (None on the CPU), and what was
    allocated between steps beyond `resident_bytes` (weights and batch): memory no plan accounts for."""
    for k in range(warmup):
        _step(run, model, seed + k, device)
    outside = 0
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        outside = torch.cuda.memory_allocated(device) - resident_bytes
    _reset_peak(device)
    times = [_step(run, model, seed + warmup + k, device)[1] for k in range(steps)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return times, peak, outside


def copy_overlap(trace_path: Path) -> dict:
    """From a torch.profiler Chrome trace: copy streams, copy time, and copy time overlapped by compute kernels.

    The compute stream is the one with the most kernel time; copies are memcpy events on any other stream.
    """
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    kernels: dict[object, list[tuple[float, float]]] = {}
    copies: list[tuple[float, float, object, str]] = []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        stream = (event.get("args") or {}).get("stream", event.get("tid"))
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        if event.get("cat") == "kernel":
            kernels.setdefault(stream, []).append(span)
        elif event.get("cat") == "gpu_memcpy":
            copies.append((*span, stream, event.get("name", "")))
    if not kernels:
        return {"compute_stream": None, "copy_streams": [], "copies": len(copies), "copy_ms": 0.0, "overlapped_ms": 0.0}
    compute_stream = max(kernels, key=lambda s: sum(end - start for start, end in kernels[s]))
    busy = _union(kernels[compute_stream])
    side = [(start, end, stream, name) for start, end, stream, name in copies if stream != compute_stream]
    copy_us = sum(end - start for start, end, _, _ in side)
    overlapped_us = sum(_intersection_us(start, end, busy) for start, end, _, _ in side)
    return {
        "compute_stream": compute_stream,
        "copy_streams": sorted({str(stream) for _, _, stream, _ in side}),
        "copies": len(side),
        "copies_on_compute_stream": len(copies) - len(side),
        "d2h_copies": sum(1 for *_, name in side if "DtoH" in name),
        "h2d_copies": sum(1 for *_, name in side if "HtoD" in name),
        "copy_ms": copy_us / 1e3,
        "overlapped_ms": overlapped_us / 1e3,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _intersection_us(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b_end) - max(start, b_start)) for b_start, b_end in busy)


def _profiled_step(step, model, device, trace_dir: Path, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    path = trace_dir / f"{label}.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        _step(step, model, 7, device)
    profiler.export_chrome_trace(str(path))
    overlap = copy_overlap(path)
    overlap["trace"] = str(path)
    return overlap


def run(
    model_name: str,
    batch: int,
    *,
    small: bool = False,
    device: str = "cuda",
    ratios: tuple[float, ...] = (0.8, 0.7, 0.6, 0.5, 0.4),
    strategy: str = "mosos",
    time_limit_s: float = 30.0,
    steps: int = 5,
    warmup: int = 2,
    profile_repeats: int = 5,
    trace_dir: Path | None = None,
    say=print,
) -> Report:
    device = torch.device(device)
    if device.type == "cuda":
        # Gradients are compared with plain PyTorch's: no TF32 on either side (the profile is taken the same way).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # a reference network by name, or a user's workload (path/to/file.py:build, e.g. benchmarks/workloads.py:bert_small)
    if looks_like_spec(model_name):
        workload = load(None, model_name, batch, device=device.type)
        label = model_name.rsplit(":", 1)[-1]
    else:
        workload = load(model_name, None, batch, device=device.type, small=small)
        label = get_model(model_name, small=small).name + (" (small)" if small else "")
    base, loss_fn, targets = workload.model, workload.loss_fn, workload.targets
    inputs, kwargs = tuple(workload.inputs), dict(workload.kwargs)
    batch = workload.batch_size or batch

    def plain_step(module):
        output = module(*inputs, **kwargs)
        return loss_fn(output, targets) if targets is not None else loss_fn(output)

    def planned_step(planned):
        return lambda: planned(*inputs, targets=targets, **kwargs)

    report = Report(model=label, batch=batch, device=device.type,
                    device_name=_device_name(device), torch_version=torch.__version__)

    # Plain PyTorch: reference gradients of the first step, then its time and peak.
    plain = copy.deepcopy(base).to(device)
    plain_loss, _ = _step(lambda: plain_step(plain), plain, 1, device)
    reference = _gradients(plain)
    times, report.plain_peak_bytes, _ = _timed_steps(lambda: plain_step(plain), plain, device, steps,
                                                     warmup, 11)
    report.plain_step_ms = statistics.median(times)
    plain = None  # its copy of the model goes before the planned runs (the lambdas above are done with it)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    say(f"plain PyTorch: {report.plain_step_ms:.1f} ms a step"
        + (f", peak {format_bytes(report.plain_peak_bytes)}" if report.plain_peak_bytes else ""))

    # The measured profile of this device.
    subject = copy.deepcopy(base).to(device)
    started = time.perf_counter()
    cpu_bandwidth = {} if device.type == "cuda" else {"d2h_gb_per_s": 10.0, "h2d_gb_per_s": 10.0}
    profile = profile_model(subject, inputs, loss_fn, targets, kwargs=kwargs, optimizer=None, repeats=profile_repeats,
                            warmup=warmup, progress=None, **cpu_bandwidth)
    report.profile_seconds = time.perf_counter() - started
    report.profile_nodes = len(profile.nodes)
    report.keep_all_peak_bytes = keep_all_peak_bytes(profile)
    say(f"profiled {len(profile.nodes)} nodes in {report.profile_seconds:.0f} s; keep-all peak "
        f"{format_bytes(report.keep_all_peak_bytes)}")
    del subject
    gc.collect()  # the captured graph holds the profiled copy in a reference cycle: free it before measuring
    if device.type == "cuda":
        torch.cuda.empty_cache()

    for ratio in ratios:
        row = Row(ratio=ratio)
        report.rows.append(row)
        try:
            schedule = plan(profile, None, memory_ratio=ratio, strategy=strategy, time_limit_s=time_limit_s)
        except MososError as error:
            row.note = str(error).splitlines()[0]
            say(f"ratio {ratio}: no plan: {row.note}")
            continue
        summary = schedule.summary
        row.feasible = True
        row.budget_bytes = schedule.budget_bytes
        row.strategy = summary.strategy if summary else strategy
        row.offloaded_bytes = summary.offloaded_bytes if summary else 0
        row.recompute_ms = summary.recompute_time_ms if summary else 0.0
        model = copy.deepcopy(base).to(device)
        planned = PlannedModule(model, profile, schedule, loss_fn)
        row.predicted_peak_bytes = planned.simulated_peak_bytes
        row.simulated_step_ms = planned.simulated_step_time_ms
        loss, _ = _step(planned_step(planned), model, 1, device)
        row.loss_error = abs(loss - plain_loss) / max(abs(plain_loss), 1e-30)
        row.gradient_error = gradient_error(reference, model)
        leaves = [t for t in tree_flatten((inputs, kwargs, targets))[0] if isinstance(t, torch.Tensor)]
        resident = distinct_bytes([*model.parameters(), *model.buffers(), *leaves])
        times, peak, row.outside_plan_bytes = _timed_steps(planned_step(planned), model, device,
                                                           steps, warmup, 11, resident)
        row.measured_step_ms = statistics.median(times)
        row.step_ms_spread = (min(times), max(times))
        row.measured_peak_bytes = peak if peak is not None else planned.peak_memory_bytes
        if device.type == "cuda" and trace_dir is not None and (row.offloaded_bytes > 0):
            row.overlap = _profiled_step(planned_step(planned), model, device, trace_dir,
                                         f"{''.join(c if c.isalnum() else '-' for c in label)}-b{batch}-r{ratio:g}")
        say(_row_line(row))
        del planned, model
        gc.collect()  # nothing of this plan may count in the next one's max_memory_allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _row_line(row: Row) -> str:
    over = row.plan_peak_bytes - row.budget_bytes if row.plan_peak_bytes is not None else 0
    text = (f"ratio {row.ratio}: budget {format_bytes(row.budget_bytes)}, peak {format_bytes(row.measured_peak_bytes)} "
            f"({over / MIB:+.1f} MiB over budget), step {row.measured_step_ms:.1f} ms vs simulated "
            f"{row.simulated_step_ms:.1f} ms ({row.time_ratio:.3f}), gradient error {row.gradient_error:.2e}")
    if row.overlap:
        text += f", copies {row.overlap['copy_ms']:.1f} ms of which {row.overlap['overlapped_ms']:.1f} ms under compute"
    return text


def table(report: Report, slack_bytes: int) -> str:
    lines = [
        "| ratio | budget | plan | offloaded | recompute (ms) | predicted peak | measured peak | outside the plan (MiB) "
        "| peak - outside - budget (MiB) | within budget + slack | simulated step (ms) "
        "| measured step (ms), median [min-max] | measured / simulated | gradient error | loss error "
        "| copies: streams, ms, ms under compute |",
        "|" + "---|" * 16,
    ]
    for row in report.rows:
        if not row.feasible:
            lines.append(f"| {row.ratio:g} | | no plan: {row.note} |" + " |" * 13)
            continue
        over = row.plan_peak_bytes - row.budget_bytes
        overlap = (f"{len(row.overlap['copy_streams'])}, {row.overlap['copy_ms']:.1f}, {row.overlap['overlapped_ms']:.1f}"
                   if row.overlap else "")
        lines.append(
            f"| {row.ratio:g} | {format_bytes(row.budget_bytes)} | {row.strategy} | {format_bytes(row.offloaded_bytes)} "
            f"| {row.recompute_ms:.1f} | {format_bytes(row.predicted_peak_bytes)} | {format_bytes(row.measured_peak_bytes)} "
            f"| {row.outside_plan_bytes / MIB:.1f} | {over / MIB:+.1f} | {'yes' if over <= slack_bytes else 'NO'} | {row.simulated_step_ms:.1f} "
            f"| {row.measured_step_ms:.1f} [{row.step_ms_spread[0]:.1f}-{row.step_ms_spread[1]:.1f}] "
            f"| {row.time_ratio:.3f} | {row.gradient_error:.1e} | {row.loss_error:.1e} | {overlap} |"
        )
    return "\n".join(lines)


def section(report: Report, command: str, slack_bytes: int) -> str:
    heading = f"## {report.model}, batch {report.batch}, {report.device_name}, {time.strftime('%Y-%m-%d')}"
    plain_peak = format_bytes(report.plain_peak_bytes) if report.plain_peak_bytes else "not measured on the CPU"
    return (
        f"{heading}\n\n"
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {report.torch_version}). "
        f"Measured profile: {report.profile_nodes} nodes, {report.profile_seconds:.0f} s to take; keep-all peak "
        f"{format_bytes(report.keep_all_peak_bytes)}. Plain PyTorch: {report.plain_step_ms:.1f} ms a step, peak "
        f"{plain_peak}. Slack allowed over the budget: {slack_bytes / MIB:g} MiB.\n\n"
        f"{table(report, slack_bytes)}\n"
    )


INTRO = (
    "# The executor against plain PyTorch\n\n"
    "Made by `benchmarks/executor_acceptance.py`: for one network it profiles a training step on the device, plans "
    "it at each memory ratio (of the measured keep-all peak), replays the plan and measures it next to plain "
    "PyTorch from the same weights, batch and random numbers. Measured peak: `torch.cuda.max_memory_allocated` "
    "over the timed steps on a GPU (with nothing else left on the device), the executor's byte-exact ledger on the "
    "CPU. Outside the plan: what stays allocated between steps beyond the weights and the batch (cuBLAS and cuDNN "
    "handle workspaces, which no profile counts); the budget check is on the peak less that. Gradient error: the largest difference from plain PyTorch's gradients, relative to the largest gradient "
    "(TF32 off on both sides). Copies: from one planned step under torch.profiler, the copy streams other than "
    "the compute stream, their copy time, and how much of it ran while the compute stream ran kernels.\n\n"
    "On the CPU the executor's own work per node (the generated step's Python and, by default there, the "
    "ledger; `benchmarks/replay_speed.py` measures it) runs in line with the arithmetic; on a GPU kernels run "
    "asynchronously behind that work, and the GPU sections say how much of it shows.\n"
)




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg19")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="the small variant (CPU-sized)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.8, 0.7, 0.6, 0.5, 0.4])
    parser.add_argument("--strategy", default="mosos")
    parser.add_argument("--time-limit", type=float, default=30.0, help="planner time limit per ratio, seconds")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--slack-mib", type=float, default=64.0,
                        help="allowed over the budget: allocator rounding and cuBLAS/cuDNN handle workspaces")
    parser.add_argument("--trace-dir", default=None, help="where the torch.profiler traces go (default: a temp dir)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available (use --device cpu)", file=sys.stderr)
        return 2
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="mosos-traces-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    report = run(args.model, args.batch, small=args.small, device=args.device, ratios=tuple(args.ratios),
                 strategy=args.strategy, time_limit_s=args.time_limit, steps=args.steps, warmup=args.warmup,
                 profile_repeats=args.profile_repeats, trace_dir=trace_dir)
    slack_bytes = int(args.slack_mib * MIB)
    command = "python3 benchmarks/executor_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = section(report, command.strip(), slack_bytes)
    print()
    print(text)
    if not args.no_write:
        write_section(RESULTS, INTRO, text)
        print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
