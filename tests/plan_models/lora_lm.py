"""A small language model fine-tuned with LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", Sec. 4.1): every projection keeps its pretrained weight frozen
(``requires_grad=False``) and trains only a rank-``rank`` update ``B A`` beside it, the way PEFT's
``LoraLayer`` wraps an ``nn.Linear``; the embedding, norms and LM head are frozen too.  So only
the adapters carry gradients and optimizer state.  Memory test fixture (tests/integration/test_memory_measured.py).

Model arguments: ``layers`` (2), ``hidden`` (32), ``rank`` (2), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, rank: int):
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(fan_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, fan_out, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


class Block(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.norm.requires_grad_(False)
        self.fc = LoRALinear(hidden, 4 * hidden, rank)
        self.proj = LoRALinear(4 * hidden, hidden, rank)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class LoRALM(nn.Module):
    def __init__(self, layers: int, hidden: int, rank: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, rank) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(layers: int = 2, hidden: int = 32, rank: int = 2, seq: int = 8, vocab: int = 64):
    return LoRALM(layers, hidden, rank, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
