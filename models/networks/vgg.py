"""VGG (Simonyan & Zisserman) and the very deep variants of the vDNN paper.

VGG-116/216/316/416 (Rhu et al., MICRO 2016) add 20 extra 3x3 convolutions to
each of the five blocks for every extra 100 layers; the extra convolutions keep
the block's channel count.
"""

from __future__ import annotations

from torch import nn

BLOCKS = {
    "vgg16": (2, 2, 3, 3, 3),
    "vgg19": (2, 2, 4, 4, 4),
}
CHANNELS = (64, 128, 256, 512, 512)


def vgg_blocks(name: str) -> tuple[int, ...]:
    """Convolutions per block for vgg16, vgg19, vgg116, vgg216, vgg316, vgg416."""
    if name in BLOCKS:
        return BLOCKS[name]
    depth = int(name.removeprefix("vgg"))
    extra_hundreds = (depth - 16) // 100
    if depth < 116 or (depth - 16) % 100:
        raise ValueError(f"unknown VGG depth {depth}: use 16, 19, 116, 216, 316 or 416")
    return tuple(n + 20 * extra_hundreds for n in BLOCKS["vgg16"])


class VGG(nn.Module):
    """Conv3x3+ReLU blocks, max-pooling, and the 3-layer classifier with dropout."""

    def __init__(
        self,
        blocks: tuple[int, ...],
        channels: tuple[int, ...] = CHANNELS,
        hidden: int = 4096,
        num_classes: int = 1000,
        pooled_size: int = 7,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for count, width in zip(blocks, channels):
            for _ in range(count):
                layers += [nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU()]
                in_channels = width
            layers.append(nn.MaxPool2d(2, 2))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(pooled_size)
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * pooled_size * pooled_size, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.flatten(self.avgpool(self.features(x))))
