"""Attention as eager runs it: the captured step calls the attention kernel eager calls, with eager's arguments.

transformers builds an explicit mask while a tracer runs (all true for BERT, the causal triangle for GPT-2,
expanded to the batch with stride 0) and passes none in eager; on a GPU the memory-efficient kernel refuses the
expanded mask and the traced step took the math path (twice eager's memory, other dropout masks). These tests
hold that pattern on the CPU, where no kernel refuses it, and check the capture takes it out."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import executor
from executor.capture import autocast
from executor.capture.capture import capture

transformers = pytest.importorskip("transformers")

ATTENTION_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math")


def _is_attention(target) -> bool:
    name = str(target)
    return any(kernel in name for kernel in ATTENTION_KERNELS) and "backward" not in name


def _call(args, kwargs) -> tuple:
    """(masked?, is_causal) of a forward attention kernel call: its positional arguments after query, key and
    value (dropout_p, is_causal, ...) and its keywords."""
    positional = list(args[3:])
    is_causal = bool(positional[1]) if len(positional) > 1 else bool(kwargs.get("is_causal", False))
    mask = kwargs.get("attn_mask")
    return mask is not None, is_causal


class _EagerAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_attention(func):
            self.calls.append((str(func.overloadpacket), *_call(args, kwargs)))
        return func(*args, **kwargs)


def _eager_calls(model, kwargs, loss_fn, targets=None):
    with _EagerAttention() as recorder:
        output = model(**kwargs)
        (loss_fn(output, targets) if targets is not None else loss_fn(output)).backward()
    model.zero_grad(set_to_none=True)
    return recorder.calls


def _captured_calls(step):
    return [(str(node.target.overloadpacket), *_call(node.args, node.kwargs))
            for node in step.graph.nodes if node.op == "call_function" and _is_attention(node.target)]


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config).train()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


IDS = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 1, 2, 0])
PADDED = torch.ones(4, 24, dtype=torch.long)
PADDED[:, 20:] = 0


def _classify(out, targets):
    return F.cross_entropy(out.logits, targets)


@pytest.mark.parametrize("padding", [False, True], ids=["no mask", "padding mask"])
def test_bert_on_the_cpu_calls_the_fused_kernel_eager_calls(padding):
    """BERT without attention dropout: eager calls ATen's CPU flash attention, without a mask where there is no
    padding and with it where there is; the captured step calls the same kernel with the same mask or none."""
    model = _bert()
    kwargs = {"input_ids": IDS, "attention_mask": PADDED} if padding else {"input_ids": IDS}
    eager = _eager_calls(model, kwargs, _classify, LABELS)
    step = capture(model, (), kwargs, LABELS, _classify)
    assert eager and _captured_calls(step) == eager
    assert all(kernel == "aten._scaled_dot_product_flash_attention_for_cpu" for kernel, _, _ in eager)
    assert all(masked == padding for _, masked, _ in eager)
    if padding:
        assert all("mask kept as given: it depends on the step's input 'attention_mask'" in note
                   for note in step.attention_notes)


@pytest.mark.parametrize("build, causal", [(_bert, False), (_gpt2, True)], ids=["bert", "gpt2"])
def test_the_mask_transformers_builds_under_a_tracer_is_taken_out_as_eager_passes_none(monkeypatch, build, causal):
    """Without the capture's switch to transformers' eager branch, the trace holds the GPU's pattern: an explicit
    mask, all true (BERT) or the causal triangle (GPT-2), expanded along the batch with stride 0. The capture
    evaluates it (it depends on shapes alone), and calls attention as eager does: no mask, is_causal for GPT-2."""
    monkeypatch.setattr(autocast, "eager_mask_branch", contextlib.nullcontext)
    model = build()
    if causal:
        kwargs, targets, loss_fn = {"input_ids": IDS, "labels": IDS}, None, (lambda out: out.loss)
    else:
        kwargs, targets, loss_fn = {"input_ids": IDS}, LABELS, _classify
    eager = _eager_calls(model, kwargs, loss_fn, targets)
    step = capture(model, (), kwargs, targets, loss_fn)
    assert eager and _captured_calls(step) == eager
    assert all(not masked and is_causal == causal for _, masked, is_causal in eager)
    expected = "the causal triangle: is_causal=True" if causal else "all true: no mask"
    assert len(step.attention_notes) == 2 and all(expected in note for note in step.attention_notes)
    assert step.attention_notes[0].startswith("attention at " + ("transformer.h.0.attn" if causal else
                                                                 "bert.encoder.layer.0.attention.self"))


class _TracedMaskAttention(nn.Module):
    """Attention with a mask built as transformers builds it while tracing, in the GPU's strides."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.project = nn.Linear(8, 24)

    def forward(self, x, padding=None):
        batch, length, _ = x.shape
        q, k, v = (t.reshape(batch, length, 2, 4).transpose(1, 2) for t in self.project(x).chunk(3, dim=-1))
        positions = torch.arange(length, device=x.device)
        if self.kind == "all true":  # strides (0, length, 1, 0): refused by the GPU's memory-efficient kernel
            mask = (positions[None, None, :, None] >= 0).expand(batch, -1, length, length)
        elif self.kind == "causal":
            mask = (positions[:, None] >= positions[None, :])[None, None].expand(batch, -1, -1, -1)
        elif self.kind == "band":
            mask = ((positions[:, None] - positions[None, :]).abs() <= 2)[None, None].expand(batch, -1, -1, -1)
        elif self.kind == "zeros":
            mask = torch.zeros(length, length, device=x.device)[None, None].expand(batch, -1, -1, -1)
        else:
            mask = padding[:, None, None, :].bool().expand(-1, -1, length, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, length, 8)


