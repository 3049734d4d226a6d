"""Hugging Face ``transformers`` OPT (causal LM), tiny, from a config.  OPT ties its LM head to
the token embedding (the config's default).

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``ffn`` (64), ``seq`` (8),
``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, seq: int = 8, vocab: int = 64):
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn,
                       num_attention_heads=heads, max_position_embeddings=2 * seq, word_embed_proj_dim=hidden,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                       use_cache=False, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    config._attn_implementation = "sdpa"
    return OPTForCausalLM(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids (no padding id) and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(3, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target_BS.flatten())
