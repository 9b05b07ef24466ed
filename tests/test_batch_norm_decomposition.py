"""Batch norm inside a compiled kernel computes as ATen's CPU kernel does (executor.engine.batch_norm_decomposition):
the forward bit for bit, the backward within a few roundings; elsewhere ATen's own kernel is called."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from executor.measure import profiler  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from executor.engine import compiled_nodes  # noqa: E402
from executor.engine.batch_norm_decomposition import batch_norm_backward, batch_norm_forward  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from planner.planning import plan  # noqa: E402
from tests.test_compiled_nodes import Normalised  # noqa: E402

_aten = torch.ops.aten


def _training_graph(shape):
    """A batch norm's forward (as a captured training graph holds it) and its backward, as one fx graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, grad, weight, bias, running_mean, running_var):
        forward = _aten._native_batch_norm_legit_functional.default(x, weight, bias, running_mean, running_var, True,
                                                                      0.1, 1e-5)
        backward = _aten.native_batch_norm_backward.default(grad, x, weight, running_mean, running_var, forward[1],
                                                            forward[2], True, 1e-5, [True, True, True])
        return tuple(forward) + tuple(backward)

    channels = shape[1]
    with torch._subclasses.fake_tensor.FakeTensorMode():
        examples = [torch.empty(shape), torch.empty(shape)] + [torch.empty(channels) for _ in range(4)]
    return make_fx(step, tracing_mode="fake")(*examples), examples


def _aten_step(x, grad, weight, bias, running_mean, running_var):
    running_mean, running_var = running_mean.clone(), running_var.clone()
    output, mean, invstd = _aten.native_batch_norm(x, weight, bias, running_mean, running_var, True, 0.1, 1e-5)
    gradients = _aten.native_batch_norm_backward(grad, x, weight, running_mean, running_var, mean, invstd, True,
                                                 1e-5, [True, True, True])
    return (output, mean, invstd, running_mean, running_var) + tuple(gradients)


@pytest.mark.parametrize("shape", [(32, 8, 12, 12), (16, 4, 7, 5), (8, 6, 50)], ids=["2d", "odd image", "1d"])
def test_a_compiled_batch_norm_is_atens_forward_bit_for_bit_and_its_backward_within_roundings(shape):
    """Its output, statistics and running statistics bitwise (sums in double, ATen's arithmetic, its contraction);
    gradients whose terms nearly cancel (the case where Inductor's own float32 sums moved a ResNet's weight
    gradients by 1e-2) within 2e-6 of the largest; and no ATen batch norm kernel runs in the compiled call."""
    torch.manual_seed(0)
    channels = shape[1]
    x = torch.randn(shape) * 3 + 1
    grad = torch.randn(shape) * 1e-3 + 0.01
    weight, bias = torch.rand(channels) + 0.5, torch.randn(channels)
    running_mean, running_var = torch.randn(channels), torch.rand(channels) + 0.5
    module, examples = _training_graph(shape)
    kernel = compiled_nodes._Kernel(module, examples, f"test batch norm {shape}")
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        got = kernel.compiled(x, grad, weight, bias, running_mean, running_var)
    ran = {event.name for event in profiled.events()}
    assert not [name for name in ran if "batch_norm" in name], sorted(ran)
    expected = _aten_step(x, grad, weight, bias, running_mean, running_var)
    names = ["output", "mean", "invstd", "running mean", "running var", "input's gradient", "weight's gradient",
             "bias's gradient"]
    for name, value, reference in zip(names[:5], got[:5], expected[:5]):
        assert torch.equal(value, reference), (name, (value - reference).abs().max().item())
    for name, value, reference in zip(names[5:], got[5:], expected[5:]):
        distance = ((value - reference).abs().max() / reference.abs().max()).item()
        assert distance <= 2e-6, (name, distance)


def _real(shape, memory_format=torch.contiguous_format, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype).contiguous(memory_format=memory_format)


@pytest.mark.parametrize("case", ["channels-last", "N x C x 1 x 1", "bfloat16", "evaluation", "no weight",
                                  "two dimensions"])
