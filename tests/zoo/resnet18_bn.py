"""ResNet-18 (He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1) on
CIFAR-size 32x32 images, written as torchvision's ``models.resnet`` writes it: a 7x7 stride-2
conv stem with BatchNorm and a 3x3 stride-2 max-pool, four stages of two BasicBlocks
(``widths`` channels; stride 2 and a 1x1 projection shortcut at the first block of stages 2-4),
BatchNorm after every convolution, adaptive average pooling and a linear head.

On 32x32 images the last stage's feature maps are 1x1, and BatchNorm in training mode cannot
normalise a channel from one value: the model cannot train on one sample per (micro-)batch
("Expected more than 1 value per channel when training").  Two samples and more train.

Model arguments: ``widths`` ("8,16,32,64"; ResNet-18's own are "64,128,256,512"), ``image``
(32), ``classes`` (10).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, widths: tuple[int, ...], classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, c = [], widths[0]
        for s, w in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(c, w, 1 if s == 0 else 2), BasicBlock(w, w, 1)))
            c = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(widths: str = "8,16,32,64", image: int = 32, classes: int = 10):
    return ResNet18(tuple(int(w) for w in str(widths).split(",")), classes)


def make_batch(batch_size: int, image: int = 32, classes: int = 10, **_ignored):
    """Gaussian images [b, 3, image, image] and class labels [b]."""
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))
