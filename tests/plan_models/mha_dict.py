"""A small transformer on ``nn.MultiheadAttention`` (which returns ``(output, None)`` without
attention weights) whose forward returns a dict.  Planner/capture test fixture.

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class MHAModel(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return {"logits": self.head(x)}


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq: int = 8, vocab: int = 64):
    return MHAModel(layers, hidden, heads, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target):
    return F.cross_entropy(output["logits"].flatten(0, 1), target.flatten())
