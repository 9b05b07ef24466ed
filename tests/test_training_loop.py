"""The rest of a training loop around a planned module: batches of several shapes, gradient accumulation, evaluation.
Every step is compared bit for bit with plain PyTorch running the same loop on a copy of the model."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

import executor  # noqa: E402

LENGTHS = (16, 24, 32, 48)  # four buckets of sequence length


def tiny_bert():
    config = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def loss_fn(output, labels):
    return F.cross_entropy(output.logits, labels)


def batch(length: int, seed: int, size: int = 8):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size, length), generator=generator), torch.randint(0, 3, (size,), generator=generator)


def plan_messages(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("new input signature")]


def same_gradients(model, plain) -> bool:
    return all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
               for p, q in zip(model.parameters(), plain.parameters()))


def test_bucketed_lengths_are_each_planned_once_and_every_step_is_plain_pytorchs():
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids, labels = batch(LENGTHS[0], seed=0)
    messages: list[str] = []
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=labels, memory_ratio=0.75,
                                time_limit_s=2, workers=1, optimizer="momentum", progress=messages.append)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    step = 0
    for epoch in range(3):
        order = [LENGTHS[(i + epoch) % len(LENGTHS)] for i in range(len(LENGTHS))]  # buckets in another order
        for length in order:
            ids, labels = batch(length, seed=100 * epoch + length)
            optimizer.zero_grad(set_to_none=True)
            plain_optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # dropout: the same masks in both
            loss = planned(input_ids=ids, targets=labels)
            loss.backward()
            torch.manual_seed(step)
            plain_loss = loss_fn(plain(input_ids=ids), labels)
            plain_loss.backward()
            assert torch.equal(loss, plain_loss), (epoch, length)
            assert same_gradients(model, plain), (epoch, length)
            optimizer.step()
            plain_optimizer.step()
            step += 1
    assert planned.signatures_planned == len(LENGTHS) - 1  # the first was planned by optimize()
    assert len(plan_messages(messages)) == len(LENGTHS) - 1
    assert len(planned.signatures) == len(LENGTHS)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_the_least_recently_used_plan_is_dropped_and_made_again_from_the_kept_one():
    model = tiny_bert()
    ids, labels = batch(LENGTHS[0], seed=0)
    messages: list[str] = []
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=labels, memory_ratio=0.6,
                                time_limit_s=2, workers=1, max_signatures=2, progress=messages.append)
    for length in (LENGTHS[1], LENGTHS[2], LENGTHS[0]):
        ids, labels = batch(length, seed=length)
        planned(input_ids=ids, targets=labels).backward()
    assert len(planned.signatures) == 2
    assert planned.signatures_planned == 3
    assert any(m.startswith("dropping the plan for input signature input_ids=int64[8,16]") for m in messages)
    # the first length came back after it was dropped: planned from the plan kept on disk, not solved again
    assert any("no profile or solve" in m for m in messages[-4:]), messages[-6:]


def test_a_module_told_not_to_plan_new_signatures_refuses_them():
    model = tiny_bert()
    ids, labels = batch(LENGTHS[0], seed=0)
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=labels, budget=None,
                                strategy="keep-all", new_signatures=False, progress=False)
    ids, labels = batch(LENGTHS[1], seed=1)
    with pytest.raises(executor.ProfileMismatch, match=r"int64\[8,16\].*int64\[8,24\]"):
        planned(input_ids=ids, targets=labels)


def test_gradient_accumulation_over_four_micro_batches_is_plain_pytorchs():
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids, labels = batch(32, seed=0)
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=labels, memory_ratio=0.75,
                                time_limit_s=2, workers=1, optimizer="adamw", progress=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for update in range(2):
        for micro in range(4):
            ids, labels = batch(32, seed=10 * update + micro)
            torch.manual_seed(micro)
            (planned(input_ids=ids, targets=labels) / 4).backward()
            torch.manual_seed(micro)
            (loss_fn(plain(input_ids=ids), labels) / 4).backward()
            assert same_gradients(model, plain), (update, micro)
        optimizer.step()
        plain_optimizer.step()
        optimizer.zero_grad()
        plain_optimizer.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_a_regulariser_in_the_loss_function_accumulates_bitwise():
    """A term on the parameters outside the planned module is summed in another order than eager's while .grad
    holds gradients (docs/training.md); given in the loss function, it is part of the planned step, bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    plain = copy.deepcopy(model)

    def regularised(module):
        return lambda output, labels: (F.cross_entropy(output, labels)
                                       + 1e-3 * sum(p.pow(2).sum() for p in module.parameters()))

    generator = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
              for _ in range(3)]
    planned = executor.optimize(model, (inputs[0][0],), regularised(model), targets=inputs[0][1], budget=None,
                                strategy="keep-all", cache=False, progress=False)
    for x, y in inputs:
        planned(x, targets=y).backward()
        regularised(plain)(plain(x), y).backward()
        assert same_gradients(model, plain)


