"""Hugging Face ``transformers`` T5 (encoder-decoder, ``T5ForConditionalGeneration``), tiny,
from a config.  ``shared`` is the embedding of the encoder and the decoder and the LM head's
weight (T5's ``tie_word_embeddings=True``): one Parameter under four names.  Relative position
bias in the first block of each stack.

Inputs, positional as ``forward(input_ids, attention_mask, decoder_input_ids)``: source ids,
an all-ones attention mask and the decoder's inputs (the targets shifted right behind the
start id 0).  Model arguments: ``layers`` (2 encoder + 2 decoder blocks), ``hidden`` (32),
``heads`` (4), ``ffn`` (64), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

START_ID = 0      # T5's decoder_start_token_id (= pad id)


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, seq: int = 8, vocab: int = 64):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=ffn, num_layers=layers,
                      num_decoder_layers=layers, num_heads=heads, relative_attention_num_buckets=8,
                      relative_attention_max_distance=2 * seq, dropout_rate=0.0, feed_forward_proj="relu",
                      tie_word_embeddings=True, use_cache=False, decoder_start_token_id=START_ID,
                      pad_token_id=START_ID, eos_token_id=1)
    config._attn_implementation = "eager"
    return T5ForConditionalGeneration(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """((source ids, attention mask, decoder input ids), target ids), all [b, seq] int64."""
    source = torch.randint(2, vocab, (batch_size, seq))
    target = torch.randint(2, vocab, (batch_size, seq))
    decoder_in = torch.cat([torch.full_like(target[:, :1], START_ID), target[:, :-1]], dim=1)
    return (source, torch.ones_like(source), decoder_in), target


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target_BS.flatten())
