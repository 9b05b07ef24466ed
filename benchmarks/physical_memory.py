"""Planned addresses against the plan's peak: per shipped profile, strategy and budget, the most bytes ever live
(the plan's peak less fixed memory, aligned), the arena the placement passes find, which pass found it, whether
fixed memory and the arena fit the budget, and what placing costs. Where the arena does not fit, plan() plans
again within less: the table gives the step time that costs.

    .venv/bin/python benchmarks/physical_memory.py [--strategies mosos,str-auto] [--time-limit 10] [--no-write]

The GPU half of the issue (reserved and outside-allocator memory per step, with and without addresses) needs the
replay to write into the arena, which it does not yet; `PlannedModule.report().held` reads them on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import publish_section  # noqa: E402
from planner.addresses import place  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from planner.simulator import allocations  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "physical_memory.md"
INTRO = ("# Planned addresses and held memory\n\nMade by `benchmarks/physical_memory.py`. `live` is the most bytes "
         "the plan's buffers hold at once (aligned to 64 bytes), `arena` what the placement found for them, "
         "`fits` whether fixed memory and the arena fit the budget; `replanned ms` the step of the plan plan() "
         "returns when it had to plan again within less (fragmentation's price).\n")
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default="keep-all,mosos,str-auto,recompute-only")
    parser.add_argument("--ratios", default="1.0,0.7,0.5")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = ["| profile | strategy | ratio | buffers | live MiB | arena MiB | arena / live | pass | place ms | fits | "
            "step ms | replanned ms |", "|" + " --- |" * 12]
    worst = 0.0
    for path in sorted((ROOT / "models" / "profiles").glob("*.json")):
        profile = load_profile(path)
        for strategy in args.strategies.split(","):
            for ratio in (float(r) for r in args.ratios.split(",")):
                try:
                    unplaced = plan(profile, memory_ratio=ratio, strategy=strategy, time_limit_s=args.time_limit,
                                    workers=1, addresses=False)
                    final = plan(profile, memory_ratio=ratio, strategy=strategy, time_limit_s=args.time_limit,
                                 workers=1)
                except BudgetError:
                    continue
                began = time.perf_counter()
                buffers = allocations(profile, unplaced)
                address_plan = place(buffers, search_time_s=1.0)
                place_ms = 1000 * (time.perf_counter() - began)
                fits = unplaced.budget_bytes is None or \
                    profile.fixed_bytes + address_plan.arena_bytes <= unplaced.budget_bytes
                worst = max(worst, address_plan.overhead)
                replanned = final.summary.predicted_step_time_ms \
                    if final.summary.predicted_step_time_ms != unplaced.summary.predicted_step_time_ms else None
                rows.append(
                    f"| {path.stem} | {strategy} | {ratio} | {len(buffers)} | "
                    f"{address_plan.lower_bound_bytes / MIB:.1f} | {address_plan.arena_bytes / MIB:.1f} | "
                    f"{1 + address_plan.overhead:.4f} | {address_plan.order} | {place_ms:.0f} | "
                    f"{'yes' if fits else 'no'} | {unplaced.summary.predicted_step_time_ms:.1f} | "
                    f"{'' if replanned is None else f'{replanned:.1f}'}"
                    f"{'' if final.arena_bytes is not None else ' (none placed)'} |")
    body = rows + ["", f"Worst arena over live: {worst:.2%}."]
    publish_section(RESULTS, INTRO, f"Arena against live memory ({args.strategies}, time limit {args.time_limit} s)",
                    "python benchmarks/physical_memory.py " + " ".join(sys.argv[1:]), "2 cores, CPU only", body,
                    write=not args.no_write)


if __name__ == "__main__":
    main()
