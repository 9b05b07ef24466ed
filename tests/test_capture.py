"""Capture through torch.export: what it refuses (with the module, the line and what to change) and what it
handles that the fx capture got wrong (in-place operations, mutated inputs)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from executor.capture.capture import capture  # noqa: E402
from executor.errors import CaptureError  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from executor.engine.schedules import recompute_everything_schedule  # noqa: E402
from planner.planning import plan  # noqa: E402


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.lin(x))


class _Branch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class _Item(nn.Module):
    def forward(self, x):
        scale = x.abs().max().item()
        return x / scale


class _Mask(nn.Module):
    def forward(self, x):
        return x[x > 0].reshape(-1, 2)


def _refusal(inner: nn.Module) -> str:
    with pytest.raises(CaptureError) as error:
        capture(_Outer(inner), (torch.randn(2, 4),), None, None, lambda out: out.sum())
    message = str(error.value)
    assert "Traceback" not in message and "\n" not in message
    return message


def test_data_dependent_control_flow_is_refused_with_the_module_and_the_line():
    message = _refusal(_Branch())
    assert "module inner (_Branch)" in message
    assert "test_capture.py" in message and "if x.sum() > 0" in message
    assert "torch.where" in message


def test_item_is_refused_with_the_module_and_the_line():
    message = _refusal(_Item())
    assert "_Item" in message and "x.abs().max().item()" in message and "keep" in message


def test_shapes_that_depend_on_values_are_refused():
    message = _refusal(_Mask())
    assert "_Mask" in message and "x[x > 0]" in message


def test_a_backward_that_fails_in_plain_pytorch_too_is_refused():
    class Overwrites(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = torch.sigmoid(self.lin(x))
            y.mul_(2)  # sigmoid's backward needs its output
            return y

    with pytest.raises(CaptureError, match="plain PyTorch's backward fails on this model too") as error:
        capture(Overwrites(), (torch.randn(2, 4),), None, None, lambda out: out.sum())
    assert "y.mul_(2)" in str(error.value) or "in-place" in str(error.value)


def test_inputs_the_model_cannot_take_are_named_as_such_not_as_a_capture_problem():
    """A workload whose inputs do not fit its model fails in plain PyTorch too: the message says so and names the
    module, instead of advising a rewrite for torch.export; checking runs on fake tensors and leaves the model be."""
    model = nn.Sequential(nn.BatchNorm1d(9), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    running_mean = model[0].running_mean.clone()
    with pytest.raises(CaptureError) as error:
        capture(model, (torch.randn(4, 9),), None, torch.tensor([0, 1, 0, 1]), nn.CrossEntropyLoss())
    message = str(error.value)
    assert message.startswith("Sequential fails on these inputs in module 1 (Linear), in plain PyTorch as well")
    assert "[4, 9] X [8, 16]" in message and "Inputs float32[4,9], targets int64[4]" in message
    assert "torch.export" not in message
    assert torch.equal(model[0].running_mean, running_mean) and int(model[0].num_batches_tracked) == 0

    with pytest.raises(CaptureError, match=r"in module loss \(CrossEntropyLoss\), in plain PyTorch as well: "
                                           r"AssertionError: 0D or 1D target tensor expected"):
        capture(model[1:], (torch.randn(4, 8),), None, torch.zeros(4, 3, dtype=torch.long), nn.CrossEntropyLoss())

    # export words this mismatch otherwise ("Attempting to broadcast a dimension of length 3"), and the user was
    # told to rewrite the loss for torch.export: plain PyTorch's own words now, in the same module
    with pytest.raises(CaptureError, match=r"Linear fails on these inputs in module loss \(MSELoss\), in plain "
                                           r"PyTorch as well: RuntimeError: The size of tensor a \(2\) must match"):
        capture(nn.Linear(4, 2), (torch.randn(2, 4),), None, torch.randn(2, 3), nn.MSELoss())


class _StraightThrough(torch.autograd.Function):
    """Quantisation-aware training's rounding: the forward rounds, the backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, gradient):
        return gradient


