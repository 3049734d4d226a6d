"""Two inputs, two towers of residual MLP blocks, their outputs joined by a head.  The second
tower does not read the first tower's output, so no single activation crosses between the
towers.  Planner/capture test fixture.

Model arguments: ``layers`` (2 per tower), ``hidden`` (16), ``features`` (8).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Tower(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


class TwoTower(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int):
        super().__init__()
        self.left = Tower(features, hidden, layers)
        self.right = Tower(features, hidden, layers)
        self.head = nn.Linear(2 * hidden, 1)

    def forward(self, a, b):
        return self.head(torch.cat([self.left(a), self.right(b)], dim=-1))


def build_model(layers: int = 2, hidden: int = 16, features: int = 8):
    return TwoTower(features, hidden, layers)


def make_batch(batch_size: int, features: int = 8, **_ignored):
    a, b = torch.randn(batch_size, features), torch.randn(batch_size, features)
    return (a, b), torch.randn(batch_size, 1)
