"""Why mosos' compiled replay keeps batch norms in PyTorch's default layout on a CNN, and what that costs: how far
a ResNet's gradients move when one kind of operation runs channels-last (NHWC), beside the float64 answer, and how
much faster plain PyTorch runs the whole model channels-last (what torch.compile's layout optimisation does), and
where torch.compile's gradients land.

The compiled replay promises gradients within 1e-5 (float32) of plain PyTorch's. Convolutions on channels-last
copies keep it (the `channels-last` algorithm); a batch norm computed channels-last sums in another order, and the
gradients before a batch norm cancel (its backward removes their mean), so the rounding apart is amplified far
beyond it. So a convolution's channels-last operands are copied per call and its results laid out back, where
torch.compile keeps the whole network channels-last and pays no copies: the remaining gap between the two on
ResNet-18-small (benchmarks/results/frontier.md).

Each variant wraps the model's modules of one kind so that they compute on channels-last copies and hand on
PyTorch's default layout (weights of wrapped convolutions made channels-last); "whole model" converts the model
and its input, as PyTorch's performance guide suggests. Gradient distance as benchmarks/frontier.py measures it
(over the parameters, the largest |difference| over the largest |reference gradient|). Time: the median over
rounds of the ratio to a plain step, the two run back to back in one process.

    python benchmarks/layout_rounding.py     # writes benchmarks/results/layout_rounding.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "layout_rounding.md"
INTRO = ("# Layout and rounding on a CNN\n\n`benchmarks/layout_rounding.py`: gradient distance from plain PyTorch "
         "when one kind of operation runs channels-last, and the speed of a channels-last step; see the script's "
         "docstring.\n")


def channels_last_variants():
    import torch.nn as nn

    return {"convolutions": (nn.Conv2d,), "batch norms": (nn.BatchNorm2d,), "max pools": (nn.MaxPool2d,),
            "convolutions and batch norms": (nn.Conv2d, nn.BatchNorm2d)}


def with_channels_last(model, kinds: tuple):
    """A copy of `model` whose modules of `kinds` compute on channels-last copies of their input."""
    import torch
    import torch.nn as nn

    class OnChannelsLast(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner.to(memory_format=torch.channels_last)

        def forward(self, x):
            return self.inner(x.contiguous(memory_format=torch.channels_last)).contiguous()

    variant = copy.deepcopy(model)
    for module in list(variant.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kinds):
                setattr(module, name, OnChannelsLast(child))
    return variant


def gradients(model, inputs, targets, loss_fn) -> list:
    for parameter in model.parameters():
        parameter.grad = None
    loss_fn(model(*inputs), targets).backward()
    return [parameter.grad.detach().clone() for parameter in model.parameters()]


def run(batch_size: int, rounds: int, threads: int, compiled: bool = True) -> dict:
    import torch

    from benchmarks.frontier import gradient_error
    from benchmarks.workloads import resnet18_small

    torch.set_num_threads(threads)
    built = resnet18_small(batch_size=batch_size)
    model, inputs, targets, loss_fn = built.model, built.inputs, built.targets, built.loss_fn

    def as_given(step_inputs):
        return step_inputs

    def channels_last_inputs(step_inputs):
        return tuple(x.contiguous(memory_format=torch.channels_last) for x in step_inputs)

    variants = {"plain PyTorch, run again": (model, as_given)}
    for label, kinds in channels_last_variants().items():
        variants[label] = (with_channels_last(model, kinds), as_given)
    variants["whole model"] = (copy.deepcopy(model).to(memory_format=torch.channels_last), channels_last_inputs)
    if compiled:
        # its layout optimisation keeps every convolution's operands channels-last, and its batch norms are its
        # own reductions over them
        variants["torch.compile (layout its own)"] = (torch.compile(copy.deepcopy(model)), as_given)
    plain = gradients(model, inputs, targets, loss_fn)
    as_float64 = gradients(copy.deepcopy(model).double(), tuple(x.double() for x in inputs), targets, loss_fn)
    rows = {"plain PyTorch": {"from_plain": 0.0, "from_float64": gradient_error(plain, as_float64)}}
    for label, (variant, prepared) in variants.items():
        grads = gradients(variant, prepared(inputs), targets, loss_fn)
        rows[label] = {"from_plain": gradient_error(grads, plain), "from_float64": gradient_error(grads, as_float64)}

    def step_s(which, prepared) -> float:
        started = time.perf_counter()
        gradients(which, prepared(inputs), targets, loss_fn)
        return time.perf_counter() - started

    for label, (variant, prepared) in variants.items():
        if label.startswith("plain"):
            continue
        ratios = []
        for round_index in range(rounds + 1):  # the first round warms both up
            if round_index % 2:
                plain_s, variant_s = step_s(model, as_given), step_s(variant, prepared)
            else:
                variant_s, plain_s = step_s(variant, prepared), step_s(model, as_given)
            if round_index:
                ratios.append(variant_s / plain_s)
        rows[label]["time_over_plain"] = statistics.median(ratios)
    return {"rows": rows, "batch": batch_size, "threads": threads, "rounds": rounds}


def table(result: dict) -> list[str]:
    lines = ["| channels-last | gradient distance from plain PyTorch | from the float64 answer | step time / plain |",
             "|---|---:|---:|---:|"]
    for label, row in result["rows"].items():
        time_ratio = f"{row['time_over_plain']:.2f}" if "time_over_plain" in row else ""
        lines.append(f"| {label} | {row['from_plain']:.1e} | {row['from_float64']:.1e} | {time_ratio} |")
    lines += ["", f"Step time: the median over {result['rounds']} rounds of the ratio to a plain step run beside it."]
    return lines


def main(argv: list[str] | None = None) -> int:
    from benchmarks.results_file import publish_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2048, help="ResNet-18-small's batch (the frontier's: 2048)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile's row")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    result = run(args.batch, args.rounds, args.threads, compiled=not args.no_compile)
    command = (f"python benchmarks/layout_rounding.py --batch {args.batch} --rounds {args.rounds}"
               + (" --no-compile" if args.no_compile else ""))
    publish_section(RESULTS, INTRO, f"resnet18-small, batch {args.batch}", command,
                    f"{args.threads} torch threads, cpu", table(result), write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
