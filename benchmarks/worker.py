"""Run one side's benchmark workloads and print the results as JSON.

Usage: ``python benchmarks/worker.py --side new|old|ref --task TASK [--dir D]``.
``new`` imports torchcache from the repository root, ``old`` from the
interpreter's site-packages (torchcache 0.6.0 in ``benchmarks/.venv-old``),
``ref`` runs the plain-torch references and never imports torchcache. The
result is printed on one line starting with ``RESULT_MARK``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import workloads as wl
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT_MARK = "@@RESULT@@ "
DEFAULT_BROTLI_QUALITY = 5


class Run:
    """Collects measurements and correctness checks of one worker process."""

    def __init__(self, side: str, quick: bool) -> None:
        """Initialise an empty result set for ``side``."""
        self.side = side
        self.quick = quick
        self.records: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []

    def reps(self, full: int, quick: int) -> int:
        """Return the repeat count for the current mode."""
        return quick if self.quick else full

    def record(self, key: str, unit: str, values: list[float], **extra: Any) -> None:
        """Store one metric (one value per repeat)."""
        self.records.append({"key": key, "unit": unit, "values": values, **extra})

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        """Store one correctness check."""
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})

    @contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Turn an exception inside a workload into a failed check."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported to the driver
            tb = traceback.format_exc(limit=6)
            self.check(f"{name} ran", False, f"{type(e).__name__}: {e}\n{tb}")


def import_torchcache(side: str) -> Any:
    """Import the side's torchcache and make sure it is the expected one."""
    if side == "new":
        sys.path.insert(0, str(ROOT))
    import torchcache

    if getattr(torchcache, "__file__", None) is None:
        raise ImportError(f"torchcache has no __init__.py yet: {torchcache!r}")
    where = Path(torchcache.__file__).resolve()
    inside = ROOT / "torchcache" in where.parents
    if (side == "new") != inside:
        raise RuntimeError(f"side {side} imported the wrong torchcache: {where}")
    return torchcache.torchcache


def fresh_subclass(base: type[nn.Module]) -> type[nn.Module]:
    """Return a new subclass of ``base`` (the same source in every process)."""

    class Fresh(base):  # type: ignore[valid-type, misc]
        """Subclass decorated in place by the new torchcache, once per call."""

    return Fresh


def checked_items(side: str, calls: int = 1, batch: int = 4) -> int:
    """Items the new torchcache computes again to check that items are independent (none for the old one).

    At a module's first call in a process, it computes some of the batch's items again in
    other batches (the last and the first, then one to three middle ones: five items of an
    even batch of six or more); and again at the first call that computes items once
    ``SPOT_ITEMS`` were computed since the last check. ``calls`` calls of ``batch`` items
    that compute them all.
    """
    if side != "new":
        return 0
    from torchcache.module.independence import SPOT_ITEMS

    checks, since = 1, 0
    for _ in range(calls - 1):
        checks, since = (checks + 1, 0) if since + batch >= SPOT_ITEMS else (checks, since + batch)
    return checks * _items_per_check(batch)


def _items_per_check(batch: int) -> int:
    """Items one check of a call of ``batch`` computes again (``torchcache.module.independence.check_items``)."""
    if batch <= 2:
        return batch
    middle = 3 if batch % 2 == 0 and batch > 4 else 2 if batch > 3 else 1
    return 2 + middle + (1 if batch == 3 else 3 if batch == 4 else 0)


def cached(side: str, kind: str, act: str = "relu", **kwargs: Any) -> nn.Module:
    """Decorate a workload module class and instantiate it.

    The new torchcache decorates a class in place, so it gets a fresh subclass
    each time; the old one subclasses the class itself.
    """
    decorator = import_torchcache(side)
    base = wl.MODULES[kind]
    cls = decorator(**kwargs)(fresh_subclass(base) if side == "new" else base)
    torch.manual_seed(0)
    module: nn.Module = cls(act=act)
    return module.eval()


