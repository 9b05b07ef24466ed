"""How big the planner's graph is and what capturing costs: joint-graph operations, planning nodes, capture
time and memory, for BERT-base (12 layers, hidden 768, sequence 512, batch 1) and smaller models.

Each workload is captured in a fresh process (`--child`) so that its memory is its own: the peak RSS rise of
`executor.measure.profiler.plan_step` (torch.export, the joint graph, grouping into planning nodes) over the resident
set after the model and its inputs are built.

    python benchmarks/capture_scale.py        # writes benchmarks/results/capture.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS = ("benchmarks/workloads.py:bert_small", "benchmarks/workloads.py:bert_base",
             "benchmarks/workloads.py:resnet18_small")
MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def child(spec: str) -> dict:
    import torch

    from executor.measure.profiler import plan_step
    from models.workload import load_workload

    torch.set_num_threads(1)
    workload = load_workload(spec)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = time.perf_counter()
    profiled = plan_step(workload.model, workload.inputs, workload.kwargs, workload.targets, workload.loss_fn)
    seconds = time.perf_counter() - start
    rise = (_status_kib("VmHWM") - before) * 1024
    step, planning = profiled.step, profiled.planning
    operations = sum(1 for n in step.graph.nodes if n.op == "call_function")
    groups = planning.groups
    forward = sum(1 for g in groups if g.kind == "forward")
    parameters = sum(p.numel() for p in workload.model.parameters())
    return {"spec": spec, "parameters": parameters, "operations": operations, "planning_nodes": len(groups),
            "forward_nodes": forward, "seconds": seconds, "export_seconds": step.export_seconds,
            "joint_seconds": step.joint_seconds, "rss_rise_bytes": rise,
            "input_signature": step.input_signature}


def run_child(spec: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"capturing {spec} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "capture.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    load = Path("/proc/loadavg").read_text().split()[:3]
    rows = []
    for spec in args.workload or WORKLOADS:
        result = run_child(spec)
        rows.append(result)
        print(json.dumps(result))
    lines = ["| workload | inputs | parameters | joint-graph ATen ops | planning nodes (forward) | capture (s): export + joint "
             "+ grouping | capture peak RSS rise |", "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        grouping = r["seconds"] - r["export_seconds"] - r["joint_seconds"]
        lines.append(f"| {r['spec'].rsplit(':', 1)[-1]} | {r['input_signature']} | {r['parameters'] / 1e6:.1f} M | "
                     f"{r['operations']} | {r['planning_nodes']} ({r['forward_nodes']}) | {r['seconds']:.1f}: {r['export_seconds']:.1f} + "
                     f"{r['joint_seconds']:.1f} + {grouping:.1f} | {r['rss_rise_bytes'] / MIB:.0f} MiB |")
    command = "python benchmarks/capture_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = ("# Capture: graph size, time and memory\n\n"
            f"Command: `{command.strip()}` (load average {' '.join(load)}, one torch thread, each workload in a fresh "
            "process). Planning nodes: the joint graph's ATen operations grouped by the rule in docs/executor.md "
            "(\"Planning nodes\"). Capture peak RSS rise: the process's peak resident set during `plan_step` "
            "(torch.export, AOTAutograd's joint graph, one run on fake tensors to learn sizes and aliases, "
            "grouping) above what the built model and its inputs already held.\n\n" + "\n".join(lines) + "\n")
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