def test_off_atens_double_path_batch_norm_is_left_to_atens_kernel(case):
    """ATen sums in float32 on its channels-last kernels (taken for an N x C x 1 x 1 tensor, and for N x C, too) and
    for lower precisions: there the decomposition declines, and Inductor calls ATen's own kernel."""
    shape = {"N x C x 1 x 1": (8, 4, 1, 1), "two dimensions": (8, 4)}.get(case, (8, 4, 6, 6))
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    x = _real(shape, torch.channels_last if case == "channels-last" else torch.contiguous_format, dtype)
    weight = None if case == "no weight" else torch.ones(4)
    stats = torch.zeros(4), torch.ones(4)
    training = case != "evaluation"
    assert batch_norm_forward(x, weight, torch.zeros(4), *stats, training, 0.1, 1e-5) is NotImplemented
    assert batch_norm_backward(x, x, weight, *stats, torch.zeros(4), torch.ones(4), training, 1e-5,
                               [True, True, True]) is NotImplemented


def test_plain_nchw_batch_norm_is_decomposed():
    """The check above is not vacuous: the plain case is taken."""
    x = _real((8, 4, 6, 6))
    stats = torch.zeros(4), torch.ones(4)
    assert batch_norm_forward(x, torch.ones(4), torch.zeros(4), *stats, True, 0.1, 1e-5) is not NotImplemented


class _NarrowNormalised(Normalised):
    """`Normalised` with 4 channels. A batch norm's backward holds one fusable operation, so it compiles only inside
    a region, and a region is allowed only within the step's peak, set here by a convolution backward's oneDNN
    scratch. oneDNN blocks channels by 8 (AVX2) or 16 (AVX-512) and pads to the block: with 8 channels AVX2 pads
    nothing, the peak is lower, and the regions stop before both batch norm backwards. 4 channels are padded on
    either ISA."""

    def __init__(self):
        super().__init__()
        self.a, self.a_norm = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b, self.b_norm = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 4)


def test_a_compiled_cnn_step_fuses_its_batch_norms_and_trains_as_plain_pytorch(monkeypatch):
    """Convolutions, batch norms and ReLUs under the compiled replay: the batch norms run in Inductor's kernels
    (no ATen batch norm call in the step), the gradients within the compiled replay's 1e-5 of plain PyTorch's, and
    the running statistics bitwise after two steps."""
    monkeypatch.setattr(profiler, "_eager_pass", lambda *args, **kwargs: [])  # every compiled node runs its kernel
    torch.manual_seed(0)
    model = _NarrowNormalised()
    x, y = torch.randn(64, 3, 16, 16), torch.randint(0, 4, (64,))
    profile_, captured = profile_step(copy.deepcopy(model), (x,), nn.functional.cross_entropy, y, repeats=1,
                                      warmup=0, algorithms=("native",), compile=True)
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile_, plan(profile_, strategy="keep-all"), nn.functional.cross_entropy,
                            profiled=captured, compile=True)
    for step in range(2):
        planned_model.zero_grad(set_to_none=True)
        plain_model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            loss = planned(x, targets=y)
            loss.backward()
        nn.functional.cross_entropy(plain_model(x), y).backward()
    record = planned.compiled_nodes
    eager_norms = sorted(node for node in record.eager if "batch_norm" in node)
    assert not eager_norms, ("premise: every batch norm node compiled (a region)", eager_norms, record.describe())
    ran = sorted({event.name for event in profiled.events() if "batch_norm" in event.name})
    assert not ran, (ran, planned.compiled_nodes.describe())
    largest = max(p.grad.abs().max().item() for p in plain_model.parameters())
    for (name, parameter), plain in zip(planned_model.named_parameters(), plain_model.parameters()):
        difference = (parameter.grad - plain.grad).abs().max().item()
        assert difference <= 1e-5 * max(plain.grad.abs().max().item(), 1e-3 * largest), (name, difference)
    for (name, buffer), plain in zip(planned_model.named_buffers(), plain_model.buffers()):
        assert torch.equal(buffer, plain), name
