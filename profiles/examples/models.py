"""Small demo models the example profiles point at (``factory: models:<name>``)."""

from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm self-attention + MLP, masked by a [batch, seq] boolean mask (True = real token)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(w // self.heads)
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = scores.softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.norm2(x))


class TextClassifier(nn.Module):
    """Token ids + attention mask → class logits, through a small transformer encoder."""

    def __init__(
        self, vocab: int = 1000, width: int = 64, heads: int = 4, layers: int = 2, classes: int = 2, max_len: int = 512
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        m = mask.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(pooled)


def text_classifier(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return TextClassifier(**kwargs)
