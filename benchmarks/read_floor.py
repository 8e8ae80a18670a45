"""The floor of a disk hit read in Python: the steps no keyed, checked read can skip.

Usage::

    python benchmarks/read_floor.py                 # 200,000 rows of (768,) float32
    python benchmarks/read_floor.py --items 50000   # a quicker run
    python benchmarks/read_floor.py --json out.json

``disk_tier.py`` compares a batch of 1,024 disk hits through the public API with an
``np.memmap`` gather of the same rows. This script measures, with plain numpy, lmdb and
xxhash and none of torchcache's code, the steps that any cache keyed by the content of
its inputs and checked per entry must take in Python for such a batch, each at its
cheapest:

1. key: one xxh3-128 per input row and one per item with the call's context (as
   ``torchcache.keys.hash_items`` does);
2. look up: the batch's 16-byte keys in an LMDB table in one read transaction, as a
   loop of ``txn.get`` and as one ``Cursor.getmulti`` (a C loop), keys in sorted order;
   the two take turns at reading a batch first, and only that first read is timed (a
   second read of the same keys finds the index pages hot, as no real hit does);
3. check: per record, its header unpacked and compared and one xxh3-64 over the key and
   payload, read from a mapping of the segment file (the lightest check that still
   catches a torn or flipped record);
4. copy: every payload joined into one output buffer.

The records live in one segment file ``header | key | payload`` and the index maps each
key to ``(offset, length)``, the packed store's layout reduced to its minimum. Every
step runs on the same 20 random batches (sorted indices, like ``disk_tier.py``); the
script prints the median of each and their sum against the memmap gather, and exits
non-zero if a copied row differs from the memmap's. The medians, with every batch's
times, go to ``--json`` (by default ``benchmarks/results/read_floor.json``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results

DIM = 768
BATCH = 1024
REPEATS = 20
HEADER = struct.Struct("<2sBIQ")  # magic, key length, payload length, checksum
ENTRY = struct.Struct("<QI")  # offset, payload length
MAGIC = b"\xc7\x5e"


def build(work: Path, items: int) -> tuple[np.ndarray, list[bytes]]:
    """Write the rows (``rows.npy``), their records (``seg``) and the index (``index.lmdb``)."""
    rng = np.random.default_rng(1)
    rows = np.lib.format.open_memmap(work / "rows.npy", mode="w+", dtype=np.float32, shape=(items, DIM))
    for start in range(0, items, 65536):
        stop = min(start + 65536, items)
        rows[start:stop] = rng.standard_normal((stop - start, DIM), dtype=np.float32)
    rows.flush()
    keys = [xxhash.xxh3_128_digest(b"ctx" + xxhash.xxh3_128_digest(rows[i].tobytes())) for i in range(items)]
    env = lmdb.open(str(work / "index.lmdb"), subdir=False, map_size=1 << 34, sync=False, metasync=False)
    offset = 0
    with open(work / "seg", "wb") as seg:
        for start in range(0, items, 4096):
            parts, entries = [], []
            for i in range(start, min(start + 4096, items)):
                payload = rows[i].tobytes()
                check = xxhash.xxh3_64_intdigest(payload, xxhash.xxh3_64_intdigest(keys[i], len(payload)))
                parts += (HEADER.pack(MAGIC, len(keys[i]), len(payload), check), keys[i], payload)
                entries.append((keys[i], ENTRY.pack(offset, len(payload))))
                offset += HEADER.size + len(keys[i]) + len(payload)
            seg.write(b"".join(parts))
            with env.begin(write=True) as txn:
                for key, value in entries:
                    txn.put(key, value)
    env.close()
    del rows
    return np.load(work / "rows.npy", mmap_mode="r"), keys


def measure(work: Path, rows: np.ndarray, keys: list[bytes], items: int) -> dict[str, Any]:
    env = lmdb.open(str(work / "index.lmdb"), subdir=False, readonly=True, lock=False)
    fd = os.open(work / "seg", os.O_RDONLY)
    view = memoryview(mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ))
    rng = np.random.default_rng(0)
    picks = [np.sort(rng.choice(items, BATCH, replace=False)) for _ in range(REPEATS)]
    inputs = [np.ascontiguousarray(rows[idx]) for idx in picks]
    times: dict[str, list[float]] = {k: [] for k in ("memmap", "key", "lookup_get", "lookup_getmulti", "check", "copy")}
    digest128, digest64, unpack, hsize = xxhash.xxh3_128_digest, xxhash.xxh3_64_intdigest, ENTRY.unpack, HEADER.size
    wrong = 0
    for idx, x in zip(picks, inputs):
        t = time.perf_counter()
        floor = rows[idx]
        times["memmap"].append(time.perf_counter() - t)

        t = time.perf_counter()
        flat, width = memoryview(x.reshape(-1).view(np.uint8)), DIM * 4
        batch_keys = [digest128(b"ctx" + digest128(flat[i * width : (i + 1) * width])) for i in range(BATCH)]
        times["key"].append(time.perf_counter() - t)

        ordered = sorted(batch_keys)
        # Each look-up timed only where it reads the batch first (the methods take turns):
        # the second look-up of the same keys finds the index pages hot, which a hit never does.
        first = "lookup_get" if len(times["lookup_get"]) <= len(times["lookup_getmulti"]) else "lookup_getmulti"
        for method in (first, "lookup_getmulti" if first == "lookup_get" else "lookup_get"):
            t = time.perf_counter()
            with env.begin() as txn:
                if method == "lookup_get":
                    get = txn.get
                    raws = [get(k) for k in ordered]
                else:
                    pairs = txn.cursor().getmulti(ordered)
            if method == first:
                times[method].append(time.perf_counter() - t)
        assert len(pairs) == BATCH and all(raw is not None for raw in raws)

        found = sorted((*unpack(raw), i) for i, raw in enumerate(raws))
        out: list[memoryview | None] = [None] * BATCH
        t = time.perf_counter()
        for offset, length, i in found:
            kb = ordered[i]
            start = offset + hsize + len(kb)
            magic, klen, plen, check = HEADER.unpack_from(view, offset)
            payload = view[start : start + length]
            whole = magic == MAGIC and plen == length and klen == len(kb)
            if whole and digest64(payload, digest64(kb, length)) == check:
                out[i] = payload
        times["check"].append(time.perf_counter() - t)

        position = {k: p for p, k in enumerate(batch_keys)}
        ordered_out = [None] * BATCH
        for i, payload in enumerate(out):
            ordered_out[position[ordered[i]]] = payload
        t = time.perf_counter()
        joined = np.frombuffer(bytearray().join(ordered_out), dtype=np.float32).reshape(BATCH, DIM)
        times["copy"].append(time.perf_counter() - t)
        wrong += int(not np.array_equal(joined, floor))
    os.close(fd)
    env.close()
    medians: dict[str, Any] = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    medians["wrong"] = wrong
    medians["runs_ms"] = {k: [t * 1e3 for t in v] for k, v in times.items()}
    return medians


def floor_sum(result: dict[str, Any]) -> float:
    """The floor in ms: key, the faster look-up, check and copy (medians)."""
    return float(
        result["key"] + min(result["lookup_get"], result["lookup_getmulti"]) + result["check"] + result["copy"]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--json", help="write the results here (default: benchmarks/results/read_floor.json)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="torchcache-read-floor-"))
    try:
        rows, keys = build(work, args.items)
        result = measure(work, rows, keys, args.items)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if result["wrong"]:
        print(f"WRONG: {result['wrong']} batches differ from the memmap gather")
        return 1
    total = floor_sum(result)
    memmap = result["memmap"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"floor of a checked, content-keyed read of {BATCH:,} hits, {args.items:,} rows of ({DIM},) float32")
    print(f"({machine})")
    print(f"  memmap gather (the reference)   {memmap:6.2f} ms")
    for name, label in (
        ("key", "key: xxh3-128 per row and item"),
        ("lookup_get", "look up: txn.get loop"),
        ("lookup_getmulti", "look up: Cursor.getmulti"),
        ("check", "check: header + xxh3-64 each"),
        ("copy", "copy: payloads joined"),
    ):
        print(f"  {label:<32} {result[name]:6.2f} ms  ({result[name] / memmap:4.1f}x memmap)")
    print(f"  sum (faster look-up)            {total:6.2f} ms  ({total / memmap:4.1f}x memmap; the target is 4x)")
    write_results("read_floor", {**result, "sum_ms": total, "items": args.items, "machine": machine}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
