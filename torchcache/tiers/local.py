"""The persistent tier on a local directory: a packed store and its metadata.

A module directory holds ``torchcache.json`` (what the cache is, for ``torchcache ls``;
its mtime is the last use) and a :class:`~torchcache.stores.packed.store.PackedStore`
(``index.lmdb`` and ``seg-*.tcs``). Entry files that torchcache 1.0 left (at ``<3 hex
digits>/<key>.tce``) are read only by ``torchcache migrate``, which packs them into the
store: a tier that finds some says so, once.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from ..errors import StoreError
from ..faults import Fault, Report
from ..meta import META_NAME, is_disk_wide, load_meta, unreadable, write_json_atomic
from ..stores.packed.store import PackedStore
from .persistent import PersistentTier

__all__ = [
    "LEGACY_ENTRY",
    "LEGACY_SHARD",
    "has_legacy_entries",
    "meta_toucher",
    "open_local_store",
    "open_local_tier",
    "trimmed",
]

_UTIME_NOFOLLOW = os.utime in os.supports_follow_symlinks
#: The names of a torchcache 1.0 entry file and of the subdirectory holding it (``<3 hex>/<key>.tce``).
LEGACY_ENTRY, LEGACY_SHARD = re.compile(r"[0-9a-f]{4,}\.tce"), re.compile(r"[0-9a-f]{3}")


def has_legacy_entries(directory: Path) -> bool:
    """Whether ``directory`` holds torchcache 1.0 entry files (``<3 hex>/<key>.tce``, regular files).

    Lists ``directory`` and its ``<3 hex>/`` subdirectories until one holds an entry file.
    """
    try:
        with os.scandir(directory) as entries:
            shards = [
                entry.path
                for entry in entries
                if LEGACY_SHARD.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
            ]
        for shard in shards:  # regular files only: what `torchcache migrate` reads
            with os.scandir(shard) as found:
                if any(LEGACY_ENTRY.fullmatch(e.name) and e.is_file(follow_symlinks=False) for e in found):
                    return True
        return False
    except OSError:
        return False


def _ensure_meta(directory: Path, meta: dict[str, Any], report: Report) -> None:
    """Write the metadata file if it is missing or damaged (a damaged one is reported)."""
    current, problem = load_meta(directory)
    if current is not None and problem is None:
        return
    path = directory / META_NAME
    if unreadable(problem):  # permissions or I/O, not damage: it may be read again once they are fixed
        report(Fault.META, f"{problem}; it is left as it is, and entries are still read and written")
        return
    try:
        write_json_atomic(path, meta)
    except OSError as exc:
        if not is_disk_wide(exc):
            report(Fault.META, f"cannot write the metadata file {path} ({exc}); entries are still read and written")
        return  # a read-only or full disk: the store's first write reports it
    if problem is not None:
        report(Fault.META, f"replaced the damaged metadata file {path} ({problem})")


def meta_toucher(directory: Path) -> Callable[[], None]:
    """A function that marks the cache in ``directory`` as used now (its metadata file's mtime)."""
    path = directory / META_NAME

    def touch() -> None:
        with contextlib.suppress(OSError):  # never through a planted link, where the OS allows it
            os.utime(path, follow_symlinks=not _UTIME_NOFOLLOW)

    return touch


def open_local_store(directory: Path, max_bytes: int, meta: dict[str, Any], report: Report) -> PackedStore:
    """The packed store of a module directory (created if missing, with its metadata file).

    Raises:
        StoreError: If the directory cannot be created or its store opened.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot use cache directory {directory}: {exc} (its root is persistent_cache_dir, else $TORCHCACHE_DIR, "
            "else the user cache directory)"
        ) from exc
    _ensure_meta(directory, {**meta, "created": time.time(), "max_bytes": max_bytes}, report)
    return trimmed(PackedStore(directory, max_bytes, report=report), report)


def trimmed(store: PackedStore, report: Report) -> PackedStore:
    """``store``, brought within its budget now if it holds more (a budget lowered since the last run).

    Otherwise only a write would: a warm cache that computes nothing would stay over it.
    """
    try:
        usage = store.usage()
        if usage["records"] + usage["index"] > store.max_bytes or usage["files"] > store.max_bytes * 1.1:
            store.trim()
    except (OSError, lmdb.Error) as exc:  # StoreError is an OSError
        report(Fault.WRITE, f"cannot bring {store.directory} within its budget of {store.max_bytes:,} bytes: {exc}")
    return store


def open_local_tier(
    directory: Path, max_bytes: int, quality: int, meta: dict[str, Any], report: Report
) -> PersistentTier:
    """The persistent tier of a module directory (created if missing).

    Raises:
        StoreError: If the directory cannot be created or its store opened.
    """
    store = open_local_store(directory, max_bytes, meta, report)
    if has_legacy_entries(directory):
        report(
            Fault.LEGACY,
            f"{directory} holds entry files of torchcache 1.0, which are read only once packed: run "
            "`torchcache migrate` to use them",
        )
    tier = PersistentTier(store, quality, report, where=str(directory), touch=meta_toucher(directory))
    tier.touch()
    return tier
