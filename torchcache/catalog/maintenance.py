"""Check and repair module caches on disk: verify entries, rebuild metadata, remove, select for pruning.

Everything here acts on what :mod:`torchcache.catalog.inspect` finds. Removal is narrow on
purpose: it empties the packed store through its index (so a process using it reads
misses, never partial entries), then unlinks the store's files (``index.lmdb*``,
``seg-*.tcs``, ``compact.lock``), torchcache 1.0 entry files (``<3 hex digits>/<key>.tce``),
temporary files (``.*.tmp``) and the metadata file, then removes directories with
:func:`os.rmdir`, which fails on a directory that still holds something, so unknown
files survive with their directory.

Temporary files younger than :data:`TMP_GRACE_SECONDS` may be a write in progress in
another process (removing one would make that process stop writing), so checking keeps
them; removing a whole module cache removes them regardless.

The cache root as a whole has a budget (:func:`root_budget`: :func:`set_root_budget`,
else ``$TORCHCACHE_MAX_SIZE``, else :data:`~torchcache.config.DEFAULT_ROOT_BUDGET`),
kept by :func:`enforce_root_budget` whenever a cache opens (:func:`claim_module_cache`):
whole module caches go, least recently used first, like ``torchcache prune``. A process
that opens a cache holds a shared ``flock`` on its directory (:class:`CacheClaim`), no
file is added; a cache is removed only under an exclusive one, taken without waiting,
and only if no writer holds one of its segments either (what a process that took no
claim, such as a dataset cache, holds while it writes), so a cache in use by a live
process is never removed. Where a directory cannot be locked (some network file
systems), nothing is removed automatically. The budget's part makes this module longer
than the others; it shares their selection and removal.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from .._log import logger
from .._version import __version__
from ..codec import PREFIX_SIZE, frame_length, parse_header, split_frame
from ..config import resolve_root_budget
from ..errors import CorruptEntryError, StoreError
from ..meta import META_NAME, is_disk_wide, meta_time, write_json_atomic
from ..policy import format_size, parse_size
from ..stores.batched import BatchedStore
from ..stores.disk import ENTRY_SUFFIX
from ..stores.features.file import FEATURES_NAME, FeatureFile
from ..stores.files import open_regular, read_at
from ..stores.packed.format import parse_segment_name
from ..stores.packed.index import INDEX_NAME
from ..stores.packed.store import PackedStore
from ..stores.packed.upkeep import discard_index
from ..tree import Layout
from .inspect import (
    CacheFiles,
    CacheUsage,
    FileInfo,
    ModuleCache,
    index_problem,
    list_files,
    open_store,
    read_usage,
)

__all__ = [
    "TMP_GRACE_SECONDS",
    "CacheClaim",
    "Migration",
    "Problem",
    "cache_in_use",
    "check_entries",
    "check_entry",
    "check_frame",
    "check_sample",
    "claim_directory",
    "claim_module_cache",
    "enforce_root_budget",
    "migrate_cache",
    "parse_duration",
    "rebuild_meta",
    "remove_cache",
    "remove_file",
    "remove_unused_cache",
    "root_budget",
    "scan_root",
    "select_for_prune",
    "set_root_budget",
    "verify_files",
    "verify_store",
]

#: Temporary files modified within this many seconds may belong to a write in progress.
TMP_GRACE_SECONDS = 60.0
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*$", re.IGNORECASE)
_UNLIMITED = 1 << 62
_MIGRATE_BATCH = 256
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_O_DIR = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
#: Seconds a claim waits for a removal of its directory in progress in another process.
_CLAIM_WAIT = 30.0
_FEATURE_CHUNK = 4096
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN)


@dataclass(frozen=True)
class Problem:
    """A file that ``verify`` reports: damaged metadata, a corrupt entry or a stray temporary file."""

    path: Path
    kind: str
    reason: str
    size: int


def verify_features(
    directory: Path, fix: bool, tick: Callable[[int], None] | None = None
) -> tuple[int, list[Problem], bool]:
    """Check a features cache (:func:`~torchcache.extract_features`): its header and every written row.

    With ``fix``, damaged rows are marked as not written (computed again at the next
    extraction), and a file whose header fails its checks is removed.

    Returns:
        The rows checked, the problems, and whether they were fixed.

    Raises:
        StoreError: If the file cannot be written with ``fix``.
    """
    path = directory / FEATURES_NAME
    try:
        file = FeatureFile.open(path)
    except FileNotFoundError:
        return 0, [], fix
    except (CorruptEntryError, OSError) as exc:
        if fix:
            remove_file(path)
        return 0, [Problem(path, "corrupt", f"the features file is not usable: {exc}", 0)], fix
    problems: list[Problem] = []
    checked = 0
    try:
        written = np.setdiff1d(np.arange(file.length), file.missing())
        damaged: list[int] = []
        for start in range(0, len(written), _FEATURE_CHUNK):
            chunk = written[start : start + _FEATURE_CHUNK]
            _, _, bad = file.read(chunk)
            damaged.extend(int(chunk[j]) for j in bad)
            checked += len(chunk)
            if tick is not None:
                tick(len(chunk))
        problems.extend(Problem(directory / f"row {i}", "corrupt", "row failed its check", 0) for i in damaged)
        if fix and damaged:
            try:
                file.unmark(damaged)
            except OSError as exc:
                raise StoreError(f"cannot mark the damaged rows of {path}: {exc}") from exc
    finally:
        file.close()
    return checked, problems, fix


def _row_bytes(header_bytes: bytes) -> int:
    return Layout.from_header(parse_header(header_bytes)).row_bytes


def check_frame(data: bytes | memoryview) -> str | None:
    """Why a stored frame is corrupt (frame, checksum, header, payload size), or ``None``."""
    try:
        split_frame(data, raw_size=_row_bytes)
    except CorruptEntryError as exc:
        return str(exc)
    except KeyError as exc:
        return f"invalid header: missing field {exc}"
    except (TypeError, ValueError, AttributeError) as exc:
        return str(exc) if str(exc).startswith("invalid header") else f"invalid header: {exc}"
    except RecursionError:
        return "invalid header: nested too deeply"
    return None


def check_sample(data: bytes | memoryview) -> str | None:
    """Why a stored dataset sample is corrupt, or ``None`` (see :mod:`torchcache.datasets.samples`)."""
    from ..datasets.samples import decode_sample

    try:
        decode_sample(data)
    except (CorruptEntryError, ValueError, TypeError, RecursionError) as exc:
        return str(exc) or type(exc).__name__
    return None


def verify_store(
    directory: Path, fix: bool, tick: Callable[[int], None] | None = None, kind: object = None
) -> tuple[int, list[Problem], bool]:
    """Check a cache directory's packed store: its index, every record's checksum, every entry.

    With ``fix``, damaged entries are removed and the index is repaired. Entries are
    checked as what the cache stores: frames of module outputs, or dataset samples when
    ``kind`` (the metadata's) is ``"dataset"``.

    Returns:
        The entries checked, the problems (a damaged entry's path is ``<directory>/<key>``),
        and whether they were fixed.

    Raises:
        StoreError: If the store cannot be opened, or with ``fix`` written.
    """
    if kind == "features":
        return verify_features(directory, fix, tick)
    problems: list[Problem] = []
    broken = index_problem(directory)
    if broken is not None:
        index = directory / INDEX_NAME
        problems.append(Problem(index, "store", f"{broken}; the index must be rebuilt from the segment files", 0))
        if fix:
            try:
                discard_index(os.fspath(directory), None)
                PackedStore(directory, _UNLIMITED, report=lambda kind, message: None).close()  # rebuilds it
            except OSError as exc:
                raise StoreError(f"cannot rebuild the index of {directory}: {exc}") from exc
    store = open_store(directory)
    if store is None:
        return 0, problems, fix
    check = check_sample if kind == "dataset" else check_frame
    with store:
        report = store.verify(fix)
        problems.extend(Problem(directory / key, "corrupt", "record failed its checks", 0) for key in report.bad)
        problems.extend(Problem(directory, "store", line, 0) for line in report.problems)
        checked = report.entries
        # Records that failed the store's checks are not read again: a read would mark them
        # for removal at the store's next write (its close), and without ``fix`` nothing is removed.
        for key, reason, size in check_entries(store, check, set(report.bad), fix, tick):
            problems.append(Problem(directory / key, "corrupt", reason, size))
    return checked, problems, fix


def check_entries(
    store: BatchedStore,
    check: Callable[[bytes | memoryview], str | None],
    skip: set[str],
    fix: bool,
    tick: Callable[[int], None] | None = None,
) -> list[tuple[str, str, int]]:
    """Check every entry of a store with ``check``, 512 at a time; with ``fix``, delete the bad ones.

    Args:
        store: The store.
        check: Why an entry's bytes are not what the cache stores, or ``None``.
        skip: Keys not to read (they failed the store's own checks).
        fix: Delete the entries that fail.
        tick: Called with the count of entries checked, after each batch.

    Returns:
        ``(key, reason, size)`` of each entry that failed.
    """
    keys = [key for key in list(store.keys()) if key not in skip]
    bad: list[tuple[str, str, int]] = []
    for start in range(0, len(keys), 512):
        chunk = keys[start : start + 512]
        for key, data in zip(chunk, store.get_many(chunk)):
            reason = None if data is None else check(data)
            if reason is not None:
                bad.append((key, reason, len(data or b"")))
        if tick is not None:
            tick(len(chunk))
    if fix and bad:
        store.delete_many([key for key, _, _ in bad])
    return bad


def check_entry(path: Path) -> str | None:
    """Check one torchcache 1.0 entry file: frame, checksum, header and payload size.

    Only the prefix is read before the file's size is checked against it.

    Returns:
        Why the entry is corrupt, or ``None`` if it is sound (or was removed meanwhile).
    """
    try:
        opened = open_regular(path)
        if opened is None:
            return "not a regular file" if os.path.lexists(path) else None
        fd, st = opened
        try:
            expected = frame_length(read_at(fd, PREFIX_SIZE))
            if expected != st.st_size:
                return f"frame length {st.st_size} does not match its prefix ({expected})"
            data = read_at(fd, st.st_size)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    except CorruptEntryError as exc:
        return str(exc)
    return check_frame(data)


def verify_files(
    files: CacheFiles, now: float, tick: Callable[[int], None] | None = None
) -> tuple[list[Problem], list[FileInfo]]:
    """Check every entry of a module cache (calling ``tick(1)`` after each) and find stray temporaries.

    Returns:
        The problems, and the temporary files young enough (at ``now``) to be writes in progress.
    """
    problems = []
    for entry in files.entries:
        reason = check_entry(entry.path)
        if reason is not None:
            problems.append(Problem(entry.path, "corrupt", reason, entry.size))
        if tick is not None:
            tick(1)
    in_progress = []
    for tmp in files.temporaries:
        if now - tmp.mtime < TMP_GRACE_SECONDS:
            in_progress.append(tmp)
        else:
            problems.append(Problem(tmp.path, "temporary", "stray temporary file", tmp.size))
    return problems, in_progress


def rebuild_meta(cache: ModuleCache) -> None:
    """Write fresh metadata for a cache whose metadata is damaged, from what its entries tell.

    The name and kind are kept where the damaged metadata still has them; ``created`` is
    the modification time of the oldest entry; the last-used time is kept.

    Raises:
        OSError: If it cannot be written (a directory at its path, a read-only directory).
    """
    files = list_files(cache.directory)
    meta: dict[str, Any] = {
        "torchcache_version": __version__,
        "module_key": cache.key,
        "created": meta_time(min((f.mtime for f in files.entries), default=None)),
        "rebuilt": True,
    }
    for field in ("name", "kind"):
        if isinstance(cache.meta.get(field), str):
            meta[field] = cache.meta[field]
    write_json_atomic(cache.directory / META_NAME, meta)
    with contextlib.suppress(OSError):
        os.utime(cache.directory / META_NAME, (cache.last_used, cache.last_used))


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


def remove_cache(directory: Path) -> tuple[int, Path | None]:
    """Remove a module cache: its entries, temporaries and metadata, then empty directories.

    Files torchcache did not write are kept, and so are the directories that hold them.

    Returns:
        The bytes freed, and the module directory if it was kept (not empty).

    Raises:
        OSError: If a file cannot be removed.
    """
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


def parse_duration(text: str) -> float:
    """Parse a duration such as ``30d``, ``12h``, ``90m``, ``2w`` or ``45s`` into seconds.

    Raises:
        ValueError: If the text is not a number followed by one of the units s, m, h, d, w.

    Example:
        >>> parse_duration("30d"), parse_duration("90m"), parse_duration("1.5h")
        (2592000.0, 5400.0, 5400.0)
    """
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"invalid duration {text!r}: expected a number and a unit s, m, h, d or w, such as 30d or 12h")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


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
        store = PackedStore(cache.directory, max(cache.max_bytes or _UNLIMITED, 1 << 16), report=lambda k, m: None)
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


# -- the budget of a cache root ---------------------------------------------------------------
_budget_override: tuple[int | None] | None = None
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class CacheClaim:
    """This process's shared ``flock`` on a module directory: while it is held, no budget or prune removes the cache.

    The lock is given back by :meth:`release`, or when the claim is garbage-collected.
    A forked child shares its parent's lock until both have let it go.
    """

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._release = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Give the lock back (again is fine)."""
        self._release()

    def __repr__(self) -> str:
        return f"<CacheClaim of {self.directory} ({'held' if self._release.alive else 'released'})>"


def _same_directory(fd: int, directory: Path) -> bool:
    """Whether ``directory`` (not followed if it is a link) is still the directory open as ``fd``."""
    try:
        st, held = os.lstat(directory), os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def claim_directory(directory: Path, wait: float = _CLAIM_WAIT) -> CacheClaim | None:
    """Make ``directory`` if it is missing and take a shared lock on it, so that no budget or prune removes it.

    A removal of the directory in progress in another process is waited for (at most
    ``wait`` seconds), then the directory is made anew.

    Returns:
        The claim, or ``None`` if the directory cannot be made, opened or locked (a
        read-only or network file system; the cache still works, unclaimed).
    """
    deadline = time.monotonic() + wait
    for _ in range(8):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory, _O_DIR)
        except FileNotFoundError:  # removed between the two: make it again
            continue
        except OSError:
            return None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # being removed: no more than a few files to unlink
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            if os.path.islink(directory) or _same_directory(fd, directory):
                return CacheClaim(directory, fd)  # a linked module directory is never removed: nothing to check
        except OSError:
            os.close(fd)
            return None
        os.close(fd)  # removed while we waited: make it again
    return None


def _writer_holds_segment(directory: Path) -> bool:
    """Whether a live writer holds the lock on one of the directory's segment files (see the segment files)."""
    try:
        with os.scandir(directory) as items:
            names = [item.name for item in items if parse_segment_name(item.name) is not None]
    except OSError:
        return False
    for name in names:
        try:
            opened = open_regular(directory / name)
        except OSError:
            continue
        if opened is None:
            continue
        try:
            fcntl.flock(opened[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                return True
        finally:
            os.close(opened[0])  # and with it the lock
    return False


def _lock_unused(directory: Path, strict: bool) -> int | None:
    """A descriptor of ``directory`` holding an exclusive lock, if no process has the cache open, else ``None``.

    ``None`` too for a directory that cannot be opened (a link) or was replaced
    meanwhile. One that cannot be locked (some network file systems) counts as in use
    if ``strict``, else the descriptor comes back unlocked.
    """
    try:
        fd = os.open(directory, _O_DIR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if strict or exc.errno in _BUSY:
            os.close(fd)
            return None
    if _same_directory(fd, directory) and not _writer_holds_segment(directory):
        return fd
    os.close(fd)  # and with it the lock
    return None


def cache_in_use(directory: Path, strict: bool = True) -> bool:
    """Whether a process has the module cache in ``directory`` open, as far as can be told.

    A process has it open while it holds a :class:`CacheClaim` on it, or while it writes
    to one of its segments.

    Args:
        directory: The module directory.
        strict: Count a cache whose directory cannot be locked (some network file
            systems) as in use.
    """
    fd = _lock_unused(directory, strict)
    if fd is None:
        return True
    os.close(fd)
    return False


def remove_unused_cache(directory: Path, strict: bool = True) -> tuple[int, Path | None] | None:
    """Remove a module cache as :func:`remove_cache` does, unless a process has it open.

    It is removed under an exclusive lock on its directory, which a process that opens
    it meanwhile waits for (and then makes the directory anew).

    Args:
        directory: The module directory.
        strict: Keep a cache whose directory cannot be locked (some network file
            systems); else remove it unless a writer holds one of its segments.

    Returns:
        ``None`` if it is in use (nothing is removed), else what :func:`remove_cache` returns.

    Raises:
        OSError: If a file cannot be removed.
    """
    fd = _lock_unused(directory, strict)
    if fd is None:
        return None
    try:
        return remove_cache(directory)
    finally:
        os.close(fd)


def set_root_budget(max_size: int | float | str | None) -> None:
    """Set the budget of every cache root this process uses, which ``$TORCHCACHE_MAX_SIZE`` sets otherwise.

    Whenever a persistent cache opens, the module caches under its root are removed,
    least recently used first, until they take no more than this, as ``torchcache prune
    --max-size`` does; a cache that a live process has open is never removed. Processes
    started from this one (spawned DataLoader workers, ``torchrun`` ranks) read
    ``$TORCHCACHE_MAX_SIZE``, not this setting.

    Args:
        max_size: Bytes, as an int or float (``20e9``) or a string such as ``"20GB"`` or
            ``"500GiB"``; ``0`` for no budget; ``None`` to go back to
            ``$TORCHCACHE_MAX_SIZE``, else the default (50 GB).

    Raises:
        ConfigError: If ``max_size`` is not a byte count.

    Example:
        >>> import torchcache
        >>> torchcache.set_root_budget("20GB")
        >>> torchcache.set_root_budget(None)
    """
    global _budget_override
    _budget_override = None if max_size is None else (parse_size(max_size, "max_size") or None,)


def root_budget() -> tuple[int | None, str]:
    """The budget of a cache root in this process, and where it comes from.

    Returns:
        The bytes (``None``: no budget), and ``"set_root_budget()"``,
        ``"TORCHCACHE_MAX_SIZE"`` or ``"default"``.

    Raises:
        ConfigError: If ``$TORCHCACHE_MAX_SIZE`` decides it and is not a byte count.
    """
    override = _budget_override
    if override is not None:
        return override[0], "set_root_budget()"
    return resolve_root_budget()


def scan_root(root: Path) -> list[CacheUsage]:
    """The module caches under a root, with their last use and size, without opening any store.

    A missing root holds none; a directory under it that cannot be listed is left out.

    Raises:
        OSError: If the root cannot be listed.
    """
    try:
        children = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for child in children:
        try:
            usage = read_usage(Path(child.path)) if child.is_dir(follow_symlinks=False) else None
        except OSError:
            continue
        if usage is not None:
            found.append(usage)
    return found


def enforce_root_budget(root: Path, max_bytes: int | None = None) -> list[CacheUsage]:
    """Remove module caches under ``root``, least recently used first, until they fit its budget.

    A cache that a live process has open is never removed (see :func:`cache_in_use`);
    when those alone take more than the budget, the root stays over it. Only one process
    at a time enforces the budget of a root: if another is doing it, this returns at once,
    and so it does where the root cannot be opened or locked (missing, not a directory,
    some network file systems).

    Args:
        root: The cache root.
        max_bytes: The budget (default: :func:`root_budget`; ``None`` there: no budget).

    Returns:
        The module caches removed.

    Raises:
        ConfigError: If ``$TORCHCACHE_MAX_SIZE`` decides the budget and is not a byte count.
        OSError: If the root cannot be listed, or a cache cannot be removed (the first
            such error, once the others are removed).
    """
    if max_bytes is None:
        max_bytes = root_budget()[0]
        if max_bytes is None:
            return []
    try:
        fd = os.open(root, _O_DIR)
    except OSError:  # missing, or not a directory: no cache to remove (opening one reports why)
        return []
    removed: list[CacheUsage] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process is enforcing it now, or directories cannot be locked here
            return removed
        caches = scan_root(root)
        if sum(c.nbytes for c in caches) <= max_bytes:
            return removed
        victims = select_for_prune(caches, time.time(), max_bytes=max_bytes, in_use=lambda c: cache_in_use(c.directory))
        failure: OSError | None = None
        for victim in victims:
            try:
                if remove_unused_cache(victim.directory) is not None:
                    removed.append(victim)
            except OSError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return removed
    finally:
        os.close(fd)


def _warn_once(root: Path, kind: str, message: str, warn: Callable[[str, str], None]) -> None:
    with _warned_lock:
        if (str(root), kind) in _warned:
            return
        _warned.add((str(root), kind))
    warn("budget", message)


def claim_module_cache(
    location: Path | str, key: str, warn: Callable[[str, str], None], local: Path | None = None
) -> CacheClaim | None:
    """Claim a module cache's directory as this process opens it, then keep its root under budget.

    Called once whenever a persistent cache opens its disk tier; cheap (a listing of the
    root, and of each module directory). Nothing it meets reaches the caller: a budget
    that cannot be kept is one warning per root and problem in this process.

    Args:
        location: The cache root, or a Redis URL (then ``local`` is the root, if any).
        key: The module key (the directory under the root).
        warn: Called with a kind and a message to warn about (a cache's
            :meth:`~torchcache.faults.FaultLog.warn`).
        local: With a Redis URL, the root of the local copies of its entries.

    Returns:
        The claim, to keep while the cache is used (``None`` if there is no local
        directory or it cannot be claimed).
    """
    root = local if isinstance(location, str) else location
    if root is None:
        return None
    claim = claim_directory(root / key)
    keep_root_budget(root, warn)
    return claim


def keep_root_budget(root: Path, warn: Callable[[str, str], None]) -> None:
    """Remove least recently used caches nobody holds until ``root`` fits its budget; never raises.

    Called when a cache opens (:func:`claim_module_cache`) and when it has grown (a flush).
    """
    try:
        removed = enforce_root_budget(root)
    except OSError as exc:
        if not is_disk_wide(exc):  # a read-only or full disk: the store reports it
            _warn_once(root, "remove", f"cannot keep the cache root {root} under its budget: {exc}", warn)
    except Exception as exc:  # noqa: BLE001 - never into the forward pass
        _warn_once(root, type(exc).__name__, f"{exc}; the cache root {root} is not kept under a budget", warn)
    else:
        if removed:
            freed = format_size(sum(c.nbytes for c in removed))
            logger.info(
                "torchcache: removed %d module cache(s) (%s) from %s to keep its budget", len(removed), freed, root
            )
