"""The Redis store against the packed disk store, and with a local copy: fill, then random batches of hits.

Usage::

    python benchmarks/redis_store.py                # 20,000 entries of 3,072 bytes
    python benchmarks/redis_store.py --entries 5000 --batches 10
    python benchmarks/redis_store.py --json out.json  # default: benchmarks/results/redis_store.json

A ``redis-server`` is started on a free loopback port (no persistence, a temporary
directory) and stopped at the end. Both stores get the same 20,000 entries of 3 KiB
(a (768,) float32 row each) in ``put_many`` batches of 1,024; then the same random
batches of 1,024 hits are read from each (``get_many``, in one process, the page cache
warm for the packed store). Each value starts with its entry number and every read is
checked against its entry. Reported: microseconds per item to fill, the median and
range of milliseconds per batch of hits, and round trips per batch (Redis:
``RedisStore.round_trips``). Exits non-zero if a read returned wrong bytes.

Two more rows give the Redis store with a local copy in front
(:class:`~torchcache.tiers.layered.LayeredStore`, ``local_cache_dir``): ``redis+copy``
is filled through the copy, so its hits are local; ``new copy`` reads the same batches
once through an empty copy (a second machine's first epoch: each batch goes to the
server once and is written to the copy).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results  # noqa: E402

from torchcache.stores.batched import BatchedStore  # noqa: E402
from torchcache.stores.packed.store import PackedStore  # noqa: E402
from torchcache.stores.redis.store import RedisStore  # noqa: E402
from torchcache.tiers.layered import LayeredStore  # noqa: E402

VALUE = 3072
BATCH = 1024


def key_of(i: int) -> str:
    """The key of entry ``i``: 32 hex digits, as the cache makes them."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()


def values(start: int, stop: int, pool: bytes) -> list[bytes]:
    """Values of entries ``start..stop``: the entry number, then bytes from ``pool``."""
    span = len(pool) - VALUE
    return [i.to_bytes(8, "little") + pool[(i * 7919) % span :][: VALUE - 8] for i in range(start, stop)]


def start_server(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on a free loopback port, ready to answer."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    command += ["--dir", str(directory), "--daemonize", "no", "--logfile", str(directory / "redis.log")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"redis-server exited: {(directory / 'redis.log').read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return process, port
        except OSError:
            pass
        time.sleep(0.01)  # polling for start-up
    process.kill()
    raise SystemExit("redis-server did not start")


def fill(store: BatchedStore, n: int, pool: bytes) -> float:
    """Write ``n`` entries in batches; return microseconds per item."""
    elapsed = 0.0
    for start in range(0, n, BATCH):
        stop = min(n, start + BATCH)
        items = list(zip((key_of(i) for i in range(start, stop)), values(start, stop, pool)))
        t = time.perf_counter()
        stored = store.put_many(items)
        elapsed += time.perf_counter() - t
        assert stored == stop - start, f"{type(store).__name__} stored {stored} of {stop - start}"
    store.flush()
    return elapsed / n * 1e6


def _no_faults(kind: str, message: str) -> None:
    raise AssertionError(f"unexpected fault {kind}: {message}")


def summary(times: list[float], fill_us: float, trips: float, right: bool) -> dict[str, float]:
    """One row of results."""
    return {
        "fill_us_per_item": fill_us,
        "batch_ms_median": statistics.median(times) * 1e3,
        "batch_ms_min": min(times) * 1e3,
        "batch_ms_max": max(times) * 1e3,
        "round_trips_per_batch": trips,
        "correct": float(right),
    }


def read(store: BatchedStore, batches: list[np.ndarray], pool: bytes) -> tuple[list[float], bool]:
    """Read each batch of hits; return the seconds of each and whether every value was right."""
    times, ok = [], True
    for rows in batches:
        keys = [key_of(int(i)) for i in rows]
        t = time.perf_counter()
        got = store.get_many(keys)
        times.append(time.perf_counter() - t)
        for v, i in zip(got, rows):
            ok = ok and v is not None and bytes(v) == values(int(i), int(i) + 1, pool)[0]
    return times, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=30, help="batches of 1,024 hits read from each store")
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/redis_store.json")
    args = parser.parse_args()
    n = args.entries
    base = Path(tempfile.mkdtemp(prefix="redis-bench-"))
    pool = np.random.default_rng(0).bytes(1 << 22)
    rng = np.random.default_rng(1)
    batches = [rng.choice(n, min(BATCH, n), replace=False) for _ in range(args.batches)]
    process, port = start_server(base)
    results: dict[str, dict[str, float]] = {}
    ok = True
    try:
        url = f"redis://127.0.0.1:{port}/0"
        redis_store = RedisStore(url, "bench", 1 << 40)
        behind = RedisStore(url, "bench-copy", 1 << 40)
        layered = LayeredStore(PackedStore(base / "copy", 1 << 40), behind, _no_faults)
        packed = PackedStore(base / "packed", 1 << 40)
        stores: list[tuple[str, BatchedStore, RedisStore | None]] = [
            ("redis", redis_store, redis_store),
            ("packed", packed, None),
            ("redis+copy", layered, behind),
        ]
        for name, store, server in stores:
            fill_us = fill(store, n, pool)
            read(store, batches[:2], pool)  # warm up (connections, page cache)
            trips = server.round_trips if server else 0
            times, right = read(store, batches, pool)
            ok = ok and right
            trips_per_batch = (server.round_trips - trips) / len(batches) if server else 0
            results[name] = summary(times, fill_us, trips_per_batch, right)
        fresh = LayeredStore(PackedStore(base / "new-copy", 1 << 40), behind, _no_faults)
        trips = behind.round_trips
        times, right = read(fresh, batches, pool)  # every batch once: from the server into the copy
        ok = ok and right
        results["new copy"] = summary(times, 0.0, (behind.round_trips - trips) / len(batches), right)
        used = redis_store.nbytes
        for each in (redis_store, behind):
            each.clear()
        for each in (redis_store, layered, fresh, packed):
            each.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)
    print(f"{n:,} entries of {VALUE:,} bytes ({used / 1e6:.1f} MB in Redis), batches of {BATCH:,} random hits")
    header = f"{'store':10} {'fill us/item':>12} {'hits ms/batch median [min-max]':>32} {'round trips/batch':>18}"
    print(f"{header}  correct")
    for name, row in results.items():
        spread = f"{row['batch_ms_median']:.2f} [{row['batch_ms_min']:.2f}-{row['batch_ms_max']:.2f}]"
        trips = "-" if name == "packed" else f"{row['round_trips_per_batch']:.0f}"
        fill_us = "-" if name == "new copy" else f"{row['fill_us_per_item']:.1f}"
        print(f"{name:10} {fill_us:>12} {spread:>32} {trips:>18}  {bool(row['correct'])}")
    write_results("redis_store", {"entries": n, "value_bytes": VALUE, "batch": BATCH, **results}, args.json)
    if not ok:
        print("WRONG BYTES: a read returned something other than the entry written", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
