"""Parameter-efficient fine-tuning, as people fine-tune models that do not fit: peft adapters (LoRA, DoRA) on
transformers models built from configs. The base weights are frozen, only the adapters train; every step is
eager PyTorch's bit for bit (loss, every adapter's gradient, frozen weights without one) within the budget."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import executor  # noqa: E402


def _causal_batch():
    ids = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _loss(output):
    return output.loss


def _trains_like_eager(model, kwargs, autocast: bool, steps: int = 2) -> None:
    plain = copy.deepcopy(model)
    region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else (
        lambda: torch.autocast("cpu", enabled=False))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    plain_optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a measuring pass over its budget is a RuntimeWarning
        with region():
            planned = executor.optimize(model, (), _loss, kwargs=kwargs, budget=None, memory_ratio=0.6,
                                        optimizer=optimizer, time_limit_s=3, workers=1, cache=False, progress=False)
    for step in range(steps):
        torch.manual_seed(step)
        with region():
            loss = planned(**kwargs)
        loss.backward()
        torch.manual_seed(step)
        with region():
            plain_loss = _loss(plain(**kwargs))
        plain_loss.backward()
        assert torch.equal(loss.detach(), plain_loss.detach()), step
        for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
            assert (a.grad is None) == (b.grad is None), name
            assert a.grad is None or torch.equal(a.grad, b.grad), f"step {step}: {name}"
        assert planned.peak_memory_bytes <= planned.schedule.budget_bytes
        optimizer.step()
        plain_optimizer.step()
        optimizer.zero_grad()
        plain_optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_dora_under_bf16_autocast_is_eager_autocasts():
    """DoRA normalises by a detached norm of the factors' product, so each factor is cast twice and has a gradient
    through one cast only: refused before, as not a plain sum of cast-backs (executor.capture.autocast)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config).train(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], use_dora=True, lora_dropout=0.05))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; a nonzero one makes the adapter change the output
            torch.nn.init.normal_(parameter, std=0.02)
    _trains_like_eager(model, _causal_batch(), autocast=True)


def test_lora_on_every_linear_layer_is_measured_within_its_budget():
    """LoRA's dropout over a frozen layer's output: no backward reads its mask, which the provisional workspace
    left out, and the measuring pass went over the budget by the measured figures (4.55 MiB of 4.54)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=16)
    model = peft.get_peft_model(transformers.MistralForCausalLM(config).train(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1))
    _trains_like_eager(model, _causal_batch(), autocast=False)
