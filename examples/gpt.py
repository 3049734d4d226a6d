"""GPT family model file for autopar (GPT-2 and GPT-3 sizes, or free dimensions).

    autopar inspect examples/gpt.py --model-arg size=gpt3-175b --batch-size 8
    autopar inspect examples/gpt.py --model-arg layers=4 --model-arg hidden=256 --model-arg heads=8

Model arguments (all optional; a named ``size`` fills in the dimensions, explicit ones win):

* ``size``      -- one of ``SIZES`` below (default ``gpt2-small``).
* ``layers``, ``hidden``, ``heads``, ``seq`` (context length), ``vocab``.
* ``dropout``   -- probability for embedding, attention and residual dropout (default 0.0).
* ``attention`` -- ``"math"`` (default): explicit Q K^T, causal mask, softmax, dropout, A V, so
  the saved activations are those Korthikanti et al. 2022 count; ``"sdpa"``: one
  ``F.scaled_dot_product_attention`` call (what a fused kernel keeps); ``"megatron"``: as
  ``"math"``, but scale, causal mask and softmax are one op, ``scaled_upper_triang_masked_softmax``
  -- the fused kernel Megatron-LM runs there (Narayanan et al. 2021, Sec. 4.2: a custom kernel
  fusing scale, mask and softmax, with implicit causal masking for GPT models), so the scores
  are read and written once instead of once per op.
* ``dtype``     -- parameter dtype: ``float32`` (default), ``bfloat16`` or ``float16``.

Structure (the names the plan refers to): ``tok_emb``, ``pos_emb``, ``drop``, ``blocks`` (an
``nn.ModuleList`` of ``Block``: ``ln1``, ``attn.qkv``, ``attn.proj``, ``ln2``, ``mlp.fc``,
``mlp.act``, ``mlp.proj``), ``ln_f``, ``head``.  Embeddings are not tied to the head.

Tensor parallelism: ``attn.qkv`` is one ``Linear(h, 3h)`` whose output features are laid out
per head as ``[heads, 3, head_dim]`` (q, k, v of head 0, then of head 1, ...; the Megatron-LM
layout), so a column-wise shard holds whole heads with their q, k and v, and the forward
reshapes with ``-1`` heads (``view(b, s, -1, 3, head_dim)``) so it runs on the local heads.
``attn.proj`` and ``mlp.proj`` are the row-wise halves, ``mlp.fc`` the column-wise one.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT2_VOCAB = 50257   # GPT-2 BPE vocabulary (Radford et al. 2019); GPT-3 reuses it (Brown et al. 2020)

# (layers, hidden, heads, seq).
# GPT-2: Radford et al. 2019, Table 2 (layers, d_model); heads = d_model / 64; context 1024.
# GPT-3: Brown et al. 2020, Table 2.1 (n_layers, d_model, n_heads); context 2048.  The table
# prints d_model = 5140 for 13B, which 40 heads of d_head = 128 contradict (5120 is used), and
# 24 heads for 1.3B, which d_model = 2048 with d_head = 128 contradicts (16 heads are used).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "gpt2-small": (12, 768, 12, 1024),
    "gpt2-medium": (24, 1024, 16, 1024),
    "gpt2-large": (36, 1280, 20, 1024),
    "gpt2-xl": (48, 1600, 25, 1024),
    "gpt3-125m": (12, 768, 12, 2048),
    "gpt3-350m": (24, 1024, 16, 2048),
    "gpt3-760m": (24, 1536, 16, 2048),
    "gpt3-1.3b": (24, 2048, 16, 2048),
    "gpt3-2.7b": (32, 2560, 32, 2048),
    "gpt3-6.7b": (32, 4096, 32, 2048),
    "gpt3-13b": (40, 5120, 40, 2048),
    "gpt3-175b": (96, 12288, 96, 2048),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_dims(**dims) -> None:
    """Refuse a dimension that is not a whole number >= 1 (``layers=0`` would silently build a
    model without blocks, or fall back to the default size)."""
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be a whole number >= 1")


def resolve_config(size: str = "gpt2-small", layers: int | None = None, hidden: int | None = None,
                   heads: int | None = None, seq: int | None = None,
                   vocab: int | None = None) -> dict[str, int]:
    """The dimensions of a named size with explicit arguments overriding them."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)} "
                         f"or give layers/hidden/heads explicitly")
    n_layers, n_hidden, n_heads, n_seq = SIZES[size]
    given = dict(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    cfg = {k: default if given[k] is None else given[k] for k, default in
           dict(layers=n_layers, hidden=n_hidden, heads=n_heads, seq=n_seq, vocab=GPT2_VOCAB).items()}
    check_dims(**cfg)
    if cfg["hidden"] % cfg["heads"]:
        raise ValueError(f"hidden={cfg['hidden']} is not divisible by heads={cfg['heads']}")
    return cfg


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim with the future (above the diagonal) masked out:
    what Megatron-LM's fused kernel of this name computes in one pass.  Kept whole by
    ``torch.fx.wrap`` so the captured graph holds one op, as the fused kernel runs."""
    s = scores.size(-1)
    future = torch.ones((s, s), dtype=torch.bool, device=scores.device).triu(1)
    return F.softmax((scores * scale).masked_fill(future, float("-inf")), dim=-1)


torch.fx.wrap("scaled_upper_triang_masked_softmax")


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, attention: str):
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)      # out features laid out [heads, 3, head_dim]
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)
        self.dropout_p = dropout
        self.use_sdpa = attention == "sdpa"
        self.fused_softmax = attention == "megatron"

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        qkv = self.qkv(x_BSH).view(b, s, -1, 3, self.head_dim)        # [b, s, heads, 3, d]
        q, k, v = qkv.unbind(dim=3)                                   # [b, s, heads, d] each
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, d]
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True)
        elif self.fused_softmax:
            att = scaled_upper_triang_masked_softmax(torch.matmul(q, k.transpose(-2, -1)),
                                                     1.0 / math.sqrt(self.head_dim))   # [b, heads, s, s]
            y = torch.matmul(self.attn_drop(att), v)                  # [b, heads, s, d]
        else:
            att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [b, heads, s, s]
            # The causal mask is built from the shape (not sliced from a buffer) so that
            # torch.fx.symbolic_trace can follow it.
            future = x_BSH.new_ones((s, s), dtype=torch.bool).triu(1)        # [s, s] above diagonal
            att = att.masked_fill(future, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_drop(att)
            y = torch.matmul(att, v)                                  # [b, heads, s, d]
        y = y.transpose(1, 2).reshape(b, s, -1)                        # [b, s, heads * d]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, attention: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout, attention)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        x = x + self.drop2(self.mlp(self.ln2(x)))
        return x


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                 dropout: float = 0.0, attention: str = "math"):
        super().__init__()
        self.seq = seq
        # Tables passed in (``_weight``) skip nn.Embedding's own N(0, 1) init, which on the meta
        # device pulls in torch._dynamo (seconds); _init_weights fills them on a real device.
        self.tok_emb = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.pos_emb = nn.Embedding(seq, hidden, _weight=torch.empty(seq, hidden))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, dropout, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx_BS: torch.Tensor) -> torch.Tensor:
        s = idx_BS.size(1)
        pos = torch.arange(s, device=idx_BS.device)
        x = self.drop(self.tok_emb(idx_BS) + self.pos_emb(pos))      # [b, s, h]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                # [b, s, vocab]


def _init_weights(module: nn.Module) -> None:
    # GPT-2 initialisation: N(0, 0.02) weights, zero biases (Radford et al. 2019, code release).
    # Meta tensors hold no values: nothing to initialise.
    if any(p.is_meta for p in module.parameters(recurse=False)):
        return
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(size: str = "gpt2-small", layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, seq: int | None = None, vocab: int | None = None,
                dropout: float = 0.0, attention: str = "math", dtype: str = "float32") -> nn.Module:
    if attention not in ("math", "sdpa", "megatron"):
        raise ValueError(f"attention={attention!r}; choose 'math', 'sdpa' or 'megatron'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
    cfg = resolve_config(size, layers, hidden, heads, seq, vocab)
    model = GPT(dropout=dropout, attention=attention, **cfg)
    model.apply(_init_weights)
    return model.to(DTYPES[dtype])


def make_batch(batch_size: int, size: str = "gpt2-small", seq: int | None = None,
               vocab: int | None = None, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    cfg = resolve_config(size, seq=seq, vocab=vocab, heads=1)
    tokens = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"] + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), target_BS.flatten())
