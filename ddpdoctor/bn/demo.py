"""The built-in `compare-bn` demo: a small conv net with several BN layers and class-conditional synthetic images.

Small enough that `ddpdoctor compare-bn` alone runs in seconds on a laptop CPU, shaped so the effect is visible:
each class has its own colour and texture, so a rank that holds a label-sorted slice of the data sees BN input
statistics far from the global ones — the mechanism behind "4 GPUs worse than 1" with sharded datasets.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
from torch.utils.data import Dataset

NUM_CLASSES = 10
IMAGE_SIZE = 16
# Not a multiple of a typical global batch (2 x 16): the epoch ends with an uneven, shorter batch.
DEMO_SAMPLES = 1000


def _block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            bn=nn.BatchNorm2d(cout),
            relu=nn.ReLU(inplace=True),
        )
    )


class DemoNet(nn.Module):
    """conv-BN-ReLU x3 (BatchNorm2d) and an MLP head with a BatchNorm1d: four BN layers, two kinds."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = _block(3, 16)
        self.layer1 = _block(16, 32, stride=2)
        self.layer2 = _block(32, 32, stride=2)
        self.head = nn.Sequential(
            OrderedDict(
                pool=nn.AdaptiveAvgPool2d(1),
                flatten=nn.Flatten(),
                fc1=nn.Linear(32, 64, bias=False),
                bn=nn.BatchNorm1d(64),
                relu=nn.ReLU(inplace=True),
                fc2=nn.Linear(64, num_classes),
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(self.stem(x))))


class ClassConditionalImages(Dataset):
    """Images whose colour and stripe texture depend on the class, plus noise; labels in a balanced order.

    Brightness rises with the class index (think day vs night photos, or scanner A vs scanner B): any split of
    the label-sorted data gives ranks visibly different input statistics, while a shuffled split does not.
    Generated once from `seed` (a torch.Generator), so every rank builds the identical dataset.
    """

    def __init__(self, n: int = DEMO_SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % NUM_CLASSES
        brightness = torch.linspace(-1.5, 1.5, NUM_CLASSES).view(-1, 1, 1, 1)
        colours = brightness + 0.75 * torch.randn(NUM_CLASSES, 3, 1, 1, generator=g)
        freq = torch.linspace(0.3, 2.5, NUM_CLASSES)
        grid = torch.arange(IMAGE_SIZE, dtype=torch.float32)
        stripes = torch.sin(freq[:, None, None] * (grid[None, :, None] + 0.5 * grid[None, None, :]))
        templates = colours + stripes[:, None, :, :]
        noise = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
        self.images = templates[self.labels] + noise
        # torchvision datasets expose `targets`; compare-bn reads it instead of loading every item to sort
        self.targets = self.labels.tolist()

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


def demo_model() -> nn.Module:
    return DemoNet()


def demo_data(seed: int = 0) -> Dataset:
    return ClassConditionalImages(seed=seed)
