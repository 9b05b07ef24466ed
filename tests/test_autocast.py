"""Mixed precision: under torch.autocast the planned step is eager autocast's, bit for bit (executor.capture.autocast).

The zoo (BERT, GPT-2 with tied embeddings, ViT, a LLaMA-style decoder, ResNet, MobileNetV2, the in-place CNN) in
float32 under bf16 CPU autocast, with keep-all, mosos at 0.6, recompute-heavy and offload-heavy plans: the loss,
every gradient and every buffer equal eager autocast's. Then fp16 autocast with GradScaler (loss, gradients, the
scaler's state and the weights after its step), a parameter used many times (eager casts it once per region), and
a module from optimize() that meets autocast after it was planned without it."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import executor  # noqa: E402
from executor.errors import ProfileMismatch  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from executor.engine.schedules import offload_everything_schedule, recompute_everything_schedule  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import plan  # noqa: E402
from tests.zoo import ZOO, plannable_ratio  # noqa: E402

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def _plain(model, args, kwargs, targets, loss_fn):
    output = model(*args, **kwargs)
    return loss_fn(output, targets) if targets is not None else loss_fn(output)


_INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor):
    """The tensor's bits (NaN compares equal to itself here, and only to the same NaN)."""
    tensor = tensor.detach().contiguous()
    return tensor.view(_INTEGER[tensor.element_size()]) if tensor.is_floating_point() else tensor


def _equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _assert_same(kind, loss, plain, planned_model, plain_model):
    assert _equal(loss, plain), f"{kind}: loss {loss.item()} vs {plain.item()}"
    for (key, a), (_, b) in zip(planned_model.named_parameters(), plain_model.named_parameters()):
        if b.grad is None:
            assert a.grad is None, f"{kind}: {key} got a gradient eager autocast does not give"
            continue
        assert a.grad.dtype == b.grad.dtype
        assert _equal(a.grad, b.grad), f"{kind}: {key} differs by {(a.grad - b.grad).abs().max().item():.3e}"
    for (key, a), (_, b) in zip(planned_model.named_buffers(), plain_model.named_buffers()):
        assert _equal(a, b), f"{kind}: buffer {key} differs"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_the_zoo_under_bf16_autocast_is_eager_autocast_bit_for_bit(name):
    model, args, kwargs, targets, loss_fn = ZOO[name](torch.float32)
    with torch.autocast(**BF16):  # captured for the precision it is called under; the passes run outside it
        profile, captured = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0,
                                         algorithms=("native",), d2h_gb_per_s=10, h2d_gb_per_s=10)
    assert captured.step.autocast == (("cpu", "bfloat16", True),)
    schedules = {
        "keep-all": plan(profile, strategy="keep-all"),
        "mosos at 0.6": plan(profile, memory_ratio=plannable_ratio(profile), strategy="mosos", time_limit_s=2,
                             workers=1, seed=0),
        "recompute-heavy": recompute_everything_schedule(profile),
        "offload-heavy": offload_everything_schedule(profile),
    }
    for kind, schedule in schedules.items():
        planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, schedule, loss_fn, profiled=captured, strict=True)
        torch.manual_seed(3)
        with torch.autocast(**BF16):
            loss = planned(*args, targets=targets, **kwargs)
        loss.backward()
        torch.manual_seed(3)
        with torch.autocast(**BF16):
            plain = _plain(plain_model, args, kwargs, targets, loss_fn)
        plain.backward()
        _assert_same(kind, loss, plain, planned_model, plain_model)
        assert planned.peak_memory_bytes == planned.simulated_peak_bytes, kind


def _sgd_steps_like_eager(planned, model, plain, x, y, autocast: dict, steps: int) -> None:
    """SGD steps of the planned module and of an eager copy under the same autocast, each step bit for bit."""
    optimizer, plain_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    for step in range(steps):
        with torch.autocast(**autocast):
            loss = planned(x, targets=y)
        loss.backward()
        with torch.autocast(**autocast):
            plain_loss = F.cross_entropy(plain(x), y)
        plain_loss.backward()
        _assert_same(f"step {step}", loss, plain_loss, model, plain)
        optimizer.step()
        plain_optimizer.step()
        optimizer.zero_grad()
        plain_optimizer.zero_grad()


