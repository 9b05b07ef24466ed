"""ResNet-18-small float32 on CUDA: a planned step's gradients against plain PyTorch's, with cuDNN's TF32
convolutions (PyTorch's default) and without; the three parameters furthest apart. Tells TF32's rounding (other
convolution algorithms, other roundings) from a replay that computes something else: without TF32 the distance
must fall to eager's own spread.

    python benchmarks/gpu_checks/tf32_convolutions.py                      # batch 2048, eager replay, keep-all
    python benchmarks/gpu_checks/tf32_convolutions.py --batch 32768 --replays compiled-1.0,compiled-0.5 --tf32 false
"""
import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import executor  # noqa: E402
from benchmarks import workloads  # noqa: E402


def grads(m):
    m = getattr(m, "model", m)
    return {k.removeprefix("_orig_mod."): p.grad.detach().double().clone() for k, p in m.named_parameters()
            if p.grad is not None}


def step(m, work):
    for p in getattr(m, "model", m).parameters():
        p.grad = None
    torch.manual_seed(0)
    if hasattr(m, "model"):
        loss = m(*work.inputs, targets=work.targets)
    else:
        loss = work.loss_fn(m(*work.inputs), work.targets)
    loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return grads(m)


def distance(a, b):
    largest = max(v.abs().max().item() for v in b.values())
    worst = []
    for k in b:
        scale = max(b[k].abs().max().item(), 1000 * 1.19e-7 * largest)
        worst.append((float(f"{(a[k] - b[k]).abs().max().item() / scale:.2g}"), k))
    return sorted(worst, reverse=True)[:3]


def algorithms_used(planned) -> dict[str, int]:
    """How many computations (recomputations included) run each implementation."""
    counts: dict[str, int] = {}
    for stage in planned.schedule.stages:
        for operation in stage.operations:
            if operation.op == "compute":
                counts[operation.implementation] = counts.get(operation.implementation, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--replays", default="eager-1.0",
                        help="eager-<ratio>, compiled-<ratio>, torch-compile; comma-separated")
    parser.add_argument("--tf32", default="true,false")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (TF32 is CUDA's)")
    args = parser.parse_args()
    work = workloads.resnet18_small(args.batch)
    device = torch.device(args.device)
    model = work.model.to(device)
    work.inputs = tuple(x.to(device) for x in work.inputs)
    work.targets = work.targets.to(device)
    for tf32 in (flag.strip() == "true" for flag in args.tf32.split(",")):
        torch.backends.cudnn.allow_tf32 = tf32
        plain = copy.deepcopy(model)
        a = step(plain, work)
        b = step(plain, work)
        print(f"tf32={tf32} batch {args.batch}: plain vs plain {distance(b, a)}", flush=True)
        for replay in args.replays.split(","):
            started = time.time()
            if replay == "torch-compile":  # torch.compile's own distance: fusion's rounding, for scale
                compiled = torch.compile(copy.deepcopy(model))
                c, d = step(compiled, work), step(compiled, work)
                print(f"  {replay}: compiled and ran in {time.time() - started:.1f} s; vs plain {distance(c, a)}; "
                      f"vs itself {distance(d, c)}", flush=True)
                continue
            kind, ratio = replay.rsplit("-", 1)
            planned = executor.optimize(copy.deepcopy(model), work.inputs, work.loss_fn, targets=work.targets,
                                        memory_ratio=float(ratio), time_limit_s=10, progress=False, cache=False,
                                        compile=kind == "compiled")
            print(f"  {replay}: optimized in {time.time() - started:.1f} s; algorithms {algorithms_used(planned)}",
                  flush=True)
            c = step(planned, work)
            d = step(planned, work)
            print(f"  {replay}: replay vs plain {distance(c, a)}; replay vs replay {distance(d, c)}", flush=True)
            del planned


if __name__ == "__main__":
    main()
