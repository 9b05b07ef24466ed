"""BERT (the frontier's GPU workload): which attention kernels the capture holds against eager's, and the eager
replay's gradients against plain PyTorch's with and without dropout (frontier.gradient_error).

    python benchmarks/gpu_checks/attention_paths.py [cuda|cpu]
"""
import copy, sys, time
from collections import Counter
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import torch
import executor
from benchmarks.frontier import workload, gradient_error

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
hidden_small = device == "cpu"


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


def step(m, work, planned):
    for p in (m.model if planned else m).parameters():
        p.grad = None
    torch.manual_seed(0)
    if planned:
        loss = m(*work["inputs"], targets=work["targets"], **work["kwargs"])
    else:
        loss = work["loss_fn"](m(*work["inputs"], **work["kwargs"]), work["targets"])
    loss.backward()
    sync()
    return [p.grad.detach().clone() for p in (m.model if planned else m).parameters()]


def no_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("dropout_prob", "attention_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model


for dropout in (True, False):
    work = workload("bert", device)
    if not dropout:
        no_dropout(work["model"])
    model = work["model"]
    started = time.time()
    planned = executor.optimize(copy.deepcopy(model), work["inputs"], work["loss_fn"], targets=work["targets"],
                                kwargs=work["kwargs"], memory_ratio=1.0, time_limit_s=5, progress=False, cache=False)
    print(f"dropout={dropout}: optimized in {time.time() - started:.1f} s", flush=True)
    graph = planned._prepared.profiled.step.graph
    ops = Counter(str(n.target) for n in graph.nodes if n.op == "call_function"
                  and any(k in str(n.target) for k in ("attention", "softmax", "dropout", "bmm", "rand")))
    print("  captured:", dict(ops))
    with torch.profiler.profile() as prof:
        step(model, work, False)
    names = Counter(e.key for e in prof.key_averages() if any(k in e.key for k in ("attention", "softmax",
                                                                                     "dropout", "bmm", "rand")))
    print("  eager:", {k: v for k, v in names.items()})
    a = step(model, work, False)
    b = step(model, work, False)
    c = step(planned, work, True)
    print(f"  plain vs plain {gradient_error(b, a):.2e}; replay vs plain {gradient_error(c, a):.2e}", flush=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(model, work, False)
        print(f"  eager peak rise {(torch.cuda.max_memory_allocated() - before) / 2**20:.0f} MiB")
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(planned, work, True)
        print(f"  mosos keep-all peak rise {(torch.cuda.max_memory_allocated() - before) / 2**20:.0f} MiB")
    if device == "cuda":  # paired: eager and the planned keep-all step alternate, the fastest of each kept
        times = {"eager": [], "mosos": []}
        for _ in range(8):
            for name, runs in (("eager", (model, False)), ("mosos", (planned, True))):
                began = time.perf_counter()
                step(runs[0], work, runs[1])
                times[name].append((time.perf_counter() - began) * 1e3)
        print(f"  step ms, fastest of 8: eager {min(times['eager'][1:]):.1f}, mosos keep-all "
              f"{min(times['mosos'][1:]):.1f} ({min(times['mosos'][1:]) / min(times['eager'][1:]):.2f}x)")
    print("  attention notes:", planned.attention_notes, flush=True)
    del planned, work, model
