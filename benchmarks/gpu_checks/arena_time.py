"""Issue 44's GPU check of what the arena costs in time: one plan, replayed through the allocator and written into
its arena, steps alternating in one process (A B A B ...), so that drift between processes cannot enter the ratio.

The model and budget are held_memory.py's (a LLaMA-style decoder from transformers, built from a config): the
plan is optimize(arena=True)'s within `--cap-mib` (no cap is set on the process: both replays live in it). Per
replay: the fastest and median step, the allocator's peaks, and the plan's summary (what it offloads and
recomputes, the simulated step); for the arena, the nodes the program names as allocating outside it, by reason.
First, one step of each from the same parameters: the loss and every gradient compared bitwise (the arena must
compute exactly what the allocator's replay does), and the nodes a step kept outside the arena at run time.
`--bf16` runs the capture and every forward under bf16 autocast.

    python benchmarks/gpu_checks/arena_time.py [--device cuda] [--cap-mib 15408] [--steps 6] [--bf16]
    python benchmarks/gpu_checks/arena_time.py --device cpu --small --cap-mib 32   # the script's own check
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from held_memory import MIB, build, mixed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cap-mib", type=float, default=15408)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--time-limit", type=float, default=20)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast around the forward and the capture")
    args = parser.parse_args()

    import torch

    import executor
    from executor.replay.replay import PlannedModule

    cuda = args.device == "cuda"
    model, ids, loss_fn = build(args.device, args.small)
    began = time.perf_counter()
    with mixed(args.device, args.bf16):
        arena_step = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=ids,
                                       budget=int(args.cap_mib * MIB), time_limit_s=args.time_limit, progress=False,
                                       cache=False, arena=True, timed_steps=0)  # no timed steps, no re-plan
    print(f"optimize(arena=True): {time.perf_counter() - began:.0f} s; arena refused: {arena_step.arena_refused}",
          flush=True)
    twin = copy.deepcopy(model)
    allocator_step = PlannedModule(twin, arena_step.profile, arena_step.schedule, loss_fn,
                                   profiled=arena_step._prepared.profiled, arena=False, ledger=False)
    replays = {"allocator": (allocator_step, twin), "arena": (arena_step, model)}

    def one_step(planned, owner) -> float:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with mixed(args.device, args.bf16):
            loss = planned(input_ids=ids, targets=ids)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        owner.zero_grad(set_to_none=True)
        return (time.perf_counter() - started) * 1e3

    # the same computation both ways: one step from the same parameters, loss and gradients compared bitwise
    found = {}
    for name, (planned, owner) in replays.items():
        with mixed(args.device, args.bf16):
            loss = planned(input_ids=ids, targets=ids)
        loss.backward()
        found[name] = (loss.detach().clone(), [p.grad.clone() for p in owner.parameters() if p.grad is not None])
        owner.zero_grad(set_to_none=True)
    (loss_a, grads_a), (loss_b, grads_b) = found["allocator"], found["arena"]
    differing = sum(not torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    print(f"arena against allocator: loss {'equal' if torch.equal(loss_a, loss_b) else 'DIFFERENT'}, "
          f"{differing} of {len(grads_a)} gradients differ; kept out of the arena at run time: "
          f"{arena_step.arena_kept_out}", flush=True)
    times = {name: [] for name in replays}
    for _ in range(args.steps):
        for name, (planned, owner) in replays.items():
            times[name].append(one_step(planned, owner))
    ratios = [a / b for a, b in zip(times["arena"], times["allocator"])]
    summary = arena_step.schedule.summary
    print(f"plan: budget {arena_step.schedule.budget_bytes / MIB:.0f} MiB, arena "
          f"{(arena_step.schedule.arena_bytes or 0) / MIB:.0f} MiB, simulated step "
          f"{arena_step.simulated_step_time_ms:.1f} ms; summary {summary.model_dump() if summary else None}")
    for name, values in times.items():
        print(f"{name}: fastest {min(values):.1f} ms, median {statistics.median(values):.1f} ms")
    print(f"arena / allocator, median of pairs: {statistics.median(ratios):.3f}")
    if cuda:
        for name, (planned, owner) in replays.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            one_step(planned, owner)
            print(f"{name}: allocated peak {torch.cuda.max_memory_allocated() / MIB:.0f} MiB, reserved peak "
                  f"{torch.cuda.max_memory_reserved() / MIB:.0f} MiB (both replays' parameters included)")
    reasons = collections.Counter((arena_step.arena_allowances or {}).values())
    print("allocating outside the arena, by reason:", dict(reasons))
    outside = collections.Counter(str(node).split("/")[0] for node in (arena_step.arena_allowances or {}))
    print("by node:", dict(outside.most_common(12)), flush=True)


if __name__ == "__main__":
    main()
