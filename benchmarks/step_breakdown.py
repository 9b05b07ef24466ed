"""Where a training step's time goes: plain PyTorch, torch.compile and mosos' compiled keep-all replay, by kind of
kernel, in one process on the CPU.

The frontier (benchmarks/frontier.py) says how fast each configuration is; this says why. Each round times one step
of every configuration (a rotating order, as the frontier pairs them) and then runs one more step of each under
torch.profiler; a step's kernel time is the self CPU time of its ATen operations (and of Inductor's generated code,
"compiled code"), summed by kind. The table gives medians over the rounds, per step; "interpreter and rest" is the
unprofiled step's time less its kernels' (Python, autograd's or the replay's own code, allocations between kernels).
A second eager copy of the weights is timed the same way: its ratio to eager is the run's noise.

    python benchmarks/step_breakdown.py --model resnet    # writes a section of benchmarks/results/step_breakdown.md
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

RESULTS = ROOT / "benchmarks" / "results" / "step_breakdown.md"
INTRO = ("# Where a step's time goes\n\n`benchmarks/step_breakdown.py`: self CPU time per step by kind of kernel "
         "(torch.profiler), medians over paired rounds in one process; see the script's docstring.\n")
KINDS = ("convolution forward", "convolution backward", "matrix products", "attention", "batch norm",
         "pooling", "copies", "compiled code", "other operations")
# a part of "convolution backward", shown under it: the call that reads the step's input (a 3-channel image)
FIRST_FILTER_GRADIENT = "of which the first layer's filter gradient"
ROWS = KINDS[:2] + (FIRST_FILTER_GRADIENT,) + KINDS[2:]
# the control: the same eager step on a second copy of the weights; its paired ratio, 1.00 on a steady machine,
# is how far this run can be trusted (two eager copies read 0.98-1.06 of each other over 12 rounds, ResNet)
EAGER_AGAIN = "eager, second copy"
_MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def kind_of(name: str) -> str | None:
    """The kind an ATen operation's self time counts as (None: a wrapper whose own time is not a kernel's)."""
    if name in ("aten::mkldnn_convolution", "aten::convolution", "aten::_convolution"):
        return "convolution forward"
    if name == "aten::convolution_backward":
        return "convolution backward"
    if name in _MATRIX_PRODUCTS:
        return "matrix products"
    if "scaled_dot_product" in name or "_flash_attention" in name or "_efficient_attention" in name:
        return "attention"
    if "batch_norm" in name:
        return "batch norm"
    if "pool" in name:
        return "pooling"
    if name in ("aten::copy_", "aten::clone", "aten::contiguous"):
        return "copies"
    if name.startswith("## Call "):  # Inductor's generated code (## Call CompiledFxGraph ...)
        return "compiled code"
    if name.startswith("aten::"):
        return "other operations"
    return None


def breakdown(events, first_input_shape: list[int] | None) -> dict[str, float]:
    """Milliseconds of self CPU time by kind, for the events of one step."""
    totals = dict.fromkeys(ROWS, 0.0)
    for event in events:
        kind = kind_of(event.name)
        if kind is None:
            continue
        milliseconds = event.self_cpu_time_total / 1000
        totals[kind] += milliseconds
        shapes = getattr(event, "input_shapes", None) or []
        if (kind == "convolution backward" and first_input_shape is not None and len(shapes) > 1
                and list(shapes[1]) == first_input_shape):
            totals[FIRST_FILTER_GRADIENT] += milliseconds
    return totals


def run(work: dict, rounds: int, threads: int, say=print) -> dict:
    """`work`: model, inputs, targets, loss_fn (and kwargs), as benchmarks.frontier.workload makes them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import executor

    torch.set_num_threads(threads)
    model, inputs, targets, loss_fn = work["model"], work["inputs"], work.get("targets"), work["loss_fn"]
    kwargs = work.get("kwargs") or {}
    first_input_shape = list(inputs[0].shape) if inputs and inputs[0].dim() == 4 else None

    def plain(module):
        def step():
            for p in module.parameters():
                p.grad = None
            output = module(*inputs, **kwargs)
            (loss_fn(output, targets) if targets is not None else loss_fn(output)).backward()
        return step

    compiled = torch.compile(copy.deepcopy(model))
    say("torch.compile: compiling")
    plain(compiled)()
    say("mosos: optimize(compile=True) at the keep-all budget")
    planned = executor.optimize(copy.deepcopy(model), inputs, loss_fn, targets=targets, kwargs=kwargs,
                                memory_ratio=1.0, compile=True, progress=False, cache=False, time_limit_s=20)

    def mosos_step():
        for p in planned.parameters():
            p.grad = None
        planned(*inputs, targets=targets, **kwargs).backward()

    steps = {"eager": plain(copy.deepcopy(model)), EAGER_AGAIN: plain(copy.deepcopy(model)),
             "torch.compile": plain(compiled), "mosos compiled, keep-all": mosos_step}
    for step in steps.values():
        step()
        step()
    # the timed first steps run node by node, and as many again after a re-plan (which runs beside the steps: its
    # plan is taken once it is ready)
    while planned.wait_for_replan() and planned.timing:
        mosos_step()
    names = list(steps)
    wall: dict[str, list[float]] = {name: [] for name in names}
    kinds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for index in range(rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            began = time.perf_counter()
            steps[name]()
            wall[name].append((time.perf_counter() - began) * 1000)
        for name in order:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
                steps[name]()
            kinds[name].append(breakdown(profiled.events(), first_input_shape))
        say(f"round {index + 1}/{rounds}: " + ", ".join(f"{n} {wall[n][-1]:.0f} ms" for n in names))
    result = {"rounds": rounds, "threads": threads, "configurations": {}}
    for name in names:
        ratios = [a / b for a, b in zip(wall[name], wall["eager"])]
        median_kinds = {kind: statistics.median(k[kind] for k in kinds[name]) for kind in ROWS}
        result["configurations"][name] = {"step_ms": statistics.median(wall[name]),
                                          "ratio_to_eager": statistics.median(ratios), "kinds_ms": median_kinds}
    return result


def table(result: dict) -> list[str]:
    names = list(result["configurations"])
    rows = ["| per step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    configurations = result["configurations"]
    rows.append("| step (unprofiled), ms | " + " | ".join(f"{configurations[n]['step_ms']:.1f}" for n in names) + " |")
    rows.append("| time / eager (paired) | "
                + " | ".join(f"{configurations[n]['ratio_to_eager']:.3f}" for n in names) + " |")
    for kind in ROWS:
        label = "&nbsp;&nbsp;" + kind if kind == FIRST_FILTER_GRADIENT else kind
        rows.append(f"| {label}, ms | " + " | ".join(f"{configurations[n]['kinds_ms'][kind]:.1f}" for n in names)
                    + " |")
    kernels = {n: sum(configurations[n]["kinds_ms"][k] for k in KINDS) for n in names}
    rows.append("| kernels in all, ms | " + " | ".join(f"{kernels[n]:.1f}" for n in names) + " |")
    rows.append("| interpreter and rest, ms | "
                + " | ".join(f"{configurations[n]['step_ms'] - kernels[n]:.1f}" for n in names) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.results_file import publish_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet", help="gpt2, bert or resnet (benchmarks/frontier.py's sizes)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    from benchmarks.frontier import workload

    result = run(workload(args.model), args.rounds, args.threads)
    command = f"python benchmarks/step_breakdown.py --model {args.model} --rounds {args.rounds}"
    publish_section(RESULTS, INTRO, args.model, command, f"{args.threads} torch threads, cpu", table(result),
                    write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
