"""A small language model whose LM head is tied to its token embedding and whose layers pass
one activation (so it can be cut into pipeline stages, the embedding on the first stage and
the head on the last): ``embed`` -> ``blocks`` (pre-norm residual MLPs) -> ``norm`` ->
``head`` (``head.weight is embed.weight``).

Model arguments: ``layers`` (2), ``hidden`` (32), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class TiedLM(nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(layers: int = 2, hidden: int = 32, seq: int = 8, vocab: int = 64):
    return TiedLM(layers, hidden, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
