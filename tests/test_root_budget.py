"""The budget of a whole cache root: its setting, and removing least recently used module caches at open."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torchcache
import torchcache.catalog.budget as root_budget_module
from tests.helpers import Counting, ProcessGroup, cached, run_python
from torchcache import CacheWarning, ConfigError
from torchcache.catalog.budget import (
    cache_in_use,
    claim_directory,
    enforce_root_budget,
    root_budget,
    scan_root,
    set_root_budget,
)
from torchcache.catalog.inspect import CacheUsage
from torchcache.catalog.removal import select_for_prune
from torchcache.config import DEFAULT_ROOT_BUDGET, resolve_root_budget
from torchcache.meta import META_NAME
from torchcache.stores.unsent import Unsent, count_unsent

#: Output width of the modules that fill caches: 512 items of 256 float32 take 512 kB, far
#: more than a store's index and lock files (about 120 kB).
WIDTH = 256
ITEMS = 512

FILL = """
import sys, torch
from tests.helpers import Counting, cached

model = cached(Counting, persistent=True)(4, {width}, seed={seed})
model(torch.randn({items}, 4, generator=torch.Generator().manual_seed({seed})))
model.cache_instance.flush()
print(model.cache_instance.cache_dir, flush=True)
"""

HOLD = """
print(model.cache_instance.stats().misses, flush=True)
sys.stdin.readline()  # the cache stays open until the test says so
print("done", flush=True)
"""


@pytest.fixture(autouse=True)
def _no_budget_set(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No budget set by the API or the environment, before and after each test."""
    monkeypatch.delenv("TORCHCACHE_MAX_SIZE", raising=False)
    set_root_budget(None)
    yield
    set_root_budget(None)


def fill(seed: int) -> Path:
    """Fill the cache of one module (by ``seed``) in a child process that then ends; its directory."""
    done = run_python(FILL.format(width=WIDTH, items=ITEMS, seed=seed))
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip())


def open_cache(seed: int, items: int = 4) -> torch.nn.Module:
    """Open (and start filling) the cache of one module in this process; the module keeps it open."""
    model = cached(Counting, persistent=True)(4, WIDTH, seed=seed)
    model(torch.randn(items, 4))
    model.cache_instance.flush()
    return model


def set_last_used(directory: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(directory / META_NAME, (t, t))


def sizes(root: Path) -> dict[Path, int]:
    return {c.directory: c.nbytes for c in scan_root(root)}


def budget_for(one: int) -> str:
    """A budget that holds one filled cache and a new one, and not two filled ones."""
    return str(int(one * 1.5))


# -- the setting ---------------------------------------------------------------------------------
def test_the_budget_comes_from_the_api_else_the_environment_else_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_root_budget() == (DEFAULT_ROOT_BUDGET, "default") == (50 * 10**9, "default")
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "20GB")
    assert root_budget() == (20 * 10**9, "TORCHCACHE_MAX_SIZE")
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "0")
    assert root_budget() == (None, "TORCHCACHE_MAX_SIZE")  # 0: no budget, as ccache's max_size
    torchcache.set_root_budget("500MiB")
    assert root_budget() == (500 * 2**20, "set_root_budget()")
    torchcache.set_root_budget(0)
    assert root_budget() == (None, "set_root_budget()")
    torchcache.set_root_budget(None)
    assert root_budget() == (None, "TORCHCACHE_MAX_SIZE")
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "twenty gigabytes")
    with pytest.raises(ConfigError, match=r"^TORCHCACHE_MAX_SIZE must be a byte count such as"):
        root_budget()
    with pytest.raises(ConfigError, match=r"^max_size must be a byte count"):
        torchcache.set_root_budget("-1GB")
    with pytest.raises(ConfigError, match=r"^max_size must be"):
        torchcache.set_root_budget(True)
    assert "set_root_budget" in torchcache.__all__


