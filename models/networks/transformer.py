"""A stack of pre-norm transformer encoder blocks, so that not everything is a convolution.

Each block: LayerNorm, q/k/v projections, multi-head scaled dot-product
attention, output projection, residual add; LayerNorm, MLP (4x, GELU),
residual add. The input is an already embedded sequence (batch, tokens,
width); the loss is the mean squared error to a target of the same shape.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.head_width = width // heads
        self.norm1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def _split(self, x):
        # (batch, tokens, width) -> (batch, heads, tokens, head_width); no sizes, so fx can trace it
        return x.unflatten(-1, (self.heads, self.head_width)).transpose(1, 2)

    def forward(self, x):
        h = self.norm1(x)
        a = F.scaled_dot_product_attention(self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h)))
        a = a.transpose(1, 2).flatten(2)
        x = x + self.proj(a)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, width: int = 1024, heads: int = 16, layers: int = 24):
        super().__init__()
        self.blocks = nn.Sequential(*(EncoderBlock(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.blocks(x))