class _Quantised(nn.Module):
    def forward(self, x):
        return _StraightThrough.apply(x)


def test_a_custom_autograd_function_is_refused_since_its_backward_would_be_lost():
    message = _refusal(_Quantised())
    assert "custom autograd.Function _StraightThrough (test_capture.py:" in message
    assert "replace with the derivative of its forward" in message


class _ScalesItsGradient(nn.Module):
    def forward(self, x):
        hidden = torch.tanh(x)
        hidden.register_hook(lambda gradient: gradient * 10)  # eager multiplies the gradient below by 10
        return hidden


def test_a_hook_on_a_tensor_of_the_step_is_refused_since_the_replay_would_never_call_it():
    """A hook registered on an activation (in the model) or an output (in the loss function) was dropped by the
    capture: a gradient 10x smaller than eager's, or a logging hook never called, silently."""
    message = _refusal(_ScalesItsGradient())
    assert "registers a hook on a tensor (Tensor.register_hook at test_capture.py:" in message
    assert "(forward))" in message and "would never call it" in message
    calls = []

    def logging_loss(out):
        out.register_hook(lambda gradient: calls.append(gradient.norm()))
        return out.sum()

    with pytest.raises(CaptureError, match=r"Tensor.register_hook at test_capture.py:\d+ \(logging_loss\)"):
        capture(nn.Linear(4, 4), (torch.randn(2, 4),), None, None, logging_loss)
    assert not calls


class _CausalByMask(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))


def test_torch_modules_deciding_by_values_are_named_with_what_to_pass_them():
    """A causal mask without is_causal (nn.TransformerEncoder compares it with a causal one by value), a batch norm
    with momentum=None: the error named the user's outer class and told them to rewrite with torch.where."""
    with pytest.raises(CaptureError) as causal:
        capture(_CausalByMask(), (torch.randn(2, 5, 8),), None, None, lambda out: out.sum())
    assert "in module encoder (TransformerEncoder)" in str(causal.value)
    assert "pass is_causal=True with a causal mask" in str(causal.value)
    cumulative = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(CaptureError) as batch_norm:
        capture(cumulative, (torch.randn(8, 4),), None, None, lambda out: out.sum())
    assert "in module 1 (BatchNorm1d)" in str(batch_norm.value)
    assert "a batch norm with momentum=None" in str(batch_norm.value)


def test_reentrant_checkpointing_is_refused_and_the_other_kind_captured():
    """torch.utils.checkpoint's reentrant variant runs its forward without autograd: the trace has no gradient there
    (the layers before it would silently get none); the non-reentrant one is captured."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, reentrant: bool):
            super().__init__()
            self.lin, self.reentrant = nn.Linear(4, 4), reentrant

        def forward(self, x):
            return checkpoint(lambda h: torch.tanh(self.lin(h)), x, use_reentrant=self.reentrant)

    message = _refusal(Checkpointed(True))
    assert "torch.utils.checkpoint with use_reentrant=True" in message and "use_reentrant=False" in message
    step = capture(_Outer(Checkpointed(False)), (torch.randn(2, 4),), None, None, lambda out: out.sum())
    assert len(step.gradients) == 4


@torch.library.custom_op("mosos_tests::half_gradient_tanh", mutates_args=())
def _half_gradient_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


@_half_gradient_tanh.register_fake
def _(x):
    return torch.empty_like(x)


def _keep_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _half_gradient(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * (1 - torch.tanh(x) ** 2) * 0.5  # not the derivative: only a registered backward gives it


_half_gradient_tanh.register_autograd(_half_gradient, setup_context=_keep_input)


class _CustomOp(nn.Module):
    def forward(self, x):
        return _half_gradient_tanh(x)


def test_a_library_custom_op_keeps_its_registered_backward_and_trains_like_plain_pytorch():
    """A torch.library custom op with register_autograd (Mixtral's grouped matmul) goes through an autograd.Function
    torch generates; it was refused as a user's custom Function, but the joint graph keeps the op and its backward."""
    import torch.nn.functional as F

    import executor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _CustomOp(), nn.Linear(8, 3))
    plain = copy.deepcopy(model)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                cache=False, progress=False)
    loss = planned(x, y)
    loss.backward()
    plain_loss = F.cross_entropy(plain(x), y)
    plain_loss.backward()
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("layer, kind", [
    (lambda: nn.LSTM(4, 4, num_layers=2, batch_first=True, dropout=0.1), "LSTM"),
    (lambda: nn.GRU(4, 4, batch_first=True), "GRU"),
    (lambda: nn.RNN(4, 4, batch_first=True), "RNN"),
])
def test_a_fused_recurrent_layer_is_refused_since_its_traced_backward_is_another_computation(layer, kind):
    """nn.LSTM's dropout between layers was silently dropped (losses equal to dropout 0) and, without dropout,
    gradients came out 7e-8 apart: tracing decomposes the fused kernel."""

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = layer()

        def forward(self, x):
            return self.rnn(x.unsqueeze(1))[0].squeeze(1)

    message = _refusal(Recurrent())
    assert f"module inner.rnn ({kind}) is a fused recurrent layer (torch.nn.{kind})" in message
    assert "nn.LSTMCell in a loop" in message


