"""Check and repair module caches on disk: verify entries, rebuild metadata, remove, select for pruning.

Everything here acts on what :mod:`torchcache.inspect_cache` finds. Removal is narrow on
purpose: it empties the packed store through its index (so a process using it reads
misses, never partial entries), then unlinks the store's files (``index.lmdb*``,
``seg-*.tcs``, ``compact.lock``), torchcache 1.0 entry files (``<3 hex digits>/<key>.tce``),
temporary files (``.*.tmp``) and the metadata file, then removes directories with
:func:`os.rmdir`, which fails on a directory that still holds something, so unknown
files survive with their directory.

Temporary files younger than :data:`TMP_GRACE_SECONDS` may be a write in progress in
another process (removing one would make that process stop writing), so checking keeps
them; removing a whole module cache removes them regardless.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._version import __version__
from .codec import PREFIX_SIZE, frame_length, parse_header, split_frame
from .errors import CorruptEntryError, StoreError
from .inspect_cache import CacheFiles, FileInfo, ModuleCache, index_problem, list_files, open_store
from .meta import META_NAME, meta_time, write_json_atomic
from .stores.batched import BatchedStore
from .stores.disk import ENTRY_SUFFIX
from .stores.files import open_regular, read_at
from .stores.packed import PackedStore
from .stores.packed_index import INDEX_NAME
from .stores.packed_upkeep import discard_index
from .tree import Layout

__all__ = [
    "TMP_GRACE_SECONDS",
    "Migration",
    "Problem",
    "check_entries",
    "check_entry",
    "check_frame",
    "check_sample",
    "migrate_cache",
    "parse_duration",
    "rebuild_meta",
    "remove_cache",
    "remove_file",
    "select_for_prune",
    "verify_files",
    "verify_store",
]

#: Temporary files modified within this many seconds may belong to a write in progress.
TMP_GRACE_SECONDS = 60.0
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*$", re.IGNORECASE)
_UNLIMITED = 1 << 62
_MIGRATE_BATCH = 256
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True)
class Problem:
    """A file that ``verify`` reports: damaged metadata, a corrupt entry or a stray temporary file."""

    path: Path
    kind: str
    reason: str
    size: int


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
    """Why a stored dataset sample is corrupt, or ``None`` (see :mod:`torchcache.samples`)."""
    from .samples import decode_sample

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
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(meta)
        if not stat.S_ISDIR(st.st_mode):  # a directory there is not ours: it keeps the module directory
            files.temporaries.append(FileInfo(meta, st.st_size if stat.S_ISREG(st.st_mode) else 0, 0.0))  # last
    own = (*files.entries, *sorted(files.store, key=lambda f: f.path.name.startswith("index")), *files.temporaries)
    # Sizes as listed before the store was cleared (as `torchcache ls` reports them), files it removed included.
    freed = sum(seen.pop(item.path, item.size) for item in own if remove_file(item.path))
    freed += sum(size for path, size in seen.items() if not os.path.lexists(path))
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


def select_for_prune(
    caches: Sequence[ModuleCache],
    now: float,
    *,
    max_bytes: int | None = None,
    older_than: float | None = None,
    keep: int | None = None,
) -> list[ModuleCache]:
    """Pick the module caches to remove, least recently used first, until the condition holds.

    Exactly one of ``max_bytes`` (total size to get under), ``older_than`` (seconds since
    last use) and ``keep`` (how many of the most recently used to keep) is given.

    Raises:
        ValueError: If not exactly one condition is given.
    """
    if sum(x is not None for x in (max_bytes, older_than, keep)) != 1:
        raise ValueError("give exactly one of max_bytes, older_than and keep")
    order = sorted(caches, key=lambda c: c.last_used)
    if keep is not None:
        return order[: max(0, len(order) - keep)]
    if older_than is not None:
        return [c for c in order if now - c.last_used > older_than]
    assert max_bytes is not None
    total = sum(c.nbytes for c in order)
    chosen = []
    for cache in order:
        if total <= max_bytes:
            break
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
