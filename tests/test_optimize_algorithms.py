"""optimize(algorithms=("native",)): the plan never picks a convolution algorithm that is not bitwise plain PyTorch's.

With every algorithm allowed, the profile's timings pick one per convolution, so a run may train with im2col
(gradients equal to rounding) and the next with native, the plan's memory figures the same in both: a Swin at 0.6
with offloads differed from plain PyTorch in 1 of 4 runs of the same script. Restricted to native, every step is
bitwise, whatever the timings and the re-plan say.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import executor  # noqa: E402


def test_native_only_plans_train_bitwise_with_offloads():
    torch.manual_seed(0)
    # a patch embedding (Swin's, ViT's) under activations that dominate the memory, so that 0.6 offloads
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 2, stride=2), torch.nn.Flatten(2), *[torch.nn.Sequential(torch.nn.Linear(64, 64),
        torch.nn.GELU(), torch.nn.Dropout(0.1)) for _ in range(12)], torch.nn.Flatten(), torch.nn.Linear(16 * 64, 4),
    )
    images = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(1))
    loss_fn = torch.nn.functional.cross_entropy
    plain = copy.deepcopy(model)
    planned = executor.optimize(model, (images,), loss_fn, targets=labels, memory_ratio=0.6, strategy="mosos",
                                d2h_gb_per_s=10, h2d_gb_per_s=10, algorithms=("native",), time_limit_s=2,
                                workers=1, repeats=1, warmup=0, cache=False, progress=False)
    assert {impl.name for node in planned.profile.nodes for impl in node.implementations} <= {"native", "default"}
    assert planned.schedule.summary.offloaded_bytes > 0
    assert "conv_forward" not in planned.code and "conv_backward" not in planned.code
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
    for step in range(3):
        torch.manual_seed(step)
        loss = planned(images, targets=labels)
        loss.backward()
        torch.manual_seed(step)
        expected = loss_fn(plain(images), labels)
        expected.backward()
        assert torch.equal(loss.detach(), expected.detach()), f"step {step}"
        for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {name}"
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
