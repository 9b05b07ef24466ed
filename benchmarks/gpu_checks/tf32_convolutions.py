"""ResNet-18-small float32 at batch 2048 on CUDA: the eager replay's gradients against plain PyTorch's, with cuDNN's
TF32 convolutions (PyTorch's default) and without; the three parameters furthest apart.

    python benchmarks/gpu_checks/tf32_convolutions.py
"""
import copy, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import torch
import models
import executor

spec = models.get_model("resnet18", small=True)
dev = torch.device("cuda")


def grads(m):
    m = getattr(m, "model", m)
    return {k: p.grad.detach().double().clone() for k, p in m.named_parameters() if p.grad is not None}


def step(m, x, y):
    for p in getattr(m, "model", m).parameters():
        p.grad = None
    torch.manual_seed(0)
    loss = m(x, targets=y) if hasattr(m, "model") else spec.loss(m(x), y)
    loss.backward()
    torch.cuda.synchronize()
    return grads(m)


def distance(a, b):
    largest = max(v.abs().max().item() for v in b.values())
    worst = []
    for k in b:
        scale = max(b[k].abs().max().item(), 1000 * 1.19e-7 * largest)
        worst.append(((a[k] - b[k]).abs().max().item() / scale, k))
    return sorted(worst, reverse=True)[:3]


for tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    model = spec.build().to(dev)
    x, y = spec.example_inputs(2048, device="cuda")
    plain = copy.deepcopy(model)
    started = time.time()
    planned = executor.optimize(copy.deepcopy(model), (x,), spec.loss, targets=y, memory_ratio=1.0, time_limit_s=5,
                                progress=False, cache=False)
    print(f"tf32={tf32}: optimized in {time.time() - started:.1f} s", flush=True)
    a = step(plain, x, y)
    b = step(plain, x, y)
    c = step(planned, x, y)
    d = step(planned, x, y)
    print("  plain vs plain", distance(b, a))
    print("  replay vs plain", distance(c, a))
    print("  replay vs replay", distance(d, c), flush=True)
    # a planned step's convolutions by themselves: the replay's source lines for the stem
    torch.backends.cudnn.deterministic = True
    e = step(plain, x, y)
    f = step(planned, x, y)
    print("  deterministic cuDNN: replay vs plain", distance(f, e), flush=True)
    torch.backends.cudnn.deterministic = False
