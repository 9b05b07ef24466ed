"""How fast the CP-SAT model finds and proves plans.

Run: `python benchmarks/solver_scaling.py [--time-limit 60] [--workers 2]`. Two tables, written to
benchmarks/results/solver_scaling.md:

1. The full MO-SOS model (keep / offload+prefetch / recompute, algorithm choice) on the shipped
   profiles (VGG19 and U-Net on the P40, ResNet-50, VGG-416) at memory ratios 0.8 and 0.6, cold
   (no hint) and warm (hinted with the best baseline plan that fits): time to the first feasible
   plan, time to the best, objective, bound, gap.
2. recompute-only on the Checkmate/Moccasin graphs at 0.8 and 0.9 of the topological peak.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.budget import budget_from_ratio, minimum_budget_bytes  # noqa: E402
from planner.cpsat.data import Features  # noqa: E402
from planner.cpsat.greedy import greedy_recompute_schedule  # noqa: E402
from planner.cpsat.reorder import memory_aware_order, reordered_schedule  # noqa: E402
from planner.cpsat.solve import solve_model  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.importer import import_graph  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.strategies import SolveOptions  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402
from planner.strategies.mosos import MOSOS, baseline_plans  # noqa: E402
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


def full_model_rows(options, ratios):
    rows, missing = [], []
    for name in PROFILES:
        path = ROOT / "models" / "profiles" / f"{name}.json"
        if not path.exists():
            missing.append(name)
            continue
        profile = load_profile(path)
        for ratio in ratios:
            budget = budget_from_ratio(profile, ratio)
            outcome, best_s, simulated = _solve(profile, budget, MOSOS, options)
            rows.append(_row(name, ratio, budget, "cold", outcome, best_s, simulated))
            print(rows[-1], flush=True)
            try:
                hints = [s for _, s in baseline_plans(profile, budget, SolveOptions(min(10.0, options.time_limit_s), options.workers, options.seed))]
            except BudgetError:
                hints = []
            greedy = greedy_recompute_schedule(profile, budget)
            hints += [greedy] if greedy else []
            outcome, best_s, simulated = _solve(profile, budget, MOSOS, options, hints)
            rows.append(_row(name, ratio, budget, "warm (baseline hints)", outcome, best_s, simulated))
            print(rows[-1], flush=True)
    return rows, missing


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per full-model solve")
    parser.add_argument("--recompute-time-limit", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ratios", default="0.8,0.6")
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    started = time.time()
    load = os.getloadavg()[0]
    recompute, missing_graphs = recompute_rows(SolveOptions(args.recompute_time_limit, args.workers, 0))
    full, missing_profiles = ([], []) if args.skip_full else full_model_rows(SolveOptions(args.time_limit, args.workers, 0), ratios)
    load = max(load, os.getloadavg()[0])
    lines = [
        "# CP-SAT solver scaling",
        "",
        f"Generated by `python benchmarks/solver_scaling.py --time-limit {args.time_limit:g} --recompute-time-limit "
        f"{args.recompute_time_limit:g} --workers {args.workers}{' --skip-full' if args.skip_full else ''}` on this {os.cpu_count()}-core machine "
        f"(load average up to {load:.1f} while it ran: other engineers' jobs shared the cores, so times are "
        "pessimistic). Encoding: intervals + cumulative (`planner/cpsat`), at most 2 recomputations and 1 "
        "prefetch per tensor. Objective = modelled compute time (+ charged prefetch waits); the simulated step "
        f"is the referee's figure for the extracted plan. Total {time.time() - started:.0f} s. Only one encoding "
        "is implemented (the MO-SOS stage model expressed with interval variables and a cumulative, O(n) copies per "
        "tensor instead of the paper's O(n^2) R/S Booleans), so there is no encoding comparison here.",
        "",
        "## recompute-only on the Checkmate / Moccasin graphs (fraction of the topological-order peak)",
        "",
        "Targets: VGG19 at 0.8 (13,646,587,904 bytes) cost <= 9,953,615 within 10 s; VGG16 proven optimal "
        "within 10 s; random_layered_n250 feasible within 10 s at 0.8.",
        "",
        "Four rows per case: the greedy evict-and-recompute plan alone (`planner/cpsat/greedy.py`), the plan in a "
        "memory-aware compute order alone (`planner/cpsat/reorder.py`: keep-all in the topological order of lowest "
        "keep-all peak that forward/backward list scheduling finds, or the greedy pass on that order when it does "
        "not fit; the order's keep-all peak is in the mode column), the CP-SAT model alone hinted with the greedy "
        "plan (at most 2 recomputations per tensor, so a greedy plan that recomputes more is no usable hint), and "
        "the `recompute-only` strategy as a user gets it (a second, independent solve: with 2 workers runs differ; "
        "the fastest of the CP-SAT, greedy and memory-aware-order plans that fit, certified by the simulator; its "
        "wall time includes the greedy and reordering passes).",
        "",
        HEADER,
        *recompute,
        "",
        "random_layered_n250 at 0.8 (117,472 bytes): the profile's order computes most of the 44 inputs of node "
        "248 (87,200 bytes, most read by nothing else) long before it and keeps them alive, so the greedy pass "
        "(stuck in stages 218-248) and the CP-SAT model (whose stages follow the profile's order; no solution in "
        "10 s, its memory-minimising form reached 121,460 bytes in 90 s) find nothing. Another topological order "
        "needs far less: the memory-aware order's keep-all plan peaks at 115,180 bytes, within the budget with no "
        "recomputation at all, so its step equals keep-all's, the least any plan can take. The model itself "
        "still cannot reorder nodes; a "
        "Moccasin-style sequence encoding that chooses the order was not attempted. For the same reason a strategy "
        "row may say OPTIMAL (the model's status, optimal within the profile's order) while the plan it returns, "
        "from another order, is faster than that objective.",
    ]
    if missing_graphs:
        lines += ["", f"Missing graphs (skipped): {', '.join(missing_graphs)}"]
    marker = "## Full MO-SOS model"
    previous = RESULTS.read_text() if RESULTS.exists() else ""
    if args.skip_full and marker in previous:
        # keep the last full-model table rather than dropping it
        note = " (kept from the previous full run: `--skip-full` did not rerun it)"
        kept = previous[previous.index(marker):].rstrip("\n").replace(note, "")
        lines += ["", kept.replace(marker, marker + note, 1)]
    if not args.skip_full:
        lines += [
            "",
            "## Full MO-SOS model on the shipped profiles (fraction of the keep-all peak)",
            "",
            "Targets: VGG19 and U-Net feasible within 2 s and within 1% of optimal within 60 s; ResNet-50 feasible "
            "within 10 s at 0.8. Cold: the model alone. Warm: hinted with the fastest baseline plan that fits "
            "(what `mosos` does).",
            "",
            HEADER,
            *full,
        ]
        if missing_profiles:
            lines += ["", f"Missing profiles (skipped): {', '.join(missing_profiles)}"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
