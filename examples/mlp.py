"""A stack of Linear + ReLU blocks on a regression target (no loss_fn: the default MSE is used).

    autopar inspect examples/mlp.py --model-arg layers=8 --model-arg hidden=1024

Model arguments: ``layers`` (default 4), ``hidden`` (256), ``inputs`` (64), ``outputs`` (8).
Structure: ``inp`` (Linear inputs->hidden), ``blocks`` (``nn.ModuleList`` of ``Block`` with
``fc`` Linear(hidden, hidden) + ReLU), ``out`` (Linear hidden->outputs).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    def __init__(self, layers: int, hidden: int, inputs: int, outputs: int):
        super().__init__()
        self.inp = nn.Linear(inputs, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x_BI: torch.Tensor) -> torch.Tensor:
        x = self.inp(x_BI)
        for block in self.blocks:
            x = block(x)
        return self.out(x)                                    # [b, outputs]


def check_dims(**dims) -> None:
    """Refuse a dimension that is not a whole number >= 1 (``layers=0`` would silently build a
    model without blocks, or fall back to the default size)."""
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be a whole number >= 1")


def build_model(layers: int = 4, hidden: int = 256, inputs: int = 64, outputs: int = 8) -> nn.Module:
    check_dims(layers=layers, hidden=hidden, inputs=inputs, outputs=outputs)
    return MLP(layers, hidden, inputs, outputs)


def make_batch(batch_size: int, inputs: int = 64, outputs: int = 8, **_ignored):
    """Gaussian features and a Gaussian regression target."""
    return torch.randn(batch_size, inputs), torch.randn(batch_size, outputs)
