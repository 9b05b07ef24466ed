"""What splitting a convolution's backward into filter- and data-gradient nodes changes, side by side.

Run: `python benchmarks/conv_split.py [--time-limit 40] [--workers 1] [--ratios 0.8,0.7,0.6,0.5,0.4]`.
For the MO-SOS experiment's profiles (VGG19 b144, U-Net b120, P40) it plans each memory ratio on
the shipped profile (split: estimator v1.1) and on the same profile with every convolution's two
backward nodes folded back into one (`models.estimator.fold_split_backward`: Pareto pairs of
(data, filter) algorithms, time = sum, workspace = max, which is what estimator v1.0 shipped, to
within 0.0001 ms of rounding), one after the other under the same load, and writes
benchmarks/results/conv_split.md: nodes, keep-all peak and floor of each, then the step time of
mosos and of the fast heuristic baselines. One worker by default, so that CP-SAT runs on
deterministic time (a wall-clock cap at the time limit still applies on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.estimator import fold_split_backward  # noqa: E402
from planner.budget import budget_from_ratio, minimum_budget_bytes  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.profile import load_profile, parse_profile  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.strategies.keep_all import keep_all_schedule  # noqa: E402
from planner.units import format_bytes  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "conv_split.md"
CASES = [("VGG19 b144", "vgg19-b144-227-p40"), ("U-Net b120", "unet-b120-256-p40")]
RATIOS = [0.8, 0.7, 0.6, 0.5, 0.4]
STRATEGIES = ["mosos", "swap-recompute-heuristic", "vdnn-dyn", "chen-sqrt"]


def one_node(profile):
    """The profile with each convolution's backward as one node, as estimator v1.0 made it."""
    data = json.loads(profile.to_json(indent=None))
    data["nodes"] = [json.loads(node.model_dump_json(exclude_none=True)) for node in fold_split_backward(profile.nodes)]
    data["name"] = profile.name + ", convolution backward as one node"
    return parse_profile(data)


def step(profile, budget, strategy, time_limit_s, workers) -> str:
    try:
        schedule = plan(profile, budget, strategy=strategy, time_limit_s=time_limit_s, workers=workers, seed=0)
    except BudgetError as error:
        minimum = error.minimum_budget_bytes
        return f"- (needs {format_bytes(minimum)})" if minimum else "-"
    summary = schedule.summary
    text = f"{summary.predicted_step_time_ms:.1f}"
    solver = summary.solver
    if strategy == "mosos" and solver is not None:
        encoding = solver.encoding or ""
        source = encoding.split("best plan:")[1].split(";")[0].strip() if "best plan:" in encoding else "cp-sat"
        text += f" ({source}, {solver.status})"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=40.0, help="seconds for each mosos call")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    started, load = time.time(), os.getloadavg()[0]
    sizes = ["| profile | backward of a convolution | nodes | keep-all peak | keep-all step | floor | floor / peak |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    plans = ["| profile | ratio | strategy | one node (v1.0) ms | split (v1.1) ms | change |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for title, stem in CASES:
        split = load_profile(ROOT / "models" / "profiles" / f"{stem}.json")
        whole = one_node(split)
        for label, profile in (("one node", whole), ("filter, then data", split)):
            keep_all = simulate(profile, keep_all_schedule(profile), keep_timeline=False)
            floor = minimum_budget_bytes(profile)
            sizes.append(f"| {title} | {label} | {len(profile.nodes)} | {format_bytes(keep_all.peak_memory_bytes)} | "
                         f"{keep_all.step_time_ms:.1f} ms | {format_bytes(floor)} | {floor / keep_all.peak_memory_bytes:.3f} |")
            print(sizes[-1], flush=True)
        for ratio in ratios:
            budget = budget_from_ratio(split, ratio)  # the same bytes for both
            for strategy in STRATEGIES:
                before = step(whole, budget, strategy, args.time_limit, args.workers)
                after = step(split, budget, strategy, args.time_limit, args.workers)
                try:
                    change = f"{100 * (float(after.split()[0]) / float(before.split()[0]) - 1):+.2f}%"
                except ValueError:
                    change = ""
                plans.append(f"| {title} | {ratio} | {strategy} | {before} | {after} | {change} |")
                print(plans[-1], flush=True)
    load = max(load, os.getloadavg()[0])
    lines = [
        "# Convolution backward as one node or as two (filter gradient, then data gradient)",
        "",
        f"Generated by `python benchmarks/conv_split.py --time-limit {args.time_limit:g} --workers {args.workers}` in "
        f"{time.time() - started:.0f} s on this {os.cpu_count()}-core machine, shared with other jobs (load average up "
        f"to {load:.1f}). Each pair of plans ran one after the other, so both saw about the same load. 'One node' "
        "is the shipped profile with each convolution's filter- and data-gradient nodes folded back into one "
        "(`models.estimator.fold_split_backward`), which is what estimator v1.0 shipped. Both plan within the same "
        "budget in bytes, the ratio of the split profile's keep-all peak (the two peaks are equal here).",
        "",
        *sizes,
        "",
        "Simulated step times (mosos: where its plan came from, and the solver's status); `-`: no plan, with the "
        "smallest budget the strategy reported.",
        "",
        *plans,
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
