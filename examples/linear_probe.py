"""Train a linear probe on a frozen backbone: features extracted once, then read by index.

Run it with ``python examples/linear_probe.py`` (``TORCHCACHE_EXAMPLE_SMALL=1`` for a
quick run). The images are generated (a class is a colour pattern plus noise), the
backbone is a small conv net with frozen random weights, and the probe is one linear
layer. Each epoch is timed both ways, side by side:

- plain: a DataLoader over the images, the backbone on every batch, then the head;
- features: ``torchcache.extract_features`` runs the backbone over the dataset once
  (in its first epoch) and returns a dataset of ``(features, label)`` samples that
  later epochs, and later runs, read straight from a file.

Run it twice: the second run finds the features on disk, and the table shows the time of
its first ``extract_features`` epoch beside the later ones. Both ways train the same head
from the same seed on the same shuffled batches, in the first run as in later ones
(``extract_features`` leaves the global random generator as it was).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import torchcache

SMALL = os.environ.get("TORCHCACHE_EXAMPLE_SMALL") == "1"
SAMPLES, EPOCHS, CLASSES = (2_000, 3, 10) if SMALL else (20_000, 5, 10)
# $TORCHCACHE_DIR when set (extract_features' default root), else a folder in the temp directory.
CACHE_DIR = os.environ.get("TORCHCACHE_DIR") or Path(tempfile.gettempdir()) / "torchcache-linear-probe"


class Patterns(Dataset[tuple[torch.Tensor, int]]):
    """Generated 32x32 RGB images: each class has its own colour pattern, plus noise."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        patterns = torch.rand(CLASSES, 3, 32, 32, generator=g)
        noise = torch.rand(n, 3, 32, 32, generator=g)
        self.images = (0.6 * patterns[self.labels] + 0.4 * noise).mul(255).to(torch.uint8)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i].float() / 255, int(self.labels[i])  # deterministic: no random augmentation


def make_backbone() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(),  # (256,) features
    )
    return net.requires_grad_(False).eval()  # frozen: extract_features refuses trainable backbones


def train_epoch(head: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: object) -> float:
    """One epoch of the probe over ``(features, label)`` batches; returns the accuracy seen."""
    correct = total = 0
    for features, labels in batches:  # type: ignore[attr-defined]
        logits = head(features)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        correct += int((logits.argmax(1) == labels).sum())
        total += len(labels)
    return correct / total


def plain_batches(backbone: torch.nn.Module, loader: DataLoader[tuple[torch.Tensor, int]]) -> object:
    """The uncached way: the backbone on every batch of every epoch."""
    for images, labels in loader:
        with torch.no_grad():
            features = backbone(images)
        yield features, labels  # outside no_grad: the head trains on them


def main() -> None:
    dataset, backbone = Patterns(SAMPLES), make_backbone()
    print(f"{SAMPLES:,} images, {EPOCHS} epochs, cache root {CACHE_DIR}")

    torch.manual_seed(1)
    head = torch.nn.Linear(256, CLASSES)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.02)
    loader = DataLoader(dataset, batch_size=256, shuffle=True)
    plain = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        accuracy = train_epoch(head, optimizer, plain_batches(backbone, loader))
        plain.append((time.perf_counter() - start, accuracy))

    torch.manual_seed(1)
    head = torch.nn.Linear(256, CLASSES)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.02)
    cached = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        # The first call runs the backbone over the dataset; later calls (and runs) find the features.
        features = torchcache.extract_features(backbone, dataset, batch_size=256, cache_dir=CACHE_DIR)
        accuracy = train_epoch(head, optimizer, features.loader(256, shuffle=True))
        cached.append((time.perf_counter() - start, accuracy))

    print(f"\n{'epoch':>5}  {'plain DataLoader + backbone':>28}  {'extract_features':>18}")
    for epoch, ((t_plain, a_plain), (t_feat, a_feat)) in enumerate(zip(plain, cached), 1):
        print(f"{epoch:>5}  {t_plain:>9.3f} s (acc {a_plain:.2f})     {t_feat:>7.3f} s (acc {a_feat:.2f})")
    later_plain = sum(t for t, _ in plain[1:]) / max(len(plain) - 1, 1)
    later_feat = sum(t for t, _ in cached[1:]) / max(len(cached) - 1, 1)
    print(f"\nlater epochs: {later_plain / later_feat:.0f}x faster from the features ({features.path})")


if __name__ == "__main__":
    main()
