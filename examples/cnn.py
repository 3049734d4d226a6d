"""A small CNN classifier: conv stem, repeated conv blocks, pooled linear classifier.

    autopar inspect examples/cnn.py --model-arg blocks=6 --model-arg channels=128

Model arguments: ``blocks`` (default 4), ``channels`` (64), ``image`` (side, 32),
``classes`` (10).  Structure: ``stem`` (Conv2d 3->C, BatchNorm, ReLU, MaxPool 2x2),
``blocks`` (``nn.ModuleList`` of ``ConvBlock``: 3x3 Conv2d C->C, BatchNorm2d, ReLU, with a
residual add), ``pool`` (global average), ``classifier`` (Linear C->classes).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return x_BCHW + self.act(self.bn(self.conv(x_BCHW)))


class CNN(nn.Module):
    def __init__(self, blocks: int, channels: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2))
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(blocks))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        x = self.stem(images_BCHW)                            # [b, C, H/2, W/2]
        for block in self.blocks:
            x = block(x)
        return self.classifier(self.pool(x).flatten(1))       # [b, classes]


def check_dims(**dims) -> None:
    """Refuse a dimension that is not a whole number >= 1 (``layers=0`` would silently build a
    model without blocks, or fall back to the default size)."""
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be a whole number >= 1")


def build_model(blocks: int = 4, channels: int = 64, image: int = 32, classes: int = 10) -> nn.Module:
    check_dims(blocks=blocks, channels=channels, image=image, classes=classes)
    if image % 2:
        raise ValueError(f"image={image} must be even (the stem pools by 2)")
    return CNN(blocks, channels, classes)


def make_batch(batch_size: int, image: int = 32, classes: int = 10, **_ignored):
    """Gaussian images [b, 3, image, image] and integer class labels [b]."""
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))


def loss_fn(logits_BK: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BK, labels_B)
