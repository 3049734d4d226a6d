"""A GPT fine-tuned with LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", Sec. 4), written as PEFT's ``LoraLayer`` wraps an ``nn.Linear``: each attention and MLP
projection keeps its pretrained ``base_layer`` frozen (``requires_grad=False``) and adds
``lora_B(lora_A(x)) * scaling`` (``lora_A`` Kaiming-uniform, ``lora_B`` zero at the start, so
the adapted model begins as the base model).  The embedding, positions, norms and LM head are
frozen too (``tied``: the head is the embedding's weight), so only the adapters train.
``attention=False`` leaves the attention out of the blocks (an MLP-only stack, whose adapters
tensor parallelism can split under sequence parallelism: nothing mixes sequence positions).

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``rank`` (4), ``seq`` (8),
``vocab`` (64), ``tied`` (False), ``attention`` (True).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoraLinear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, rank: int, alpha: float = 8.0):
        super().__init__()
        self.base_layer = nn.Linear(fan_in, fan_out)
        self.base_layer.requires_grad_(False)
        self.lora_A = nn.Linear(fan_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, fan_out, bias=False)
        self.scaling = alpha / rank
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        # PEFT starts lora_B at zero; a small value here so that the adapters' gradients reach lora_A
        nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, rank: int):
        super().__init__()
        self.heads = heads
        self.q_proj = LoraLinear(hidden, hidden, rank)
        self.k_proj = LoraLinear(hidden, hidden, rank)
        self.v_proj = LoraLinear(hidden, hidden, rank)
        self.o_proj = LoraLinear(hidden, hidden, rank)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.fc_in = LoraLinear(hidden, 4 * hidden, rank)
        self.fc_out = LoraLinear(4 * hidden, hidden, rank)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, rank: int, attention: bool):
        super().__init__()
        if attention:
            self.ln_1 = nn.LayerNorm(hidden)
            self.attn = Attention(hidden, heads, rank)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, rank)

    def forward(self, x):
        if hasattr(self, "attn"):
            x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LoraGPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, rank: int, seq: int, vocab: int, tied: bool,
                 attention: bool):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.h = nn.ModuleList(Block(hidden, heads, rank, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        for frozen in (self.wte, self.wpe, self.ln_f, self.lm_head, *(m for b in self.h for m in b.children()
                                                                    if isinstance(m, nn.LayerNorm))):
            frozen.requires_grad_(False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, rank: int = 4, seq: int = 8, vocab: int = 64,
                tied: bool = False, attention: bool = True):
    return LoraGPT(layers, hidden, heads, rank, seq, vocab, tied, attention)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
