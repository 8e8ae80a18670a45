"""Reuse a persistent cache across runs and processes.

::

    python examples/persistent_reuse.py [CACHE_DIR]

Run 1, in this process, embeds 1,024 synthetic images with ``persistent=True``: every
item is computed and written to CACHE_DIR. Run 2 is a new Python process (this script,
started again with ``--child``). Its memory cache is empty, but it reads every item
from disk and never runs the encoder. Without CACHE_DIR the cache goes to a temporary
directory, removed at the end. With CACHE_DIR it is kept, so running the script again
finds everything on disk in run 1 as well. ``TORCHCACHE_EXAMPLE_SMALL=1`` embeds 256
images instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from torchcache import torchcache

N_IMAGES = 256 if os.environ.get("TORCHCACHE_EXAMPLE_SMALL") == "1" else 1024
BATCH_SIZE = 128


@torchcache(persistent=True)  # the cache root comes from $TORCHCACHE_DIR (set in main)
class Encoder(nn.Module):
    """A frozen conv net: 3x64x64 images -> 128 features."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.requires_grad_(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map images ``(batch, 3, 64, 64)`` to features ``(batch, 128)``."""
        return self.net(images)


def run(title: str) -> None:
    """Embed the dataset for two epochs and print where the items came from."""
    # The module key covers the class's code, the init arguments and the weights, so
    # both processes must build the same weights (in practice: load the same checkpoint).
    torch.manual_seed(0)
    encoder = Encoder().eval()
    images = torch.randn(N_IMAGES, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    cache = encoder.cache_instance
    print(f"{title} (pid {os.getpid()}), module key {cache.module_hash}")
    for epoch in (1, 2):
        before = cache.stats()
        start = time.perf_counter()
        for batch in images.split(BATCH_SIZE):
            encoder(batch)
        seconds = time.perf_counter() - start
        after = cache.stats()
        assert before.disk is not None and after.disk is not None
        computed = after.misses - before.misses
        from_disk = after.disk.hits - before.disk.hits
        from_memory = after.memory.hits - before.memory.hits
        print(
            f"  epoch {epoch}: {seconds:5.2f} s   computed {computed:>4}   "
            f"read from disk {from_disk:>4}   from memory {from_memory:>4}"
        )
    # Writes run in the background: wait until they are on disk before another process
    # reads the directory. (Interpreter exit flushes too.)
    cache.flush()
    stats = cache.stats()
    assert stats.disk is not None
    print(
        f"  cache: {stats.hits} hits, {stats.misses} misses; memory {stats.memory.entries} entries, "
        f"disk {stats.disk.entries} entries ({stats.disk.bytes / 1e6:.2f} MB)\n"
    )


def describe(cache_root: Path) -> None:
    """Show what a persistent cache looks like on disk, then what ``torchcache ls`` says of it."""
    print(f"{str(cache_root) + '/':<50}the cache root ($TORCHCACHE_DIR)")
    for module_dir in sorted(p for p in cache_root.iterdir() if p.is_dir()):
        meta = json.loads((module_dir / "torchcache.json").read_text())
        segments = sorted(module_dir.glob("seg-*.tcs"))
        segment_bytes = sum(p.stat().st_size for p in segments)
        print(f"  {module_dir.name + '/':<48}one directory per module key")
        about = f"name={meta['name']} kind={meta['kind']} version={meta['torchcache_version']}"
        print(f"    {'torchcache.json':<46}{about}")
        print(f"    {'index.lmdb':<46}the index: entry key -> segment, offset, length")
        print(f"    {'seg-*.tcs':<46}{len(segments)} segment file(s), {segment_bytes / 1e6:.2f} MB of packed entries")
    # The command line describes caches too: `torchcache info KEY` shows one in detail.
    print("\n$ torchcache ls", flush=True)
    subprocess.run([sys.executable, "-m", "torchcache", "ls", str(cache_root)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache_dir", nargs="?", help="cache root to use and keep (default: a temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run("run 2: a new process")
        return

    keep = args.cache_dir is not None
    cache_root = Path(args.cache_dir) if keep else Path(tempfile.mkdtemp(prefix="torchcache-example-"))
    # Like running `TORCHCACHE_DIR=... python script.py`; the child process inherits it.
    os.environ["TORCHCACHE_DIR"] = str(cache_root)
    try:
        run("run 1: this process")
        sys.stdout.flush()  # before the child's lines
        subprocess.run([sys.executable, __file__, "--child"], check=True)
        describe(cache_root)
        if keep:
            print(f"\nThe cache is kept in {cache_root}: run the script again to start with hits.")
    finally:
        if not keep:
            shutil.rmtree(cache_root, ignore_errors=True)


if __name__ == "__main__":
    main()