def test_eval_and_no_grad_run_the_plain_forward_and_train_returns_to_the_plan():
    """Evaluation under torch.no_grad() runs the model's own forward, at any size, planning nothing. model.eval()
    with gradients on is a step of its own, planned for eval mode: the own forward would save every activation."""
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids, labels = batch(16, seed=0)
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=labels, memory_ratio=0.6,
                                time_limit_s=2, workers=1, progress=False)
    other_ids, other_labels = batch(40, seed=1)  # evaluation at another size plans nothing
    with torch.no_grad():  # still in training mode: dropout draws, the same masks in both
        torch.manual_seed(1)
        evaluated = planned(input_ids=other_ids, targets=other_labels)
        torch.manual_seed(1)
        assert torch.equal(evaluated, loss_fn(plain(input_ids=other_ids), other_labels))
    planned.eval()
    plain.eval()
    assert not model.training
    with torch.no_grad():
        evaluated = planned(input_ids=other_ids, targets=other_labels)  # dropout off
    assert torch.equal(evaluated, loss_fn(plain(input_ids=other_ids), other_labels))
    assert planned.signatures_planned == 0
    evaluated = planned(input_ids=ids, targets=labels)  # dropout off, gradients on: a planned step
    evaluated.backward()
    expected = loss_fn(plain(input_ids=ids), labels)
    expected.backward()
    assert torch.equal(evaluated, expected) and same_gradients(model, plain)
    assert planned.signatures_planned == 1 and not model.training
    assert planned.last_ledger is not None and planned.last_ledger.peak_bytes() <= planned.schedule.budget_bytes
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    planned.train()
    plain.train()
    torch.manual_seed(3)
    loss = planned(input_ids=ids, targets=labels)
    loss.backward()
    torch.manual_seed(3)
    loss_fn(plain(input_ids=ids), labels).backward()
    assert same_gradients(model, plain)
    assert planned.last_ledger is not None and planned.last_ledger.peak_bytes() <= planned.schedule.budget_bytes


def test_post_accumulate_grad_hooks_fire_once_per_parameter_and_see_the_gradient():
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids, labels = batch(16, seed=0)
    planned = executor.optimize(model, (), loss_fn, kwargs={"input_ids": ids}, targets=labels, memory_ratio=0.6,
                                time_limit_s=2, workers=1, progress=False)
    seen: list[tuple[int, torch.Tensor]] = []
    for index, parameter in enumerate(model.parameters()):
        parameter.register_post_accumulate_grad_hook(lambda p, i=index: seen.append((i, p.grad.clone())))
    torch.manual_seed(0)
    planned(input_ids=ids, targets=labels).backward()
    torch.manual_seed(0)
    loss_fn(plain(input_ids=ids), labels).backward()
    assert sorted(i for i, _ in seen) == list(range(len(list(model.parameters()))))
    plain_grads = [p.grad for p in plain.parameters()]
    assert all(torch.equal(grad, plain_grads[i]) for i, grad in seen)  # each hook saw the finished gradient
    assert same_gradients(model, plain)


def test_a_signature_the_budget_refuses_is_named_and_refused_at_once_when_it_comes_back():
    """A longer batch under a fixed budget failed with "no measuring pass fits ..." naming no shape (only a progress
    line did), and each time it came back it was captured and measured again before failing the same way."""
    from planner.errors import BudgetError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 4))
    small = torch.randn(16, 32), torch.randint(0, 4, (16,))
    large = torch.randn(4096, 32), torch.randint(0, 4, (4096,))
    messages: list[str] = []
    planned = executor.optimize(model, (small[0],), F.cross_entropy, targets=small[1], budget="2MiB", time_limit_s=2,
                                workers=1, optimizer="sgd", progress=messages.append, cache=False)
    with pytest.raises(BudgetError) as refused:
        planned(large[0], targets=large[1])
    assert str(refused.value).startswith("planning the new input signature float32[4096,32]"), str(refused.value)
    captures = sum("capturing the step" in m for m in messages)
    with pytest.raises(BudgetError, match="refused before in this run; nothing was planned again") as again:
        planned(large[0], targets=large[1])
    assert sum("capturing the step" in m for m in messages) == captures  # no capture or measuring this time
    assert again.value.minimum_budget_bytes == refused.value.minimum_budget_bytes
    loss = planned(small[0], targets=small[1])  # the kept plan still serves its own signature
    loss.backward()