def flush(module: nn.Module) -> None:
    """Wait for pending background writes (new side; no-op for the old one)."""
    getattr(module.cache_instance, "flush", lambda: None)()


def stats_of(module: nn.Module) -> str:
    """Return the cache's ``stats()`` as text when it has them (new side)."""
    return repr(getattr(module.cache_instance, "stats", lambda: "")())


def record_warm_and_cold(run: Run, key: str, fn: Callable[[Any], object], batches: list[Any]) -> None:
    """Record passes of ``fn`` over ``batches`` with a warm page cache, then after dropping it.

    Cold passes are recorded only where the page cache can be dropped (root).
    """
    warm = [wl.pass_times(fn, batches) for _ in range(run.reps(5, 3))]
    run.record(f"{key}/warm", "ms/batch", wl.per_batch_ms(warm, len(batches)))
    cold: list[float] = []
    for _ in range(run.reps(3, 2)):
        if not wl.drop_page_cache():
            break
        cold.append(wl.pass_times(fn, batches))
    if cold:
        run.record(f"{key}/cold", "ms/batch", wl.per_batch_ms(cold, len(batches)))
        wl.pass_times(fn, batches)  # the next process (another round) starts with a warm page cache again


def fill_time(m: nn.Module, xs: list[Tensor]) -> float:
    """Time one pass over ``xs`` plus the wait for pending disk writes."""
    t0 = time.perf_counter()
    for x in xs:
        m(x)
    flush(m)
    return time.perf_counter() - t0


def cache_dir_of(m: nn.Module) -> Path:
    """The module's cache directory (``cache_instance.cache_dir``)."""
    cache: Any = m.cache_instance
    return Path(cache.cache_dir)


def verify(run: Run, name: str, m: nn.Module, xs: list[Tensor], refs: list[Tensor]) -> None:
    """Check that every output equals the reference (compared at once)."""
    bad = 0
    for x, ref in zip(xs, refs):
        out = m(x)
        if not torch.equal(out.float(), ref.float()):
            bad += 1
    run.check(name, bad == 0, f"{bad}/{len(xs)} batches differ")


def plain_outputs(kind: str, xs: list[Tensor], act: str = "relu") -> list[Tensor]:
    """Return the uncached module's outputs for every batch."""
    plain = wl.build_plain(kind, act)
    return [plain(x) for x in xs]


# --------------------------------------------------------------------- W1, W2
def task_mem(run: Run, _dir: Path, only: set[str]) -> None:
    """W1/W2: uncached forward, first pass (all misses), memory hit passes."""
    for w, kind, batch, seed in (("W1", "feat768", 256, 11), ("W2", "tok197", 64, 12)):
        if w not in only:
            continue
        with run.guard(w):
            xs = wl.make_inputs(8, batch, seed)
            plain = wl.build_plain(kind)
            refs = [plain(x) for x in xs]
            wl.release_memory()
            wl.pass_times(plain, xs)
            un = [wl.pass_times(plain, xs) for _ in range(3)]
            run.record(f"{w}/uncached", "ms/batch", wl.per_batch_ms(un, len(xs)))
            first, hits, alive = [], [], []
            for r in range(2):
                wl.release_memory()
                m = cached(run.side, kind, max_memory_cache_size=int(2e9))
                count = wl.Computed(m, kind)
                first.append(wl.pass_times(m, xs))
                if r == 0:
                    run.check(
                        f"{w} first pass computed all",
                        count.items == 8 * batch + checked_items(run.side, 8, batch),
                        f"computed {count.items} items",
                    )
                    verify(run, f"{w} hits equal plain", m, xs, refs)
                    wl.pass_times(m, xs)
                    hits = [wl.pass_times(m, xs) for _ in range(run.reps(5, 3))]
                    run.check(
                        f"{w} hit passes computed nothing",
                        count.items == 8 * batch + checked_items(run.side, 8, batch),
                        f"computed {count.items} items; {stats_of(m)}",
                    )
                alive.append(m)  # freeing it would leave heap holes the next repeat reuses
            run.record(f"{w}/first", "ms/batch", wl.per_batch_ms(first, len(xs)))
            run.record(f"{w}/hit", "ms/batch", wl.per_batch_ms(hits, len(xs)))


