"""The packed disk store through its own API: fill, size on disk, open, and batch reads.

Usage::

    python benchmarks/packed_store.py                 # 200,000 entries of 3,072 bytes
    python benchmarks/packed_store.py --large         # 1,000,000 entries
    python benchmarks/packed_store.py --lmdb-values   # also: the same through LMDB values alone
    python benchmarks/packed_store.py --json out.json

Each entry's value starts with its number, so every read is checked against the entry
it must be. Steps: fill the store with ``put_many`` batches of 1,024 and ``flush``
(microseconds per item); bytes on disk (allocated blocks) over raw payload bytes; open
the store in a fresh process and run a first ``get_many`` of 1,024 missing keys; then,
in another fresh process, 20 ``get_many`` of 1,024 random hits (median) against the
floor: an ``np.memmap`` gather of the same rows from one ``.npy`` file, in a fresh
process too. The page cache is warm for both (the files were just written). It exits
non-zero if a read returned wrong bytes or a target was missed. The results, with every
batch's time, go to ``--json`` (by default ``benchmarks/results/packed_store.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results  # noqa: E402

from torchcache.stores.packed.store import PackedStore  # noqa: E402

VALUE = 3072
BATCH = 1024
REPEATS = 20
TARGETS = {"fill_us": 15.0, "disk_ratio": 1.05, "open_s": 0.5, "batch_ratio": 3.0}


def key_of(i: int) -> str:
    """The key of entry ``i``: 32 hex digits, as the cache makes them."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()


def values(start: int, stop: int, pool: bytes) -> list[bytes]:
    """Values of entries ``start..stop``: the entry number, then random bytes from ``pool``."""
    span = len(pool) - VALUE
    return [i.to_bytes(8, "little") + pool[(i * 7919) % span :][: VALUE - 8] for i in range(start, stop)]


