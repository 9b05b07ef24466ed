"""Train a model a few steps under a memory budget, next to plain PyTorch.

    python3 examples/train.py --model vgg19 --small --batch 32 --memory-ratio 0.7 --steps 3
    python3 examples/train.py --model resnet50 --batch 64 --budget 6GiB --device cuda
    python3 examples/train.py --model path/to/my_model.py:build --memory-ratio 0.6

`--model` is a reference network's name or your own workload (`file.py:build`
or `package.module:build`, see models/workload.py).

Both runs start from the same weights and see the same batches and random
numbers, so their losses should agree step by step. Peak memory is
torch.cuda.max_memory_allocated on a GPU; on the CPU, the executor's
byte-exact ledger for the planned run, and the simulated keep-all peak for
plain PyTorch (which the CPU cannot measure).

With `--budget`, the budget holds for the whole run, capture, profiling and
planning included: plain PyTorch runs beside the plan only where its step (and
the copy of the model it trains) fits in what the budget leaves, unless
`--compare-plain` asks for it anyway; the last line gives the peak of the
whole run against the budget.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import executor  # noqa: E402
from executor.replay.reference import load  # noqa: E402
from models.workload import looks_like_spec  # noqa: E402
from planner.errors import MososError  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402
from planner.units import format_bytes  # noqa: E402


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg19", help="a reference network or path/to/file.py:build")
    parser.add_argument("--small", action="store_true", help="the small variant (CPU-sized)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (reference networks: default 32)")
    parser.add_argument("--budget", default=None, help="device memory budget, e.g. 6GiB")
    parser.add_argument("--memory-ratio", type=float, default=None, help="budget as a fraction of the keep-all peak")
    parser.add_argument("--strategy", default="mosos")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--time-limit", type=float, default=30.0, help="planner time limit, seconds")
    parser.add_argument("--planner-url", default=None, help="plan on a mosos service instead of locally")
    parser.add_argument("--d2h-gb-per-s", type=float, default=None, help="CPU: assumed copy bandwidth (default 10)")
    parser.add_argument("--h2d-gb-per-s", type=float, default=None)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--compile", action="store_true",
                        help="run the planning nodes as Inductor kernels (equal to plain PyTorch to rounding)")
    parser.add_argument("--arena", action=argparse.BooleanOptionalAction, default=None,
                        help="write every node's outputs into the plan's arena (planned addresses), allocated once "
                             "(default: on a GPU, not on the CPU)")
    parser.add_argument("--split-loss", action="store_true",
                        help="a language model's cross-entropy over chunks of rows, its logits never whole (equal to "
                             "plain PyTorch to rounding)")
    parser.add_argument("--compare-plain", action="store_true",
                        help="with --budget: run plain PyTorch beside the plan even where it does not fit the budget")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    if args.budget is not None and args.memory_ratio is not None:
        parser.error("give --budget or --memory-ratio, not both")
    if args.budget is None and args.memory_ratio is None:
        args.memory_ratio = 0.7
    return args


def _peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def main() -> int:
    args = _arguments()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if device.type == "cpu":
        args.d2h_gb_per_s = args.d2h_gb_per_s or 10.0
        args.h2d_gb_per_s = args.h2d_gb_per_s or 10.0
    try:
        if looks_like_spec(args.model):
            workload = load(None, args.model, args.batch, device=device.type)
        else:
            workload = load(args.model, None, args.batch or 32, device=device.type, small=args.small)
    except MososError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model, inputs, kwargs, targets, loss_fn = (workload.model, workload.inputs, workload.kwargs, workload.targets,
                                               workload.loss_fn)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the budget holds from here: capture, profiling, planning, training
    try:
        planned = executor.optimize(
            model, inputs, loss_fn, budget=args.budget, targets=targets, kwargs=kwargs,
            memory_ratio=args.memory_ratio, strategy=args.strategy, planner_url=args.planner_url,
            time_limit_s=args.time_limit, optimizer="momentum", d2h_gb_per_s=args.d2h_gb_per_s,
            h2d_gb_per_s=args.h2d_gb_per_s, compile=args.compile, arena=args.arena, split_loss=args.split_loss,
        )
    except MososError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plain_fits = args.budget is None or (
        keep_all_peak_bytes(planned.profile) + planned.profile.fixed_bytes <= planned.schedule.budget_bytes)
    compare = plain_fits or args.compare_plain
    plain_model = copy.deepcopy(model) if compare else None
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=args.lr, momentum=0.9) if compare else None
    planned_opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def run(step_model, optimizer, seed):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        if step_model is planned:
            loss = planned(*inputs, targets=targets, **kwargs)
        else:
            output = step_model(*inputs, **kwargs)
            loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss.item(), (time.perf_counter() - start) * 1e3, _peak(device.type)

    summary = planned.schedule.summary
    print(f"\n{workload.name}, {device.type}; plan: "
          f"{summary.strategy}, budget {format_bytes(planned.schedule.budget_bytes)}, predicted step "
          f"{summary.predicted_step_time_ms:.2f} ms, predicted peak {format_bytes(summary.peak_memory_bytes)}")
    if planned.compiled_nodes is not None:
        print(f"compiled: {planned.compiled_nodes.describe()}")
    for note in planned.loss_notes:
        print(f"loss: {note}")
    if planned.arena_enabled:
        if planned.arena_refused is not None:
            print(f"arena: not used: {planned.arena_refused}")
        else:
            allowances = planned.arena_allowances
            print(f"arena: {format_bytes(planned.schedule.arena_bytes)} (planned addresses); {len(allowances)} nodes "
                  "still allocate for themselves (planned.arena_allowances)")
    plain_peak_note = format_bytes(keep_all_peak_bytes(planned.profile)) + " (simulated keep-all)"
    print(f"{'step':>4}  {'plain loss':>12}  {'planned loss':>12}  {'plain ms':>9}  {'planned ms':>10}  "
          f"{'plain peak':>26}  {'planned peak':>14}")
    if not compare:
        print(f"plain PyTorch not run: its step and its copy of the model need "
              f"{format_bytes(keep_all_peak_bytes(planned.profile) + planned.profile.fixed_bytes)}, over the budget "
              "(--compare-plain runs it anyway)")
    run_peak = planned.profiled_peak_bytes or 0  # the measuring passes, by the measured figures
    for step in range(args.steps):
        if compare:
            plain_loss, plain_ms, plain_peak = run(plain_model, plain_opt, 100 + step)
        planned_loss, planned_ms, planned_peak = run(planned, planned_opt, 100 + step)
        if planned_peak is None:
            planned_peak = planned.peak_memory_bytes
        run_peak = max(run_peak, planned_peak or 0)
        if not compare:
            plain_loss, plain_ms, plain_text = float("nan"), float("nan"), "not run"
        else:
            plain_text = format_bytes(plain_peak) if plain_peak is not None else plain_peak_note
        print(f"{step:>4}  {plain_loss:>12.6f}  {planned_loss:>12.6f}  {plain_ms:>9.1f}  {planned_ms:>10.1f}  "
              f"{plain_text:>26}  {format_bytes(planned_peak):>14}")
    if args.budget is not None:
        how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "the ledger and the measuring passes"
        if device.type == "cuda" and not compare:
            run_peak = torch.cuda.max_memory_allocated()
        within = run_peak <= planned.schedule.budget_bytes
        print(f"peak of the whole run ({how}): {format_bytes(run_peak)} of the budget "
              f"{format_bytes(planned.schedule.budget_bytes)}" + ("" if within else ": OVER THE BUDGET"))
        if not within and not compare:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
