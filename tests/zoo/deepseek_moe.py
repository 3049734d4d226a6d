"""A DeepSeek-V3-style mixture-of-experts language model, tiny and hand-written (transformers'
DeepseekV3 is not used: its tiny config brings multi-head latent attention and rope scaling that
have nothing to do with the experts).

What makes it DeepSeek-V3-like (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 2.1.2):

- the first ``dense_layers`` blocks have a dense SwiGLU MLP, the others a mixture of experts;
- a mixture of experts = one always-on **shared expert** plus ``experts`` **routed experts**,
  each a SwiGLU MLP, held in an ``nn.ModuleList`` (the layout of DeepSeek's own code and of
  transformers 4's ``DeepseekV3MoE``) and called once per expert on the rows routed to it;
- the router scores every expert with a sigmoid; the top-k are chosen on the scores plus a
  per-expert bias (a buffer without gradient, the auxiliary-loss-free balancing), and the
  chosen scores are normalised to sum to one and multiplied by ``routed_scaling`` (eq. 12-16).

Attention: causal multi-head attention with torch's ``scaled_dot_product_attention``.

Model arguments: ``layers`` (3), ``dense_layers`` (1), ``hidden`` (32), ``heads`` (4), ``ffn`` (64),
``expert_ffn`` (16), ``experts`` (4), ``top_k`` (2), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTED_SCALING = 2.5   # DeepSeek-V3's routed_scaling_factor (its config.json)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores, top-k on score + bias, normalised chosen scores times the scaling."""

    def __init__(self, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(experts, hidden) * hidden ** -0.5)
        self.register_buffer("score_bias", torch.linspace(-0.05, 0.05, experts))

    def forward(self, x):
        scores = torch.sigmoid(F.linear(x, self.weight))                      # [T, E]
        chosen = torch.topk(scores + self.score_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True) * ROUTED_SCALING
        return chosen, weights


class MoE(nn.Module):
    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int):
        super().__init__()
        self.gate = Router(hidden, experts, top_k)
        self.experts = nn.ModuleList(SwiGLU(hidden, expert_ffn) for _ in range(experts))
        self.shared_experts = SwiGLU(hidden, expert_ffn)

    def forward(self, x_BSH):
        b, s, h = x_BSH.shape
        x = x_BSH.reshape(b * s, h)
        chosen, weights = self.gate(x)
        routed = torch.zeros_like(x)
        hits = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 0, 1)   # [E, T, k]
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(hits[e])
            out = expert(x[token]) * weights[token, slot].unsqueeze(-1)
            routed = routed.index_add(0, token, out)
        return (routed + self.shared_experts(x)).view(b, s, h)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, expert_ffn: int, experts: int, top_k: int, dense: bool):
        super().__init__()
        self.head_dim = hidden // heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, ffn) if dense else MoE(hidden, expert_ffn, experts, top_k)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q, k, v = (p(y).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.mlp_norm(x))


class DeepSeekLM(nn.Module):
    def __init__(self, layers, dense_layers, hidden, heads, ffn, expert_ffn, experts, top_k, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, expert_ffn, experts, top_k, dense=i < dense_layers)
                                    for i in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(layers: int = 3, dense_layers: int = 1, hidden: int = 32, heads: int = 4, ffn: int = 64,
                expert_ffn: int = 16, experts: int = 4, top_k: int = 2, seq: int = 8, vocab: int = 64):
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
    return DeepSeekLM(layers, dense_layers, hidden, heads, ffn, expert_ffn, experts, top_k, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
