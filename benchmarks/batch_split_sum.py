"""A filter gradient by native's whole-batch call against algorithm batch-split-sum (summed over quarters).

Run: `python benchmarks/batch_split_sum.py [--batch 2048] [--rounds 9] [--threads 2]`. On ResNet-18-small's
stem (3 -> 4 channels, 7x7, stride 2, 32x32 images) it takes the output gradient of one real training step, then
computes the stem's filter gradient both ways: the scratch each call allocates beyond its result (the allocator's
events), the time (rounds alternating which goes first, median of each), and how far each is from the float64
answer and from each other (largest |difference| / largest |value|). Writes benchmarks/results/batch_split_sum.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "batch_split_sum.md"
MIB = 1 << 20


def stem_filter_gradient(batch: int):
    """(input, output gradient, weight) of the stem in one real step of ResNet-18-small at `batch`."""
    from models.workload import reference_workload

    work = reference_workload("resnet18", batch, small=True)
    model, images = work.model, work.inputs[0]
    captured = {}

    def keep_output_gradient(module, inputs, output):  # returns None: the output stays the module's
        output.register_hook(lambda gradient: captured.setdefault("gradient", gradient))

    model.conv1.register_forward_hook(keep_output_gradient)
    work.loss_fn(model(images), work.targets).backward()
    return images, captured["gradient"], model.conv1.weight.detach().clone()


def run(batch: int, rounds: int, threads: int) -> dict:
    import torch

    from executor.measure.allocations import AllocationTrace
    from executor.engine.conv_algorithms import backward

    images, gradient, weight = stem_filter_gradient(batch)
    torch.set_num_threads(threads)
    arguments = ([2, 2], [3, 3], [1, 1], False, [0, 0], 1)
    calls = {
        "native": lambda: torch.ops.aten.convolution_backward(gradient, images, weight, None, *arguments,
                                                              [False, True, False])[1],
        "batch-split-sum": lambda: backward("batch-split-sum", gradient, images, weight, None, *arguments,
                                            [False, True, False])[1],
    }
    results, scratch, times = {}, {}, {name: [] for name in calls}
    for name, call in calls.items():
        call()
        with AllocationTrace() as trace:
            results[name] = call()
        scratch[name] = trace.peak_bytes - results[name].nbytes
    for index in range(rounds):
        for name in (list(calls) if index % 2 == 0 else list(calls)[::-1]):
            began = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - began) * 1000)
    exact = torch.ops.aten.convolution_backward(gradient.double(), images.double(), weight.double(), None,
                                                *arguments, [False, True, False])[1]

    def distance(a, b) -> float:
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    return {
        "batch": batch, "rounds": rounds, "threads": threads,
        "rows": [{"algorithm": name, "scratch_mib": scratch[name] / MIB, "time_ms": statistics.median(times[name]),
                  "from_float64": distance(results[name], exact), "from_native": distance(results[name],
                                                                                          results["native"])}
                 for name in calls],
    }


def table(result: dict) -> list[str]:
    lines = ["| algorithm | scratch MiB | time ms (median) | from float64 | from native |", "|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['algorithm']} | {row['scratch_mib']:.1f} | {row['time_ms']:.1f} | "
                     f"{row['from_float64']:.1e} | {row['from_native']:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from benchmarks.results_file import write_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    result = run(args.batch, args.rounds, args.threads)
    lines = table(result)
    print("\n".join(lines))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = f"python benchmarks/batch_split_sum.py --batch {args.batch} --rounds {args.rounds} --threads {args.threads}"
    intro = ("# The stem's filter gradient: native against batch-split-sum (CPU)\n\n"
             "ResNet-18-small's stem, the output gradient of one real step; scratch beyond the result from the "
             "allocator's events; distances are largest |difference| / largest |value|.\n")
    write_section(RESULTS, intro, f"## batch {args.batch}\n\n`{command}` ({stamp})\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