# ------------------------------------------------------------------------- W3
W3_CASES = (("feat768", 256, 31), ("tok197", 64, 32))


def w3_cases(only: set[str]) -> list[tuple[str, int, int]]:
    """The W3 shapes selected by ``--only`` (``W3`` or ``W3.<kind>``)."""
    return [c for c in W3_CASES if {"W3", f"W3.{c[0]}"} & only]


def task_w3fill(run: Run, directory: Path, only: set[str]) -> None:
    """W3 (fill): write persistent caches that a fresh process reads."""
    for kind, batch, seed in w3_cases(only):
        with run.guard(f"W3 fill {kind}"):
            xs = wl.make_inputs(4, batch, seed)
            m = cached(run.side, kind, persistent=True, persistent_cache_dir=str(directory / kind))
            wl.Computed(m, kind)  # the reader's counting hook: a hook is part of the module's key
            wl.release_memory()
            fill = fill_time(m, xs)
            nbytes, _, files = wl.entry_bytes(cache_dir_of(m))
            run.record(f"W3/{kind}/fill", "ms/batch", [fill * 1e3 / len(xs)], entry_bytes=nbytes, files=files)
            run.check(f"W3 fill {kind} wrote entries", files > 0, f"{files} files")


def task_w3read(run: Run, directory: Path, only: set[str]) -> None:
    """W3 (read, fresh process): disk hits with warm and cold page cache."""
    for kind, batch, seed in w3_cases(only):
        with run.guard(f"W3 read {kind}"):
            xs = wl.make_inputs(4, batch, seed)
            refs = plain_outputs(kind, xs)
            m = cached(
                run.side, kind, persistent=True, max_memory_cache_size=0, persistent_cache_dir=str(directory / kind)
            )
            count = wl.Computed(m, kind)
            key = f"W3/{kind}"
            wl.warm_page_cache(directory / kind)  # an earlier process's cold passes dropped it
            wl.release_memory()  # no writeback of files an earlier process wrote during the timed passes
            run.record(f"{key}/fresh", "ms/batch", wl.per_batch_ms([wl.pass_times(m, xs)], 4))
            record_warm_and_cold(run, key, m, xs)
            verify(run, f"W3 {kind} disk hits equal plain", m, xs, refs)
            run.check(  # the new side's first call, all hits in a process that checked nothing, is checked whole
                f"W3 {kind} disk passes computed nothing",
                count.items == (batch if run.side == "new" else 0),
                f"computed {count.items} items; {stats_of(m)}",
            )


def new_brotli_quality() -> int:
    """Return the new torchcache's default ``brotli_quality`` (fallback 5)."""
    try:
        params = inspect.signature(import_torchcache("new")).parameters
        default = params["brotli_quality"].default
        return int(default) if isinstance(default, int) else DEFAULT_BROTLI_QUALITY
    except Exception:  # noqa: BLE001 - library not importable yet
        return DEFAULT_BROTLI_QUALITY


