"""A training script in a process whose memory is capped (RLIMIT_AS): the CPU's stand-in for a GPU too small
for the model. Run by tests/test_budget_promise.py in fresh processes:

    python tests/capped_step.py MODEL MODE BUDGET_MIB HEADROOM_MIB OUT

MODE: `plain` (three plain PyTorch steps, no cap: the reference), `plain-capped` (one plain step under the cap:
must fail with the allocator's error) or `planned` (optimize() with the budget under the cap, then three steps).
The cap is the process's address space once the model is built, plus the budget, plus `HEADROOM_MIB` for what is
not tensor storage (the interpreter's heap during capture, the solver's threads). OUT gets the losses and the
gradients of every step (torch.save), or the error.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

MIB = 1 << 20
STEPS = 3


class TanhChain(nn.Module):
    """12 x tanh(x * s): every activation as large as the input, every operation cheap (issue 21's model)."""

    def __init__(self, layers: int = 12):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.tensor(1.0 + 0.01 * i)) for i in range(layers))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        for scale in self.scales:
            x = torch.tanh(x * scale)
        return self.head(x.reshape(-1, 64))


def build(name: str):
    """(model, inputs, kwargs, targets, loss_fn), deterministic."""
    torch.manual_seed(0)
    if name == "tanh":
        rows = 96 * MIB // 4 // 64  # a 96 MiB float32 activation
        x = torch.randn(rows, 64)
        y = torch.randint(0, 4, (rows,))
        return TanhChain(), (x,), {}, y, F.cross_entropy
    if name == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        # long sequences, few channels: the attention scores and their dropout masks dominate the step
        config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=1024, num_labels=4,
                            attn_implementation="eager")
        model = BertForSequenceClassification(config).train()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 512, (8, 1024), generator=generator)
        labels = torch.randint(0, 4, (8,), generator=generator)
        return model, (), {"input_ids": ids}, labels, lambda out, t: F.cross_entropy(out.logits, t)
    raise SystemExit(f"unknown model {name!r}")


def address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def cap(budget_mib: int, headroom_mib: int) -> int:
    limit = address_space_bytes() + (budget_mib + headroom_mib) * MIB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


def steps(step, model, optimizer) -> dict:
    losses, gradients = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = step()
        loss.backward()
        losses.append(loss.detach().clone())
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return {"losses": losses, "gradients": gradients}


def main() -> None:
    name, mode, budget_mib, headroom_mib, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    model, inputs, kwargs, targets, loss_fn = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict = {"mode": mode}
    if mode == "plain":
        result |= steps(lambda: loss_fn(model(*inputs, **kwargs), targets), model, optimizer)
    elif mode == "plain-capped":
        result["limit_bytes"] = cap(budget_mib, headroom_mib)
        try:
            loss_fn(model(*inputs, **kwargs), targets).backward()
            result["error"] = None
        except (RuntimeError, MemoryError) as error:
            result["error"] = f"{type(error).__name__}: {error}"
    elif mode == "planned":
        import executor

        result["limit_bytes"] = cap(budget_mib, headroom_mib)
        started = time.monotonic()
        planned = executor.optimize(model, inputs, loss_fn, budget=budget_mib * MIB, targets=targets, kwargs=kwargs,
                                    repeats=1, warmup=1, time_limit_s=10, workers=1, progress=False)
        result["optimize_s"] = time.monotonic() - started
        result["measuring"] = planned.profiled_under
        result |= steps(lambda: planned(*inputs, targets=targets, **kwargs), model, optimizer)
        result["ledger_peak_bytes"] = planned.peak_memory_bytes
        result["budget_bytes"] = planned.schedule.budget_bytes
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    torch.save(result, out)
    os._exit(0)  # skip interpreter teardown under the cap


if __name__ == "__main__":
    main()
