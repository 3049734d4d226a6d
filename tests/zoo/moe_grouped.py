"""A top-k mixture-of-experts language model written as torchtitan writes its MoE layer: the
router's choices are sorted by expert, and a ``GroupedExperts`` module holding the stacked expert
weights ``w1, w3 [experts, ffn, hidden]``, ``w2 [experts, hidden, ffn]`` (SwiGLU) is called as
``experts(x_sorted_by_expert, num_tokens_per_expert)``; the outputs are unsorted and summed with
the router's weights (torchtitan's ``MoE`` / ``GroupedExperts``, 2025, for-loop variant).

Data-dependent token counts: capture keeps the MoE block opaque (it cannot run on meta).

Model arguments: ``layers`` (2), ``hidden`` (32), ``ffn`` (32), ``experts`` (4), ``top_k`` (2),
``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GroupedExperts(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) * ffn ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, ffn, hidden) * hidden ** -0.5)

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append(F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e]))
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.top_k, self.experts_n = top_k, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = GroupedExperts(hidden, ffn, experts)

    def forward(self, x_BSH):
        b, s, h = x_BSH.shape
        x = x_BSH.reshape(b * s, h)
        scores = F.softmax(self.router(x), dim=-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)                     # [T, k]
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.experts_n)
        out = self.experts(x[order // self.top_k], counts)                    # sorted by expert
        unsorted = torch.empty_like(out).index_copy(0, order, out)
        return (unsorted.view(b * s, self.top_k, h) * weights.unsqueeze(-1)).sum(dim=1).view(b, s, h)


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, ffn, experts, top_k)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class GroupedMoELM(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, experts: int, top_k: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, ffn, experts, top_k) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(layers: int = 2, hidden: int = 32, ffn: int = 32, experts: int = 4, top_k: int = 2,
                seq: int = 8, vocab: int = 64):
    return GroupedMoELM(layers, hidden, ffn, experts, top_k, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