def test_sparse_embedding_gradients_and_parameters_changed_in_forward_are_refused_by_name():
    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)

        def forward(self, x):
            return self.emb((x.abs() * 3).long().clamp(max=9)).sum(1)

    message = _refusal(Sparse())
    assert "module inner.emb (Embedding) makes sparse gradients" in message and "sparse=False" in message

    class Renormalised(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, max_norm=1.0)

        def forward(self, x):
            return self.emb((x.abs() * 3).long().clamp(max=9)).sum(1)

    message = _refusal(Renormalised())
    assert "changes the parameter 'inner.emb.weight' in place" in message and "max_norm" in message


class _Cholesky(nn.Module):
    def forward(self, x):
        return x @ torch.linalg.cholesky(x.T @ x + 4 * torch.eye(4))


def test_a_checked_solver_is_refused_with_its_unchecked_variant_named():
    message = _refusal(_Cholesky())
    assert "side effect" in message and "torch.linalg.cholesky_ex" in message


class _InPlace(nn.Module):
    """Every in-place spelling of the issue, each on a tensor that is read afterwards."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.c1(x)
        y.masked_fill_(y < 0, 0)
        z = self.relu(self.bn(y))
        w = self.c2(z)
        w.mul_(2)
        w[:, :4].mul_(2)
        u = w + z
        u.relu_()
        v = nn.functional.relu(self.c2(u) * 1.5, inplace=True)
        return self.fc((v + u + y).mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_in_place_operations_train_exactly_like_plain_pytorch(dtype):
    """The fx capture dropped these mutations (loss 2.2469 against 2.2197, gradients off by 171%)."""
    torch.manual_seed(0)
    model = _InPlace().to(dtype)
    x = torch.randn(4, 3, 8, 8, dtype=dtype)
    t = torch.randint(0, 4, (4,))
    loss_fn = nn.functional.cross_entropy
    profile, step = profile_step(model, x, loss_fn, t, repeats=1, warmup=0, algorithms=("native",))
    for schedule in (plan(profile, strategy="keep-all"), recompute_everything_schedule(profile)):
        planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, schedule, loss_fn, profiled=step, strict=True)
        torch.manual_seed(1)
        loss = planned(x, t)
        loss.backward()
        torch.manual_seed(1)
        plain = loss_fn(plain_model(x), t)
        plain.backward()
        assert torch.equal(loss, plain)
        for a, b in zip(planned_model.parameters(), plain_model.parameters()):
            assert torch.equal(a.grad, b.grad)
        for a, b in zip(planned_model.buffers(), plain_model.buffers()):
            assert torch.equal(a, b)


def test_an_input_mutated_in_place_is_written_back_once_like_plain_pytorch():
    """`torch.relu_(z)` on the model's input: the input ends the step relu'd, as after a plain step."""

    class MutatesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, z):
            torch.relu_(z)
            return self.lin(z)

    torch.manual_seed(0)
    model = MutatesInput()
    z = torch.randn(3, 4)
    profile, step = profile_step(model, z.clone(), lambda out: out.square().sum(), repeats=1, warmup=0)
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, recompute_everything_schedule(profile),
                            lambda out: out.square().sum(), profiled=step, strict=True)
    mine, theirs = z.clone(), z.clone()
    for _ in range(2):
        loss = planned(mine)
        loss.backward()
        plain = plain_model(theirs).square().sum()
        plain.backward()
        assert torch.equal(loss, plain)
        assert torch.equal(mine, theirs) and bool((mine >= 0).all())
    for a, b in zip(planned_model.parameters(), plain_model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_the_cli_refuses_a_model_it_cannot_capture_with_the_line_and_no_traceback(tmp_path):
    """Through `mosos profile file.py:build` in a fresh process, as a user meets it."""
    import subprocess
    import sys
    from pathlib import Path

    workload = tmp_path / "branchy.py"
    workload.write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        if y.mean() > 0:\n"
        "            y = y * 2\n"
        "        return y\n"
        "def build():\n"
        "    return torch.nn.Sequential(Branchy()), torch.randn(2, 4), None, lambda out: out.sum()\n"
    )
    result = subprocess.run([sys.executable, "-m", "cli", "profile", f"{workload}:build", "--repeats", "1",
                             "--warmup", "0", "-o", str(tmp_path / "p.json")], capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "if y.mean() > 0" in result.stderr and "0 (Branchy)" in result.stderr


def test_an_attention_without_dropout_is_not_a_random_node():
    """ATen's CPU flash attention is tagged random for its dropout argument, but accepts only 0 there and draws
    nothing: it is recomputed like any other node (no generator state kept, free to join a compiled region).
    Dropout stays random."""
    from executor.capture.planning_graph import is_random

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    without = graph.call_function(attention, (q, q, q, 0.0, True))
    by_keyword = graph.call_function(attention, (q, q, q), {"dropout_p": 0.0})
    with_dropout = graph.call_function(attention, (q, q, q, 0.1))
    dropout = graph.call_function(torch.ops.aten.native_dropout.default, (q, 0.1, True))
    assert not is_random(without) and not is_random(by_keyword)
    assert is_random(with_dropout) and is_random(dropout)
    x = torch.randn(2, 4, 16, 8)
    state = torch.get_rng_state()
    attention(x, x, x, 0.0, True)
    assert torch.equal(state, torch.get_rng_state())  # it draws nothing


def test_a_loss_that_is_not_a_single_number_is_refused_as_plain_backward_would():
    """`loss_fn=lambda out: out` went through capture and measuring and ended in a traceback from the plain step's
    backward ("grad can be implicitly created only for scalar outputs"); `mosos estimate` accepted it. The replay's
    joint graph would have trained on the sum."""
    with pytest.raises(CaptureError, match=r"the loss function returned a float32\[2,2\] tensor, not a single number"):
        capture(nn.Linear(4, 2), (torch.randn(2, 4),), None, None, lambda out: out)
    captured = capture(nn.Linear(4, 2), (torch.randn(2, 4),), None, None, lambda out: out.sum().reshape(1))
    assert captured is not None  # one element in any shape is what backward takes


def test_a_number_read_from_a_tensor_only_to_be_logged_is_refused_too():
    """`print(round(h.mean().item(), 4))` in forward: the capture printed "RoundDecimal(zuf0, 4)", the value was used by no
    tensor (so no node carried it), and the planned steps printed nothing, silently."""

    class Logs(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            h = self.linear(x)
            self.seen = h.mean().item()  # kept for a log line
            return h

    with pytest.raises(CaptureError, match=r"reads a Python number from a tensor .* that no tensor of the step uses"):
        capture(Logs(), (torch.randn(2, 4),), None, None, lambda out: out.sum())
