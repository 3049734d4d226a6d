"""Hugging Face ``transformers`` BERT masked LM (``BertForMaskedLM``), tiny, from a config.

The MLM decoder is tied to the word embedding (BERT's default).  ``make_batch`` masks exactly
``masked`` positions of every sample (token id ``MASK_ID``) and labels only those (-100
elsewhere), so every sample weighs the same in the mean loss however the batch is split.

Model arguments: ``layers`` (2), ``hidden`` (32), ``heads`` (4), ``ffn`` (64), ``seq`` (8),
``vocab`` (64), ``masked`` (2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MASK_ID = 3
IGNORE = -100     # F.cross_entropy's default ignore_index


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, seq: int = 8, vocab: int = 64,
                masked: int = 2):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=ffn, max_position_embeddings=2 * seq, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, type_vocab_size=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return BertForMaskedLM(config)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, masked: int = 2, **_ignored):
    """Token ids [b, seq] with ``masked`` positions per row replaced by MASK_ID; labels [b, seq]
    hold the original ids there and IGNORE elsewhere."""
    tokens = torch.randint(4, vocab, (batch_size, seq))
    positions = torch.rand(batch_size, seq).argsort(dim=1)[:, :masked]
    labels = torch.full_like(tokens, IGNORE).scatter(1, positions, tokens.gather(1, positions))
    inputs = tokens.scatter(1, positions, torch.full_like(positions, MASK_ID))
    return inputs, labels


def loss_fn(output, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=IGNORE)
