"""A token language model whose feed-forward is a mixture of experts with top-k routing.

Each ``MoEBlock`` has a router ``Linear(hidden, experts)``; a token goes to its ``top_k``
highest-scoring experts, whose outputs are mixed by the softmax of those top-k scores
(Shazeer et al. 2017; Fedus et al. 2022).  The experts' weights are stacked as parameters
``w_in [experts, hidden, ffn]`` and ``w_out [experts, ffn, hidden]`` of one ``Experts`` module
called as transformers 5 calls its experts, ``experts(x, top_k_index, top_k_weights)`` (an
index ``>= num_experts`` adds nothing, as its ``_is_expert_parallel`` flag promises); a token's
chosen experts' weights are gathered by index and applied with batched matmuls, so only the
top-k experts run per token and every shape is static (no data-dependent token counts).

Model arguments: ``layers`` (2), ``hidden`` (32), ``ffn`` (64), ``experts`` (4), ``top_k`` (2),
``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Experts(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.num_experts = experts
        self._is_expert_parallel = False
        self.w_in = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn ** -0.5)

    def forward(self, x, top_k_index, top_k_weights):
        t, k = top_k_index.shape
        present = top_k_index < self.num_experts                           # [T, k]
        chosen = torch.where(present, top_k_index, 0).flatten()
        w_in = self.w_in[chosen]                                           # [T*k, h, f]
        w_out = self.w_out[chosen]                                         # [T*k, f, h]
        xk = x.repeat_interleave(k, dim=0).unsqueeze(1)                    # [T*k, 1, h]
        y = torch.bmm(F.gelu(torch.bmm(xk, w_in)), w_out).squeeze(1)       # [T*k, h]
        gates = top_k_weights * present.to(top_k_weights.dtype)
        return (y.view(t, k, -1) * gates.unsqueeze(-1)).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, ffn, experts)

    def forward(self, x_BSH):
        b, s, h = x_BSH.shape
        x = x_BSH.reshape(b * s, h)                                        # [T, h]
        scores, chosen = self.router(x).topk(self.top_k, dim=-1)           # [T, k]
        gates = F.softmax(scores, dim=-1)                                  # [T, k]
        return self.experts(x, chosen, gates).view(b, s, h)


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, ffn, experts, top_k)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, experts: int, top_k: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MoEBlock(hidden, ffn, experts, top_k) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(layers: int = 2, hidden: int = 32, ffn: int = 64, experts: int = 4, top_k: int = 2,
                seq: int = 8, vocab: int = 64):
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
    return MoELM(layers, hidden, ffn, experts, top_k, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
