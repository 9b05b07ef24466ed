"""The replay writing into the arena against the replay through the allocator, on the CPU, per zoo model and plan.

For each model of tests/zoo.py (built from configs, profiled here) and each plan (keep-all, and mosos at the
zoo's plannable ratio of keep-all, planned as optimize(arena=True) plans: within the budget less what the step
holds beside the arena), one process builds two planned modules of the same plan, one with
`arena=True`, and alternates their steps (A B A B ...) so that drift between processes cannot enter the time
ratio. Per configuration: the median step time, the bytes the allocator hands out during one step (its own
events: what the arena saves), the most live storage rises during a step above what was held before it
(AllocationTrace) plus, with the arena, the arena itself, and the nodes the program names as allocating
outside the arena, by reason.

    .venv/bin/python benchmarks/arena_replay.py [--models resnet,gpt2] [--steps 15] [--no-write]
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import publish_section  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "arena_replay.md"
INTRO = ("# The replay writing into the arena\n\nMade by `benchmarks/arena_replay.py` on the CPU. Each row pairs "
         "the same plan replayed through the allocator (`allocator`) and written into its arena (`arena`), steps "
         "alternating in one process; `time ratio` is the median of arena/allocator per pair of steps. `allocated` "
         "is what the allocator hands out during one step (after warm-up, gradients included: the step allocates "
         ".grad as eager does), `held` the most live storage above the step's start plus, with the arena, the "
         "arena (allocated once, kept between steps); `outside bound` what the program says the allocator may hold "
         "beside the arena at once (.grad apart).\n")
MIB = 2**20


def _step(planned, model, args, kwargs, targets) -> float:
    started = time.perf_counter()
    planned(*args, targets=targets, **kwargs).backward()
    elapsed = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return elapsed * 1e3


def _allocated_and_held(planned, model, args, kwargs, targets) -> tuple[int, int]:
    from executor.measure.allocations import AllocationTrace, _allocations, _Session

    session = _Session()
    session.start()
    try:
        planned(*args, targets=targets, **kwargs).backward()
    finally:
        events = _allocations(session.stop())
    model.zero_grad(set_to_none=True)
    with AllocationTrace() as trace:
        planned(*args, targets=targets, **kwargs).backward()
    model.zero_grad(set_to_none=True)
    return sum(size for _, size in events if size > 0), trace.peak_bytes


def measure(name: str, steps: int) -> list[dict]:
    import torch

    from executor.measure.profiler import profile_step
    from executor.replay.replay import PlannedModule, arena_outside_bytes, arena_reserve_bytes, plan_beside_the_arena
    from planner.planning import addressed, plan
    from planner.strategies.keep_all import keep_all_peak_bytes
    from tests.zoo import ZOO, plannable_ratio

    torch.set_num_threads(1)
    model, args, kwargs, targets, loss_fn = ZOO[name](torch.float32)
    profile, captured = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0,
                                     algorithms=("native",))
    # mosos as optimize(arena=True) plans it: within the budget less what the step holds beside the arena
    budget = int(plannable_ratio(profile) * keep_all_peak_bytes(profile))
    cpu = torch.device("cpu")
    reserve = arena_reserve_bytes(profile, captured, cpu)
    plans = {"keep-all": addressed(profile, plan(profile, strategy="keep-all"))}
    mosos = f"mosos at {plannable_ratio(profile):g}"
    said: list[str] = []
    within, _ = plan_beside_the_arena(
        profile, budget, reserve, lambda view, b: plan(view, b, strategy="mosos", time_limit_s=5, workers=1, seed=0),
        said.append, in_order=(lambda: arena_reserve_bytes(profile, captured, cpu, any_order=False),
                               lambda schedule: arena_outside_bytes(profile, captured, schedule, cpu)))
    plans[mosos] = within if within is not None else "no plan leaves room beside the arena: " + "; ".join(said[1:])
    rows = []
    for kind, schedule in plans.items():
        if isinstance(schedule, str):
            rows.append({"model": name, "plan": kind, "skipped": schedule})
            continue
        if schedule.arena_bytes is None:
            rows.append({"model": name, "plan": kind, "skipped": "its arena does not fit its budget"})
            continue
        modules = {}
        for use_arena in (False, True):
            copied = copy.deepcopy(model)
            modules[use_arena] = (PlannedModule(copied, profile, schedule, loss_fn, profiled=captured,
                                                arena=use_arena, ledger=False), copied)
        for use_arena, (planned, copied) in modules.items():
            for _ in range(2):
                _step(planned, copied, args, kwargs, targets)
        if modules[True][0].arena_refused is not None:
            rows.append({"model": name, "plan": kind, "skipped": "arena refused: " + modules[True][0].arena_refused})
            continue
        times = {False: [], True: []}
        for _ in range(steps):
            for use_arena, (planned, copied) in modules.items():
                times[use_arena].append(_step(planned, copied, args, kwargs, targets))
        ratios = [a / b for a, b in zip(times[True], times[False])]
        figures = {use_arena: _allocated_and_held(planned, copied, args, kwargs, targets)
                   for use_arena, (planned, copied) in modules.items()}
        planned = modules[True][0]
        reasons = collections.Counter(planned.arena_allowances.values())
        rows.append({
            "model": name, "plan": kind, "nodes": len(profile.nodes),
            "written": len(planned._prepared.program.written),
            "allocator ms": statistics.median(times[False]), "arena ms": statistics.median(times[True]),
            "time ratio": statistics.median(ratios),
            "allocated MiB": (figures[False][0] / MIB, figures[True][0] / MIB),
            "held MiB": (figures[False][1] / MIB, (figures[True][1] + planned.arena_bytes) / MIB),
            "arena MiB": planned.arena_bytes / MIB,
            "outside bound MiB": planned._prepared.program.outside_arena_bytes / MIB,
            "peak MiB": (planned.simulated_peak_bytes - profile.fixed_bytes) / MIB,
            "reasons": dict(reasons),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | plan | nodes | written in place | allocator ms | arena ms | time ratio | allocated MiB "
             "(allocator / arena) | held MiB (allocator / arena + its arena) | arena MiB "
             "| outside bound MiB | plan's peak less fixed MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['plan']} | {row['skipped']} ||||||||||")
            continue
        lines.append(
            f"| {row['model']} | {row['plan']} | {row['nodes']} | {row['written']} | {row['allocator ms']:.2f} | "
            f"{row['arena ms']:.2f} | {row['time ratio']:.3f} | {row['allocated MiB'][0]:.2f} / "
            f"{row['allocated MiB'][1]:.2f} | {row['held MiB'][0]:.2f} / {row['held MiB'][1]:.2f} | "
            f"{row['arena MiB']:.2f} | {row['outside bound MiB']:.2f} | {row['peak MiB']:.2f} |")
    reasons: collections.Counter = collections.Counter()
    for row in rows:
        reasons.update(row.get("reasons", {}))
    lines.append("")
    lines.append("Nodes allocating outside the arena, by reason (all rows): "
                 + "; ".join(f"{reason}: {count}" for reason, count in reasons.most_common()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tests.zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    arguments = parser.parse_args(argv)
    rows = []
    for name in arguments.models.split(","):
        rows.extend(measure(name, arguments.steps))
    command = ".venv/bin/python benchmarks/arena_replay.py " + " ".join(argv if argv is not None else sys.argv[1:])
    publish_section(RESULTS, INTRO, "zoo on the CPU", command.strip(), "CPU, 1 thread, float32",
                    table(rows).splitlines(), write=not arguments.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
