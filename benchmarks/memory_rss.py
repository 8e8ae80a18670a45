"""Does the memory tier hold what ``stats()`` says? RSS growth against ``stats().memory.bytes``.

Usage::

    python benchmarks/memory_rss.py [--gb 1.0] [--json PATH]

Fills the memory tier of a decorated function with about ``--gb`` GB of entries, for
small (768,) items and for large (197, 768) items, then reads the process's resident
set size (``VmRSS`` in ``/proc/self/status``, Linux only). Inputs are made and dropped
batch by batch, so what stays resident is the cache. It checks that every entry is
served back equal to its output and prints RSS growth next to the bytes the tier reports
(and writes them to ``--json``, by default ``benchmarks/results/memory_rss.json``).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results

from torchcache import torchcache


def rss_bytes() -> int:
    """Resident set size of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def fill(shape: tuple[int, ...], batch: int, total: int) -> tuple[int, int, int, bool]:
    """Fill a fresh cache with ``total`` bytes of items; return (rss growth, tier bytes, entries, correct)."""

    @torchcache(max_memory_cache_size=2 * total)
    def features(seed: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int(seed[0]))
        return torch.relu(torch.randn(seed.shape[0], *shape, generator=gen))

    item = 4 * int(torch.tensor(shape).prod())
    batches = max(1, total // (item * batch))
    gc.collect()
    before = rss_bytes()
    for b in range(batches):
        seed = torch.arange(b * batch, (b + 1) * batch, dtype=torch.int64)
        features(seed)
    gc.collect()
    grown = rss_bytes() - before
    stats = features.cache_instance.stats()  # type: ignore[attr-defined]
    correct = True
    for b in (0, batches // 2, batches - 1):  # hits come back equal to a fresh computation
        seed = torch.arange(b * batch, (b + 1) * batch, dtype=torch.int64)
        gen = torch.Generator().manual_seed(int(seed[0]))
        expected = torch.relu(torch.randn(batch, *shape, generator=gen))
        correct &= torch.equal(features(seed), expected)
    correct &= features.cache_instance.stats().misses == stats.misses  # type: ignore[attr-defined]
    return grown, stats.memory.bytes, stats.memory.entries, correct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="bytes of entries per case, in GB (default 1.0)")
    parser.add_argument("--json", help="default: benchmarks/results/memory_rss.json")
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    ok = True
    rows = []
    print(f"{'items':<12} {'entries':>9} {'stats bytes':>14} {'RSS growth':>14} {'RSS/stats':>10}  check")
    for shape, batch in (((768,), 256), ((197, 768), 16)):
        grown, nbytes, entries, correct = fill(shape, batch, total)
        ok &= correct
        print(
            f"{shape!s:<12} {entries:>9,} {nbytes:>14,} {grown:>14,} {grown / nbytes:>10.3f}  "
            f"{'hits equal outputs' if correct else 'WRONG'}"
        )
        rows.append({"shape": str(shape), "entries": entries, "stats_bytes": nbytes, "rss_growth": grown})
        rows[-1] |= {"rss_over_stats": grown / nbytes, "correct": bool(correct)}
    write_results("memory_rss", {"gb": args.gb, "rows": rows, "correct": bool(ok)}, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
