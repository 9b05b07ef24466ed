"""Measured against simulated step time of planned steps on the CPU, and the time to a first planned step.

Section "step time": for each workload, one process profiles the keep-all step once, then for each memory ratio
plans with mosos and runs the planned step with the ledger off: the measured step (forward and backward parts, the
calling thread's CPU time with one torch thread, as the profiler times nodes; median of `--steps` steps after a
warm-up) against the simulator's. Then the same module as optimize() builds it: the first two steps timed node by
node and, where the measured step is more than 10% off, one re-plan on the measured node times; the re-planned
step is measured the same way. On the CPU host memory is the same RAM, so the plans only recompute (no link).

Section "first step": fresh processes, alternating, `--rounds` each: (a) `optimize(budget=B)` with B = 0.5 of the
keep-all peak (the budgeted path: capture, a measuring pass within B, planning, the first step), against (b) the
keep-all profile path (capture, keep-all measuring, planning within B, the first step); the wall time from the
model built to the first step's backward done.

    python benchmarks/measured_vs_simulated.py                       # both sections, results file updated
    python benchmarks/measured_vs_simulated.py --sections first-step --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_section  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "measured_vs_simulated.md"
WORKLOADS = ("bert_small", "gpt2_small", "resnet18_small")
RATIOS = (0.7, 0.5, 0.35)
INTRO = ("# Measured against simulated step time (CPU)\n\nWritten by `benchmarks/measured_vs_simulated.py`; "
         "each section says how it was made.\n")


def _spec(name: str) -> str:
    return f"benchmarks/workloads.py:{name}"


def _call(planned, work):
    loss = planned(*work.inputs, targets=work.targets, **(work.kwargs or {})) if work.targets is not None else \
        planned(*work.inputs, **(work.kwargs or {}))
    loss.backward()


def _measure_steps(planned, work, steps: int) -> float:
    """Median thread-CPU time of `steps` planned steps after one warm-up."""
    times = []
    for index in range(steps + 1):
        for p in planned.model.parameters():
            p.grad = None
        started = time.thread_time_ns()
        _call(planned, work)
        if index:
            times.append((time.thread_time_ns() - started) / 1e6)
    return statistics.median(times)


def step_time_rows(workload: str, ratios, steps: int, time_limit_s: float) -> list[dict]:
    import torch

    from executor.measure.profiler import profile_step
    from executor.replay.replay import PlannedModule
    from models.workload import load_workload
    from planner.errors import BudgetError
    from planner.planning import plan
    from planner.strategies.keep_all import keep_all_peak_bytes

    torch.set_num_threads(1)
    work = load_workload(_spec(workload))
    profile, profiled = profile_step(work.model, work.inputs, work.loss_fn, work.targets, kwargs=work.kwargs,
                                     repeats=5, warmup=2)
    rows = []
    for ratio in ratios:
        budget = int(keep_all_peak_bytes(profile) * ratio)
        row = {"workload": workload, "ratio": ratio, "budget_bytes": budget}
        try:
            schedule = plan(profile, budget, strategy="mosos", time_limit_s=time_limit_s, workers=1)
        except BudgetError as error:
            row["note"] = str(error).split(";")[0]
            rows.append(row)
            continue
        planned = PlannedModule(work.model, profile, schedule, work.loss_fn, profiled=profiled, ledger=False)
        row["simulated_ms"] = schedule.summary.predicted_step_time_ms
        row["recompute_ms"] = schedule.summary.recompute_time_ms
        row["measured_ms"] = _measure_steps(planned, work, steps)
        # as optimize() builds it: two timed steps, one re-plan when more than 10% off
        replanned = PlannedModule(
            work.model, profile, schedule, work.loss_fn, profiled=profiled, ledger=False, timed_steps=2,
            replan=lambda measured, _schedule, _token, b=budget: plan(measured, b, strategy="mosos", time_limit_s=time_limit_s,
                                                   workers=1))
        for _ in range(2):
            for p in work.model.parameters():
                p.grad = None
            _call(replanned, work)
        report = replanned.report()
        row["replanned"] = report.replanned
        if report.replanned:
            row["replan_simulated_ms"] = replanned.simulated_step_time_ms
            replanned.timed_steps = 0  # measure the new plan untimed
            row["replan_measured_ms"] = _measure_steps(replanned, work, steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _child_first_step(workload: str, path: str, ratio: float) -> dict:
    """One fresh process: the wall time from the built model to the first planned step's backward."""
    import torch

    import executor
    from executor.measure.profiler import profile_step
    from executor.replay.replay import PlannedModule
    from models.workload import load_workload
    from planner.planning import plan
    from planner.strategies.keep_all import keep_all_peak_bytes

    torch.set_num_threads(1)
    work = load_workload(_spec(workload))
    budget = int(os.environ["MOSOS_BENCH_BUDGET"])
    started = time.monotonic()
    if path == "budgeted":
        from planner.errors import BudgetError

        try:
            planned = executor.optimize(work.model, work.inputs, work.loss_fn, budget=budget, targets=work.targets,
                                        kwargs=work.kwargs, time_limit_s=10, workers=1, progress=False)
        except BudgetError as error:  # said before anything beyond the model was allocated
            return {"path": path, "seconds": time.monotonic() - started, "measured_under": None,
                    "refused": str(error), "minimum_budget_bytes": error.minimum_budget_bytes}
        measured_under = planned.profiled_under
    else:
        profile, profiled = profile_step(work.model, work.inputs, work.loss_fn, work.targets, kwargs=work.kwargs)
        schedule = plan(profile, budget, strategy="mosos", time_limit_s=10, workers=1)
        planned = PlannedModule(work.model, profile, schedule, work.loss_fn, profiled=profiled)
        measured_under = f"keep-all (peak {keep_all_peak_bytes(profile)} bytes)"
    _call(planned, work)
    return {"path": path, "seconds": time.monotonic() - started, "measured_under": measured_under}


