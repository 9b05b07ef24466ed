"""Reference networks by name, each with its input shape, example data and loss.

`get_model("vgg19")` is the network of the papers; `small=True` is a tiny
variant with the same kinds of layers (for CPU tests and measured profiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.networks.resnet import LAYOUTS, ResNet
from models.networks.transformer import Transformer
from models.networks.unet import UNet
from models.networks.vgg import VGG, vgg_blocks

from models.names import MODEL_NAMES, VGG_NAMES  # noqa: E402  (kept here too: torch-free for the service's checks)


@dataclass(frozen=True)
class ModelSpec:
    """How to build a reference network and feed it one training step."""

    name: str
    description: str
    input_shape: tuple[int, ...]
    target: str  # "class" (one label per sample), "pixel-class" (one label per pixel) or "regression"
    num_classes: int
    builder: Callable[[], nn.Module] = field(repr=False)
    small: bool = False

    def build(self) -> nn.Module:
        return self.builder()

    def example_inputs(
        self, batch_size: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the right shapes (seeded, so runs repeat)."""
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, not {batch_size}")
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn((batch_size, *self.input_shape), generator=generator, dtype=dtype)
        if self.target == "class":
            targets = torch.randint(self.num_classes, (batch_size,), generator=generator)
        elif self.target == "pixel-class":
            targets = torch.randint(self.num_classes, (batch_size, *self.input_shape[1:]), generator=generator)
        else:
            targets = torch.randn((batch_size, *self.input_shape), generator=generator, dtype=dtype)
        return inputs.to(device), targets.to(device)

    def target_shape(self, batch_size: int) -> tuple[tuple[int, ...], str]:
        """Shape and kind ("int64" or "float") of the targets, without making them."""
        if self.target == "class":
            return (batch_size,), "int64"
        if self.target == "pixel-class":
            return (batch_size, *self.input_shape[1:]), "int64"
        return (batch_size, *self.input_shape), "float"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.target == "regression":
            return F.mse_loss(output, targets)
        return F.cross_entropy(output, targets)


def list_models() -> list[str]:
    return list(MODEL_NAMES)


def get_model(name: str, small: bool = False, *, image_size: int | None = None, tokens: int | None = None) -> ModelSpec:
    """The named network; `image_size` (images) or `tokens` (transformer) override the default input size."""
    key = name.lower().replace("-", "")
    if key not in MODEL_NAMES:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    if key == "transformer":
        if image_size is not None:
            raise ValueError("the transformer takes token sequences: give tokens, not image_size")
        return _transformer(small, tokens)
    if tokens is not None:
        raise ValueError(f"{key} takes images: give image_size, not tokens")
    size = image_size or (32 if small else (256 if key == "unet" else 224))
    if size < (16 if key == "unet" else 32):
        raise ValueError(f"image size {size} is too small for {key}")
    if key in VGG_NAMES:
        return _vgg(key, small, size)
    if key == "unet":
        return _unet(small, size)
    return _resnet(key, small, size)


def _vgg(name: str, small: bool, size: int) -> ModelSpec:
    blocks = vgg_blocks(name)
    if small:
        build = lambda: VGG(blocks, channels=(4, 8, 16, 32, 32), hidden=32, num_classes=10, pooled_size=1)  # noqa: E731
        classes = 10
    else:
        build = lambda: VGG(blocks)  # noqa: E731
        classes = 1000
    depth = sum(blocks) + 3
    return ModelSpec(name, f"VGG-{depth} ({sum(blocks)} convolutions)", (3, size, size), "class", classes, build, small)


def _unet(small: bool, size: int) -> ModelSpec:
    if size % 16:
        raise ValueError(f"U-Net needs an image size divisible by 16, not {size}")
    base = 4 if small else 64
    # 3 input channels: the RGB Data Science Bowl images of the MO-SOS experiment (Ronneberger used 1)
    return ModelSpec("unet", "U-Net (Ronneberger et al. 2015), padded convolutions", (3, size, size), "pixel-class", 2,
                     lambda: UNet(3, 2, base), small)


def _resnet(name: str, small: bool, size: int) -> ModelSpec:
    base, classes = (4, 10) if small else (64, 1000)
    return ModelSpec(name, f"ResNet-{name.removeprefix('resnet')} ({LAYOUTS[name][0]} blocks)", (3, size, size), "class",
                     classes, lambda: ResNet(name, base, classes), small)


def _transformer(small: bool, tokens: int | None) -> ModelSpec:
    width, heads, layers = (16, 2, 2) if small else (1024, 16, 24)
    length = tokens or (8 if small else 1024)
    return ModelSpec("transformer", f"transformer encoder, {layers} blocks, width {width}, {heads} heads",
                     (length, width), "regression", 0, lambda: Transformer(width, heads, layers), small)