def test_selection_skips_caches_in_use_and_takes_the_next_least_recently_used(tmp_path: Path) -> None:
    caches = [CacheUsage(tmp_path / name, last_used, 10) for name, last_used in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    oldest, middle, newest = caches
    asked: list[CacheUsage] = []

    def in_use(cache: CacheUsage) -> bool:
        asked.append(cache)
        return cache is oldest

    assert select_for_prune(caches, 10.0, max_bytes=20, in_use=in_use) == [middle]
    assert asked == [oldest, middle]  # only caches that would go are asked about
    assert select_for_prune(caches, 10.0, max_bytes=5, in_use=in_use) == [middle, newest]
    assert select_for_prune(caches, 10.0, keep=1, in_use=in_use) == [middle]
    assert select_for_prune(caches, 10.0, older_than=7.5, in_use=in_use) == [middle]
    assert select_for_prune(caches, 10.0, max_bytes=20) == [oldest]


# -- in this process -----------------------------------------------------------------------------
def filled_here(seed: int, items: int = 64) -> Path:
    """A cache filled in this process and let go (as by a process that ended)."""
    model = open_cache(seed, items)
    directory = model.cache_instance.cache_dir
    assert directory is not None
    del model
    gc.collect()  # the cache, its claim and the lock on the segment it wrote go
    assert not cache_in_use(directory)
    return directory


def test_enforcing_removes_the_least_recently_used_caches_no_process_holds(cache_root: Path) -> None:
    a, b, c, d = (filled_here(seed) for seed in (1, 2, 3, 4))
    for age, directory in zip((400, 300, 200, 100), (a, b, c, d)):
        set_last_used(directory, age)
    (cache_root / "notes").mkdir()
    (cache_root / "notes" / "todo.txt").write_text("not a module cache")
    used = sizes(cache_root)
    assert set(used) == {a, b, c, d}

    claim = claim_directory(a)  # as a process that opened it
    assert claim is not None and cache_in_use(a)
    segment = next(b.glob("seg-*.tcs"))  # as a writer that took no claim (a dataset cache) holds its segment
    writer = os.open(segment, os.O_RDONLY)
    fcntl.flock(writer, fcntl.LOCK_SH)
    try:
        assert cache_in_use(b)
        removed = enforce_root_budget(cache_root, used[a] + used[b] + used[d])
        assert [r.directory for r in removed] == [c]  # a and b are in use: c goes in their place
        assert a.exists() and b.exists() and not c.exists() and d.exists()
    finally:
        os.close(writer)
        claim.release()
    assert "released" in repr(claim) and not cache_in_use(a)
    assert [r.directory for r in enforce_root_budget(cache_root, used[b] + used[d])] == [a]
    assert enforce_root_budget(cache_root, 0) and list(scan_root(cache_root)) == []
    assert (cache_root / "notes" / "todo.txt").read_text() == "not a module cache"
    assert enforce_root_budget(cache_root / "missing", 0) == []


def test_a_local_copy_holding_entries_its_server_did_not_take_is_never_removed(cache_root: Path) -> None:
    copy, other = filled_here(1), filled_here(2)
    set_last_used(copy, 200)
    set_last_used(other, 100)
    waiting = Unsent(copy)  # as a process whose server refused these: their only copy is here
    waiting.add([format(i, "032x") for i in range(3)])
    del waiting  # that process ended before its server came back
    gc.collect()
    assert [c.directory for c in scan_root(cache_root) if c.unsent] == [copy]
    assert [r.directory for r in enforce_root_budget(cache_root, 0)] == [other]
    assert copy.exists() and count_unsent(copy.glob("unsent-*")) == 3


def test_a_budget_set_by_the_api_is_kept_when_a_cache_opens(cache_root: Path) -> None:
    old = filled_here(1, items=256)
    set_last_used(old, 100)
    set_root_budget(sizes(cache_root)[old] // 2)
    model = open_cache(2)  # a module whose weights changed: the old cache goes
    assert not old.exists() and model.cache_instance.cache_dir.exists()  # type: ignore[union-attr]
    set_root_budget(1)  # the cache this process has open stays, whatever the budget
    again = open_cache(3)
    assert model.cache_instance.cache_dir.exists() and again.cache_instance.cache_dir.exists()  # type: ignore[union-attr]


def test_an_invalid_budget_is_one_warning_and_never_breaks_a_call(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = filled_here(1)
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "lots")
    monkeypatch.setattr(root_budget_module, "_warned", set())
    x = torch.randn(3, 4)
    model = cached(Counting, persistent=True)(4, WIDTH, seed=2)
    with pytest.warns(CacheWarning, match="TORCHCACHE_MAX_SIZE must be a byte count.*not kept under a budget"):
        out = model(x)
    torch.testing.assert_close(out, Counting(4, WIDTH, seed=2)(x))
    other = cached(Counting, persistent=True)(4, WIDTH, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per root and problem in a process
        other(x)
    assert old.exists()


@pytest.mark.parametrize("error", [errno.EBUSY, errno.EROFS])
def test_a_failed_removal_is_one_warning(cache_root: Path, monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    old = filled_here(1)
    set_last_used(old, 100)
    set_root_budget(1)
    monkeypatch.setattr(root_budget_module, "_warned", set())

    def refuse(directory: Path) -> tuple[int, Path | None]:  # EROFS: a store of another user's, on a writable disk
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(root_budget_module, "remove_cache", refuse)
    with pytest.warns(CacheWarning, match="cannot keep the cache root .* under its budget: .*") as caught:
        open_cache(2)
    assert old.exists() and os.strerror(error) in str(caught[0].message)


# -- across processes ----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_least_recently_used_cache_goes_when_another_opens(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = fill(1)
    second = fill(2)
    used = sizes(cache_root)
    assert set(used) == {first, second}
    budget = budget_for(used[first])
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", budget)  # this process reads it
    assert max(used.values()) < int(budget) < sum(used.values())
    set_last_used(first, 200)
    set_last_used(second, 100)

    model = open_cache(3)  # a third cache opens: the least recently used one goes, without any command
    assert not first.exists() and second.exists()
    assert set(sizes(cache_root)) == {second, model.cache_instance.cache_dir}


@pytest.mark.slow
def test_a_cache_a_live_process_holds_is_never_removed(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    held, other = fill(1), fill(2)
    holder = ProcessGroup((FILL + HOLD).format(width=WIDTH, items=ITEMS, seed=1), tmp_path / "stderr")
    try:
        assert Path(holder.readline().strip()) == held  # it opened the cache and stays until told
        assert holder.readline().strip() == "0"  # every item was a hit: it only reads, so it locks no segment
        assert not root_budget_module._writer_holds_segment(held) and cache_in_use(held)  # its claim alone keeps it
        monkeypatch.setenv("TORCHCACHE_MAX_SIZE", budget_for(sizes(cache_root)[other]))
        set_last_used(held, 300)  # the least recently used of all
        set_last_used(other, 200)
        model = open_cache(3)
        assert held.exists() and not other.exists()  # the next least recently used one went instead
        assert enforce_root_budget(cache_root, 1) == [] and held.exists()  # held, and this process holds its own
        holder.send("go")
        assert holder.readline().strip() == "done"
        assert holder.proc.wait(timeout=60) == 0
    finally:
        holder.close()
    assert not cache_in_use(held)
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "1")  # whatever the budget, the caches this process holds stay
    later = open_cache(4)  # once its process ended, the held cache goes
    assert not held.exists()
    assert {model.cache_instance.cache_dir, later.cache_instance.cache_dir} == set(sizes(cache_root))


def test_a_dataset_cache_that_is_only_read_is_kept(tmp_path: Path) -> None:
    from torchcache import CachedDataset

    data = CachedDataset(list(range(64)), tmp_path, max_memory_size=0)
    assert [data[i] for i in range(64)] == list(range(64))
    directory = data.cache.directory
    assert directory is not None and directory.is_dir()
    reader = CachedDataset(list(range(64)), tmp_path, max_memory_size=0)
    assert reader[3] == 3  # opens the tiers: the directory is claimed
    data.close()
    removed = enforce_root_budget(tmp_path, max_bytes=1)
    assert directory.is_dir() and all(c.directory != directory for c in removed)
    reader.close()
    enforce_root_budget(tmp_path, max_bytes=1)
    assert not directory.exists()


@pytest.mark.slow
def test_a_cache_that_grows_past_the_root_budget_removes_the_least_recently_used(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = fill(1)
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", budget_for(sizes(cache_root)[first]))
    model = open_cache(2, items=ITEMS)  # opens within the budget, then grows past it: its flush removes the other
    assert not first.exists() and set(sizes(cache_root)) == {model.cache_instance.cache_dir}
