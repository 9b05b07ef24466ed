"""Real memory of planned training steps on the CPU: does a plan that "fits" fit in the process's memory?

For each strategy that finds a plan at each ratio, one planned step runs in a fresh Python process
(`--child`): a warm-up step first (lazy initialisation; the host buffers of offloads and the staging buffers
are allocated once and stay: host memory and fixed memory), then `.grad` set to None as `optimizer.zero_grad()`
leaves it, then

- **RSS**: `echo 5 > /proc/self/clear_refs` resets the kernel's high-water mark (VmHWM) to the current
  resident set; one step runs; the rise is VmHWM minus the resident set before the step. glibc is run with
  `MALLOC_MMAP_THRESHOLD_=65536` and `MALLOC_TRIM_THRESHOLD_=0`: every block of 64 KiB or more is its own
  mapping, returned to the kernel when freed, and the heap top is trimmed at once, so that memory freed by
  the warm-up step is not kept in glibc's free lists and silently reused (which would hide a rise), and
  memory freed during the step leaves the resident set when PyTorch frees it (as it leaves the caching
  allocator's count on a GPU). Without them glibc's threshold grows up to 32 MiB and freed blocks stay
  resident, so the measurement would say little either way.
- **Live tensor storage**, an independent count: a second step under `torch.profiler` with
  `profile_memory=True`, whose memory events see every allocation and free of c10's CPU allocator (tensor
  storages, and kernels' own scratch); the peak of their running sum over the step is the rise.

Both are checked against the plan's budget minus the fixed memory resident before the step (fixed memory less
the gradients, which the step allocates), plus 2% and 4 MiB for the interpreter and allocator granularity.
(With `.grad` kept from the previous step, gradient accumulation, each new gradient lives beside the old
one until it is added: the ledger counts that transient, the planner does not model it; up to the largest
parameter's size.) The ledger's and the
simulator's peaks are printed beside them. keep-all has no budget: its simulated peak stands for one.

    python benchmarks/real_memory.py          # elementwise, BERT-small, ResNet-18-small at batch 256; ratios 0.9 0.6 0.5
    python benchmarks/real_memory.py --workload benchmarks/workloads.py:bert_small --ratios 0.6
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
SLACK_FRACTION = 0.02
SLACK_BYTES = 4 << 20
STRATEGIES = ("keep-all", "mosos", "chen-sqrt", "checkpoint-all", "recompute-only", "checkmate-auto",
              "swap-recompute-heuristic", "vdnn-all", "vdnn-conv", "vdnn-dyn", "str-auto", "auto")
MIB = 2**20


@dataclass
class Row:
    workload: str
    strategy: str
    ratio: float | None
    planned: bool
    note: str = ""
    allowed_bytes: int = 0  # budget (or keep-all's simulated peak) minus fixed memory resident before the step
    simulated_bytes: int = 0  # simulator's peak minus fixed memory
    ledger_bytes: int = 0  # the executor's ledger's peak minus fixed memory
    rss_rise_bytes: int = 0
    storage_rise_bytes: int = 0
    host_bytes: int = 0  # host buffers of offloads (resident since the warm-up step, not part of the rise)

    @property
    def limit_bytes(self) -> int:
        return int(self.allowed_bytes * (1 + SLACK_FRACTION)) + SLACK_BYTES

    @property
    def within(self) -> bool:
        return self.rss_rise_bytes <= self.limit_bytes and self.storage_rise_bytes <= self.limit_bytes


# --- the child: one planned step in a fresh process ------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _storage_rise_bytes(step) -> int:
    from executor.measure.allocations import AllocationTrace

    with AllocationTrace() as trace:
        step()
    return trace.peak_bytes


def child(spec: str, profile_path: str, schedule_path: str) -> dict:
    import gc

    import torch

    from executor.replay.replay import PlannedModule
    from models.workload import load_workload
    from planner.profile import parse_profile
    from planner.schedule import parse_schedule

    torch.set_num_threads(1)
    workload = load_workload(spec)
    profile = parse_profile(json.loads(Path(profile_path).read_text()))
    schedule = parse_schedule(json.loads(Path(schedule_path).read_text()))
    planned = PlannedModule(workload.model, profile, schedule, workload.loss_fn, example_inputs=workload.inputs,
                            kwargs=workload.kwargs, targets=workload.targets)

    def step():
        loss = planned(*workload.inputs, targets=workload.targets, **workload.kwargs)
        loss.backward()

    step()  # warm-up: lazy initialisation; host and staging buffers are allocated here and stay
    workload.model.zero_grad(set_to_none=True)  # as optimizer.zero_grad() leaves them: the step allocates .grad
    gc.collect()
    before_kib = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    step()
    rss_rise = (_status_kib("VmHWM") - before_kib) * 1024
    ledger_peak = planned.peak_memory_bytes
    workload.model.zero_grad(set_to_none=True)
    gc.collect()
    storage_rise = _storage_rise_bytes(step)
    host = planned._prepared.runtime.transfers.host_pool_bytes()
    return {"rss_rise_bytes": rss_rise, "storage_rise_bytes": storage_rise, "ledger_peak_bytes": ledger_peak,
            "host_bytes": host}


# --- the parent: profile, plan, one child per plan ----------------------------------------------------------


def measured_profile(spec: str):
    """The workload's profile as the planner sees it (native algorithms, no optimizer: the check has none)."""
    import torch

    from executor.measure.profiler import profile_step
    from models.workload import load_workload

    torch.set_num_threads(1)
    workload = load_workload(spec)
    profile, _ = profile_step(workload.model, workload.inputs, workload.loss_fn, workload.targets,
                              kwargs=workload.kwargs, optimizer=None, repeats=1, warmup=1,
                              algorithms=("native",), d2h_gb_per_s=10, h2d_gb_per_s=10)
    return profile