def task_w3ref(run: Run, directory: Path, only: set[str]) -> None:
    """W3 references: raw per-item file reads and 2-thread brotli decode."""
    quality = new_brotli_quality()
    pool = ThreadPoolExecutor(2)
    for kind, batch, seed in w3_cases(only):
        with run.guard(f"W3 ref {kind}"):
            xs = wl.make_inputs(4, batch, seed)
            refs = plain_outputs(kind, xs)
            shape = wl.OUTPUT_SHAPES[kind]
            paths = wl.write_raw_files(directory / kind, refs)
            key = f"W3/{kind}"
            ok = all(torch.equal(wl.raw_read(p, shape), r) for p, r in zip(paths, refs))
            run.check(f"W3 raw read {kind} equal", ok)
            read = functools.partial(wl.raw_read, item_shape=shape)
            wl.release_memory()  # the files just written are on disk before the timed reads
            record_warm_and_cold(run, key, read, paths)
            payloads = [wl.brotli_payloads(r, quality) for r in refs]
            ok = all(torch.equal(wl.brotli_decode(pool, p, shape), r) for p, r in zip(payloads, refs))
            run.check(f"W3 brotli decode {kind} equal", ok)
            decode = functools.partial(wl.brotli_decode, pool, item_shape=shape)
            dec = [wl.pass_times(decode, payloads) for _ in range(run.reps(5, 3))]
            size = sum(len(b) for p in payloads for b in p) / (len(xs) * batch)
            run.record(f"{key}/brotli", "ms/batch", wl.per_batch_ms(dec, len(xs)), quality=quality, bytes_per_item=size)
    pool.shutdown()


# ------------------------------------------------------------------------- W4
def task_w4(run: Run, directory: Path, only: set[str]) -> None:
    """W4: persistent first pass against the uncached forward."""
    cases = (("W4a", "feat768", 256, 4, 41), ("W4b", "backbone", 64, 3, 42))
    for w, kind, batch, n, seed in cases:
        if w not in only:
            continue
        with run.guard(w):
            xs = wl.make_inputs(n, batch, seed)
            plain = wl.build_plain(kind)
            refs = [plain(x) for x in xs]
            wl.pass_times(plain, xs)
            un = []
            for _ in range(3):  # each after release_memory(), as the first passes below are
                wl.release_memory()
                un.append(wl.pass_times(plain, xs))
            base = sorted(un)[len(un) // 2]
            first, raw, alive = [], [], []
            for r in range(2):
                d = directory / f"{w}-{r}"
                m = cached(run.side, kind, persistent=True, persistent_cache_dir=str(d))
                wl.release_memory()
                first.append(fill_time(m, xs))
                if r == 0:
                    verify(run, f"{w} hits equal plain", m, xs, refs)
                    files = wl.entry_bytes(cache_dir_of(m))[2]
                    run.check(f"{w} wrote entries", files > 0, f"{files} files")
                alive.append(m)  # directories are removed at the end: deletes slow down writes
                wl.release_memory()
                t0 = time.perf_counter()
                wl.write_raw_files(directory / f"{w}-raw-{r}", refs)
                raw.append((time.perf_counter() - t0) * 1e6 / (n * batch))
            run.record(f"{w}/uncached", "ms/batch", wl.per_batch_ms(un, n))
            run.record(f"{w}/first", "ms/batch", wl.per_batch_ms(first, n))
            if w == "W4a":
                miss = [(t - base) * 1e6 / (n * batch) for t in first]
                run.record(f"{w}/miss_cost", "us/item", miss)
                run.record(f"{w}/raw_write", "us/item", raw)
            else:
                run.record(f"{w}/ratio", "x", [t / base for t in first])


# ------------------------------------------------------------------------- W5
ZSTD22 = {"zstd_compression": True, "zstd_compression_level": 22}
ZSTD3 = {"zstd_compression": True, "zstd_compression_level": 3}
W5_SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "new": {"default": {}, "max": {"brotli_quality": 11}},
    "old": {"default": {}, "max": ZSTD22, "zstd3": ZSTD3},
}
W5_VARIANTS = (("relu_f32", "relu", None), ("gelu_f32", "gelu", None), ("relu_bf16", "relu", torch.bfloat16))


