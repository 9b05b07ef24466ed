"""Workloads the executor's benchmarks measure, as `benchmarks/workloads.py:NAME` specs (models/workload.py).

- `elementwise`: issue 11's case of cheap element-wise operations with large activations, 12 x tanh(x * s)
  on float32 activations of 32 MiB each: the product x * s is a transient the old ledger did not count.
- `bert_small`: BertForSequenceClassification from a config (never downloaded): 4 layers, hidden 256,
  4 heads, batch 8, sequence 128.
- `gpt2_small`: GPT2LMHeadModel from a config: 4 layers, hidden 256, batch 8, sequence 128, its own loss.
- `resnet18_small`: the reference ResNet-18 (models/), small variant, batch 8.
- `tiny_layers`: issue 45's many small operations, 300 x tanh(x * scale + shift) on 16 x 64 activations (1,500
  planning nodes of microseconds each): what the replay costs beyond the ATen work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ElementwiseChain(nn.Module):
    """tanh(x * s), `layers` times: every activation is as large as the input, every operation cheap."""

    def __init__(self, layers: int = 12):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.tensor(1.0 + 0.01 * i)) for i in range(layers))

    def forward(self, x):
        for scale in self.scales:
            x = torch.tanh(x * scale)
        return x


def elementwise(batch_size: int | None = None, activation_mib: int = 32, layers: int = 12):
    torch.manual_seed(0)
    rows = batch_size or 8
    x = torch.randn(rows, activation_mib * 2**20 // 4 // rows)
    return {"model": ElementwiseChain(layers), "inputs": (x,), "loss_fn": lambda out: out.square().mean()}


class TinyLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width) * 1.01)
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return torch.tanh(x * self.scale + self.shift)


def tiny_layers(batch_size: int | None = None, layers: int = 300, width: int = 64):
    torch.manual_seed(0)
    model = nn.Sequential(*[TinyLayer(width) for _ in range(layers)])
    x, targets = torch.randn(batch_size or 16, width), torch.randn(batch_size or 16, width)
    return {"model": model, "inputs": (x,), "targets": targets, "loss_fn": F.mse_loss}


def bert_small(batch_size: int | None = None, layers: int = 4, hidden: int = 256, sequence: int = 128):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    batch = batch_size or 8
    config = BertConfig(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=hidden // 64, intermediate_size=4 * hidden,
                        max_position_embeddings=max(512, sequence), num_labels=4)
    model = BertForSequenceClassification(config).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (batch, sequence), generator=generator)
    labels = torch.randint(0, 4, (batch,), generator=generator)
    return {"model": model, "inputs": (), "kwargs": {"input_ids": ids}, "targets": labels,
            "loss_fn": lambda out, t: F.cross_entropy(out.logits, t)}


def gpt2_small(batch_size: int | None = None, layers: int = 4, hidden: int = 256, sequence: int = 128):
    """GPT-2 from a config (tied embeddings, its own causal LM loss): 4 layers, hidden 256, batch 8, sequence 128."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1024, n_positions=max(512, sequence), n_embd=hidden, n_layer=layers,
                        n_head=hidden // 64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 1024, (batch_size or 8, sequence), generator=torch.Generator().manual_seed(0))
    return {"model": model, "inputs": (), "kwargs": {"input_ids": ids, "labels": ids}, "loss_fn": lambda out: out.loss}


def gpt2_vocab(batch_size: int | None = None, sequence: int = 128):
    """GPT-2 (4 layers, hidden 256) with its real vocabulary, 50,257 classes, at batch 4: the logits (100 MiB) and
    their gradient outweigh the blocks' activations, as they do on a GPU at GPT-2's own sizes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=max(512, sequence), n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 50257, (batch_size or 4, sequence), generator=torch.Generator().manual_seed(0))
    return {"model": model, "inputs": (), "kwargs": {"input_ids": ids, "labels": ids}, "loss_fn": lambda out: out.loss}


def convnext_small(batch_size: int | None = None):
    """transformers' ConvNeXt from a config (four stages, 16-128 channels, 7x7 depthwise), 64x64 images at batch
    16: its last stages' images are 4x4 and 2x2."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10,
                            image_size=64)
    model = ConvNextForImageClassification(config).train()
    batch = batch_size or 16
    pixels = torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
    return {"model": model, "inputs": (), "kwargs": {"pixel_values": pixels, "labels": labels},
            "loss_fn": lambda out: out.loss}


def bert_base(batch_size: int | None = None):
    """BERT-base's shape (12 layers, hidden 768, 12 heads) at sequence 512: the planning-node count target."""
    return bert_small(batch_size or 1, layers=12, hidden=768, sequence=512)


def resnet18_small(batch_size: int | None = None):
    from models.workload import reference_workload

    return reference_workload("resnet18", batch_size or 8, small=True)


def resnet18_batch256(batch_size: int | None = None):
    """ResNet-18-small at batch 256: about 10 MiB of activations at its keep-all peak (beyond fixed memory),
    a few times the interpreter's own noise in a step's RSS."""
    return resnet18_small(batch_size or 256)
