"""A nanoGPT-style GPT written the way that code base writes it: a fused ``c_attn`` projection
whose output is ``split`` into q, k, v and ``view``-ed with the global head count, ``lm_head``
tied to ``transformer.wte``, and ``forward(idx, targets)`` returning ``(logits, loss)``.

The inputs are ``(idx, targets)`` (the targets go into ``forward``, as in nanoGPT's training
loop) and ``loss_fn`` returns the loss the model computed.  Model arguments: ``layers`` (2),
``hidden`` (32), ``heads`` (4), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int):
        super().__init__()
        self.n_head, self.n_embd = heads, hidden
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, seq)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, hidden),
            wpe=nn.Embedding(seq, hidden),
            h=nn.ModuleList(Block(hidden, heads, seq) for _ in range(layers)),
            ln_f=nn.LayerNorm(hidden),
        ))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight       # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq: int = 8, vocab: int = 64):
    return GPT(layers, hidden, heads, seq, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """((idx, targets), targets): token ids and next-token targets, [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return (idx, targets), targets


def loss_fn(output, target):
    logits, loss = output
    return loss
