"""Models nobody here wrote, built small from configs (transformers, never downloaded) or written torchvision-style,
for the executor's model zoo test and benchmarks: each `build_<name>(dtype)` returns (model, inputs, kwargs,
targets, loss_fn)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _generator():
    return torch.Generator().manual_seed(0)


def build_bert(dtype=torch.float32):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = BertForSequenceClassification(config).train().to(dtype)
    ids = torch.randint(0, 64, (8, 48), generator=_generator())
    mask = torch.ones(8, 48, dtype=torch.long)
    mask[:, 40:] = 0  # padding: the attention mask path
    labels = torch.randint(0, 3, (8,), generator=_generator())
    return model, (), {"input_ids": ids, "attention_mask": mask}, labels, lambda out, t: F.cross_entropy(out.logits, t)


def build_gpt2(dtype=torch.float32):
    """Tied input and output embeddings; the model computes its own loss (ForCausalLMLoss)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train().to(dtype)
    ids = torch.randint(0, 64, (8, 48), generator=_generator())
    assert model.lm_head.weight is model.transformer.wte.weight
    return model, (), {"input_ids": ids, "labels": ids}, None, lambda out: out.loss


def build_vit(dtype=torch.float32):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.1,
                       attention_probs_dropout_prob=0.1)
    model = ViTForImageClassification(config).train().to(dtype)
    images = torch.randn(8, 3, 32, 32, generator=_generator(), dtype=dtype)
    labels = torch.randint(0, 5, (8,), generator=_generator())
    return model, (), {"pixel_values": images}, labels, lambda out, t: F.cross_entropy(out.logits, t)


def build_llama(dtype=torch.float32):
    """A LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.1)
    model = LlamaForCausalLM(config).train().to(dtype)
    ids = torch.randint(0, 64, (8, 48), generator=_generator())
    return model, (), {"input_ids": ids, "labels": ids}, None, lambda out: out.loss


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: in-place ReLUs, BatchNorm, a strided 1x1 downsample."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, depthwise 3x3 (groups = channels), linear 1x1 projection, ReLU6 in place."""

    def __init__(self, inputs: int, outputs: int, stride: int, expansion: int = 4):
        super().__init__()
        hidden = inputs * expansion
        self.use_residual = stride == 1 and inputs == outputs
        self.conv = nn.Sequential(
            nn.Conv2d(inputs, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, outputs, 1, bias=False), nn.BatchNorm2d(outputs),
        )

    def forward(self, x):
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True)),
            InvertedResidual(8, 8, 1), InvertedResidual(8, 12, 2), InvertedResidual(12, 12, 1),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(12, classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class InPlaceStage(nn.Module):
    """Each in-place spelling of issue 11, each on a tensor that is read afterwards."""

    def __init__(self, channels: int):
        super().__init__()
        self.c1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.c1(x)
        y.masked_fill_(y < 0, 0)  # Tensor.masked_fill_
        z = self.relu(self.bn(y))  # nn.ReLU(inplace=True)
        w = self.c2(z)
        w.mul_(2)  # Tensor.mul_
        w[:, :4].mul_(2)  # an in-place op on a view
        u = w + z
        u.relu_()  # Tensor.relu_
        v = F.relu(self.c2(u) * 1.5, inplace=True)  # F.relu(..., inplace=True)
        return v + u + y


class InPlaceCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.Sequential(InPlaceStage(3), InPlaceStage(8), InPlaceStage(8))
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.drop(self.stages(x).mean((2, 3))))


def _images(build):
    def make(dtype=torch.float32):
        torch.manual_seed(0)
        model = build().to(dtype)
        images = torch.randn(16, 3, 32, 32, generator=_generator(), dtype=dtype)
        labels = torch.randint(0, 4, (16,), generator=_generator())
        return model, (images,), {}, labels, F.cross_entropy

    return make


build_resnet = _images(ResNet)
build_mobilenet = _images(MobileNetV2)
build_inplace_cnn = _images(InPlaceCNN)

ZOO = {
    "bert": build_bert,
    "gpt2": build_gpt2,
    "vit": build_vit,
    "llama": build_llama,
    "resnet": build_resnet,
    "mobilenet": build_mobilenet,
    "inplace-cnn": build_inplace_cnn,
}


def plannable_ratio(profile, ratio: float = 0.6) -> float:
    """`ratio` of the keep-all peak, or the smallest multiple of 0.05 above it that a plan can meet. The zoo's small
    CNNs keep only what eager autograd keeps (a batch norm's output is not held for its statistics), so their
    keep-all peak is within 1/0.6 of the stem convolution that bounds every plan."""
    import math

    from planner.budget import minimum_budget_bytes
    from planner.strategies.keep_all import keep_all_peak_bytes

    floor = minimum_budget_bytes(profile) / keep_all_peak_bytes(profile)
    return ratio if ratio >= floor else math.ceil(floor * 20 + 1e-9) / 20


def assert_trains_like_plain(model, plain, loss, args, kwargs, targets, loss_fn, seed: int) -> None:
    """`plain`, a copy of `model` before its planned step, stepped as plain PyTorch from `seed`: the same loss and
    the same gradients, bit for bit, as `model`'s planned step gave."""
    torch.manual_seed(seed)
    output = plain(*args, **kwargs)
    plain_loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
    plain_loss.backward()
    assert torch.equal(loss, plain_loss)
    for (name, mine), theirs in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad), name
