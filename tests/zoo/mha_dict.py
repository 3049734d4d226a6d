"""A small transformer encoder classifier built on ``nn.MultiheadAttention`` (whose forward
returns ``(output, None)`` when ``need_weights=False``) that returns a dict
``{"logits": [b, classes], "pooled": [b, hidden]}``.

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``seq`` (8), ``vocab`` (64),
``classes`` (8).  Target: one class per sample.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class EncoderBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x):
        h = self.norm1(x)
        attended, _ = self.attn(h, h, h, need_weights=False)
        x = x + attended
        return x + self.ff(self.norm2(x))


class Classifier(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        pooled = self.norm(x).mean(dim=1)
        return {"logits": self.head(pooled), "pooled": pooled}


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq: int = 8, vocab: int = 64, classes: int = 8):
    return Classifier(layers, hidden, heads, seq, vocab, classes)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, classes: int = 8, **_ignored):
    """Token ids [b, seq] and class labels [b]."""
    return torch.randint(0, vocab, (batch_size, seq)), torch.randint(0, classes, (batch_size,))


def loss_fn(output: dict, labels_B: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"], labels_B)
