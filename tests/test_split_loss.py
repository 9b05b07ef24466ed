"""The split loss (executor/capture/split_loss.py): a language model's cross-entropy over its LM head computed over
chunks of rows, its gradient made in the forward, so that the logits are never whole."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import executor
from executor.capture.capture import capture
from executor.capture.split_loss import LINEAR_CROSS_ENTROPY, linear_cross_entropy
from planner.errors import BudgetError, MososError

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # the issue's: float32 gradients within 1e-5 (relative to the largest) of eager's


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, 64, 1000])
def test_the_split_kernel_is_cross_entropy_to_rounding(rows_per_chunk, reduction):
    """Loss and both gradients, with rows whose target is ignored, for chunks that do and do not divide the rows."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 16, generator=generator, requires_grad=True)
    weight = (torch.randn(500, 16, generator=generator) * 0.3).requires_grad_()
    target = torch.randint(0, 500, (64,), generator=generator)
    target[::5] = -100
    eager = F.cross_entropy(hidden @ weight.t(), target, reduction=reduction)
    eager.backward()
    eager_hidden, eager_weight = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    loss, _, _ = linear_cross_entropy(hidden, weight, target, -100, rows_per_chunk, reduction == "mean")
    (loss * 3).backward()  # an incoming gradient other than one scales both
    assert abs(loss.item() - eager.item()) <= TOLERANCE * abs(eager.item())
    assert _relative(hidden.grad, 3 * eager_hidden) <= TOLERANCE
    assert _relative(weight.grad, 3 * eager_weight) <= TOLERANCE


def test_every_row_ignored_gives_eagers_nan():
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(30, 8)
    target = torch.full((4,), -100)
    assert torch.isnan(F.cross_entropy(hidden @ weight.t(), target))
    assert torch.isnan(linear_cross_entropy(hidden, weight, target, -100, 2, True)[0])
    assert linear_cross_entropy(hidden, weight, target, -100, 2, False)[0].item() == 0.0  # as eager's sum


def _gpt2(vocab: int = 3000, dropout: float = 0.1):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _loss(out):
    return out.loss


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_capture_splits_transformers_causal_lm_loss():
    model, kwargs = _gpt2()
    step = capture(model, (), kwargs, None, _loss, (), loss_split=True)
    targets = {node.target for node in step.graph.nodes if node.op == "call_function"}
    assert LINEAR_CROSS_ENTROPY in targets
    assert torch.ops.aten._log_softmax.default not in targets and torch.ops.aten.nll_loss_forward.default not in targets
    assert step.loss_notes == ["the loss at cross_entropy_loss is split: 96 rows in chunks of 32 over 3000 classes"]
    whole = capture(model, (), kwargs, None, _loss, ())
    assert torch.ops.aten._log_softmax.default in {node.target for node in whole.graph.nodes}
    assert not whole.loss_notes


def test_a_planned_step_with_the_loss_split_is_eagers_to_rounding():
    """Dropout on: the replay draws eager's masks, so loss and every gradient agree to the kernel's rounding."""
    model, kwargs = _gpt2(vocab=500)  # the blocks' activations outweigh the loss: a plan at 0.7 recomputes some
    eager = _gpt2(vocab=500)[0]
    eager.load_state_dict(model.state_dict())
    planned = executor.optimize(model, (), _loss, kwargs=kwargs, memory_ratio=0.7, split_loss=True, repeats=1,
                                warmup=0, time_limit_s=5, workers=1, progress=False, cache=False, timed_steps=0)
    assert any("is split" in note for note in planned.loss_notes)
    assert planned.schedule.summary.recompute_time_ms > 0
    for _ in range(2):  # the second step from the state the first left (the optimizer is the caller's: none here)
        for p in list(model.parameters()) + list(eager.parameters()):
            p.grad = None
        torch.manual_seed(5)
        loss = planned(**kwargs)
        loss.backward()
        torch.manual_seed(5)
        eager_loss = eager(**kwargs).loss
        eager_loss.backward()
        assert abs(loss.item() - eager_loss.item()) <= TOLERANCE * abs(eager_loss.item())
        got, expected = _gradients(model), _gradients(eager)
        assert got.keys() == expected.keys()
        largest = max(g.abs().max() for g in expected.values())
        worst = max((got[name] - expected[name]).abs().max() for name in expected) / largest
        assert worst <= TOLERANCE, worst