def task_w5(run: Run, directory: Path, _only: set[str]) -> None:
    """W5: bytes of entry files per item for several dtypes and settings."""
    xs = wl.make_inputs(2, 256, 51)
    items = 2 * 256
    for variant, act, dtype in W5_VARIANTS:
        refs = plain_outputs("feat768", xs, act)
        expect = [r.to(dtype) for r in refs] if dtype is not None else refs
        raw = expect[0][0].numel() * expect[0].element_size()
        run.record(f"W5/{variant}/raw", "B/item", [float(raw)])
        for setting, extra in W5_SETTINGS[run.side].items():
            with run.guard(f"W5 {variant} {setting}"):
                d = directory / f"{variant}-{setting}"
                kw = dict(extra, persistent=True, persistent_cache_dir=str(d))
                if dtype is not None:
                    kw["cache_dtype"] = dtype
                m = cached(run.side, "feat768", act, **kw)
                wl.Computed(m, "feat768")  # the reader's counting hook: a hook is part of the module's key
                wl.pass_times(m, xs)
                flush(m)
                nbytes, alloc, files = wl.entry_bytes(cache_dir_of(m))
                run.record(
                    f"W5/{variant}/{setting}", "B/item", [nbytes / items], allocated_per_item=alloc / items, files=files
                )
                del m
                reader = cached(run.side, "feat768", act, max_memory_cache_size=0, **kw)
                count = wl.Computed(reader, "feat768")
                verify(run, f"W5 {variant} {setting} disk hits equal", reader, xs, expect)
                run.check(  # the writer, in this process, already checked that items are independent
                    f"W5 {variant} {setting} read from disk", count.items == 0, f"computed {count.items} items"
                )
                del reader
                wl.release_memory()


# ------------------------------------------------------------------------- W6
def task_floor(run: Run, _dir: Path, only: set[str]) -> None:
    """W6: hash inputs with xxh3-128, dict lookup, index_select from a slab."""
    for w, kind, batch, seed in (("W1", "feat768", 256, 11), ("W2", "tok197", 64, 12)):
        if w not in only:
            continue
        with run.guard(f"W6 floor {w}"):
            xs = wl.make_inputs(8, batch, seed)
            refs = plain_outputs(kind, xs)
            floor = wl.Floor(xs, refs)
            ok = all(torch.equal(floor.lookup(x), r) for x, r in zip(xs, refs))
            run.check(f"W6 floor {w} equal plain", ok)
            wl.pass_times(floor.lookup, xs)
            t = [wl.pass_times(floor.lookup, xs) for _ in range(run.reps(7, 3))]
            run.record(f"W6/{w}", "ms/batch", wl.per_batch_ms(t, len(xs)))


def info(side: str) -> dict[str, str]:
    """Versions seen by this worker."""
    from importlib import metadata

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_threads": str(torch.get_num_threads())}
    for pkg in ("numpy", "brotli", "xxhash", "zstd", "torchcache"):
        with suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    if side != "ref":
        import_torchcache(side)
        import torchcache

        out["torchcache_file"] = torchcache.__file__
        out["torchcache"] = getattr(torchcache, "__version__", out.get("torchcache", "?"))
    return out


TASKS: dict[str, Callable[[Run, Path, set[str]], None]] = {
    "mem": task_mem,
    "floor": task_floor,
    "w3fill": task_w3fill,
    "w3read": task_w3read,
    "w3ref": task_w3ref,
    "w4": task_w4,
    "w5": task_w5,
}


def main() -> None:
    """Parse arguments, run one task and print its JSON result."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--side", choices=("new", "old", "ref"), required=True)
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--dir", type=Path, default=Path("."), help="scratch directory")
    p.add_argument("--only", default="W1,W2,W3,W4,W5,W6")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    only = set(a.only.split(","))
    only |= {"W4a", "W4b"} if "W4" in only else set()
    run = Run(a.side, a.quick)
    result: dict[str, Any] = {"side": a.side, "task": a.task}
    with run.guard(f"{a.side} setup"):
        result["info"] = info(a.side)
    if not run.checks:  # setup failed (e.g. torchcache not importable): skip the task
        with torch.no_grad():
            TASKS[a.task](run, a.dir, only)
    result["records"] = run.records
    result["checks"] = run.checks
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
