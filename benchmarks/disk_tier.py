"""The persistent tier through the public API: fill, bytes on disk, open, and batches of hits.

Usage::

    python benchmarks/disk_tier.py                  # 200,000 items of (768,) float32
    python benchmarks/disk_tier.py --items 1000000  # 1,000,000 items
    python benchmarks/disk_tier.py --json out.json

A cached module returns a copy of its input, so every output is a random (incompressible)
(768,) float32 row that the test can check: hits must equal the rows they were computed
from. The inputs live in one ``.npy`` file, which is also the floor: an ``np.memmap``
gather of the same rows, what users do by hand when they precompute features. Steps,
with ``max_memory_cache_size=0``:

1. fill: batches of 1,024 misses through ``model(x)``, then ``flush()`` (microseconds per
   item; the time to draw the inputs from the memmap is left out);
2. bytes on disk (allocated blocks of the module directory) over the raw output bytes;
3. open: in a fresh process, the first call (1,024 new items, all misses) plus ``flush()``;
4. hits: in another fresh process, 20 random batches of 1,024 hits (median), against the
   median of 20 memmap gathers of the same rows in that process. The page cache is warm
   for both (the files were just written).

It exits non-zero if a hit returned a wrong row or a target was missed. The results,
with every batch's time, go to ``--json`` (by default ``benchmarks/results/disk_tier.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results

ROOT = Path(__file__).resolve().parent.parent
DIM = 768
BATCH = 1024
REPEATS = 20
TARGETS = {"fill_us": 25.0, "disk_ratio": 1.05, "open_s": 0.5, "hit_ratio": 4.0}

_MODEL = textwrap.dedent(
    """
    import sys, time, json
    import numpy as np
    import torch
    sys.path.insert(0, {root!r})
    from torchcache import torchcache

    @torchcache(persistent=True, persistent_cache_dir={cache!r}, max_memory_cache_size=0,
                persistent_module_hash="disk-tier-benchmark")
    class Backbone(torch.nn.Module):
        def forward(self, x):
            return x.clone()

    torch.set_num_threads(1)
    rows = np.load({rows!r}, mmap_mode="r")
    model = Backbone().eval()
    """
)

_FILL = """
out = {{}}
elapsed = 0.0
for start in range(0, {items}, {batch}):
    x = torch.from_numpy(np.ascontiguousarray(rows[start : start + {batch}]))
    t = time.perf_counter()
    model(x)
    elapsed += time.perf_counter() - t
t = time.perf_counter()
model.cache_instance.flush()
elapsed += time.perf_counter() - t
out["fill_s"] = elapsed
out["misses"] = model.cache_instance.stats().misses
print(json.dumps(out))
"""

_OPEN = """
fresh = torch.randn({batch}, {dim})
t = time.perf_counter()
model(fresh)
model.cache_instance.flush()
print(json.dumps({{"open_s": time.perf_counter() - t, "misses": model.cache_instance.stats().misses}}))
"""

_HITS = """
rng = np.random.default_rng(0)
picks = [np.sort(rng.choice({items}, {batch}, replace=False)) for _ in range({repeats})]
gathers, hits, wrong = [], [], 0
for idx in picks:
    t = time.perf_counter()
    floor = rows[idx]
    gathers.append(time.perf_counter() - t)
for idx in picks:
    x = torch.from_numpy(np.ascontiguousarray(rows[idx]))
    t = time.perf_counter()
    y = model(x)
    hits.append(time.perf_counter() - t)
    wrong += int(not torch.equal(y, x))
stats = model.cache_instance.stats()
print(json.dumps({{"hit_s": sorted(hits)[len(hits) // 2], "memmap_s": sorted(gathers)[len(gathers) // 2],
                   "wrong": wrong, "hits": stats.hits, "misses": stats.misses,
                   "hit_runs_s": hits, "memmap_runs_s": gathers}}))
"""


def _run(script: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark step failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--dir", help="work directory (default: a temporary directory, removed afterwards)")
    parser.add_argument("--json", help="write the results here (default: benchmarks/results/disk_tier.json)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="torchcache-disk-tier-"))
    work.mkdir(parents=True, exist_ok=True)
    cache, rows_path = work / "cache", work / "rows.npy"
    try:
        rng = np.random.default_rng(1)
        rows = np.lib.format.open_memmap(rows_path, mode="w+", dtype=np.float32, shape=(args.items, DIM))
        for start in range(0, args.items, 65536):
            stop = min(start + 65536, args.items)
            rows[start:stop] = rng.standard_normal((stop - start, DIM), dtype=np.float32)
        rows.flush()
        del rows
        head = _MODEL.format(root=str(ROOT), cache=str(cache), rows=str(rows_path))
        params = {"items": args.items, "batch": BATCH, "dim": DIM, "repeats": REPEATS}
        fill = _run(head + _FILL.format(**params))
        assert fill["misses"] == args.items, fill
        raw = args.items * DIM * 4
        disk = _disk_bytes(cache)
        opened = _run(head + _OPEN.format(**params))
        assert opened["misses"] == BATCH, opened
        hits = _run(head + _HITS.format(**params))
        if hits["wrong"] or hits["misses"]:
            print(f"WRONG: {hits['wrong']} batches differ, {hits['misses']} misses where all should hit")
            return 1
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    results = {
        "items": args.items,
        "fill_us": fill["fill_s"] / args.items * 1e6,
        "disk_ratio": disk / raw,
        "open_s": opened["open_s"],
        "hit_ms": hits["hit_s"] * 1e3,
        "memmap_ms": hits["memmap_s"] * 1e3,
        "hit_ratio": hits["hit_s"] / hits["memmap_s"],
        "hit_runs_ms": [t * 1e3 for t in hits["hit_runs_s"]],
        "memmap_runs_ms": [t * 1e3 for t in hits["memmap_runs_s"]],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    print(f"persistent tier, {args.items:,} items of ({DIM},) float32, max_memory_cache_size=0 ({results['machine']})")
    checks = [
        ("fill (incl. flush)", f"{results['fill_us']:.1f} us/item", results["fill_us"] <= TARGETS["fill_us"], "<= 25"),
        (
            "bytes on disk / raw",
            f"{results['disk_ratio']:.3f}x",
            results["disk_ratio"] <= TARGETS["disk_ratio"],
            "<= 1.05",
        ),
        (
            "open (first call + flush)",
            f"{results['open_s'] * 1e3:.0f} ms",
            results["open_s"] <= TARGETS["open_s"],
            "<= 500 ms",
        ),
        (
            "1,024 random hits",
            f"{results['hit_ms']:.2f} ms (memmap {results['memmap_ms']:.2f} ms, {results['hit_ratio']:.1f}x)",
            results["hit_ratio"] <= TARGETS["hit_ratio"],
            "<= 4x memmap",
        ),
    ]
    for name, value, ok, target in checks:
        print(f"  {name:<28} {value:<44} target {target:<12} {'met' if ok else 'MISSED'}")
    results["targets_met"] = all(ok for _, _, ok, _ in checks)
    write_results("disk_tier", results, args.json)
    return 0 if all(ok for _, _, ok, _ in checks) else 1


if __name__ == "__main__":
    start = time.perf_counter()
    status = main()
    print(f"({time.perf_counter() - start:.0f} s)")
    sys.exit(status)