def first_step_rows(workload: str, ratio: float, rounds: int) -> list[dict]:
    from executor.measure.profiler import profile_step
    from models.workload import load_workload
    from planner.strategies.keep_all import keep_all_peak_bytes

    work = load_workload(_spec(workload))
    profile, _ = profile_step(work.model, work.inputs, work.loss_fn, work.targets, kwargs=work.kwargs, repeats=1,
                              warmup=0)
    budget = int(keep_all_peak_bytes(profile) * ratio)
    rows = []
    for round_index in range(rounds):
        for path in ("budgeted", "keep-all"):
            environment = {**os.environ, "MOSOS_BENCH_BUDGET": str(budget)}
            output = subprocess.run([sys.executable, __file__, "--child", workload, path, str(ratio)],
                                    capture_output=True, text=True, env=environment, cwd=ROOT, check=True)
            row = json.loads(output.stdout.strip().splitlines()[-1])
            row |= {"workload": workload, "round": round_index, "budget_bytes": budget}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _step_section(rows: list[dict], command: str) -> str:
    lines = ["## Step time: measured / simulated", "",
             f"`{command}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
             f"{os.getloadavg()[0]:.1f}, 1 torch thread, ledger off, mosos plans (recompute only: no host link on "
             "the CPU). Measured: median thread-CPU time of the planned step; re-planned: the same module after "
             "two timed steps and the one re-plan optimize() makes when more than 10% off.", "",
             "| workload | ratio | simulated ms | measured ms | measured / simulated | re-planned: simulated ms "
             "| measured ms | measured / simulated |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "simulated_ms" not in row:
            lines.append(f"| {row['workload']} | {row['ratio']} | no plan: {row.get('note', '')} | | | | | |")
            continue
        first = row["measured_ms"] / row["simulated_ms"]
        if row.get("replanned"):
            second = row["replan_measured_ms"] / row["replan_simulated_ms"]
            tail = f"{row['replan_simulated_ms']:.1f} | {row['replan_measured_ms']:.1f} | {second:.3f}"
        else:
            tail = "(within 10%: not re-planned) | | "
        lines.append(f"| {row['workload']} | {row['ratio']} | {row['simulated_ms']:.1f} | {row['measured_ms']:.1f} "
                     f"| {first:.3f} | {tail} |")
    planned = [r for r in rows if "simulated_ms" in r]
    final = [(r["replan_measured_ms"] / r["replan_simulated_ms"]) if r.get("replanned")
             else r["measured_ms"] / r["simulated_ms"] for r in planned]
    within = sum(1 for value in final if abs(value - 1) <= 0.10)
    lines += ["", f"After optimize()'s re-plan, {within} of {len(final)} planned rows are within 10% "
              f"(final ratios {min(final):.3f} to {max(final):.3f})." if final else ""]
    return "\n".join(lines) + "\n"


def _first_section(rows: list[dict], command: str) -> str:
    lines = ["## Time to a first planned step at 0.5 of keep-all", "",
             f"`{command}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, fresh processes, the two paths "
             "alternating; wall seconds from the built model to the first planned step's backward.", "",
             "| workload | budgeted path s (median) | keep-all profile path s (median) | budgeted / keep-all | "
             "budgeted path measured under |", "|---|---:|---:|---:|---|"]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        budgeted = [r["seconds"] for r in rows if r["workload"] == workload and r["path"] == "budgeted"]
        keep_all = [r["seconds"] for r in rows if r["workload"] == workload and r["path"] == "keep-all"]
        first = next(r for r in rows if r["workload"] == workload and r["path"] == "budgeted")
        if first.get("refused"):
            lines.append(f"| {workload} | refused in {statistics.median(budgeted):.1f} s: {first['refused']} | "
                         f"{statistics.median(keep_all):.1f} | | |")
            continue
        lines.append(f"| {workload} | {statistics.median(budgeted):.1f} | {statistics.median(keep_all):.1f} | "
                     f"{statistics.median(budgeted) / statistics.median(keep_all):.2f} | {first['measured_under']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--sections", nargs="+", default=["step-time", "first-step"])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "PATH", "RATIO"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child_first_step(args.child[0], args.child[1], float(args.child[2]))))
        return
    command = "python " + " ".join(["benchmarks/measured_vs_simulated.py", *sys.argv[1:]])
    if "step-time" in args.sections:
        rows = []
        for workload in args.workloads:
            output = subprocess.run([sys.executable, "-c", (
                "import json, sys; sys.path.insert(0, '.'); from benchmarks.measured_vs_simulated import "
                f"step_time_rows; print('ROWS', json.dumps(step_time_rows({workload!r}, {args.ratios!r}, "
                f"{args.steps}, {args.time_limit})))")], capture_output=True, text=True, cwd=ROOT, check=True)
            rows += json.loads(next(line for line in output.stdout.splitlines() if line.startswith("ROWS"))[5:])
        section = _step_section(rows, command)
        print(section)
        if not args.no_write:
            write_section(RESULTS, INTRO, section)
    if "first-step" in args.sections:
        rows = []
        for workload in args.workloads:
            rows += first_step_rows(workload, 0.5, args.rounds)
        section = _first_section(rows, command)
        print(section)
        if not args.no_write:
            write_section(RESULTS, INTRO, section)


if __name__ == "__main__":
    main()
