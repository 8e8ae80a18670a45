"""``torchcache verify``: check module caches on disk, entry by entry, and rebuild their metadata.

Everything here acts on what :mod:`torchcache.catalog.inspect` finds. Temporary files
younger than :data:`TMP_GRACE_SECONDS` may be a write in progress in another process
(removing one would make that process stop writing), so checking keeps them; removing a
whole module cache removes them regardless.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..catalog.inspect import (
    ENTRY_SUFFIX,
    CacheFiles,
    FileInfo,
    ModuleCache,
    index_problem,
    list_files,
    open_store,
)
from ..catalog.removal import remove_file, remove_planted
from ..codec import PREFIX_SIZE, frame_length, parse_header, split_frame
from ..errors import CorruptEntryError, StoreError
from ..meta import META_NAME, meta_size, meta_time, write_json_atomic
from ..stores.batched import BatchedStore
from ..stores.features.digests import DIGESTS_NAME, DigestFile
from ..stores.features.file import FEATURES_NAME, open_features
from ..stores.files import open_regular, read_at
from ..stores.packed.index import INDEX_NAME
from ..stores.packed.store import PackedStore
from ..stores.packed.upkeep import discard_index
from ..tree import Layout

__all__ = [
    "Problem",
    "TMP_GRACE_SECONDS",
    "check_entries",
    "check_entry",
    "check_frame",
    "check_sample",
    "rebuild_meta",
    "verify_features",
    "verify_files",
    "verify_store",
]


#: Temporary files modified within this many seconds may belong to a write in progress.
TMP_GRACE_SECONDS = 60.0


UNLIMITED = 1 << 62


_FEATURE_CHUNK = 4096


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
        file = open_features(path)
    except FileNotFoundError:
        return 0, [], fix
    except CorruptEntryError as exc:
        problem = Problem(path, "corrupt", f"the features file is not usable: {exc}", 0)
        if fix:
            try:
                remove_file(path)
            except OSError as err:  # a directory at its path: listed as left, the other caches still fixed
                raise StoreError(f"cannot remove the damaged {path}: {err.strerror or err}") from None
        return 0, [problem], fix
    except OSError as exc:  # a link is removed with --fix; unreadable now (permissions, I/O), or a full directory: left
        kind = "corrupt" if exc.errno == errno.ELOOP else "store"
        problem = Problem(path, kind, f"the features file cannot be read: {exc.strerror or exc}", 0)
        if fix and kind == "store":  # a FIFO or an empty directory planted there: removed, made anew at extraction
            try:
                return 0, [problem], remove_planted(path)
            except OSError as err:
                raise StoreError(f"cannot remove {path}: {err.strerror or err}") from None
        return 0, [problem], False
    problems: list[Problem] = _check_digests(directory / DIGESTS_NAME, file.length, fix)
    checked = 0
    try:
        written = file.written()
        damaged: list[int] = []
        for start in range(0, len(written), _FEATURE_CHUNK):
            chunk = written[start : start + _FEATURE_CHUNK]
            bad = file.read(chunk).damaged
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


def _check_digests(path: Path, length: int, fix: bool) -> list[Problem]:
    """The input digests file beside a features file, if it is there and not valid (removed with ``fix``).

    Raises:
        StoreError: If it cannot be removed with ``fix``.
    """
    if not os.path.lexists(path):
        return []
    digests = DigestFile.open(path, length, create=False)
    if digests is not None:
        digests.close()
        return []
    reason = "the input digests file is not valid (a link, another file, cut short): no row is reused from this cache"
    if fix:
        try:
            remove_planted(path) or remove_file(path)
        except OSError as err:
            raise StoreError(f"cannot remove {path}: {err.strerror or err}") from None
    return [Problem(path, "corrupt", reason, 0)]


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
    """Why a stored dataset sample is corrupt (frame, checksum, layout, payload), or ``None``.

    An intact sample of torchcache 1.2 is not corrupt: ``torchcache migrate`` converts it.
    """
    from ..datasets.decode import decode_sample
    from ..datasets.encode import is_sample_1_2
    from .samples12 import convert_sample

    try:
        if is_sample_1_2(data):
            convert_sample(data)
        else:
            split_frame(data)  # the checksum, which reading a sample leaves to the store
            decode_sample(data)
    except (CorruptEntryError, ValueError, TypeError, RecursionError) as exc:
        return str(exc) or type(exc).__name__
    return None


def check_frame_or_sample(data: bytes | memoryview) -> str | None:
    """:func:`check_frame`, or :func:`check_sample` for a cache whose metadata no longer says which it holds."""
    problem = check_frame(data)
    return None if problem is None or check_sample(data) is None else problem


def stored_kind(directory: Path) -> str | None:
    """``"dataset"`` if the first entry of the store at ``directory`` is a sample and not a frame."""
    store = open_store(directory, readonly=True)
    if store is None:
        return None
    with store:
        key = next(iter(store.keys()), None)
        data = store.get_many([key])[0] if key is not None else None
    intact_sample = data is not None and check_frame(data) is not None and check_sample(data) is None
    return "dataset" if intact_sample else None


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
    index = directory / INDEX_NAME
    broken = index_problem(directory)
    if broken is not None:
        problems.append(Problem(index, "store", f"{broken}; the index must be rebuilt from the segment files", 0))
        if not fix:
            return 0, problems, fix
        try:
            discard_index(os.fspath(directory), None)
            PackedStore(directory, UNLIMITED, report=lambda kind, message: None).close()  # rebuilds it
        except OSError as exc:
            raise StoreError(f"cannot rebuild the index of {directory}: {exc}") from exc
    store = open_store(directory, readonly=not fix)
    if store is None:
        return 0, problems, fix
    check = (
        check_sample if kind == "dataset" else check_frame if kind in ("module", "function") else check_frame_or_sample
    )
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
    if len(path.name) - len(ENTRY_SUFFIX) > 64:
        return "its name is not a key of at most 64 hex digits"
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


UNMIGRATED = (
    "a link or other non-file at a torchcache 1.0 name, never read: `torchcache migrate` reads regular files in "
    "real subdirectories; put the file there to migrate it, or --fix unlinks this (never what a link points to)"
)


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
    problems.extend(Problem(path, "not a file", UNMIGRATED, 0) for path in files.unmigrated)
    in_progress = []
    for tmp in files.temporaries:
        if now - tmp.mtime < TMP_GRACE_SECONDS:
            in_progress.append(tmp)
        else:
            problems.append(Problem(tmp.path, "temporary", "stray temporary file", tmp.size))
    return problems, in_progress


def rebuild_meta(cache: ModuleCache) -> None:
    """Write fresh metadata for a cache whose metadata is damaged, from what its entries tell.

    The name, kind and budget (``max_bytes``) are kept where the damaged metadata still has them; ``created`` is
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
    if (size := meta_size(cache.meta.get("max_bytes"))) is not None:
        meta["max_bytes"] = size  # the budget it was made with: a dataset reopened without one keeps it
    if "kind" not in meta and (kind := stored_kind(cache.directory)) is not None:
        meta["kind"] = kind  # a dataset cache stays one
    remove_planted(cache.directory / META_NAME)  # an empty directory or a FIFO there: the rename would fail on it
    write_json_atomic(cache.directory / META_NAME, meta)
    with contextlib.suppress(OSError):
        os.utime(cache.directory / META_NAME, (cache.last_used, cache.last_used))
