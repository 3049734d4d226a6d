"""A transformer-free mixture-of-experts stack: each block routes every token to ``top_k`` of
``experts`` MLP experts (softmax router, torch.topk), Shazeer et al. 2017 style, with the tokens
gathered per expert (data-dependent shapes).  Planner/capture test fixture.

Model arguments: ``layers`` (2), ``hidden`` (16), ``experts`` (4), ``top_k`` (1), ``seq`` (8),
``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)))


class MoE(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(flat).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, weights[rows, slot, None] * expert(flat[rows]))
        return x + out.reshape(x.shape)


class MoEModel(nn.Module):
    def __init__(self, layers: int, hidden: int, experts: int, top_k: int, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MoE(hidden, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model(layers: int = 2, hidden: int = 16, experts: int = 4, top_k: int = 1, seq: int = 8,
                vocab: int = 64):
    return MoEModel(layers, hidden, experts, top_k, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
