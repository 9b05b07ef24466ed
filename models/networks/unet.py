"""U-Net (Ronneberger, Fischer & Brox, MICCAI 2015), the network of the MO-SOS experiment.

As in the paper: two 3x3 convolutions + ReLU per level, 2x2 max-pooling, 2x2
up-convolutions that halve the channels, concatenation with the cropped
contracting-path map, dropout at the end of the contracting path, and a 1x1
convolution to the classes. One change: the 3x3 convolutions are padded, so a
256x256 input gives a 256x256 segmentation map and no cropping is needed.
"""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        return self.relu2(self.conv2(self.relu1(self.conv1(x))))


class Up(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 2, base: int = 64, depth: int = 4):
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        previous = in_channels
        for width in widths[:-1]:
            self.down.append(DoubleConv(previous, width))
            previous = width
        self.pool = nn.MaxPool2d(2, 2)
        self.bottom = DoubleConv(widths[-2], widths[-1])
        self.dropout = nn.Dropout(0.5)
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(base, num_classes, 1)

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.dropout(self.bottom(x))
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)
