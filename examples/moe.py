"""Mixture-of-experts decoder model file for autopar: the Llama block (RMSNorm, rotary embeddings,
grouped-query attention) with its feed-forward replaced by routed SwiGLU experts.

    autopar inspect examples/moe.py --model-arg experts=8 --model-arg top_k=2 --batch-size 2

Model arguments: ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``head_dim`` (0: hidden / heads),
``experts`` (E), ``top_k`` (k), ``expert_ffn`` (each expert's SwiGLU inner width), ``shared_ffn``
(inner width of an always-on shared expert, 0: none), ``dense_layers`` (the first blocks keep a
dense SwiGLU of width ``dense_ffn``), ``qk_norm`` (1: RMSNorm of each query and key head, as
Qwen3), ``seq``, ``vocab``, ``dtype`` (``bfloat16`` only: ``DTYPES``).  Defaults are a tiny model.

The routed experts (``Experts``): the weights of all E experts stacked as ``w13 [E, hidden,
2 * expert_ffn]`` (gate and up fused) and ``w2 [E, expert_ffn, hidden]``, called as transformers 5
calls its experts, ``experts(x [T, h], top_k_index [T, k], top_k_weights [T, k])`` (an index
``>= num_experts`` adds nothing: core/experts.py).  Inside, the T x k (token, expert) pairs are
sorted by expert and both projections run as one grouped GEMM each (``torch._grouped_mm`` with the
per-expert row offsets), as Megatron-Core's ``TEGroupedMLP`` and torchtitan's ``GroupedExperts``
do; the outputs are unsorted and summed with the router's weights.  Every shape is static (the
token counts per expert are values, not shapes), so the model captures on meta at any size.

Router: softmax over a ``Linear(hidden, E)``'s scores, top-k, the chosen weights renormalised to
sum to one (Mixtral, Jiang et al. 2024, Sec. 2.1; Qwen3's ``norm_topk_prob``).  FLOPs per token
and MoE layer: 2 h E (router) + k * 3 * 2 h f (the chosen experts' SwiGLU: three h x f matmuls,
Shazeer 2020) + 3 * 2 h f_shared.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ROPE_THETA = 10000.0      # Su et al. 2021 (RoFormer), base of the rotary frequencies
NORM_EPS = 1e-6
#: ``torch._grouped_mm`` takes bf16 operands (its meta and CUDA kernels refuse others), so the model is bf16
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEFAULTS = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=0, experts=4, top_k=2, expert_ffn=32,
                shared_ffn=0, dense_layers=0, dense_ffn=128, qk_norm=0, seq=64, vocab=512)


def resolve_config(**given) -> dict[str, int]:
    d = dict(DEFAULTS)
    d.update({k: v for k, v in given.items() if v is not None})
    for name, value in d.items():
        floor = 0 if name in ("head_dim", "shared_ffn", "dense_layers", "qk_norm") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < floor:
            raise ValueError(f"{name}={value!r}; it must be a whole number >= {floor}")
    if d["heads"] % d["kv_heads"] or (not d["head_dim"] and d["hidden"] % d["heads"]):
        raise ValueError(f"heads={d['heads']} must divide by kv_heads={d['kv_heads']}, and hidden={d['hidden']} "
                         f"by heads unless head_dim is given")
    if not 1 <= d["top_k"] <= d["experts"]:
        raise ValueError(f"top_k={d['top_k']} must be between 1 and experts={d['experts']}")
    if d["dense_layers"] > d["layers"]:
        raise ValueError(f"dense_layers={d['dense_layers']} exceeds layers={d['layers']}")
    return d


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.head_dim = head_dim
        self.num_rep = heads // kv_heads
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=NORM_EPS) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=NORM_EPS) if qk_norm else None
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q = self.wq(x_BSH).view(b, s, -1, self.head_dim)
        k = self.wk(x_BSH).view(b, s, -1, self.head_dim)
        v = self.wv(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        pos = torch.arange(s, device=x_BSH.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(self.num_rep, dim=1)
        v = v.repeat_interleave(self.num_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """E SwiGLU experts, stacked; one grouped GEMM per projection over the rows sorted by expert."""

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.num_experts = experts
        self._is_expert_parallel = False
        self.w13 = nn.Parameter(torch.empty(experts, hidden, 2 * ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        present = top_k_index < self.num_experts                       # an index >= E adds nothing
        chosen = torch.where(present, top_k_index, self.num_experts - 1).flatten()   # [T*k]
        order = torch.argsort(chosen, stable=True)
        counts = torch.histc(chosen.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)          # end row of each expert's group
        rows = x[order // k]                                           # [T*k, h], sorted by expert
        gate, up = torch._grouped_mm(rows, self.w13, offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offsets)            # [T*k, h]
        unsorted = torch.empty_like(out).index_copy(0, order, out)
        gates = (top_k_weights * present.to(top_k_weights.dtype)).to(out.dtype)
        return (unsorted.view(t, k, -1) * gates.unsqueeze(-1)).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int, shared_ffn: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, expert_ffn, experts)
        self.shared = SwiGLU(hidden, shared_ffn) if shared_ffn else None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, h = x_BSH.shape
        x = x_BSH.reshape(b * s, h)
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts(x, chosen, weights)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(b, s, h)


class Block(nn.Module):
    def __init__(self, cfg: dict, dense: bool):
        super().__init__()
        hd = cfg["head_dim"] or cfg["hidden"] // cfg["heads"]
        self.attn_norm = nn.RMSNorm(cfg["hidden"], eps=NORM_EPS)
        self.attn = Attention(cfg["hidden"], cfg["heads"], cfg["kv_heads"], hd, bool(cfg["qk_norm"]))
        self.ffn_norm = nn.RMSNorm(cfg["hidden"], eps=NORM_EPS)
        self.ffn = (SwiGLU(cfg["hidden"], cfg["dense_ffn"]) if dense else
                    MoE(cfg["hidden"], cfg["expert_ffn"], cfg["experts"], cfg["top_k"], cfg["shared_ffn"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class MoEDecoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab"], cfg["hidden"], _weight=torch.empty(cfg["vocab"], cfg["hidden"]))
        self.layers = nn.ModuleList(Block(cfg, dense=i < cfg["dense_layers"]) for i in range(cfg["layers"]))
        self.norm = nn.RMSNorm(cfg["hidden"], eps=NORM_EPS)
        self.output = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)

    def forward(self, idx_BS: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx_BS)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


def _init_weights(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        if not p.is_meta and p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=0.02)


def build_model(layers=None, hidden=None, heads=None, kv_heads=None, head_dim=None, experts=None, top_k=None,
                expert_ffn=None, shared_ffn=None, dense_layers=None, dense_ffn=None, qk_norm=None, seq=None,
                vocab=None, dtype: str = "bfloat16") -> nn.Module:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
    cfg = resolve_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         experts=experts, top_k=top_k, expert_ffn=expert_ffn, shared_ffn=shared_ffn,
                         dense_layers=dense_layers, dense_ffn=dense_ffn, qk_norm=qk_norm, seq=seq, vocab=vocab)
    model = MoEDecoder(cfg)
    model.apply(_init_weights)
    return model.to(DTYPES[dtype])


def make_batch(batch_size: int, seq: int | None = None, vocab: int | None = None, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    cfg = resolve_config(seq=seq, vocab=vocab)
    tokens = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"] + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), target_BS.flatten())
