"""A ResNet-like CNN with BatchNorm: a stem, two stages of residual blocks (the second stage
doubles the channels and halves the resolution through a strided projection), global
average pooling and a linear classifier.

BatchNorm normalises with the statistics of the batch it sees: under data parallelism (and
with micro-batches) that is each rank's (micro-)batch, not the global batch.

Model arguments: ``blocks`` (2 per stage), ``channels`` (8), ``image`` (8), ``classes`` (4).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks: int, channels: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.stage1 = nn.Sequential(*(ResBlock(channels, channels, 1) for _ in range(blocks)))
        self.stage2 = nn.Sequential(ResBlock(channels, 2 * channels, 2),
                                    *(ResBlock(2 * channels, 2 * channels, 1) for _ in range(blocks - 1)))
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, images):
        x = self.stage2(self.stage1(self.stem(images)))
        return self.fc(x.mean(dim=(2, 3)))


def build_model(blocks: int = 2, channels: int = 8, image: int = 8, classes: int = 4):
    if image % 2:
        raise ValueError(f"image={image} must be even (the second stage halves it)")
    return ResNet(blocks, channels, classes)


def make_batch(batch_size: int, image: int = 8, classes: int = 4, **_ignored):
    """Gaussian images [b, 3, image, image] and class labels [b]."""
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))


def loss_fn(logits_BK: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BK, labels_B)
