"""Replay speed on the CPU: a plain PyTorch step, the planned keep-all step and a planned step at 0.6 of the
keep-all peak, side by side in one run, with the replay's own cost per planning node.

The steps of one round (at least `--rounds`, more for short steps: about 30 s, at most 400) run one after
another in a rotating order (so that a busy machine slows all of them
alike), every step from `.grad` set to None, each timed alone with `time.perf_counter`; the table gives
medians over the rounds and the median of the per-round ratios to the plain step. The planned steps run the
generated code's fast path (no ledger), and keep-all once more with the ledger, the CPU's default (it checks the
first step of each pattern of gradients held, then the checked program runs without it). The
replay's own cost per node: the median of the per-round differences (planned keep-all - plain) over the planning
nodes computed, what the generated step spends beyond the ATen work an eager step does (it can be negative: the generated step has no autograd graph
to build). The step at 0.6 also pays for what it recomputes and copies.

    python benchmarks/replay_speed.py      # BERT-small, ResNet-18-small, 300 tiny layers; writes a section of
                                           # benchmarks/results/executor.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS = ("benchmarks/workloads.py:bert_small", "benchmarks/workloads.py:resnet18_small",
             "benchmarks/workloads.py:tiny_layers")
HEADING = "## Replay speed on the CPU"


def measure(spec: str, rounds: int, warmup: int, ratio: float, time_limit_s: float, say=print) -> dict:
    from executor.measure.profiler import profile_step
    from executor.replay.replay import PlannedModule
    from models.workload import load_workload
    from planner.budget import minimum_budget_bytes
    from planner.errors import BudgetError
    from planner.planning import plan
    from planner.strategies.keep_all import keep_all_peak_bytes

    workload = load_workload(spec)
    model, inputs, kwargs, targets, loss_fn = (workload.model, workload.inputs, workload.kwargs, workload.targets,
                                               workload.loss_fn)
    say(f"{spec}: profiling")
    profile, captured = profile_step(model, inputs, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=1,
                                     algorithms=("native",), d2h_gb_per_s=10, h2d_gb_per_s=10)
    keep_all = plan(profile, strategy="keep-all")
    try:
        planned_ratio = plan(profile, memory_ratio=ratio, strategy="mosos", time_limit_s=time_limit_s, workers=1,
                             seed=0)
        label = f"mosos at {ratio:g}"
    except BudgetError:  # fixed memory is most of a small model's peak: plan at the smallest budget instead
        floor = minimum_budget_bytes(profile)
        planned_ratio = plan(profile, floor, strategy="mosos", time_limit_s=time_limit_s, workers=1, seed=0)
        label = f"mosos at {floor / keep_all_peak_bytes(profile):.2f} (no plan at {ratio:g})"
    fast = PlannedModule(model, profile, keep_all, loss_fn, profiled=captured, ledger=False)
    ledgered = PlannedModule(model, profile, keep_all, loss_fn, profiled=captured, ledger=True)
    at_ratio = PlannedModule(model, profile, planned_ratio, loss_fn, profiled=captured, ledger=False)

    def plain():
        output = model(*inputs, **kwargs)
        loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
        loss.backward()

    def planned(module):
        def step():
            module(*inputs, targets=targets, **kwargs).backward()
        return step

    steps = {"plain": plain, "keep-all": planned(fast), "keep-all + ledger": planned(ledgered),
             label: planned(at_ratio)}
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    def one_round(round_index: int) -> dict[str, float]:
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        taken = {}
        for name in order:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            steps[name]()
            taken[name] = (time.perf_counter() - start) * 1e3
        return taken

    warm = [one_round(k) for k in range(warmup)]
    if warm:  # short steps get more rounds (about 30 s of them, at most 400): their noise is larger
        round_s = sum(warm[-1].values()) / 1e3
        rounds = min(400, max(rounds, int(30 / max(round_s, 1e-3))))
    say(f"{spec}: timing {rounds} rounds")
    for round_index in range(warmup, warmup + rounds):
        for name, elapsed in one_round(round_index).items():
            times[name].append(elapsed)
    model.zero_grad(set_to_none=True)
    computes = fast._prepared.program.computes
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {name: statistics.median(t / p for t, p in zip(times[name], times["plain"])) for name in names}
    summary = planned_ratio.summary
    return {
        "spec": spec, "nodes": len(profile.nodes), "computes": computes, "medians": medians, "ratios": ratios,
        "mins": {name: min(values) for name, values in times.items()},
        "cost_per_node_us": _paired(times["keep-all"], times["plain"]) * 1e3 / computes,
        "ledger_per_node_us": _paired(times["keep-all + ledger"], times["keep-all"]) * 1e3 / computes,
        "ratio_plan": f"{summary.strategy}, budget {planned_ratio.budget_bytes / 2**20:.2f} MiB, "
                      f"recompute {summary.recompute_time_ms:.2f} ms, offload {summary.offloaded_bytes / 2**20:.2f} MiB, "
                      f"{at_ratio._prepared.program.computes} computes",
        "rounds": rounds,
    }


def _paired(these: list[float], those: list[float]) -> float:
    """Median of the per-round differences (ms): steps of one round ran under the same load."""
    return statistics.median(a - b for a, b in zip(these, those))


def section(results: list[dict], command: str, load: str, threads: int) -> str:
    import torch

    lines = [HEADING, "",
             f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
             f"{threads} torch thread(s), load average before the run {load}). How: the docstring of "
             "`benchmarks/replay_speed.py`. Times in ms, medians over the rounds [fastest]; ratio: median of the "
             "per-round ratios to the plain step.", "",
             "| workload | planning nodes | step | median ms [min] | ratio to plain |",
             "| --- | ---: | --- | --- | ---: |"]
    for r in results:
        name = r["spec"].rsplit(":", 1)[-1]
        for step, median in r["medians"].items():
            lines.append(f"| {name} | {r['nodes']} | {step} | {median:.2f} [{r['mins'][step]:.2f}] | "
                         f"{r['ratios'][step]:.3f} |")
    lines.append("")
    for r in results:
        name = r["spec"].rsplit(":", 1)[-1]
        lines.append(f"- {name}: replay's own cost {r['cost_per_node_us']:+.1f} us per planning node computed "
                     f"({r['computes']} computes in keep-all), the ledger {r['ledger_per_node_us']:+.1f} us more; "
                     f"the plan at the ratio: {r['ratio_plan']}; {r['rounds']} rounds.")
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace this benchmark's section of the results file (the acceptance benchmark writes the others)."""
    existing = path.read_text() if path.exists() else "# The executor against plain PyTorch\n"
    if HEADING in existing:
        before, _, rest = existing.partition(HEADING)
        following = rest.find("\n## ")
        existing = before + (rest[following + 1:] if following >= 0 else "")
        existing = existing.rstrip("\n") + "\n\n"
    else:
        existing = existing.rstrip("\n") + "\n\n"
    path.write_text(existing + text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", help="file.py:build specs (default: BERT-small, ResNet-18-small)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "executor.md")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    results = [measure(spec, args.rounds, args.warmup, args.ratio, args.time_limit)
               for spec in (args.workload or WORKLOADS)]
    command = "python benchmarks/replay_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = section(results, command.strip(), load, args.threads)
    print(text)
    write_section(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