def _refusal(model, kwargs, split: bool) -> BudgetError:
    with pytest.raises(BudgetError) as refused:
        executor.optimize(model, (), _loss, kwargs=kwargs, budget=1, split_loss=split, repeats=1, warmup=0,
                          time_limit_s=5, workers=1, progress=False, cache=False)
    return refused.value


def test_the_split_loss_lowers_the_smallest_budget_and_a_step_there_holds_it():
    """Where the logits outweigh the rest (a large vocabulary, few rows), the whole loss sets the floor; split, the
    floor falls and a plan at it trains within it, every allocation counted by the allocator's events."""
    from executor.measure.allocations import AllocationTrace
    from tests.test_budgeted_profiling import _resident_bytes

    torch.set_num_threads(1)
    model, kwargs = _gpt2(vocab=20000, dropout=0.0)
    whole_refusal, split_refusal = _refusal(model, kwargs, split=False), _refusal(model, kwargs, split=True)
    whole, split = whole_refusal.minimum_budget_bytes, split_refusal.minimum_budget_bytes
    assert split < 0.9 * whole, (split, whole)
    # the refusal of the whole loss says what the split loss would do, the split's says nothing more
    offered = re.search(r"would lower the floor any plan needs from .* to .* \((\d+) bytes\): ask for it with "
                        r"split_loss=True", str(whole_refusal))
    assert offered is not None, str(whole_refusal)
    assert split <= int(offered.group(1)) * 1.05
    assert "split_loss=True" not in str(split_refusal)
    resident = _resident_bytes(model, (), kwargs, None)
    with AllocationTrace() as trace:
        planned = executor.optimize(model, (), _loss, kwargs=kwargs, budget=split, split_loss=True, repeats=1,
                                    warmup=0, time_limit_s=5, workers=1, progress=False, cache=False, timed_steps=1)
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            planned(**kwargs).backward()
    assert trace.peak_bytes <= split - resident, (trace.peak_bytes, split, resident)


def test_under_autocast_the_loss_stays_whole_and_says_why():
    model, kwargs = _gpt2(dropout=0.0)
    with torch.autocast("cpu", torch.bfloat16):
        step = capture(model, (), kwargs, None, _loss, loss_split=True)
    assert LINEAR_CROSS_ENTROPY not in {node.target for node in step.graph.nodes}
    assert len(step.loss_notes) == 1 and "computed whole" in step.loss_notes[0] and "autocast" in step.loss_notes[0]


class _Smoothed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("loss_fn, why", [
    (lambda out, t: F.cross_entropy(out, t, label_smoothing=0.1), "label smoothing"),
    (lambda out, t: F.cross_entropy(out, t, reduction="none").mean(), "a reduction other than the mean or the sum"),
    (lambda out, t: F.cross_entropy(out, t, weight=torch.ones(50)), "class weights"),
    (lambda out, t: F.cross_entropy(out * 2, t), "not a view of a linear layer's output"),
])
def test_a_loss_the_kernel_does_not_compute_stays_whole_and_says_why(loss_fn, why):
    x, t = torch.randn(6, 8), torch.randint(0, 50, (6,))
    step = capture(_Smoothed(), (x,), None, t, loss_fn, (), loss_split=True)
    assert LINEAR_CROSS_ENTROPY not in {node.target for node in step.graph.nodes}
    assert len(step.loss_notes) == 1 and why in step.loss_notes[0], step.loss_notes


def test_a_model_without_a_cross_entropy_says_so():
    step = capture(_Smoothed(), (torch.randn(6, 8),), None, None, lambda out: out.square().mean(), (),
                   loss_split=True)
    assert step.loss_notes == ["the loss is computed whole: the step has no cross-entropy (torch's cross_entropy "
                               "over a linear layer's logits) to split"]


