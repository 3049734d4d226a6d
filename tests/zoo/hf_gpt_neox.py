"""Hugging Face ``transformers`` GPT-NeoX (causal LM), tiny, from a config: parallel residual,
partial rotary embedding, fused ``query_key_value`` projection, untied ``embed_out``.

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``ffn`` (64), ``seq`` (8),
``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, seq: int = 8, vocab: int = 64):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=ffn, max_position_embeddings=2 * seq, rotary_pct=0.25,
                           hidden_dropout=0.0, attention_dropout=0.0, use_parallel_residual=True,
                           tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=1)
    config._attn_implementation = "sdpa"
    return GPTNeoXForCausalLM(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target_BS.flatten())
