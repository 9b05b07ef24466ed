"""How the planner scales: the CP-SAT models on published graphs, the joint model on 1,000-5,000-node
profiles within a time limit, and whether every call keeps its time limit.

Run: `python benchmarks/solver_scaling.py [--sections checkmate,scale,layered] [--time-limit 60]
[--layered-time-limit 30] [--workers 2]`. Sections of benchmarks/results/solver_scaling.md (each run replaces
the sections it ran and keeps the others):

1. recompute-only on the Checkmate / Moccasin graphs at 0.8 and 0.9 of the topological peak.
2. mosos (the joint model: keep / offload+prefetch / recompute / algorithm) on the shipped large profiles,
   transformer-b64-h100, resnet50-b256-v100 and vgg416-b32-titanx, at 0.8 / 0.6 / 0.5 with the time limit:
   step time, overhead over the trivial lower bound, gap to the best valid bound (`planner/bounds.py`),
   first-feasible and best-found times, where the plan came from, the wall time against the limit.
3. Random layered graphs of 500 and 1,000 nodes (our generator of Moccasin's family,
   `planner/random_layered.py`, seed 0) at 0.6 and 0.5 of the topological peak: every strategy that runs on
   them, its wall time against limit + 5% + 1 s, and whether it found a plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_section  # noqa: E402
from planner.bounds import keep_all_bound_ms, order_bound_ms  # noqa: E402
from planner.budget import budget_from_ratio, minimum_budget_bytes  # noqa: E402
from planner.cpsat.greedy import greedy_recompute_schedule  # noqa: E402
from planner.cpsat.reorder import keep_all_in_order, memory_aware_order, reordered_schedule  # noqa: E402
from planner.cpsat.solve import solve_model  # noqa: E402
from planner.errors import MososError  # noqa: E402
from planner.importer import import_graph  # noqa: E402
from planner.options import SolveOptions  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from planner.random_layered import random_layered_profile  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402
from planner.strategies.recompute_only import RECOMPUTE_ONLY, recompute_only_plan  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "solver_scaling.md"
PROFILES = ["vgg19-b144-227-p40", "unet-b120-256-p40", "resnet50-b256-v100", "vgg416-b32-titanx"]
GRAPHS = ["vgg16_b256_train", "vgg19_b256_train", "random_layered_n100", "random_layered_n250"]
CHECKMATE = ROOT.parent / "shared" / "data" / "checkmate-graphs"


def _fmt(value, digits=2):
    return "" if value is None else f"{value:.{digits}f}"


def _row(name, ratio, budget, mode, outcome, best_s, simulated):
    info = outcome.info
    return (
        f"| {name} | {ratio} | {budget} | {mode} | {info.status} | {_fmt(info.time_to_first_solution_s)} | "
        f"{_fmt(best_s)} | {_fmt(info.objective, 3)} | {_fmt(info.bound, 3)} | "
        f"{'' if info.gap is None else f'{100 * info.gap:.2f}%'} | {_fmt(simulated, 3)} | {info.wall_time_s:.1f} |"
    )


def _solve(profile, budget, features, options, hints=()):
    best = {"t": None}

    def progress(event):
        best["t"] = event["elapsed_s"]

    run_options = SolveOptions(options.time_limit_s, options.workers, options.seed, progress=progress)
    outcome = solve_model(profile, budget, features, run_options, "bench", hints=list(hints))
    simulated = simulate(profile, outcome.schedule, budget).step_time_ms if outcome.schedule else None
    return outcome, best["t"], simulated


def recompute_rows(options):
    rows, missing = [], []
    for name in GRAPHS:
        path = CHECKMATE / f"{name}.json"
        if not path.exists():
            missing.append(name)
            continue
        profile = import_graph(path)
        peak = keep_all_peak_bytes(profile)
        for ratio in (0.8, 0.9):
            budget = int(peak * ratio)
            if name == "vgg19_b256_train" and ratio == 0.8:
                budget = 13_646_587_904  # the figure of the target (the papers' peak differs by 512 bytes)
            floor = minimum_budget_bytes(profile)
            if budget < floor:
                rows.append(
                    f"| {name} | {ratio} | {budget} | recompute-only | below every plan (fixed memory + the largest node "
                    f"with its inputs: {floor} bytes) | | | | | | | |"
                )
                continue
            started = time.monotonic()
            greedy = greedy_recompute_schedule(profile, budget)
            greedy_s = time.monotonic() - started
            greedy_step = simulate(profile, greedy, budget).step_time_ms if greedy else None
            rows.append(
                f"| {name} | {ratio} | {budget} | greedy evict-and-recompute | {'FEASIBLE' if greedy else 'no plan'} | "
                f"{_fmt(greedy_s) if greedy else ''} | | {_fmt(greedy_step, 3)} | | | {_fmt(greedy_step, 3)} | {greedy_s:.1f} |"
            )
            print(rows[-1], flush=True)
            started = time.monotonic()
            reordered = reordered_schedule(profile, budget)
            reordered_s = time.monotonic() - started
            reordered_step = simulate(profile, reordered, budget).step_time_ms if reordered else None
            order_peak = memory_aware_order(profile)[1]
            rows.append(
                f"| {name} | {ratio} | {budget} | memory-aware order (keep-all peak {order_peak}) | "
                f"{'FEASIBLE' if reordered else 'no plan'} | {_fmt(reordered_s) if reordered else ''} | | "
                f"{_fmt(reordered_step, 3)} | | | {_fmt(reordered_step, 3)} | {reordered_s:.1f} |"
            )
            print(rows[-1], flush=True)
            outcome, best_s, simulated = _solve(profile, budget, RECOMPUTE_ONLY, options, [greedy] if greedy else [])
            rows.append(_row(name, ratio, budget, "CP-SAT model (greedy hint)", outcome, best_s, simulated))
            print(rows[-1], flush=True)
            rows.append(_strategy_row(name, ratio, budget, profile, options))
            print(rows[-1], flush=True)
    return rows, missing


def _strategy_row(name, ratio, budget, profile, options):
    """The recompute-only strategy as a user gets it: the model, the greedy plan, the best that fits."""
    started = time.monotonic()
    schedule = recompute_only_plan(profile, budget, options, explain_infeasible=False)
    wall = time.monotonic() - started
    if schedule is None:
        return f"| {name} | {ratio} | {budget} | recompute-only strategy | no plan | | | | | | | {wall:.1f} |"
    info = schedule.summary.solver
    encoding = info.encoding or ""
    won = next((plan for plan in ("greedy", "memory-aware order") if f"best plan: {plan}" in encoding or encoding.startswith(plan)), "CP-SAT")
    return (
        f"| {name} | {ratio} | {budget} | recompute-only strategy ({won} plan) | {info.status} | | | "
        f"{_fmt(info.objective, 3)} | {_fmt(info.bound, 3)} | {'' if info.gap is None else f'{100 * info.gap:.2f}%'} | "
        f"{_fmt(schedule.summary.predicted_step_time_ms, 3)} | {wall:.1f} |"
    )


HEADER = (
    "| case | ratio | budget (bytes) | mode | status | first feasible (s) | best found (s) | objective (ms) | "
    "bound (ms) | gap | simulated step (ms) | wall (s) |\n| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)

SCALE_PROFILES = ["transformer-b64-h100", "resnet50-b256-v100", "vgg416-b32-titanx"]
SCALE_RATIOS = [0.8, 0.6, 0.5]
LAYERED = [500, 1000]
LAYERED_RATIOS = [0.6, 0.5]
LAYERED_STRATEGIES = ["mosos", "recompute-only", "checkmate-auto", "str-auto", "chen-sqrt", "auto"]


def within(limit_s: float, wall_s: float) -> bool:
    """The promise: a call returns within its limit + 5% + 1 s."""
    return wall_s <= 1.05 * limit_s + 1.0


def _plan_timed(profile, budget, strategy, limit_s, workers):
    """(schedule or the error, wall s, first progress s, last progress s)."""
    events = []
    started = time.monotonic()

    def progress(event):
        events.append(time.monotonic() - started)

    try:
        schedule = plan(profile, budget, strategy=strategy, time_limit_s=limit_s, workers=workers, seed=0,
                        progress=progress)
    except MososError as error:
        schedule = error
    wall = time.monotonic() - started
    return schedule, wall, (events[0] if events else None), (events[-1] if events else None)


def _source(schedule) -> str:
    """Where mosos' plan came from: its own model (window search from which start) or another plan."""
    encoding = schedule.summary.solver.encoding or ""
    if "best plan:" in encoding:
        return encoding.split("best plan:")[1].split(";")[0].strip()
    if "window search" in encoding:
        return "model (window search from " + encoding.split("started from")[-1].strip() + ")"
    if encoding.startswith("memory-aware order"):
        return "memory-aware order (at the lower bound)"
    return "model"


