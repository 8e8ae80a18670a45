"""``torchcache migrate``: move the entry files of torchcache 1.0 into a packed store."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..catalog.inspect import (
    ENTRY_SUFFIX,
    ModuleCache,
    find_caches,
    index_problem,
    list_files,
    open_store,
)
from ..catalog.removal import remove_file
from ..errors import StoreError
from ..stores.files import open_regular, read_at
from ..stores.packed.store import PackedStore
from .commands import command_root
from .output import Progress, error, plural, relative, table
from .verify import UNLIMITED, Problem, check_entry

__all__ = ["Migration", "cmd_migrate", "migrate_cache"]


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


def cmd_migrate(args: argparse.Namespace) -> int:
    """``torchcache migrate``: pack the torchcache 1.0 entry files of module caches into their packed stores.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 1 if damaged files were left or a module cache could not be migrated, else 0.
    """
    root = command_root(args.path)
    caches = [cache for cache in find_caches(root) if cache.legacy_entries]
    if not caches:
        print(f"nothing to migrate: no torchcache 1.0 entries under {root}")
        return 0
    progress = Progress(sum(c.legacy_entries for c in caches), "migrate")
    moved = dropped = 0
    damaged: list[Problem] = []
    failures: list[str] = []
    try:
        for cache in caches:
            try:
                done = migrate_cache(cache, progress.update)
            except StoreError as exc:  # the others are still migrated
                failures.append(f"cannot migrate {cache.directory}: {exc}")
                continue
            moved, dropped = moved + done.moved, dropped + done.dropped
            damaged.extend(done.damaged)
    finally:
        progress.close()
    migrated = len(caches) - len(failures)
    print(f"packed {plural(moved, 'entry', 'entries')} of {plural(migrated, 'module cache')} under {root}")
    if dropped:
        print(f"{plural(dropped, 'entry', 'entries')} did not fit the size limit and were dropped")
    if damaged:
        rows = [[p.reason, relative(p.path, root)] for p in damaged]
        print(table(["REASON", "FILE"], rows))
        error(f"left {plural(len(damaged), 'damaged file')}; `torchcache verify --fix` removes them")
    for failure in failures:
        error(failure)
    return 1 if damaged or failures else 0
