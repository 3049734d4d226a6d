"""A small recurrent language model: ``embed`` -> ``nn.LSTM`` (``layers`` stacked layers,
batch_first) -> ``head``.  The LSTM is one ``torch.nn`` module whose weights
(``weight_ih_l{k}``, ``weight_hh_l{k}``, ``bias_*``) the forward uses inside its fused kernel.
Memory and capture test fixture (tests/integration/test_memory_measured.py, tests/core/test_capture.py).

Model arguments: ``layers`` (2), ``hidden`` (32), ``seq`` (8), ``vocab`` (64), ``cell``
("lstm", "gru" or "rnn"), ``bidirectional`` (False).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class RecurrentLM(nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int, cell: str, bidirectional: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = CELLS[cell](hidden, hidden, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), vocab)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def build_model(layers: int = 2, hidden: int = 32, seq: int = 8, vocab: int = 64, cell: str = "lstm",
                bidirectional: bool = False):
    return RecurrentLM(layers, hidden, vocab, cell, bidirectional)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten())
