"""ResNet-18/50/101 (He et al., CVPR 2016), bottleneck with the stride on the 3x3 (v1.5)."""

from __future__ import annotations

from torch import nn

LAYOUTS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
}


class Basic(nn.Module):
    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.relu2 = nn.ReLU()
        self.shortcut = _shortcut(in_channels, out, stride)

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        identity = x if self.shortcut is None else self.shortcut(x)
        return self.relu2(y + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu3 = nn.ReLU()
        self.shortcut = _shortcut(in_channels, out, stride)

    def forward(self, x):
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        identity = x if self.shortcut is None else self.shortcut(x)
        return self.relu3(y + identity)


def _shortcut(in_channels: int, out_channels: int, stride: int):
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))


class ResNet(nn.Module):
    def __init__(self, name: str, base: int = 64, num_classes: int = 1000):
        super().__init__()
        kind, counts = LAYOUTS[name]
        block = Basic if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(3, base, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        in_channels = base
        for index, count in enumerate(counts):
            width = base * 2**index
            blocks = []
            for i in range(count):
                blocks.append(block(in_channels, width, 2 if (i == 0 and index > 0) else 1))
                in_channels = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))
