"""Issue 11's planning-node targets: a standard layer is no longer one opaque node.

Two `nn.TransformerEncoderLayer`s (the fx capture's plan floor was 0.95 of the keep-all peak) and BERT from
a config plan at 0.6 of keep-all, and the planned step still trains exactly like plain PyTorch.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from executor.measure.profiler import profile_step  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402


class EncoderStack(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def _encoder_stack():
    torch.manual_seed(0)
    model = EncoderStack().train()
    x = torch.randn(8, 32, 64)
    labels = torch.randint(0, 5, (8,))
    return model, (x,), {}, labels, nn.functional.cross_entropy


def _bert():
    pytest.importorskip("transformers")
    from tests.zoo import build_bert

    return build_bert(torch.float32)


@pytest.mark.parametrize("build", [_encoder_stack, _bert], ids=["transformer-encoder-x2", "bert"])
def test_standard_layers_plan_at_six_tenths_of_keep_all(build):
    model, args, kwargs, targets, loss_fn = build()
    profile, captured = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0,
                                     algorithms=("native",), d2h_gb_per_s=10, h2d_gb_per_s=10)
    # inside a layer: attention, its softmax and dropout, the MLP, the norms are planning nodes of their own
    assert len(profile.nodes) > 40
    keep_all = keep_all_peak_bytes(profile)
    for strategy in ("mosos", "recompute-only"):
        schedule = plan(profile, memory_ratio=0.6, strategy=strategy, time_limit_s=3, workers=1, seed=0)
        assert schedule.budget_bytes <= 0.6 * keep_all + 1
        planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, schedule, loss_fn, profiled=captured)
        torch.manual_seed(1)
        loss = planned(*args, targets=targets, **kwargs)
        loss.backward()
        torch.manual_seed(1)
        plain = loss_fn(plain_model(*args, **kwargs), targets)
        plain.backward()
        assert torch.equal(loss.detach(), plain.detach()), strategy
        for (key, a), (_, b) in zip(planned_model.named_parameters(), plain_model.named_parameters()):
            assert torch.equal(a.grad, b.grad), f"{strategy}: {key}"
        assert planned.peak_memory_bytes == planned.simulated_peak_bytes <= schedule.budget_bytes