def check(spec: str, profile, strategy: str, ratio: float | None, time_limit_s: float = 5.0) -> Row:
    """Plan `profile` with `strategy` at `ratio` and measure one planned step of the workload in a fresh process."""
    from planner.errors import MososError
    from planner.planning import plan
    from planner.simulator import simulate

    try:
        schedule = plan(profile, memory_ratio=ratio, strategy=strategy, time_limit_s=time_limit_s, workers=1, seed=0)
    except MososError as error:
        return Row(spec, strategy, ratio, False, note=_why_no_plan(str(error)))
    simulated = simulate(profile, schedule, keep_timeline=False).peak_memory_bytes
    budget = schedule.budget_bytes if schedule.budget_bytes is not None else simulated
    # fixed memory counts the gradients from the start; the step allocates them (zero_grad left none)
    fixed = profile.fixed_bytes - profile.fixed_memory.gradients_bytes
    with tempfile.TemporaryDirectory(prefix="mosos-real-memory-") as folder:
        profile_path, schedule_path = Path(folder) / "profile.json", Path(folder) / "schedule.json"
        profile_path.write_text(profile.to_json())
        schedule_path.write_text(schedule.to_json())
        result = run_child(spec, profile_path, schedule_path)
    return Row(spec, strategy, ratio, True, allowed_bytes=budget - fixed, simulated_bytes=simulated - fixed,
               ledger_bytes=result["ledger_peak_bytes"] - fixed, rss_rise_bytes=result["rss_rise_bytes"],
               storage_rise_bytes=result["storage_rise_bytes"], host_bytes=result["host_bytes"])


def _why_no_plan(message: str) -> str:
    sizes = re.findall(r"\(([\d.]+ [KMG]?i?B)\)", message)
    if "below what any plan needs" in message and sizes:
        return f"every plan needs {sizes[-1]} or more"
    if "smallest budget it can meet" in message and sizes:
        return f"this strategy needs {sizes[-1]}"
    return message.splitlines()[0][:80]


def measure(spec: str, ratios=(0.6, 0.5), strategies=STRATEGIES, time_limit_s: float = 5.0,
            say=print) -> list[Row]:
    say(f"{spec}: profiling")
    profile = measured_profile(spec)
    rows: list[Row] = []
    for strategy in strategies:
        for ratio in ([None] if strategy == "keep-all" else ratios):
            row = check(spec, profile, strategy, ratio, time_limit_s)
            rows.append(row)
            if not row.planned:
                say(f"  {strategy} at {ratio}: no plan")
                continue
            say(f"  {strategy} at {ratio}: allowed {row.allowed_bytes / MIB:.1f} MiB, RSS rise "
                f"{row.rss_rise_bytes / MIB:.1f}, storage {row.storage_rise_bytes / MIB:.1f}, "
                f"{'within' if row.within else 'OVER'}")
    return rows


def run_child(spec: str, profile_path: Path, schedule_path: Path) -> dict:
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec, str(profile_path),
                           str(schedule_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[Row]) -> str:
    lines = ["| workload | strategy | ratio | allowed: budget - resident fixed | simulated | ledger | RSS rise | live storage rise | "
             "host buffers | within (+2% +4 MiB) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:g}"
        name = row.workload.rsplit(":", 1)[-1]
        if not row.planned:
            lines.append(f"| {name} | {row.strategy} | {ratio} | no plan: {row.note} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {row.strategy} | {ratio} | {row.allowed_bytes / MIB:.1f} MiB | {row.simulated_bytes / MIB:.1f} | "
            f"{row.ledger_bytes / MIB:.1f} | {row.rss_rise_bytes / MIB:.1f} | {row.storage_rise_bytes / MIB:.1f} | "
            f"{row.host_bytes / MIB:.1f} | {'yes' if row.within else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append",
                        help="file.py:build specs (default: elementwise, bert_small, resnet18_batch256)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.9, 0.6, 0.5],
                        help="of the keep-all peak (0.9 because ResNet-18-small has no plan at 0.6)")
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_memory.md")
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "PROFILE", "SCHEDULE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    specs = args.workload or ["benchmarks/workloads.py:elementwise", "benchmarks/workloads.py:bert_small",
                              "benchmarks/workloads.py:resnet18_batch256"]
    rows = [row for spec in specs for row in measure(spec, tuple(args.ratios), time_limit_s=args.time_limit)]
    text = table(rows)
    print(text)
    load = Path("/proc/loadavg").read_text().split()[:3]
    command = "python benchmarks/real_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.write_text(
        "# Real memory of planned steps on the CPU\n\n"
        f"Command: `{command.strip()}` (load average {' '.join(load)}; one torch thread; glibc with "
        f"{' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}). How it is measured: the docstring of "
        "`benchmarks/real_memory.py`. Memory in MiB beyond the fixed memory resident before the step (parameters, "
        "inputs, buffers; the gradients are allocated by the step, as after `optimizer.zero_grad()`, so they count "
        "in the rise and in the allowance); host buffers are where offloaded tensors wait (resident since "
        "the warm-up step, the CPU's stand-in for pinned host memory).\n\n" + text + "\n"
    )
    print(f"wrote {args.out}")
    return 0 if all(row.within for row in rows if row.planned) else 1


if __name__ == "__main__":
    raise SystemExit(main())
