"""Hugging Face ``transformers`` 5 Mistral (causal LM), tiny, built from a config (no download):
grouped-query attention (``heads`` query heads sharing ``kv_heads`` key/value heads), SwiGLU MLP,
RMSNorm.  Planner test fixture.

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``kv_heads`` (2), ``ffn`` (64),
``seq`` (8), ``vocab`` (64).  The output is a ``CausalLMOutputWithPast``; ``loss_fn`` reads its
``logits``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 64,
                seq: int = 8, vocab: int = 64):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2 * seq,
                           sliding_window=None, tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return MistralForCausalLM(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target_BS.flatten())