class SharedWeights(nn.Module):
    """One weight used four times in a region (eager casts it once, and sums its four gradients in bf16)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.b = nn.Linear(128, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        h = F.gelu(self.norm(self.a(x)))
        h = torch.softmax(self.b(h), -1) @ self.b.weight
        h = h @ self.b.weight.t() + self.b(h)
        return self.head(h)


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_a_parameter_cast_many_times_sums_its_gradients_as_eager_autocast_does(cache_enabled):
    """With autocast's cache (the default) eager casts a parameter once per region and sums the uses' gradients in
    lower precision; without it, it casts at every use and sums the cast-backs in float32."""
    torch.manual_seed(0)
    model = SharedWeights()
    plain = copy.deepcopy(model)
    x, y = torch.randn(2048, 64), torch.randint(0, 10, (2048,))
    autocast = {**BF16, "cache_enabled": cache_enabled}
    with torch.autocast(**autocast):
        planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.8, time_limit_s=2,
                                    workers=1, cache=False, progress=False)
    graph = planned._prepared.profiled.step.graph
    weight = next(n for n, s in planned._prepared.profiled.step.sources.items() if s.name == "b.weight")
    casts = [u for u in weight.users if u.target is torch.ops.aten._to_copy.default]
    assert (len(casts) == 1) == cache_enabled, f"b.weight is cast {len(casts)} times in {graph}"
    _sgd_steps_like_eager(planned, model, plain, x, y, autocast, steps=3)


class WeightNormedLowRank(nn.Module):
    """peft's DoRA: the low-rank factors' product normalises the output through a detached norm (no gradient),
    and the factors are used again for the update itself. Eager casts each factor once; only one use has a
    gradient."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(64, 64).requires_grad_(False)
        self.down = nn.Parameter(torch.randn(4, 64) * 0.1)
        self.up = nn.Parameter(torch.randn(64, 4) * 0.1)
        self.magnitude = nn.Parameter(torch.ones(64))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        norm = (self.base.weight + self.up @ self.down).norm(dim=1).detach()
        update = F.linear(F.linear(x, self.down), self.up)
        return self.head((self.magnitude / norm) * (self.base(x) + update))


def test_a_parameter_cast_twice_with_a_gradient_through_one_cast_is_eager_autocasts():
    """Refused before ("cast to lower precision 2 times and its gradient is not a plain sum of their cast-backs"):
    a cast whose uses give no gradient adds no term to the sum."""
    torch.manual_seed(0)
    model = WeightNormedLowRank()
    plain = copy.deepcopy(model)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with torch.autocast(**BF16):
        planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                    cache=False, progress=False)
    _sgd_steps_like_eager(planned, model, plain, x, y, BF16, steps=2)


def test_fp16_autocast_with_grad_scaler_matches_eager_including_the_scaler_state():
    torch.manual_seed(0)
    model = SharedWeights()
    plain = copy.deepcopy(model)
    x, y = torch.randn(2048, 64), torch.randint(0, 10, (2048,))
    fp16 = {"device_type": "cpu", "dtype": torch.float16}
    with torch.autocast(**fp16):
        planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.8, time_limit_s=2,
                                    workers=1, cache=False, progress=False)
    optimizer, plain_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    # a huge initial scale overflows fp16 on the first step: the scaler must skip it and back off, in both
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    for step in range(3):
        with torch.autocast(**fp16):
            loss = planned(x, targets=y)
        scaler.scale(loss).backward()
        with torch.autocast(**fp16):
            plain_loss = F.cross_entropy(plain(x), y)
        plain_scaler.scale(plain_loss).backward()
        _assert_same(f"step {step}", loss, plain_loss, model, plain)
        for s, o in ((scaler, optimizer), (plain_scaler, plain_optimizer)):
            s.step(o)
            s.update()
            o.zero_grad()
        assert scaler.get_scale() == plain_scaler.get_scale()
        assert all(_equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    assert scaler.get_scale() < 2.0 ** 40  # it did overflow and back off


def test_a_planned_module_meets_autocast_and_plans_it_once_a_hand_built_one_refuses_it():
    torch.manual_seed(0)
    model = SharedWeights()
    plain = copy.deepcopy(model)
    x, y = torch.randn(2048, 64), torch.randint(0, 10, (2048,))
    messages: list[str] = []
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.8, time_limit_s=2,
                                workers=1, cache=False, progress=messages.append)
    for precision in ("float32", "bf16", "float32", "bf16"):
        context = torch.autocast(**BF16) if precision == "bf16" else torch.autocast("cpu", enabled=False)
        with context:
            loss = planned(x, targets=y)
            plain_loss = F.cross_entropy(plain(x), y)
        loss.backward()
        plain_loss.backward()
        _assert_same(precision, loss, plain_loss, model, plain)
        for m in (model, plain):
            m.zero_grad()
    assert planned.signatures_planned == 1
    assert sum("under autocast cpu bfloat16" in m for m in messages) == 1
    # the plan in use now is the bf16 one: built by hand, it refuses a float32 call rather than plan it
    by_hand = PlannedModule(model, planned.profile, planned.schedule, F.cross_entropy,
                            profiled=planned._prepared.profiled)
    with pytest.raises(ProfileMismatch, match="captured with autocast cpu bfloat16 but is called under no autocast"):
        by_hand(x, targets=y)


