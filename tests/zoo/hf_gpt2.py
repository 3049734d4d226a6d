"""Hugging Face ``transformers`` GPT-2 (causal LM), tiny, built from a config (no download).

Its projections are ``transformers.pytorch_utils.Conv1D`` (weight ``[in, out]``, ``addmm``), not
``nn.Linear``; ``attn.c_attn`` is one fused q/k/v projection whose output is split into q, k
and v.  The LM head is tied to the token embedding.

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``seq`` (8), ``vocab`` (64).
``loss_fn`` reads the output's ``logits``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq: int = 8, vocab: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, vocab_size=vocab,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=1)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target_BS.flatten())