def scale_rows(limit_s: float, workers: int):
    rows, missing = [], []
    for name in SCALE_PROFILES:
        path = ROOT / "models" / "profiles" / f"{name}.json"
        if not path.exists():
            missing.append(name)
            continue
        profile = load_profile(path)
        trivial = keep_all_bound_ms(profile)
        for ratio in SCALE_RATIOS:
            budget = budget_from_ratio(profile, ratio)
            bound = max(trivial, order_bound_ms(profile, budget))
            schedule, wall, first, last = _plan_timed(profile, budget, "mosos", limit_s, workers)
            if isinstance(schedule, MososError):
                rows.append(f"| {name} | {ratio} | {budget} | {trivial:.2f} | {bound:.2f} | no plan: {str(schedule)[:120]} "
                            f"| | | | | | | | {wall:.1f} | {'yes' if within(limit_s, wall) else 'NO'} |")
                print(rows[-1], flush=True)
                continue
            summary = schedule.summary
            step = summary.predicted_step_time_ms
            source = _source(schedule)
            from_model = source.startswith("model")
            rows.append(
                f"| {name} | {ratio} | {budget} | {trivial:.2f} | {bound:.2f} | {step:.2f} | "
                f"{100 * (step / trivial - 1):+.2f}% | {100 * (step - bound) / step:.2f}% | "
                f"{summary.offloaded_bytes / 2**30:.1f} | {summary.recompute_time_ms:.1f} | {summary.implementations_changed} | "
                f"{_fmt(first)} | {_fmt(last if from_model else None)} | {source} | {summary.solver.status} | "
                f"{wall:.1f} | {'yes' if within(limit_s, wall) else 'NO'} |"
            )
            print(rows[-1], flush=True)
    return rows, missing


