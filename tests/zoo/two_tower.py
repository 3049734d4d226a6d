"""A two-input model: a user tower and an item tower (MLP stacks over different feature
widths) whose outputs are concatenated and scored by a head -- ``forward(user, item)``.

Model arguments: ``layers`` (2 per tower), ``hidden`` (32), ``user_features`` (16),
``item_features`` (24).  Target: a float score per pair (MSE).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tower(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


class TwoTower(nn.Module):
    def __init__(self, layers: int, hidden: int, user_features: int, item_features: int):
        super().__init__()
        self.user = Tower(user_features, hidden, layers)
        self.item = Tower(item_features, hidden, layers)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user, item):
        return self.head(torch.cat([self.user(user), self.item(item)], dim=-1)).squeeze(-1)


def build_model(layers: int = 2, hidden: int = 32, user_features: int = 16, item_features: int = 24):
    return TwoTower(layers, hidden, user_features, item_features)


def make_batch(batch_size: int, user_features: int = 16, item_features: int = 24, **_ignored):
    """((user [b, user_features], item [b, item_features]), score [b]) all float32."""
    user, item = torch.randn(batch_size, user_features), torch.randn(batch_size, item_features)
    return (user, item), torch.randn(batch_size)


def loss_fn(score_B: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(score_B, target_B)