def _sum_of_squares(out):
    return out.pow(2).sum()


@pytest.mark.parametrize("kind, rewritten", [("all true", "no mask"), ("causal", "is_causal=True"),
                                             ("zeros", "no mask"), ("band", None), ("input", None)])
def test_a_constant_mask_is_rewritten_only_where_eager_would_compute_the_same(kind, rewritten):
    """All true and zeros become no mask, the causal triangle is_causal; a band (masks something that is_causal
    does not) and a mask read from an input are kept, each with its reason. The planned step's loss and
    gradients equal eager's (with its explicit mask) to float rounding."""
    torch.manual_seed(0)
    model = _TracedMaskAttention(kind)
    x = torch.randn(3, 10, 8)
    padding = torch.ones(3, 10)
    padding[0, 7:] = 0
    step = capture(model, (x, padding), None, None, _sum_of_squares)
    calls = _captured_calls(step)
    assert len(step.attention_notes) == 1
    note = step.attention_notes[0]
    assert note.startswith("attention at the model's forward: ")
    if rewritten is None:
        assert all(masked for _, masked, _ in calls) and "mask kept as given" in note
        assert ("neither all true nor the causal triangle" if kind == "band" else "step's positional input 1") in note
    else:
        assert all(not masked and is_causal == (kind == "causal") for _, masked, is_causal in calls)
        assert rewritten in note
    reference = _TracedMaskAttention(kind)
    reference.load_state_dict(model.state_dict())
    planned = executor.optimize(model, (x, padding), _sum_of_squares)
    assert planned.attention_notes == [note]
    loss = planned(x, padding)
    loss.backward()
    expected = _sum_of_squares(reference(x, padding))
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, parameter), mine in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, parameter.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_mask_drawn_at_random_is_never_evaluated():
    from executor.capture.attention import constant_value

    graph = torch.fx.Graph()
    drawn = graph.call_function(torch.ops.aten.rand.default, ([4, 4],), {"device": torch.device("cpu")})
    mask = graph.call_function(torch.ops.aten.gt.Scalar, (drawn, 0.5))
    assert constant_value(mask) == (None, "it is drawn at random")


def test_the_notes_come_back_with_a_plan_from_the_cache(tmp_path):
    """A plan served from the cache in a later run (no capture) still says what became of each attention mask."""
    x = torch.randn(3, 10, 8)
    padding = torch.ones(3, 10)

    def run():
        torch.manual_seed(0)
        messages: list[str] = []
        planned = executor.optimize(_TracedMaskAttention("causal"), (x, padding), _sum_of_squares, budget=None,
                                    strategy="keep-all", cache=tmp_path, timed_steps=0, progress=messages.append)
        return planned, messages

    made, _ = run()
    loaded, messages = run()
    assert any("no profile or solve" in m for m in messages)
    assert loaded.attention_notes == made.attention_notes
    assert len(made.attention_notes) == 1 and "is_causal=True" in made.attention_notes[0]
