"""Notebook-style use: a memory-only cache, so that a cell run again finds its items in memory.

Each ``# %%`` block is one notebook cell. The file also runs as a plain script (VS Code
and Jupytext open it as a notebook)::

    python examples/notebook_session_cache.py

Nothing is written to disk: ``@torchcache()`` without ``persistent=True`` keeps the
outputs in memory, on the encoder instance, for as long as the session lives. Each cell
prints its time and how many items hit and missed.
"""

# %% Cell 1: a frozen encoder, some data, and a helper that times a cell.
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from torchcache import torchcache


@torchcache(max_memory_cache_size="256MB")  # memory only, with a budget for this session
class Encoder(nn.Module):
    """A frozen conv net: images -> 128 features, pooled by average or maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.requires_grad_(False)

    def forward(self, images: torch.Tensor, pool: str = "avg") -> torch.Tensor:
        """Map images ``(batch, 3, H, W)`` to features ``(batch, 128)``."""
        maps = self.features(images)
        # ``pool`` is a plain argument: it is part of every item's key.
        return maps.mean(dim=(2, 3)) if pool == "avg" else maps.amax(dim=(2, 3))


def run_cell(title: str, encoder: Encoder, cell: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run a cell and print its time and how many items hit and missed."""
    before = encoder.cache_instance.stats()
    start = time.perf_counter()
    out = cell()
    ms = (time.perf_counter() - start) * 1000
    after = encoder.cache_instance.stats()
    hits, misses = after.hits - before.hits, after.misses - before.misses
    print(f"{title:<52} {ms:8.1f} ms   {hits:>4} hits {misses:>4} misses")
    return out


torch.manual_seed(0)
encoder = Encoder().eval()
images = torch.randn(512, 3, 64, 64)
new_images = torch.randn(256, 3, 64, 64)

# %% Cell 2: embed 512 images. Nothing is cached yet, so the encoder runs for all of them.
first = run_cell("cell 2: embed 512 images", encoder, lambda: encoder(images))

# %% Cell 3: run the same cell again: every item is a hit, and the encoder does not run.
again = run_cell("cell 3: the same cell again", encoder, lambda: encoder(images))
print(f"{'':<52} same output: {torch.equal(first, again)}")

# %% Cell 4: a batch that overlaps: 256 seen images and 256 new ones. Only the new ones
# are computed, and the output comes back in input order.
mixed = torch.cat([images[:256], new_images])
run_cell("cell 4: 256 seen + 256 new images", encoder, lambda: encoder(mixed))

# %% Cell 5: another value of a plain argument is another key: max pooling is computed.
run_cell("cell 5: the same images, pool='max'", encoder, lambda: encoder(images, pool="max"))
run_cell("cell 5 again", encoder, lambda: encoder(images, pool="max"))

# %% Cell 6: what the cache holds now.
stats = encoder.cache_instance.stats()
print(
    f"\ncache: {stats.memory.entries} entries, {stats.memory.bytes / 1e6:.2f} MB "
    f"of {stats.memory.max_bytes / 1e6:.0f} MB; hit rate {stats.hit_rate:.0%} over the session\n"
)

# %% Cell 7: re-running cell 1 makes a new encoder, and each instance has its own memory
# cache, so the new one starts empty (even with the same weights). Keep the encoder in
# its own cell, or use persistent=True: a new instance with the same code, arguments and
# weights then finds the entries on disk (see examples/persistent_reuse.py).
torch.manual_seed(0)
encoder = Encoder().eval()
run_cell("cell 7: a re-created encoder, 512 images", encoder, lambda: encoder(images))

# %% Cell 8: clear() empties the cache, e.g. to free memory.
encoder.cache_instance.clear()
print(f"cell 8: after clear(): {encoder.cache_instance.stats().memory.entries} entries")
