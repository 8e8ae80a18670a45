"""``torchcache migrate``: move the entry files of torchcache 1.0 into a packed store."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..catalog.inspect import (
    ModuleCache,
    index_problem,
    list_files,
    open_store,
)
from ..catalog.removal import remove_file
from ..errors import StoreError
from ..stores.disk import ENTRY_SUFFIX
from ..stores.files import open_regular, read_at
from ..stores.packed.store import PackedStore
from .verify import UNLIMITED, Problem, check_entry

__all__ = ["Migration", "migrate_cache"]


_MIGRATE_BATCH = 256


@dataclass(frozen=True)
class Migration:
    """What :func:`migrate_cache` did to one module cache."""

    moved: int
    dropped: int
    damaged: list[Problem]


def _read_entry(path: Path) -> bytes | str:
    """An entry file's frame, checked, or why it cannot be used."""
    reason = check_entry(path)
    if reason is not None:
        return reason
    opened = open_regular(path)
    if opened is None:
        return "removed meanwhile"
    fd, st = opened
    try:
        return read_at(fd, st.st_size)
    finally:
        os.close(fd)


def migrate_cache(cache: ModuleCache, tick: Callable[[int], None] | None = None) -> Migration:
    """Pack a module cache's torchcache 1.0 entry files into its packed store, then remove them.

    Entries are added in batches, each file removed once its entry is in the store; the
    store's budget (the metadata's ``max_bytes``) still holds, so entries beyond it are
    evicted: ``moved`` counts the entries migrated that the store holds at the end, and
    ``dropped`` every entry the migration left out or evicted (a later batch can evict an
    earlier one, or entries the store held before). Damaged files are left in place and
    reported (``torchcache verify --fix`` removes them). Safe to interrupt and run again.

    Raises:
        StoreError: If the store cannot be opened (its index must be rebuilt first) or written.
        OSError: If a file cannot be removed.
    """
    broken = index_problem(cache.directory)
    if broken is not None:
        raise StoreError(f"the index of {cache.directory} is {broken}; run `torchcache verify --fix` to rebuild it")
    files = list_files(cache.directory)
    store = open_store(cache.directory)
    if store is None:
        store = PackedStore(cache.directory, max(cache.max_bytes or UNLIMITED, 1 << 16), report=lambda k, m: None)
    migrated: set[str] = set()
    damaged: list[Problem] = []
    with store:
        before = set(store.keys())
        for start in range(0, len(files.entries), _MIGRATE_BATCH):
            batch: list[tuple[str, bytes]] = []
            paths: list[Path] = []
            for entry in files.entries[start : start + _MIGRATE_BATCH]:
                data = _read_entry(entry.path)
                if isinstance(data, str):
                    if data != "removed meanwhile":
                        damaged.append(Problem(entry.path, "corrupt", data, entry.size))
                    continue
                batch.append((entry.path.name.removesuffix(ENTRY_SUFFIX), data))
                paths.append(entry.path)
            if batch:
                store.put_many(batch)
                migrated.update(key for key, _ in batch)
            for path in paths:
                remove_file(path)
            if tick is not None:
                tick(len(files.entries[start : start + _MIGRATE_BATCH]))
        after = set(store.keys())
    for shard in files.shards:
        with contextlib.suppress(OSError):  # damaged files left, or unknown ones
            os.rmdir(shard)
    return Migration(len(migrated & after), len((migrated | before) - after), damaged)