def test_split_loss_is_checked():
    model, kwargs = _gpt2()
    with pytest.raises(MososError, match="split_loss is True or False"):
        executor.optimize(model, (), _loss, kwargs=kwargs, split_loss="yes", progress=False)


def test_a_plan_with_the_loss_split_comes_back_from_the_cache_split(tmp_path):
    model, kwargs = _gpt2(dropout=0.0)

    def run():
        messages: list[str] = []
        planned = executor.optimize(model, (), _loss, kwargs=kwargs, budget=None, strategy="keep-all",
                                    split_loss=True, cache=tmp_path, timed_steps=0, repeats=1, warmup=0,
                                    progress=messages.append)
        return planned, messages

    made, _ = run()
    loaded, messages = run()
    assert any("no profile or solve" in m for m in messages)
    assert loaded.loss_notes == made.loss_notes and "is split" in made.loss_notes[0]
    assert LINEAR_CROSS_ENTROPY in {node.target for node in loaded._prepared.profiled.step.graph.nodes}


def test_mosos_profile_split_loss_profiles_the_split_step_and_mosos_plan_plans_it(tmp_path):
    """Through the CLI as a user runs it: the profile says the loss was split, and a plan is made from it."""
    from planner.profile import load_profile
    from tests.test_budgeted_profiling import _fresh

    spec = tmp_path / "lm.py"
    spec.write_text(
        "import torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n\n\n"
        "def build(batch_size=None):\n"
        "    torch.manual_seed(0)\n"
        "    config = GPT2Config(vocab_size=3000, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,\n"
        "                        eos_token_id=0)\n"
        "    ids = torch.randint(0, 3000, (batch_size or 2, 48), generator=torch.Generator().manual_seed(1))\n"
        "    return {'model': GPT2LMHeadModel(config).train(), 'inputs': (), 'kwargs': {'input_ids': ids, "
        "'labels': ids}, 'loss_fn': lambda out: out.loss}\n")
    out = tmp_path / "lm.json"
    done = _fresh("-m", "cli", "profile", f"{spec}:build", "--split-loss", "--repeats", "1", "--warmup", "0",
                  "-o", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    profile = load_profile(out)
    assert "the loss at cross_entropy_loss is split: 96 rows in chunks of 32 over 3000 classes" in \
        profile.provenance.notes
    assert any(node.op_type == "linear_cross_entropy" for node in profile.nodes)
    planned = _fresh("-m", "cli", "plan", str(out), "--strategy", "keep-all", "-o", str(tmp_path / "plan.json"))
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-2000:]


def test_a_summed_loss_as_transformers_trainer_asks_for_it_is_split_too():
    """transformers' Trainer passes num_items_in_batch: the loss is then the sum over the rows, divided by the
    tokens of the whole accumulated batch. Split, it is eager's to rounding."""
    model, kwargs = _gpt2(vocab=500, dropout=0.0)
    eager = _gpt2(vocab=500, dropout=0.0)[0]
    eager.load_state_dict(model.state_dict())
    items = torch.tensor(300)
    kwargs = dict(kwargs, num_items_in_batch=items)
    planned = executor.optimize(model, (), _loss, kwargs=kwargs, budget=None, strategy="keep-all", split_loss=True,
                                repeats=1, warmup=0, progress=False, cache=False, timed_steps=0)
    assert any("is split" in note for note in planned.loss_notes), planned.loss_notes
    loss = planned(**kwargs)
    loss.backward()
    eager_loss = eager(**kwargs).loss
    eager_loss.backward()
    assert abs(loss.item() - eager_loss.item()) <= TOLERANCE * abs(eager_loss.item())
    got, expected = _gradients(model), _gradients(eager)
    largest = max(g.abs().max() for g in expected.values())
    assert max((got[name] - expected[name]).abs().max() for name in expected) / largest <= TOLERANCE
