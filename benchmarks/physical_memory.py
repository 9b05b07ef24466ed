"""Planned addresses against the plan's peak: per shipped profile, strategy and budget, the most bytes ever live
(the plan's peak less fixed memory, aligned), the arena the placement passes find, which pass found it, whether
fixed memory and the arena fit the budget, and what placing costs. Where the arena does not fit, plan() plans
again within less: the table gives the step time that costs.

    .venv/bin/python benchmarks/physical_memory.py [--strategies mosos,str-auto] [--time-limit 10] [--no-write]
    .venv/bin/python benchmarks/physical_memory.py --zoo --ratios 1.0,0.7,0.5,smallest --strategies mosos

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
from planner.addresses import most_live_bytes, place  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from planner.simulator import allocations  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "physical_memory.md"
INTRO = ("# Planned addresses and held memory\n\nMade by `benchmarks/physical_memory.py`. `live` is the most bytes "
         "the plan's buffers hold at once (aligned to 64 bytes), `arena` what the placement found for them, "
         "`fits` whether fixed memory and the arena fit the budget; `replanned ms` the step of the plan plan() "
         "returns when it had to plan again within less (fragmentation's price); `returned arena / live` the arena "
         "of the plan plan() returns over its own live bytes (none: it returned no addresses).\n")
MIB = 2**20


def _zoo_profiles():
    """The zoo's models (tests/zoo.py: transformers' BERT, GPT-2, ViT, LLaMA built from configs, torchvision-style
    CNNs), profiled on the CPU."""
    import torch

    from executor.measure.profiler import profile_step
    from tests.zoo import ZOO

    torch.set_num_threads(1)
    for name, build in ZOO.items():
        model, args, kwargs, targets, loss_fn = build()
        profile, _ = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0)
        yield f"zoo {name}", profile


def _plan_at(profile, ratio, strategy: str, time_limit_s: float, **options):
    """A plan at `ratio` of keep-all, or ratio None: at the smallest budget the strategy names."""
    if ratio is not None:
        return plan(profile, memory_ratio=ratio, strategy=strategy, time_limit_s=time_limit_s, workers=1, **options)
    try:
        return plan(profile, memory_ratio=0.05, strategy=strategy, time_limit_s=time_limit_s, workers=1, **options)
    except BudgetError as error:  # below the floor, or no plan there: both name the smallest budget they know
        if not error.minimum_budget_bytes:
            raise
        return plan(profile, error.minimum_budget_bytes, strategy=strategy, time_limit_s=time_limit_s, workers=1,
                    **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default="keep-all,mosos,str-auto,recompute-only")
    parser.add_argument("--ratios", default="1.0,0.7,0.5")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--zoo", action="store_true", help="the zoo's models (profiled here) instead of the shipped "
                        "profiles; ratio 'smallest' is the smallest budget the strategy names")
    args = parser.parse_args()
    ratios = [None if r == "smallest" else float(r) for r in args.ratios.split(",")]
    sources = _zoo_profiles() if args.zoo else ((path.stem, load_profile(path)) for path in
                                                 sorted((ROOT / "models" / "profiles").glob("*.json")))
    rows = ["| profile | strategy | ratio | buffers | live MiB | arena MiB | arena / live | pass | place ms | fits | "
            "step ms | replanned ms | returned arena / live |", "|" + " --- |" * 13]
    worst = 0.0
    for name, profile in sources:
        for strategy in args.strategies.split(","):
            for ratio in ratios:
                try:
                    unplaced = _plan_at(profile, ratio, strategy, args.time_limit, addresses=False)
                    final = plan(profile, unplaced.budget_bytes, strategy=strategy, time_limit_s=args.time_limit,
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
                returned = "none" if final.arena_bytes is None else \
                    f"{final.arena_bytes / max(most_live_bytes(allocations(profile, final)), 1):.4f}"
                replanned = final.summary.predicted_step_time_ms \
                    if final.summary.predicted_step_time_ms != unplaced.summary.predicted_step_time_ms else None
                rows.append(
                    f"| {name} | {strategy} | {'smallest' if ratio is None else ratio} | {len(buffers)} | "
                    f"{address_plan.lower_bound_bytes / MIB:.1f} | {address_plan.arena_bytes / MIB:.1f} | "
                    f"{1 + address_plan.overhead:.4f} | {address_plan.order} | {place_ms:.0f} | "
                    f"{'yes' if fits else 'no'} | {unplaced.summary.predicted_step_time_ms:.1f} | "
                    f"{'' if replanned is None else f'{replanned:.1f}'}"
                    f"{'' if final.arena_bytes is not None else ' (none placed)'} | {returned} |")
    body = rows + ["", f"Worst arena over live: {worst:.2%}."]
    what = "the zoo" if args.zoo else "shipped profiles"
    publish_section(RESULTS, INTRO, f"Arena against live memory: {what} ({args.strategies}, time limit "
                    f"{args.time_limit} s)",
                    "python benchmarks/physical_memory.py " + " ".join(sys.argv[1:]), "2 cores, CPU only", body,
                    write=not args.no_write)


if __name__ == "__main__":
    main()
