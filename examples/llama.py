"""Llama family model file for autopar: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

    autopar inspect examples/llama.py --model-arg size=llama2-7b --batch-size 4

Model arguments (a named ``size`` fills in the dimensions, explicit ones win): ``size``,
``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn`` (SwiGLU inner width), ``seq``,
``vocab``, ``dtype`` (``float32`` default, ``bfloat16``, ``float16``).

Structure: ``tok_emb``, ``layers`` (an ``nn.ModuleList`` of ``Block``: ``attn_norm``,
``attn.wq``/``wk``/``wv`` (column-wise), ``attn.wo`` (row-wise), ``ffn_norm``,
``ffn.w1``/``w3`` (column-wise), ``ffn.w2`` (row-wise)), ``norm``, ``output`` (untied).
Heads are reshaped with ``-1`` so a column-wise shard of wq/wk/wv runs on its local heads;
each query head group shares one key/value head (``heads / kv_heads`` queries per KV head).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# (layers, hidden, heads, kv_heads, ffn, seq, vocab)
# Llama 2: Touvron et al. 2023, "Llama 2", Table 1 (context 4096, GQA for 70B) with the widths
#   of the released configurations (7B ffn 11008, 13B 13824, 70B 28672; vocab 32000).
# Llama 3 8B: Llama Team 2024, "The Llama 3 Herd of Models", Table 3 (32 layers, 4096 wide,
#   32 heads / 8 KV heads, FFN 14336, vocab 128256); context 8192.
SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "llama-tiny": (2, 64, 4, 2, 172, 64, 512),
    "llama2-7b": (32, 4096, 32, 32, 11008, 4096, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 4096, 32000),
    "llama3-8b": (32, 4096, 32, 8, 14336, 8192, 128256),
}
ROPE_THETA = 10000.0      # Su et al. 2021 (RoFormer), base of the rotary frequencies
NORM_EPS = 1e-5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_dims(**dims) -> None:
    """Refuse a dimension that is not a whole number >= 1 (``layers=0`` would silently build a
    model without blocks, or fall back to the default size)."""
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be a whole number >= 1")


def resolve_config(size: str = "llama-tiny", layers=None, hidden=None, heads=None, kv_heads=None,
                   ffn=None, seq=None, vocab=None) -> dict[str, int]:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    d = dict(zip(("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab"), SIZES[size]))
    for k, v in dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     seq=seq, vocab=vocab).items():
        if v is not None:
            d[k] = v
    if heads is not None and kv_heads is None:
        d["kv_heads"] = d["heads"]
    check_dims(**d)
    if d["hidden"] % d["heads"] or d["heads"] % d["kv_heads"]:
        raise ValueError(f"hidden={d['hidden']} must divide by heads={d['heads']}, "
                         f"and heads by kv_heads={d['kv_heads']}")
    return d


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.num_rep = heads // kv_heads                      # query heads per KV head
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q = self.wq(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)   # [b, heads, s, d]
        k = self.wk(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)   # [b, kv_heads, s, d]
        v = self.wv(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)
        # rotary position embedding, rotate-half form (Su et al. 2021, Eq. 34)
        pos = torch.arange(s, device=x_BSH.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)                          # [s, d/2]
        angles = torch.cat((angles, angles), dim=-1)                      # [s, d]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(self.num_rep, dim=1)                      # [b, heads, s, d]
        v = v.repeat_interleave(self.num_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # [b, heads, s, d]
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=NORM_EPS)
        self.attn = Attention(hidden, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(hidden, eps=NORM_EPS)
        self.ffn = FeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int):
        super().__init__()
        self.seq = seq
        # _weight skips nn.Embedding's N(0, 1) init (pointless on meta, and slow there)
        self.tok_emb = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=NORM_EPS)
        self.output = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx_BS: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx_BS)                                          # [b, s, h]
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))                                  # [b, s, vocab]


def _init_weights(module: nn.Module) -> None:
    if any(p.is_meta for p in module.parameters(recurse=False)):
        return                                                            # nothing to fill on meta
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def build_model(size: str = "llama-tiny", layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None,
                seq: int | None = None, vocab: int | None = None, dtype: str = "float32") -> nn.Module:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
    model = Llama(**resolve_config(size, layers, hidden, heads, kv_heads, ffn, seq, vocab))
    model.apply(_init_weights)
    return model.to(DTYPES[dtype])


def make_batch(batch_size: int, size: str = "llama-tiny", seq: int | None = None,
               vocab: int | None = None, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    cfg = resolve_config(size, seq=seq, vocab=vocab)
    tokens = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"] + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), target_BS.flatten())