SCALE_HEADER = (
    "| profile | ratio | budget (bytes) | trivial bound (ms) | best valid bound (ms) | mosos step (ms) | over trivial | "
    "gap to bound | offloaded (GiB) | recompute (ms) | algorithms changed | first feasible (s) | best found (s) | "
    "plan from | status | wall (s) | within limit + 5% + 1 s |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- |"
)


def layered_rows(limit_s: float, workers: int):
    rows = []
    for n in LAYERED:
        profile = random_layered_profile(n, seed=0)
        peak = keep_all_peak_bytes(profile)
        floor = minimum_budget_bytes(profile)
        smallest_known = _smallest_known_budget(profile)
        for ratio in LAYERED_RATIOS:
            budget = int(peak * ratio)
            if budget < floor:
                rows.append(f"| n{n} | {ratio} | {budget} | all | below every plan (floor {floor} bytes) | | |")
                continue
            found = []
            for strategy in LAYERED_STRATEGIES:
                schedule, wall, _, _ = _plan_timed(profile, budget, strategy, limit_s, workers)
                if isinstance(schedule, MososError):
                    answer = "no plan: " + str(schedule).split(";")[0].split(", ")[-1][:90]
                else:
                    answer = f"plan, step {schedule.summary.predicted_step_time_ms:.0f}"
                    found.append(strategy)
                rows.append(f"| n{n} | {ratio} | {budget} | {strategy} | {answer} | {wall:.1f} | "
                            f"{'yes' if within(limit_s, wall) else 'NO'} |")
                print(rows[-1], flush=True)
            bound = order_bound_ms(profile, budget, transfers=False)
            known = ", ".join(found) if found else (
                "none: no plan in the profile's order fits (the peak-instant bound is infinite)" if bound == float("inf")
                else "none found by any strategy in this run (no plan is known to exist at this budget; the "
                f"smallest budget with a known plan is {smallest_known} bytes = {smallest_known / peak:.3f} of the "
                f"peak, keep-all in a memory-aware order; no plan needs less than the floor, {floor} bytes = "
                f"{floor / peak:.3f})"
            )
            rows.append(f"| n{n} | {ratio} | {budget} | plans found by | {known} | | |")
    return rows


def _smallest_known_budget(profile) -> int:
    """The peak of keep-all in the memory-aware order (`planner/cpsat/reorder.py`), certified by the simulator."""
    order, _ = memory_aware_order(profile)
    schedule = keep_all_in_order(profile, order, None)
    return simulate(profile, schedule, keep_timeline=False).peak_memory_bytes


LAYERED_HEADER = (
    "| graph | ratio | budget (bytes) | strategy | answer | wall (s) | within limit + 5% + 1 s |\n"
    "| --- | ---: | ---: | --- | --- | ---: | --- |"
)


