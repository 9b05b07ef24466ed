"""The memory-time frontier: what a PyTorch user picks instead of mosos, against mosos, on the CPU.

    python benchmarks/frontier.py                           # GPT-2, BERT, ResNet-18-small: every configuration
    python benchmarks/frontier.py --models gpt2 --rounds 5 --configs eager,per-block,mosos-0.5

Every configuration runs in a process of its own (torch.compile shares compiled code between instances of a model
in one process, so budgets would leak), beside an eager copy of the same weights. Time: the median over `--rounds`
of the pair ratio (configuration step / eager step, the two run back to back, alternating which goes first), so that
the machine's drift between processes (20-40%) cancels. Peak: the rise of live tensor storage during one step, from
the allocator's records (`executor.allocations.AllocationTrace`), gradients set to None before it as
`optimizer.zero_grad()` leaves them. mosos on the CPU plans recomputation only (host memory is the same RAM).

Families: eager; per-block checkpointing (transformers' `gradient_checkpointing_enable()` where the model has it,
`torch.utils.checkpoint` around each block otherwise); torch.compile, also with
`torch._functorch.config.activation_memory_budget`; mosos (eager replay) at fractions of the keep-all peak; mosos
with compiled planning nodes (`mosos-compiled-<ratio>`, `optimize(compile=True)`; 1.0 is the keep-all budget); the
planner's own per-block baseline replayed by mosos (`mosos-per-block`: the simulator's view of per-block
checkpointing, measured). Compile time: torch.compile's first step, and the planned step's kernels as the
profiling compiled them. Writes benchmarks/results/frontier.md and frontier_<model>.png, and prints, for each torch
configuration, the fastest mosos plan at equal or less measured memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.results_file import write_section  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "frontier.md"
MIB = 2**20
MODELS = ("gpt2", "bert", "resnet")
MOSOS_RATIOS = (1.0, 0.9, 0.8, 0.6, 0.5, 0.35, 0.3)
# compiled: denser where torch.compile's configurations sit (between 0.45 and 0.9 of keep-all)
MOSOS_COMPILED_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.35, 0.3)
COMPILE_BUDGETS = (0.8, 0.5, 0.2)
TORCH_FAMILIES = ("per-block", "torch.compile", "torch.compile budget")


def all_configs() -> list[str]:
    return (["eager", "per-block", "compile"] + [f"compile-budget-{b}" for b in COMPILE_BUDGETS]
            + ["mosos-per-block"] + [f"mosos-{r}" for r in MOSOS_RATIOS]
            + [f"mosos-compiled-{r}" for r in MOSOS_COMPILED_RATIOS])


def family(config: str) -> str:
    if config == "eager":
        return "eager"
    if config == "per-block":
        return "per-block"
    if config == "compile":
        return "torch.compile"
    if config.startswith("compile-budget-"):
        return "torch.compile budget"
    if config == "mosos-per-block":
        return "mosos per-block plan"
    if config.startswith("mosos-compiled-"):
        return "mosos compiled"
    return "mosos"


def workload(model: str):
    """The issue's configurations: 4 layers, hidden 256, sequence 256, batch 16 (float32); ResNet-18-small at batch
    2048 (its activations well above its fixed memory, as for a model that does not fit)."""
    from benchmarks import workloads

    if model == "gpt2":
        return workloads.gpt2_small(batch_size=16, sequence=256)
    if model == "bert":
        return workloads.bert_small(batch_size=16, sequence=256)
    if model == "resnet":
        work = workloads.resnet18_small(batch_size=2048)
        return {"model": work.model, "inputs": work.inputs, "kwargs": work.kwargs, "targets": work.targets,
                "loss_fn": work.loss_fn}
    raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS)}")


def _blocks(model) -> list[tuple[object, str, object]]:
    """(parent, attribute, module) for each layer of a repeated container (as the planner's per-block baseline)."""
    from torch import nn

    found = []
    for _, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            numbered = [(name, child) for name, child in module.named_children() if name.isdigit()]
            if len(numbered) >= 2 and not any(child is module for _, child in numbered):
                found.extend((module, name, child) for name, child in numbered)
    # the outermost containers only: a layer inside a checkpointed layer is recomputed with it anyway
    inside = {id(m) for _, _, block in found for m in list(block.modules())[1:]}
    return [(parent, name, block) for parent, name, block in found if id(block) not in inside]


def checkpoint_per_block(model) -> str:
    """transformers' own gradient checkpointing where the model has it, else torch.utils.checkpoint per block."""
    import torch
    from torch import nn

    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "transformers gradient_checkpointing_enable()"

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    blocks = _blocks(model)
    if not blocks:
        raise SystemExit("no repeated blocks to checkpoint")
    for parent, name, block in blocks:
        setattr(parent, name, Checkpointed(block))
    return f"torch.utils.checkpoint around {len(blocks)} blocks"


def child(model_name: str, config: str, rounds: int, time_limit_s: float, threads: int) -> dict:
    import torch

    from executor.allocations import AllocationTrace

    torch.set_num_threads(threads)
    work = workload(model_name)
    model = work["model"]
    eager = copy.deepcopy(model)
    inputs, kwargs, targets, loss_fn = work["inputs"], work.get("kwargs") or {}, work.get("targets"), work["loss_fn"]

    def plain_step(module):
        def step():
            for p in module.parameters():
                p.grad = None
            output = module(*inputs, **kwargs)
            loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
            loss.backward()
        return step

    row = {"model": model_name, "config": config, "family": family(config), "note": "", "simulated_ms": None,
           "keep_all_simulated_ms": None, "prepare_s": None}
    started = time.perf_counter()
    if config == "eager":
        step = plain_step(model)
    elif config == "per-block":
        row["note"] = checkpoint_per_block(model)
        step = plain_step(model)
    elif config.startswith("compile"):
        if config.startswith("compile-budget-"):
            import torch._functorch.config as functorch_config

            functorch_config.activation_memory_budget = float(config.rsplit("-", 1)[1])
        model = torch.compile(model)
        step = plain_step(model)
        began = time.perf_counter()
        step()  # compiles forward and backward
        row["compile_s"] = time.perf_counter() - began
        step()
    elif config.startswith("mosos"):
        import executor

        strategy, ratio = ("per-block", 1.0) if config == "mosos-per-block" else ("mosos", float(config.split("-")[-1]))
        compiled = config.startswith("mosos-compiled-")
        planned = executor.optimize(model, inputs, loss_fn, targets=targets, kwargs=kwargs, memory_ratio=ratio,
                                    strategy=strategy, time_limit_s=time_limit_s, progress=False, cache=False,
                                    compile=compiled)

        def step():
            for p in planned.parameters():
                p.grad = None
            planned(*inputs, targets=targets, **kwargs).backward()

        step()
        step()  # the timed first steps (and a re-plan, if one happens)
        summary = planned.schedule.summary
        row["simulated_ms"] = summary.predicted_step_time_ms
        row["simulated_peak_mib"] = summary.peak_memory_bytes / MIB
        row["budget_mib"] = planned.schedule.budget_bytes / MIB if planned.schedule.budget_bytes else None
        row["note"] = f"{summary.strategy}, recompute {summary.recompute_time_ms:.0f} ms simulated"
        if compiled:
            # the node kernels the profiling compiled, and the regions the replay compiled (executor.regions)
            record, replayed = planned._prepared.profiled.compiled, planned.compiled_nodes
            row["compile_s"] = record.compile_seconds + replayed.compile_seconds
            row["note"] += f"; profiled: {record.describe()}; replayed: {replayed.describe()}"
        from planner.planning import plan

        row["keep_all_simulated_ms"] = plan(planned.profile, None, strategy="keep-all").summary.predicted_step_time_ms
    else:
        raise SystemExit(f"unknown configuration {config!r}; known: {', '.join(all_configs())}")
    row["prepare_s"] = time.perf_counter() - started
    reference = plain_step(eager)
    reference()
    step()
    with AllocationTrace() as trace:
        step()
    row["peak_mib"] = trace.peak_bytes / MIB
    ratios, eager_ms, config_ms = [], [], []
    for i in range(rounds):
        pair = [(reference, eager_ms), (step, config_ms)]
        for function, times in (pair if i % 2 == 0 else pair[::-1]):
            began = time.perf_counter()
            function()
            times.append((time.perf_counter() - began) * 1000)
        ratios.append(config_ms[-1] / eager_ms[-1])
    row.update(time_ratio=statistics.median(ratios), eager_ms=statistics.median(eager_ms),
               config_ms=statistics.median(config_ms))
    return row


def run_one(model: str, config: str, rounds: int, time_limit_s: float, threads: int) -> dict:
    command = [sys.executable, __file__, "--child", model, config, "--rounds", str(rounds),
               "--time-limit", str(time_limit_s), "--threads", str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        return {"model": model, "config": config, "family": family(config), "error": done.stderr.strip()[-600:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_mosos_at_or_below(rows: list[dict], peak_mib: float) -> dict | None:
    candidates = [r for r in rows if r["family"] in ("mosos", "mosos compiled") and "error" not in r
                  and r["peak_mib"] <= peak_mib]
    return min(candidates, key=lambda r: r["time_ratio"], default=None)


def table(model: str, rows: list[dict]) -> list[str]:
    lines = [f"### {model}", "",
             "| configuration | time / eager | peak MiB | eager step ms | simulated / keep-all simulated | "
             "prepare s | compile s | note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed | | | | | | {r['error'].splitlines()[-1][:160]} |")
            continue
        simulated = (f"{r['simulated_ms'] / r['keep_all_simulated_ms']:.2f}"
                     if r.get("simulated_ms") and r.get("keep_all_simulated_ms") else "")
        lines.append(f"| {r['config']} | {r['time_ratio']:.2f} | {r['peak_mib']:.0f} | {r['eager_ms']:.0f} | "
                     f"{simulated} | {r['prepare_s']:.1f} | "
                     + (f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "") + f" | {r['note']} |")
    lines += ["", "| torch configuration | its time / peak | fastest mosos at <= its peak | mosos time / peak | "
              "mosos / torch time |", "|---|---|---|---|---:|"]
    for r in rows:
        if "error" in r or r["family"] not in TORCH_FAMILIES:
            continue
        best = best_mosos_at_or_below(rows, r["peak_mib"])
        if best is None:
            lines.append(f"| {r['config']} | {r['time_ratio']:.2f} / {r['peak_mib']:.0f} MiB | none | | |")
        else:
            lines.append(f"| {r['config']} | {r['time_ratio']:.2f} / {r['peak_mib']:.0f} MiB | {best['config']} | "
                         f"{best['time_ratio']:.2f} / {best['peak_mib']:.0f} MiB | "
                         f"{best['time_ratio'] / r['time_ratio']:.2f} |")
    return lines + [""]


def plot(model: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    families: dict[str, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            families.setdefault(r["family"], []).append(r)
    for name, members in families.items():
        members = sorted(members, key=lambda r: r["peak_mib"])
        axes.plot([r["peak_mib"] for r in members], [r["time_ratio"] for r in members], marker="o",
                  linestyle="-" if len(members) > 1 else "none", label=name)
        for r in members:
            axes.annotate(r["config"].replace("compile-budget-", "b").replace("mosos-compiled-", "c").replace("mosos-", ""),
                          (r["peak_mib"], r["time_ratio"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes.set_xlabel("peak rise of live tensor storage in one step (MiB)")
    axes.set_ylabel("step time / eager (paired median)")
    axes.set_title(f"{model}: memory-time frontier on the CPU")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(all_configs()))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--time-limit", type=float, default=20.0, help="mosos' solve time limit, seconds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rerun", default="", help="configurations to measure (again); the model's other rows are "
                        "kept from its results file (a row disturbed by other load on the machine, a new ratio)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.rounds, args.time_limit, args.threads)))
        return 0
    command = "python benchmarks/frontier.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    rerun = [c for c in args.rerun.split(",") if c]
    for model in args.models.split(","):
        rows = []
        kept = {}
        if rerun:
            kept = {row["config"]: row for row in json.loads(RESULTS.with_name(f"frontier_{model}.json").read_text())}
        for config in args.configs.split(","):
            if rerun and config not in rerun:
                if config in kept:
                    rows.append(kept[config])
                continue
            row = run_one(model, config, args.rounds, args.time_limit, args.threads)
            if rerun:
                row["note"] = "; ".join(filter(None, [row.get("note"), "measured in a later run (--rerun)"]))
            rows.append(row)
            shown = row.get("error", "").splitlines()[-1:] if "error" in row else (
                f"{row['time_ratio']:.2f} x eager, {row['peak_mib']:.0f} MiB")
            print(f"{model:7s} {config:22s} {shown}", flush=True)
        lines = table(model, rows)
        print("\n".join(lines))
        picture = RESULTS.with_name(f"frontier_{model}.png")
        plot(model, rows, picture)
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = "\n".join([f"## {model}", "", f"`{command.strip()}` ({when}; {args.rounds} paired rounds, "
                             f"{args.threads} torch threads; plot: {picture.name})", "", *lines[1:]])
        write_section(RESULTS, "# Memory-time frontier (CPU)\n\n" + __doc__.split("\n\n")[2] + "\n", section + "\n")
        (RESULTS.with_name(f"frontier_{model}.json")).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
