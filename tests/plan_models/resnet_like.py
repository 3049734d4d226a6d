"""A ResNet-like CNN: a stem, ``stages`` stages of ``blocks`` residual blocks (the first block of
each later stage halves the resolution and doubles the channels), BatchNorm, a pooled linear
head.  Planner/capture test fixture.

Model arguments: ``stages`` (3), ``blocks`` (2), ``channels`` (8), ``image`` (16), ``classes`` (10).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class ResNetLike(nn.Module):
    def __init__(self, stages: int, blocks: int, channels: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        layers, c = [], channels
        for s in range(stages):
            cout = channels * 2 ** s
            layers.append(nn.Sequential(*[BasicBlock(c if i == 0 else cout, cout, 2 if (s and i == 0) else 1)
                                          for i in range(blocks)]))
            c = cout
        for s, stage in enumerate(layers):
            setattr(self, f"layer{s + 1}", stage)
        self.num_stages = stages
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for s in range(self.num_stages):
            x = getattr(self, f"layer{s + 1}")(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def build_model(stages: int = 3, blocks: int = 2, channels: int = 8, image: int = 16, classes: int = 10):
    return ResNetLike(stages, blocks, channels, classes)


def make_batch(batch_size: int, image: int = 16, classes: int = 10, **_ignored):
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))