def _tiny_bert():
    import transformers

    config = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def _bert_loss(output, labels):
    return F.cross_entropy(output.logits, labels)


def test_a_padded_attention_mask_is_eager_autocast_and_an_all_ones_one_is_refused():
    model = _tiny_bert()
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (8, 32), generator=generator), torch.randint(0, 3, (8,), generator=generator)
    padded = torch.ones(8, 32, dtype=torch.long)
    padded[:, 24:] = 0
    with torch.autocast(**BF16):
        planned = executor.optimize(model, (), _bert_loss, kwargs={"input_ids": ids, "attention_mask": padded},
                                    targets=labels, memory_ratio=0.6, time_limit_s=2, workers=1, cache=False,
                                    progress=False)
        torch.manual_seed(1)
        loss = planned(input_ids=ids, attention_mask=padded, targets=labels)
        torch.manual_seed(1)
        plain_loss = _bert_loss(plain(input_ids=ids, attention_mask=padded), labels)
    loss.backward()
    plain_loss.backward()
    _assert_same("padded", loss, plain_loss, model, plain)
    with torch.autocast(**BF16), pytest.raises(executor.ReplayError, match="attention_mask is all ones"):
        planned(input_ids=ids, attention_mask=torch.ones_like(padded), targets=labels)


def test_dropout_on_a_bfloat16_model_is_eager_pytorchs():
    """Eager CPU dropout draws and scales its mask in the tensor's dtype: a bf16 model trains as eager does."""
    model = _tiny_bert().to(torch.bfloat16)
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (8, 32), generator=generator), torch.randint(0, 3, (8,), generator=generator)
    planned = executor.optimize(model, (), _bert_loss, kwargs={"input_ids": ids}, targets=labels, memory_ratio=0.6,
                                time_limit_s=2, workers=1, cache=False, progress=False)
    assert "bernoulli" in planned.code
    for step in range(2):
        torch.manual_seed(step)
        loss = planned(input_ids=ids, targets=labels)
        loss.backward()
        torch.manual_seed(step)
        plain_loss = _bert_loss(plain(input_ids=ids), labels)
        plain_loss.backward()
        _assert_same(f"step {step}", loss, plain_loss, model, plain)
        for m in (model, plain):
            m.zero_grad()


