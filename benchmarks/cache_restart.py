"""Time to the first planned step of a restarted run: a first process (empty cache) against a second one (the plan
kept by the first), each a fresh Python process calling optimize() on the same workload with the same budget.

    python benchmarks/cache_restart.py [--workload bert_small] [--ratio 0.5] [--pairs 3]

Each pair uses a cache directory of its own; the figure is the time from the optimize() call to the end of the first
step's backward (model construction and imports excluded, as they are the same in both), and the second/first ratio
is taken per pair. Writes benchmarks/results/cache_restart.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_file import write_section  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "cache_restart.md"

ONE_RUN = '''
import json, sys, time
sys.path.insert(0, {benchmarks!r})
import executor, workloads
work = getattr(workloads, {workload!r})()
messages = []
started = time.perf_counter()
planned = executor.optimize(work["model"], work["inputs"], work["loss_fn"], kwargs=work.get("kwargs"),
                            targets=work.get("targets"), memory_ratio={ratio}, time_limit_s={time_limit},
                            progress=messages.append)
loss = planned(*work["inputs"], targets=work.get("targets"), **(work.get("kwargs") or {{}}))
loss.backward()
print(json.dumps({{"seconds": time.perf_counter() - started, "cached": any("no capture" in m for m in messages),
                  "predicted_ms": planned.schedule.summary.predicted_step_time_ms}}))
'''


def one_run(workload: str, ratio: float, time_limit: float, cache_dir: str) -> dict:
    code = ONE_RUN.format(benchmarks=str(REPO / "benchmarks"), workload=workload, ratio=ratio, time_limit=time_limit)
    env = dict(os.environ, MOSOS_CACHE_DIR=cache_dir)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=1800)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="bert_small")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=20.0)
    args = parser.parse_args()
    rows = []
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory(prefix="mosos-cache-") as cache_dir:
            first = one_run(args.workload, args.ratio, args.time_limit, cache_dir)
            second = one_run(args.workload, args.ratio, args.time_limit, cache_dir)
        assert not first["cached"] and second["cached"], (first, second)
        rows.append((first["seconds"], second["seconds"], second["seconds"] / first["seconds"]))
        print(f"pair {pair + 1}: first {first['seconds']:.2f} s, second {second['seconds']:.2f} s, "
              f"ratio {rows[-1][2]:.3f}", flush=True)
    table = ["| pair | first process s | second process s | second / first |", "|---:|---:|---:|---:|"]
    table += [f"| {i + 1} | {a:.2f} | {b:.2f} | {r:.3f} |" for i, (a, b, r) in enumerate(rows)]
    median = statistics.median(r for _, _, r in rows)
    section = (
        f"## {args.workload} at {args.ratio:g} of keep-all\n\n"
        f"`python benchmarks/cache_restart.py --workload {args.workload} --ratio {args.ratio:g} --pairs {args.pairs} "
        f"--time-limit {args.time_limit:g}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs)\n\n" + "\n".join(table) + f"\n\nmedian second / first: **{median:.3f}** "
        "(target at most 0.20)\n"
    )
    intro = ("# Restart: time to the first planned step with the plan kept by an earlier run\n\n"
             "From the optimize() call to the end of the first step's backward, in fresh processes; the first "
             "captures, profiles within the budget and solves, the second rebuilds the kept capture and plan.\n")
    write_section(RESULTS, intro, section)
    print(table and "\n".join(table))
    print(f"median second / first: {median:.3f}")


if __name__ == "__main__":
    main()
