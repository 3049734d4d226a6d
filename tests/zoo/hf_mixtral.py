"""Hugging Face ``transformers`` (5.x) Mixtral (causal LM, sparse mixture of experts), tiny, built
from a config (no download).

transformers 5 stores each layer's experts as two stacked parameters of ``MixtralExperts``:
``gate_up_proj [experts, 2 * ffn, hidden]`` (gate and up fused) and ``down_proj [experts,
hidden, ffn]``; a router ``Linear`` picks ``top_k`` experts per token.  Attention as in Llama
(grouped-query, rotary).

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``kv_heads`` (2), ``ffn`` (64),
``experts`` (4), ``top_k`` (2), ``seq`` (8), ``vocab`` (64).  ``loss_fn`` reads the output's
``logits`` (the router's auxiliary loss is off, as in the config's default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 64,
                experts: int = 4, top_k: int = 2, seq: int = 8, vocab: int = 64):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
                           num_experts_per_tok=top_k, max_position_embeddings=2 * seq, sliding_window=None,
                           tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
                           router_jitter_noise=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return MixtralForCausalLM(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target_BS.flatten())