def test_dropout_over_a_transposed_bfloat16_tensor_draws_eagers_mask():
    """Eager's mask is laid out as its input and drawn in memory order; over nn.TransformerEncoderLayer's first
    dropout (attention's batch-first output, transposed) the capture drew another mask: loss 5.59 against 5.41."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True),
                          nn.Flatten(), nn.Linear(16 * 64, 10)).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 16, 64, generator=generator).to(torch.bfloat16), torch.randint(0, 10, (4,))
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                cache=False, progress=False)
    assert "permute" in planned.code and "bernoulli" in planned.code
    for step in range(2):
        torch.manual_seed(step)
        loss = planned(x, targets=y)
        loss.backward()
        torch.manual_seed(step)
        plain_loss = F.cross_entropy(plain(x), y)
        plain_loss.backward()
        _assert_same(f"step {step}", loss, plain_loss, model, plain)


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, lambda c: nn.GroupNorm(2, c)], ids=["batch", "group"])
# 0.6: the head's bf16 product is allowed its threads' packing buffers (executor.measure.measuring), which set the
# floor of this small a model above 0.5 of its keep-all step
@pytest.mark.parametrize("budgeted", [False, True], ids=["keep-all", "smallest-budget"])
def test_compiled_replay_under_autocast_runs_mixed_dtype_norms_eagerly(norm, budgeted):
    """A batch or group norm on autocast's bfloat16 activations with float32 weights: torch's shape functions give
    its statistics bfloat16 where ATen's kernel gives float32, so a kernel compiled around it handed the norm's
    backward bfloat16 statistics and ATen refused them ("mixed dtype (CPU)"). Those nodes run eager's call, said
    in the report; the rest compiles, and the step is eager autocast's within bfloat16's rounding."""
    torch.manual_seed(0)
    # convolutions without bias, as CNNs have them before a norm: a bias's gradient there cancels to rounding noise
    # (the norm removes the mean), which any other order of summing changes entirely
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), norm(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), norm(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 10))
    plain = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))

    def optimize(budget):
        with torch.autocast(**BF16):
            return executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=budget, compile=True,
                                     cache=False, progress=False, timed_steps=0, time_limit_s=5, workers=1)

    if budgeted:  # the smallest budget named, where the plan has least room (so little an activation, it is
        # fixed memory and the linear layer's node: 0.6 of the keep-all peak is below it)
        with pytest.raises(BudgetError) as refused:
            optimize(1)
        planned = optimize(refused.value.minimum_budget_bytes)
    else:
        planned = optimize(None)
    record = planned.compiled_nodes
    reasons = list(record.eager.values()) + list(record.regions_refused.values())
    assert record.compiled and any("normalization on mixed dtypes (bfloat16/float32)" in r for r in reasons), \
        record.describe()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(2):
        with torch.autocast(**BF16):
            loss = planned(x, y)
            plain_loss = F.cross_entropy(plain(x), y)
        loss.backward()
        plain_loss.backward()
        assert abs(loss.item() - plain_loss.item()) <= 1e-2 * abs(plain_loss.item()), step
        for (key, a), b in zip(model.named_parameters(), plain.parameters()):
            scale = b.grad.abs().max().item() or 1.0
            assert a.grad.dtype == b.grad.dtype
            # two bfloat16 units: a budget may pick the channels-last convolution algorithm, whose input gradient
            # rounds apart from native's (where the CPU has no AVX-512, ATen's bfloat16 im2col kernel, each 0.6-1%
            # of the largest value from float64's), and a norm's backward passes that on to the layer before it
            assert (a.grad - b.grad).abs().max().item() <= 2e-2 * scale, (step, key)
        for (key, a), b in zip(model.named_buffers(), plain.buffers()):
            assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3), (step, key)
        if planned.last_ledger is not None and planned.schedule.budget_bytes is not None:
            assert planned.last_ledger.peak_bytes() <= planned.schedule.budget_bytes
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        # the next step from the same weights: weights apart by a rounding's update cross bfloat16 rounding
        # boundaries, and after this small a model's first step (loss 2.5 -> 0.07) the next gradients, small and
        # cancelling in the norms, come out 0.1-0.2 of their largest apart (plain PyTorch with channels-last
        # convolutions too); each step is compared, not the trajectory
        plain.load_state_dict(model.state_dict())


def test_nodes_captured_under_autocast_keep_their_modules():
    """torch.export makes an autocast region one `wrap_with_autocast` call; traced whole, every node in it took the
    region's metadata and was named after the loss ('loss/convolution'), so the per-block baseline found no
    blocks and messages named no layer. The region's body is traced node by node now."""
    from executor.measure.profiler import plan_step

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    with torch.autocast(**BF16):
        step = plan_step(model, (x,), {}, y, F.cross_entropy, None)
    modules = {group.op_type: group.module for group in step.planning.groups if group.kind == "forward"}
    assert modules["convolution+relu"] == "0" and modules["addmm+to_copy+log_softmax"] == "3", modules
