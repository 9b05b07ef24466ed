"""Issue 44's GPU check: does a planned step fit a device the size of its budget?

A LLaMA-style decoder from transformers (built from a config, nothing downloaded) trains under a cap equal to the
budget (`torch.cuda.set_per_process_memory_fraction`, as a smaller GPU would cap it), each configuration in a fresh
process (a cap cannot be lifted): plain PyTorch (expected to run out of memory), transformers' per-block gradient
checkpointing, mosos' optimize(budget=cap), and mosos again under the caching allocator's expandable segments
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which maps pages into one growing segment instead of
reserving segments of many sizes), and mosos writing into its arena (`optimize(arena=True)`: each node's
outputs in the slot its planned address names, the arena allocated once: the fragmentation planned addresses are
meant to remove). Per configuration:
out of memory or not, the step time, the allocator's peaks (allocated, reserved), what the device held outside
the allocator, and mosos' own held-memory record (`planned.held_memory`: steps over the budget, re-plans within
less).

    python benchmarks/gpu_checks/held_memory.py [--device cuda] [--ratio 0.5] [--steps 6] [--bf16] [--write]
    python benchmarks/gpu_checks/held_memory.py --device cpu --small   # the script's own check, no cap

The budget is `ratio` of plain PyTorch's held peak (reserved plus outside the allocator), measured first, uncapped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "gpu_held_memory.md"
MIB = 2**20


def build(device: str, small: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if small:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
        batch, length = 4, 64
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
        batch, length = 8, 2048
    model = LlamaForCausalLM(config).train().to(device)
    ids = torch.randint(0, config.vocab_size, (batch, length), device=device)

    def loss_fn(output, labels):
        logits = output.logits if hasattr(output, "logits") else output[0]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return model, ids, loss_fn


def held(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.max_memory_reserved()
    return {"allocated_peak_mib": torch.cuda.max_memory_allocated() / MIB, "reserved_peak_mib": reserved / MIB,
            "outside_mib": max(0, total - free - torch.cuda.memory_reserved()) / MIB}


def mixed(device: str, bf16: bool):
    """bf16 autocast around the forward (and the capture), as a user training in mixed precision has it."""
    import contextlib

    import torch

    return torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def one(kind: str, device: str, cap_bytes: int | None, steps: int, small: bool, time_limit_s: float = 60,
        bf16: bool = False) -> dict:
    """One configuration in this (fresh) process: returns its figures."""
    import torch

    if device == "cuda":
        torch.cuda.init()
        if cap_bytes is not None:
            total = torch.cuda.mem_get_info()[1]
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
    model, ids, loss_fn = build(device, small)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    planned = None
    if kind == "checkpoint":
        model.gradient_checkpointing_enable()
    if kind.startswith("mosos"):
        import executor

        began = time.perf_counter()
        try:
            with mixed(device, bf16):
                planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=ids,
                                            budget=cap_bytes, time_limit_s=time_limit_s, progress=False,
                                            cache=False, arena=kind == "mosos-arena")
        except torch.OutOfMemoryError as error:
            message = str(error).splitlines()[0][:200]
            return {"kind": kind, "oom": True, "steps": 0, "error": f"in optimize(): {message}", **held(device)}
        optimize_s = time.perf_counter() - began
    times_ms = []
    try:
        for _ in range(steps):
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with mixed(device, bf16):
                loss = (planned(input_ids=ids, targets=ids) if planned is not None
                        else loss_fn(model(input_ids=ids), ids))
            loss.backward()
            optimizer.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times_ms.append((time.perf_counter() - began) * 1e3)
            if planned is not None:
                planned.wait_for_replan(120)
    except torch.OutOfMemoryError as error:
        return {"kind": kind, "oom": True, "steps": len(times_ms), "error": str(error).splitlines()[0][:200],
                **held(device)}
    found = {"kind": kind, "oom": False, "steps": len(times_ms), "step_ms": min(times_ms[1:] or times_ms),
             **held(device)}
    if planned is not None and planned.held_memory is not None:
        found["mosos_held"] = planned.held_memory.describe()
        found["plan_budget_mib"] = planned.schedule.budget_bytes / MIB
    if planned is not None:
        found["optimize_s"] = optimize_s
        found["arena_refused"] = planned.arena_refused
    return found


# configurations run in a process with these allocator settings (set before CUDA starts)
ALLOCATOR_CONF = {"mosos-expandable": "expandable_segments:True"}


def run(kind: str, args, cap_bytes: int | None) -> dict:
    import os

    environment = dict(os.environ)
    if kind in ALLOCATOR_CONF:
        environment["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_CONF[kind]
    command = [sys.executable, __file__, "--one", kind, "--device", args.device, "--steps", str(args.steps),
               "--time-limit", str(args.time_limit)] + (["--bf16"] if args.bf16 else [])
    if cap_bytes is not None:
        command += ["--cap-bytes", str(cap_bytes)]
    if args.small:
        command.append("--small")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout, env=environment)
    except subprocess.TimeoutExpired as expired:
        return {"kind": kind, "oom": None, "error": f"no result within {args.run_timeout} s: "
                f"{(expired.stderr or b'')[-300:]!r}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"kind": kind, "oom": None, "error": (done.stderr or done.stdout)[-400:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--kinds", default="plain,checkpoint,mosos,mosos-expandable,mosos-arena",
                        help="the capped configurations to run, in this order (comma-separated)")
    parser.add_argument("--time-limit", type=float, default=60, help="optimize()'s time_limit_s")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds one configuration may take")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast around every configuration's forward")
    parser.add_argument("--cap-mib", type=float, help="the cap, as measured by an earlier run (skips plain's)")
    parser.add_argument("--one")
    parser.add_argument("--cap-bytes", type=int)
    args = parser.parse_args()
    if args.one:
        found = one(args.one, args.device, args.cap_bytes, args.steps, args.small, args.time_limit, args.bf16)
        print(json.dumps(found), flush=True)
        return
    plain = run("plain", args, None) if args.cap_mib is None else {}
    print("uncapped plain:", plain, flush=True)
    if args.cap_mib is not None:  # a cap measured before: plain's uncapped run is skipped
        held_peak = args.cap_mib / args.ratio * MIB
    elif args.device == "cuda":
        held_peak = (plain["reserved_peak_mib"] + plain["outside_mib"]) * MIB
    else:
        held_peak = 64 * MIB  # no cap on the CPU: the script's own check
    cap = int(args.ratio * held_peak)
    rows = []
    for kind in args.kinds.split(","):
        rows.append(run(kind, args, cap))
        print("capped:", rows[-1], flush=True)  # each row as it comes: a run cut short keeps the ones before
    table = ["| configuration | out of memory | steps | step ms | allocated MiB | reserved MiB | outside MiB | mosos |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        table.append(f"| {row['kind']} | {row.get('oom')} | {row.get('steps', '')} | {row.get('step_ms', 0):.1f} | "
                     f"{row.get('allocated_peak_mib', 0):.0f} | {row.get('reserved_peak_mib', 0):.0f} | "
                     f"{row.get('outside_mib', 0):.0f} | {row.get('mosos_held', row.get('error', ''))}"
                     f"{'; arena refused: ' + row['arena_refused'] if row.get('arena_refused') else ''}"
                     f"{'; optimize() %.0f s' % row['optimize_s'] if 'optimize_s' in row else ''} |")
    text = (f"cap {cap / MIB:.0f} MiB = {args.ratio} of plain's uncapped held peak "
            f"({held_peak / MIB:.0f} MiB), {args.device}\n\n" + "\n".join(table))
    print(text)
    if args.write:
        # a section added at the end: the file keeps the runs before it and what was read from them
        title = "# A planned step under a cap equal to its budget (issue 44)\n"
        earlier = RESULTS.read_text() if RESULTS.exists() else title
        command = " ".join(["python", "benchmarks/gpu_checks/held_memory.py", *sys.argv[1:]])
        RESULTS.write_text(earlier.rstrip("\n") + f"\n\n## `{command}` "
                           f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n{text}\n")


if __name__ == "__main__":
    main()
