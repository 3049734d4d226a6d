"""ResNet-50 (He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1: the
50-layer column) on ImageNet-size images, written as torchvision's ``models.resnet50`` writes it
(torchvision is not installed here): a 7x7 stride-2 conv stem with BatchNorm and a 3x3 stride-2
max-pool, four stages of 3, 4, 6 and 3 Bottleneck blocks (1x1, 3x3, 1x1 convolutions of width
64, 128, 256, 512, the last expanded 4x; stride 2 on the 3x3 of the first block of stages 2-4,
torchvision's "ResNet V1.5"; a 1x1 projection shortcut on each stage's first block), BatchNorm
after every convolution, adaptive average pooling and a linear head.  25.6 M parameters at 1000
classes, as torchvision's.

The model of the published PowerSGD run priced by benchmarks/grad_compression_runs.py.
Model arguments: ``image`` (224), ``classes`` (1000).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

#: blocks per stage and the stages' widths (He et al. 2016, Table 1, 50-layer)
BLOCKS = (3, 4, 6, 3)
WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * EXPANSION
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, c = [], 64
        for s, (n, w) in enumerate(zip(BLOCKS, WIDTHS)):
            for i in range(n):
                blocks.append(Bottleneck(c, w, 2 if s > 0 and i == 0 else 1))
                c = w * EXPANSION
        self.blocks = nn.ModuleList(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(image: int = 224, classes: int = 1000):
    return ResNet50(classes)


def make_batch(batch_size: int, image: int = 224, classes: int = 1000, **_ignored):
    """Gaussian images [b, 3, image, image] and class labels [b]."""
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))