def _load_note() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on this {os.cpu_count()}-core machine at the end"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="checkmate,scale,layered")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per mosos call on the large profiles")
    parser.add_argument("--layered-time-limit", type=float, default=30.0, help="seconds per call on random layered graphs")
    parser.add_argument("--recompute-time-limit", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    command = (f"python benchmarks/solver_scaling.py --sections {{}} --time-limit {args.time_limit:g} "
               f"--layered-time-limit {args.layered_time_limit:g} --recompute-time-limit {args.recompute_time_limit:g} "
               f"--workers {args.workers}")
    intro = (
        "# CP-SAT solver scaling\n\n"
        "Each section says the command that wrote it and the machine's load: this is a shared 2-core machine, other "
        "engineers' jobs ran beside these, so times are pessimistic and noisy.\n"
    )
    if "checkmate" in sections:
        started = time.time()
        recompute, missing_graphs = recompute_rows(SolveOptions(args.recompute_time_limit, args.workers, 0))
        lines = [
            "## 1. recompute-only on the Checkmate / Moccasin graphs (fraction of the topological-order peak)",
            "",
            f"`{command.format('checkmate')}`, {time.time() - started:.0f} s, {_load_note()}.",
            "",
            "Targets: VGG19 at 0.8 (13,646,587,904 bytes) cost <= 9,953,615 within 10 s; VGG16 proven optimal "
            "within 10 s; random_layered_n250 feasible within 10 s at 0.8.",
            "",
            "Four rows per case: the greedy evict-and-recompute plan alone (`planner/cpsat/greedy.py`), the plan in a "
            "memory-aware compute order alone (`planner/cpsat/reorder.py`), the CP-SAT model alone hinted with the "
            "greedy plan, and the `recompute-only` strategy as a user gets it (a second, independent solve).",
            "",
            HEADER,
            *recompute,
        ]
        if missing_graphs:
            lines += ["", f"Missing graphs (skipped): {', '.join(missing_graphs)}"]
        write_section(RESULTS, intro, "\n".join(lines) + "\n")
    if "scale" in sections:
        started = time.time()
        rows, missing = scale_rows(args.time_limit, args.workers)
        lines = [
            f"## 2. The joint model at scale: mosos on the large shipped profiles, --time-limit {args.time_limit:g}",
            "",
            f"`{command.format('scale')}`, {time.time() - started:.0f} s, {_load_note()}.",
            "",
            "Targets (issue 12): ResNet-50 within 1% of its bound, the transformer within 2% of the lower bound at 0.6 "
            "with offload used, VGG-416 within 5%. The *trivial bound* is every node once at its fastest (keep-all); "
            "the *best valid bound* also counts what the budget forces (`planner/bounds.py`, the peak-instant bound: "
            "at the moment a node finishes, what does not fit must come back by recomputation or by an offload that "
            "ended on the one d2h link, and a recomputation also brings back its inputs that died before that moment), "
            "valid for every plan in the profile's order. *Gap to bound* = (step - bound) "
            "/ step. *First feasible*: the first plan any solver phase reported; *best found*: the last improvement of "
            "the plan returned, when it is the model's. *Plan from*: `model (window search from X)` is a solution of "
            "the joint model (`planner/cpsat/lns.py`) started from X's plan, certified by the simulator.",
            "",
            SCALE_HEADER,
            *rows,
        ]
        if missing:
            lines += ["", f"Missing profiles (skipped): {', '.join(missing)}"]
        write_section(RESULTS, intro, "\n".join(lines) + "\n")
    if "layered" in sections:
        started = time.time()
        rows = layered_rows(args.layered_time_limit, args.workers)
        lines = [
            f"## 3. Random layered graphs, n500 and n1000: every call within --time-limit {args.layered_time_limit:g}",
            "",
            f"`{command.format('layered')}`, {time.time() - started:.0f} s, {_load_note()}.",
            "",
            "Graphs: `planner.random_layered.random_layered_profile(n, seed=0)`, our generator of the family of the "
            "published random_layered_n100/n250 (levels of about n^w nodes, w chosen for ~22 levels as the published "
            "ones have, level widths within +-75%, edge density 0.2 between consecutive levels, skip links at 0.14, "
            "a random topological order), no transfer bandwidth. Budgets are fractions of the keep-all peak in the "
            "given order. The issue's measurement: `--time-limit 30` ran 89 s or was killed at 90 s.",
            "",
            LAYERED_HEADER,
            *rows,
        ]
        write_section(RESULTS, intro, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