_CHILD = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from torchcache.stores.packed.store import PackedStore
    sys.path.insert(0, sys.argv[2])
    from packed_store import key_of
    imported = time.perf_counter() - t0
    mode, directory, n, seed = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    rng = np.random.default_rng(seed)
    batches = [np.sort(rng.choice(n, 1024, replace=False)) for _ in range(20)]
    out = {"import_s": imported}
    if mode == "open":
        missing = [key_of(n + i) for i in range(1024)]
        t = time.perf_counter()
        store = PackedStore(directory, 1 << 50)
        got = store.get_many(missing)
        out["open_s"] = time.perf_counter() - t
        out["ok"] = all(v is None for v in got)
    elif mode == "store":
        store = PackedStore(directory, 1 << 50)
        times, ok = [], True
        for rows in batches:
            keys = [key_of(int(i)) for i in rows]
            t = time.perf_counter()
            got = store.get_many(keys)
            times.append(time.perf_counter() - t)
            ok = ok and all(v is not None and int.from_bytes(v[:8], "little") == int(i) for v, i in zip(got, rows))
        out["times"], out["ok"] = times, ok
    elif mode == "memmap":
        array = np.load(directory + "/rows.npy", mmap_mode="r")
        times, ok = [], True
        for rows in batches:
            t = time.perf_counter()
            got = array[rows]
            times.append(time.perf_counter() - t)
            ok = ok and bool((got[:, :8].copy().view(np.int64)[:, 0] == rows).all())
        out["times"], out["ok"] = times, ok
    print(json.dumps(out))
    """
)


def child(mode: str, directory: Path, n: int, seed: int) -> dict[str, object]:
    """Run one measurement in a fresh interpreter."""
    here = str(Path(__file__).parent)
    args = [sys.executable, "-c", _CHILD, str(ROOT), here, mode, str(directory), str(n), str(seed)]
    result = subprocess.run(args, capture_output=True, text=True, check=False, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.splitlines()[-1]))


def fill(directory: Path, n: int, pool: bytes) -> tuple[float, int]:
    """Fill a store with ``n`` entries; return (seconds, store disk bytes)."""
    store = PackedStore(directory, 1 << 50)
    keys = [key_of(i) for i in range(n)]
    elapsed = 0.0
    for start in range(0, n, BATCH):
        stop = min(n, start + BATCH)
        items = list(zip(keys[start:stop], values(start, stop, pool)))
        t = time.perf_counter()
        store.put_many(items)
        elapsed += time.perf_counter() - t
    t = time.perf_counter()
    store.flush()
    store.close()
    elapsed += time.perf_counter() - t
    return elapsed, PackedStore(directory, 1 << 50).disk_bytes


def write_npy(directory: Path, n: int, pool: bytes) -> None:
    """The same rows in one ``.npy`` file, for the memmap floor."""
    array = np.lib.format.open_memmap(directory / "rows.npy", mode="w+", dtype=np.uint8, shape=(n, VALUE))
    for start in range(0, n, 16384):
        stop = min(n, start + 16384)
        array[start:stop] = np.frombuffer(b"".join(values(start, stop, pool)), dtype=np.uint8).reshape(-1, VALUE)
    array.flush()
    del array


def lmdb_values(directory: Path, n: int, pool: bytes) -> dict[str, float]:
    """The alternative of keeping values in LMDB itself: fill, disk ratio, batch read."""
    import lmdb

    env = lmdb.open(str(directory / "values.lmdb"), map_size=1 << 40, subdir=False, sync=False, metasync=False)
    keys = [bytes.fromhex(key_of(i)) for i in range(n)]
    t = time.perf_counter()
    for start in range(0, n, BATCH):
        stop = min(n, start + BATCH)
        with env.begin(write=True) as txn:
            for kb, value in zip(keys[start:stop], values(start, stop, pool)):
                txn.put(kb, value)
    fill_s = time.perf_counter() - t
    rng = np.random.default_rng(1)
    times = []
    for _ in range(REPEATS):
        rows = np.sort(rng.choice(n, BATCH, replace=False))
        t = time.perf_counter()
        with env.begin() as txn:
            got = [txn.get(keys[int(i)]) for i in rows]
        times.append(time.perf_counter() - t)
        assert all(v is not None and int.from_bytes(v[:8], "little") == int(i) for v, i in zip(got, rows))
    env.close()
    disk = sum(p.stat().st_blocks * 512 for p in directory.glob("values.lmdb*"))
    return {
        "fill_us": fill_s / n * 1e6,
        "disk_ratio": disk / (n * VALUE),
        "batch_ms_same_process": statistics.median(times) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="1,000,000 entries instead of 200,000")
    parser.add_argument("--lmdb-values", action="store_true", help="also measure values kept in LMDB itself")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the store (a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/packed_store.json")
    args = parser.parse_args()
    n = 1_000_000 if args.large else 200_000
    base = Path(tempfile.mkdtemp(prefix="packed-bench-", dir=args.dir))
    pool = np.random.default_rng(0).bytes(1 << 22)
    try:
        fill_s, disk = fill(base / "store", n, pool)
        write_npy(base, n, pool)
        opened = child("open", base / "store", n, 0)
        store = child("store", base / "store", n, 1)
        floor = child("memmap", base, n, 1)
        extra = lmdb_values(base, n, pool) if args.lmdb_values else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    store_ms = statistics.median(store["times"]) * 1e3  # type: ignore[arg-type]
    floor_ms = statistics.median(floor["times"]) * 1e3  # type: ignore[arg-type]
    results = {
        "entries": n,
        "fill_us": fill_s / n * 1e6,
        "disk_ratio": disk / (n * VALUE),
        "open_s": opened["open_s"],
        "import_s": opened["import_s"],
        "batch_ms": store_ms,
        "floor_ms": floor_ms,
        "batch_ratio": store_ms / floor_ms,
        "batch_runs_ms": [t * 1e3 for t in store["times"]],  # type: ignore[attr-defined]
        "floor_runs_ms": [t * 1e3 for t in floor["times"]],  # type: ignore[attr-defined]
        "correct": bool(opened["ok"] and store["ok"] and floor["ok"]),
        "machine": f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "lmdb_values": extra,
    }
    print(f"packed store, {n:,} entries of {VALUE:,} bytes ({results['machine']})")
    print(f"  fill (put_many of {BATCH:,}, flush)   {results['fill_us']:8.2f} us/item   target <= {TARGETS['fill_us']}")
    print(f"  bytes on disk / raw             {results['disk_ratio']:8.4f}          target <= {TARGETS['disk_ratio']}")
    print(f"  open + get_many of 1,024 misses   {results['open_s']:8.3f} s         target <= {TARGETS['open_s']}")
    print(f"  get_many of 1,024 hits (median)   {store_ms:8.2f} ms")
    print(f"  np.memmap gather, same rows       {floor_ms:8.2f} ms  ratio {results['batch_ratio']:.2f}, target <= 3")
    if extra:
        print(f"  LMDB values alone: fill {extra['fill_us']:.2f} us/item, disk/raw {extra['disk_ratio']:.3f}, ", end="")
        print(f"batch {extra['batch_ms_same_process']:.2f} ms (same process)")
    missed = [name for name, target in TARGETS.items() if float(results[name]) > target]  # type: ignore[arg-type]
    results["targets_missed"] = missed
    write_results("packed_store", results, args.json)
    if not results["correct"]:
        print("FAILED: a read returned wrong bytes")
        return 1
    if missed:
        print(f"targets missed: {', '.join(missed)}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
