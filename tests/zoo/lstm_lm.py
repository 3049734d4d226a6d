"""A word-level LSTM language model in the style of PyTorch's ``word_language_model`` example
(embedding -> ``nn.LSTM`` -> linear decoder), batch-first (the runtime splits the batch along
dim 0).  The whole model is one layer: its embedding and its decoder sit side by side under the
model itself, with no Linear pair between them.

Model arguments: ``layers`` (2, LSTM layers), ``hidden`` (32), ``seq`` (8), ``vocab`` (64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.encoder = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        output, _hidden = self.rnn(self.encoder(tokens))
        return self.decoder(output)


def build_model(layers: int = 2, hidden: int = 32, seq: int = 8, vocab: int = 64):
    return RNNModel(vocab, hidden, layers)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
