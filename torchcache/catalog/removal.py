"""Remove module caches and their files, and choose which to prune.

Removal is narrow on purpose: it empties the packed store through its index (so a
process using it reads misses, never partial entries), then unlinks the store's files
(``index.lmdb*``, ``seg-*.tcs``, the two ``.lock`` files), torchcache 1.0 entry files
(``<3 hex digits>/<key>.tce``), temporary files (``.*.tmp``) and the metadata file, then
removes directories with :func:`os.rmdir`, which fails on a directory that still holds
something, so unknown files survive with their directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from ..errors import StoreError
from ..meta import META_NAME
from .inspect import (
    FileInfo,
    list_files,
    open_store,
)

__all__ = ["remove_cache", "remove_file", "remove_planted", "select_for_prune"]


def remove_file(path: Path) -> bool:
    """Unlink one file; return whether it was there.

    Raises:
        OSError: If it exists and cannot be removed.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_planted(path: Path) -> bool:
    """Remove what sits at a file's path without being a file (a FIFO, a socket, a device node, an empty directory).

    Returns:
        Whether something was removed (a regular file, a link, or a directory that holds
        something is left).

    Raises:
        OSError: If it cannot be removed.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        try:
            os.rmdir(path)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        return True
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        os.unlink(path)
        return True
    return False


def remove_cache(directory: Path) -> tuple[int, Path | None]:
    """Remove a module cache: its entries, temporaries and metadata, then empty directories.

    Files torchcache did not write are kept, and so are the directories that hold them.

    Returns:
        The bytes freed, and the module directory if it was kept (not empty).

    Raises:
        OSError: If a file cannot be removed.
    """
    if directory.is_symlink():  # its target is not this cache's to empty
        raise OSError(errno.ELOOP, f"{directory} is a link, not a module cache's directory")
    before = list_files(directory)
    seen = {f.path: f.size for f in (*before.entries, *before.store, *before.temporaries)}
    try:
        store = open_store(directory)
        if store is not None:
            with store:
                store.clear()  # removes the segment files itself
    except StoreError as exc:
        raise OSError(exc.errno, f"cannot clear the packed store: {exc}") from exc
    files = list_files(directory)
    meta = directory / META_NAME
    meta_dir = False
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(meta)
        meta_dir = stat.S_ISDIR(st.st_mode)
        if not meta_dir:
            files.temporaries.append(FileInfo(meta, st.st_size if stat.S_ISREG(st.st_mode) else 0, 0.0))  # last
    for path in files.irregular:  # FIFOs and links at the names of torchcache's files: unlinked, never opened
        remove_file(path)
    own = (*files.entries, *sorted(files.store, key=lambda f: f.path.name.startswith("index")), *files.temporaries)
    # Sizes as listed before the store was cleared (as `torchcache ls` reports them), files it removed included.
    freed = sum(seen.pop(item.path, item.size) for item in own if remove_file(item.path))
    freed += sum(size for path, size in seen.items() if not os.path.lexists(path))
    if meta_dir:  # an empty directory at the metadata's name goes; one that holds files keeps the module directory
        with contextlib.suppress(OSError):
            os.rmdir(meta)
    for shard in files.shards:
        with contextlib.suppress(OSError):  # not empty: unknown files, or entries written meanwhile
            os.rmdir(shard)
    kept: Path | None = None
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:
        kept = directory
    return freed, kept


class _Sized(Protocol):
    """A module cache as pruning sees it (:class:`ModuleCache`, :class:`CacheUsage`)."""

    @property
    def last_used(self) -> float: ...

    @property
    def nbytes(self) -> int: ...


_C = TypeVar("_C", bound=_Sized)


def select_for_prune(
    caches: Sequence[_C],
    now: float,
    *,
    max_bytes: int | None = None,
    older_than: float | None = None,
    keep: int | None = None,
    in_use: Callable[[_C], bool] | None = None,
) -> list[_C]:
    """Pick the module caches to remove, least recently used first, until the condition holds.

    Exactly one of ``max_bytes`` (total size to get under), ``older_than`` (seconds since
    last use) and ``keep`` (how many of the most recently used to keep) is given. A cache
    that ``in_use`` says a process has open is never picked (it is asked only of the
    caches that would be); with ``max_bytes`` it still counts toward the total, so more
    recently used ones may go in its place.

    Raises:
        ValueError: If not exactly one condition is given.
    """
    if sum(x is not None for x in (max_bytes, older_than, keep)) != 1:
        raise ValueError("give exactly one of max_bytes, older_than and keep")
    order = sorted(caches, key=lambda c: c.last_used)

    def free(cache: _C) -> bool:
        return in_use is None or not in_use(cache)

    if keep is not None:
        return [c for c in order[: max(0, len(order) - keep)] if free(c)]
    if older_than is not None:
        return [c for c in order if now - c.last_used > older_than and free(c)]
    assert max_bytes is not None
    total = sum(c.nbytes for c in order)
    chosen = []
    for cache in order:
        if total <= max_bytes:
            break
        if free(cache):
            chosen.append(cache)
            total -= cache.nbytes
    return chosen
