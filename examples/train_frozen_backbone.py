"""Train a linear head on a frozen conv-net backbone, without and with torchcache.

The backbone is frozen, so its output for an image never changes: computing it again
in every epoch is wasted work. ``@torchcache()`` keeps each image's features, keyed by
the image's exact bytes, so from the second epoch on the backbone runs for no item.

The script trains the same head twice on the same shuffled batches: once with a plain
backbone and once with the cached one. It prints the epoch times, where the cached
backbone's items came from, the cache statistics, and checks that the cached features
(and so the trained heads) equal the uncached ones. Everything is synthetic and runs on a
CPU (``TORCHCACHE_EXAMPLE_SMALL=1`` trains on 256 images instead of 1,024)::

    python examples/train_frozen_backbone.py

The features persist in the cache root (``$TORCHCACHE_DIR``, else the user cache
directory), so a second run reads every item from disk, even in its first epoch.
``torchcache ls`` lists the cache and ``torchcache clear KEY`` removes it.
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchcache import torchcache

SMALL = os.environ.get("TORCHCACHE_EXAMPLE_SMALL") == "1"
N_IMAGES = 256 if SMALL else 1024
IMAGE_SIZE = 64
BATCH_SIZE = 64
EPOCHS = 3


class Backbone(nn.Module):
    """A small frozen conv net: 64x64 RGB images -> 128 features."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(4 * width, 4 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        # Cached outputs carry no gradient, so torchcache refuses a module with trainable
        # parameters: freeze it at the end of __init__.
        self.requires_grad_(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map images ``(batch, 3, 64, 64)`` to features ``(batch, 128)``."""
        return self.net(images)


# The only change to cache the backbone: the decorator (``@torchcache`` alone works too). Here
# it decorates a subclass so that the plain Backbone stays available for comparison. The
# persistent cache goes to $TORCHCACHE_DIR, else to the user cache directory.
@torchcache(persistent=True)
class CachedBackbone(Backbone):
    """The same backbone, with its outputs cached per image in memory and on disk."""


def make_dataset(n: int = N_IMAGES, size: int = IMAGE_SIZE) -> TensorDataset:
    """Noisy images of coloured stripes; the label says whether they are horizontal (0) or vertical (1)."""
    g = torch.Generator().manual_seed(0)
    coords = torch.arange(size, dtype=torch.float32)
    labels = torch.randint(0, 2, (n,), generator=g)
    freq = torch.empty(n, 1).uniform_(0.2, 0.8, generator=g)
    phase = torch.empty(n, 1).uniform_(0.0, 2 * math.pi, generator=g)
    wave = torch.sin(freq * coords + phase)  # (n, size)
    horizontal = wave[:, :, None].expand(n, size, size)  # varies along rows
    vertical = wave[:, None, :].expand(n, size, size)  # varies along columns
    pattern = torch.where(labels[:, None, None] == 0, horizontal, vertical)
    colour = torch.rand(n, 3, 1, 1, generator=g) + 0.5
    images = colour * pattern[:, None] + 0.5 * torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(images, labels)


def make_head() -> nn.Module:
    """The trainable part: standardise the 128 features, then a linear classifier."""
    # momentum=None: running statistics are plain averages over the batches seen.
    return nn.Sequential(nn.BatchNorm1d(128, momentum=None), nn.Linear(128, 2))


def train(backbone: nn.Module, dataset: TensorDataset) -> tuple[nn.Module, list[float], list[float], list[str]]:
    """Train a fresh head on the backbone's features.

    Returns:
        The head, each epoch's wall time in seconds, each epoch's mean loss, and for a
        cached backbone where each epoch's items came from.
    """
    cache = getattr(backbone, "cache_instance", None)
    torch.manual_seed(1)  # the same head initialisation for both runs
    head = make_head()
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    # The same shuffled batches for both runs: items arrive in a new order every epoch,
    # which does not matter to the cache (it keys items, not batches).
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(2))
    backbone.eval()  # the training flag is part of the key: keep the frozen backbone in eval mode
    times, losses, sources = [], [], []
    for _ in range(EPOCHS):
        before = cache.stats() if cache is not None else None
        start = time.perf_counter()
        total = 0.0
        for images, labels in loader:
            features = backbone(images)  # cached: only the items not seen before are computed
            loss = nn.functional.cross_entropy(head(features), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(labels)
        times.append(time.perf_counter() - start)
        losses.append(total / len(dataset))
        if cache is not None and before is not None:
            after = cache.stats()
            disk = after.disk.hits - before.disk.hits if after.disk and before.disk else 0
            memory = after.memory.hits - before.memory.hits
            sources.append(f"computed {after.misses - before.misses:>4}, disk hits {disk:>4}, memory hits {memory:>4}")
    return head, times, losses, sources


def accuracy(backbone: nn.Module, head: nn.Module, dataset: TensorDataset) -> float:
    """Accuracy of the head on the training set (the point is the cache, not generalisation)."""
    images, labels = dataset.tensors
    head.eval()
    with torch.no_grad():
        return (head(backbone(images)).argmax(1) == labels).float().mean().item()


def main() -> None:
    dataset = make_dataset()
    # Seeded weights: the module key covers the class's code, the init arguments and the
    # weights, so a second run finds this run's entries only if it builds the same
    # weights (in practice: loads the same checkpoint).
    torch.manual_seed(0)
    plain = Backbone()
    cached = CachedBackbone()
    # The same weights in both. The key is taken at the first call, so weights loaded
    # before it are part of the key.
    cached.load_state_dict(plain.state_dict())
    print(f"{N_IMAGES} images of 3x{IMAGE_SIZE}x{IMAGE_SIZE}, batches of {BATCH_SIZE}, {EPOCHS} epochs")

    head_plain, times_plain, losses_plain, _ = train(plain, dataset)
    head_cached, times_cached, losses_cached, sources = train(cached, dataset)

    print("\nepoch   without cache   with cache   cached backbone's items")
    for epoch, (a, b, source) in enumerate(zip(times_plain, times_cached, sources), start=1):
        print(f"{epoch:>5}   {a:>11.2f} s   {b:>8.2f} s   {source}")
    speedup = sum(times_plain[1:]) / sum(times_cached[1:])
    print(f"later epochs are {speedup:.0f}x faster with the cache")

    # Background writes: wait until every entry is on disk before reading the disk stats.
    cache = cached.cache_instance
    cache.flush()
    stats = cache.stats()
    print(f"\ncache stats: {stats.hits} hits, {stats.misses} misses, hit rate {stats.hit_rate:.0%}")
    print(f"  memory: {stats.memory.entries} entries, {stats.memory.bytes / 1e6:.2f} MB")
    if stats.disk is not None:
        print(f"  disk:   {stats.disk.entries} entries, {stats.disk.bytes / 1e6:.2f} MB in {cache.cache_dir}")
        if stats.disk.hits:
            print(f"  {stats.disk.hits} disk hits: entries written by an earlier run")
        else:
            print("  run the script again: its first epoch reads every item from disk")
    # Correctness: the cached features are the uncached ones, bit for bit, so training
    # through the cache gives the same losses and the same head.
    images = dataset.tensors[0]
    with torch.no_grad():
        same_features = torch.equal(cached(images), plain(images))
    plain_state, cached_state = head_plain.state_dict(), head_cached.state_dict()
    same_head = all(torch.equal(plain_state[k], cached_state[k]) for k in plain_state)
    print(f"\ncached features equal uncached features: {same_features}")
    print(f"same losses per epoch: {losses_plain == losses_cached}; same trained head: {same_head}")
    print(f"epoch losses: {', '.join(f'{x:.3f}' for x in losses_cached)}")
    print(f"head accuracy on the training images: {accuracy(cached, head_cached, dataset):.0%}")
    if not (same_features and same_head):
        raise SystemExit("cached and uncached results differ")


if __name__ == "__main__":
    main()
