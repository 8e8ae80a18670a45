"""``torchcache migrate``: entry files of torchcache 1.0 into packed stores, features files and samples of 1.2."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..catalog.inspect import (
    ENTRY_SUFFIX,
    ModuleCache,
    find_caches,
    index_problem,
    list_files,
    open_store,
)
from ..catalog.removal import remove_file
from ..errors import CorruptEntryError, StoreError
from ..locations import is_url
from ..policy import plural
from ..stores.features.file import FEATURES_NAME, LEGACY_FEATURES_NAME, create_features, open_existing
from ..stores.features.layout import Field, SampleLayout
from ..stores.files import open_regular, read_at
from ..stores.packed.store import PackedStore
from ..stores.redis.url import redact_url
from ..stores.rows.file import RowsFile
from .commands import command_root
from .output import Progress, error, relative, table
from .remote import open_remote, remote_namespaces
from .samples12 import migrate_samples
from .verify import UNLIMITED, UNMIGRATED, Problem, check_entry

__all__ = ["Migration", "cmd_migrate", "migrate_cache", "migrate_features"]


_MIGRATE_BATCH = 256
#: Bytes of frames read before they are packed (1.0 entries may be large).
_BATCH_BYTES = 64 << 20
_LEGACY_HEAD = struct.Struct("<8sIIQQQQQ")  # magic, version, JSON length, length, stride, checks at, rows at, size
_PAGE = 4096


@dataclass(frozen=True)
class Migration:
    """What :func:`migrate_cache` did to one module cache."""

    moved: int
    dropped: int
    damaged: list[Problem]
    #: Why the store could not be written, if it could not (``moved``: the entries packed before).
    failed: str | None = None


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

    Entries are added in batches (of :data:`_MIGRATE_BATCH` entries or :data:`_BATCH_BYTES`),
    each file removed once its entry is in the store; the store's budget (the metadata's
    ``max_bytes``) still holds, so entries beyond it are evicted: ``moved`` counts the
    entries migrated that the store holds at the end, and ``dropped`` every entry the
    migration left out or evicted (a later batch can evict an earlier one, or entries the
    store held before). Damaged files are left in place and reported (``torchcache verify
    --fix`` removes them). A store that cannot be written (a full disk) ends the migration
    with ``failed`` set and ``moved`` the entries packed until then. Safe to interrupt and
    run again.

    Raises:
        StoreError: If the store's index must be rebuilt first.
        OSError: If a file cannot be removed.
    """
    broken = index_problem(cache.directory)
    if broken is not None:
        raise StoreError(f"the index of {cache.directory} is {broken}; run `torchcache verify --fix` to rebuild it")
    files = list_files(cache.directory)
    told: list[str] = []  # what the store reported: the cause of an error it raises
    migrated: set[str] = set()
    damaged = [Problem(path, "not a file", UNMIGRATED, 0) for path in files.unmigrated]
    budget = max(cache.max_bytes or UNLIMITED, 1 << 16)
    try:
        with PackedStore(cache.directory, budget, report=lambda kind, message: told.append(message)) as store:
            before = set(store.keys())
            for batch, paths, seen in _batches(files.entries, damaged):
                if batch:
                    store.put_many(batch)
                    migrated.update(key for key, _ in batch)
                for path in paths:
                    remove_file(path)
                if tick is not None:
                    tick(seen)
            after = set(store.keys())
    except StoreError as exc:
        cause = next((f" ({m})" for m in reversed(told) if m not in str(exc)), "")
        return Migration(len(migrated), 0, damaged, failed=f"{exc}{cause}")
    for shard in files.shards:
        with contextlib.suppress(OSError):  # damaged files left, or unknown ones
            os.rmdir(shard)
    return Migration(len(migrated & after), len((migrated | before) - after), damaged)


def _batches(entries: list[Any], damaged: list[Problem]) -> Iterator[tuple[list[tuple[str, bytes]], list[Path], int]]:
    """``(key, frame)`` pairs of the entry files, their paths, and how many files each batch looked at.

    A batch ends at :data:`_MIGRATE_BATCH` entries or :data:`_BATCH_BYTES` of frames, so
    that large entries never pile up in memory; damaged files go to ``damaged``.
    """
    batch: list[tuple[str, bytes]] = []
    paths: list[Path] = []
    seen = size = 0
    for entry in entries:
        seen += 1
        data = _read_entry(entry.path)
        if isinstance(data, str):
            if data != "removed meanwhile":
                damaged.append(Problem(entry.path, "corrupt", data, entry.size))
        else:
            batch.append((entry.path.name.removesuffix(ENTRY_SUFFIX), data))
            paths.append(entry.path)
            size += len(data)
        if len(batch) >= _MIGRATE_BATCH or size >= _BATCH_BYTES or seen >= _MIGRATE_BATCH * 4:
            yield batch, paths, seen
            batch, paths, seen, size = [], [], 0, 0
    if seen:
        yield batch, paths, seen


def _up(value: int) -> int:
    return -(-value // _PAGE) * _PAGE


def _legacy_features(fd: int, file_size: int) -> tuple[dict[str, Any], int, int, int, int]:
    """The header, length, stride and checks and rows offsets of a torchcache 1.2 features file, checked.

    Raises:
        CorruptEntryError: If it is not a whole features file of torchcache 1.2.
    """
    head = read_at(fd, _LEGACY_HEAD.size)
    if len(head) < _LEGACY_HEAD.size:
        raise CorruptEntryError("its header is cut short")
    magic, version, json_len, length, stride, checks_at, rows_at, size = _LEGACY_HEAD.unpack(head)
    if magic != b"TCFEATS1" or version != 1 or json_len > 1 << 20:
        raise CorruptEntryError("it is not a features file of torchcache 1.2")
    rest = read_at(fd, json_len + 8, _LEGACY_HEAD.size)
    if len(rest) < json_len + 8 or int.from_bytes(rest[json_len:], "little") != xxhash.xxh3_64_intdigest(
        head + rest[:json_len]
    ):
        raise CorruptEntryError("its header fails its checksum")
    try:
        header = json.loads(rest[:json_len])
    except (ValueError, RecursionError):
        raise CorruptEntryError("its header is not valid JSON") from None
    expected_checks = _up(_LEGACY_HEAD.size + json_len + 8)
    if (
        not isinstance(header, dict)
        or header.get("length") != length
        or not isinstance(header.get("layout"), dict)
        or header["layout"].get("stride") != stride
        or (checks_at, rows_at) != (expected_checks, expected_checks + _up(8 * length))
        or size != rows_at + length * stride
        or file_size < size
    ):
        raise CorruptEntryError("its header does not describe the file")
    return header, length, stride, checks_at, rows_at


def migrate_features(directory: Path) -> Migration:
    """Turn the torchcache 1.2 features file of a features cache into a rows file, then remove it.

    The layout is rewritten in today's notation and each row repacked to match it (its
    fields where a packed row puts them; unchanged when the features come first, as they
    most often do). Rows that fail their check are left out (computed again by the next
    extraction). The input digests beside the file stay valid; a row that moved is not
    lent to another cache's extraction until it is written again. Rows already in a rows
    file of the cache (a migrate interrupted and run again) are kept, and the others
    moved. An old file that is not whole or whose layout is invalid is removed (reported
    in ``damaged``).

    Raises:
        StoreError: If the rows file cannot be made or written.
    """
    old = directory / LEGACY_FEATURES_NAME
    opened = open_regular(old, follow_symlinks=False)
    if opened is None:
        return Migration(0, 0, [])
    fd, st = opened
    moved = dropped = 0
    try:
        try:
            header, length, stride, checks_at, rows_at = _legacy_features(fd, st.st_size)
        except CorruptEntryError as exc:  # nothing can read it: removed, its rows computed again
            remove_file(old)
            return Migration(0, 0, [Problem(old, "corrupt", f"the features file is not usable: {exc}", st.st_size)])
        try:
            layout, moves = _layout_12(header["layout"], stride)
        except CorruptEntryError as exc:
            remove_file(old)
            return Migration(0, 0, [Problem(old, "corrupt", f"the features file is not usable: {exc}", st.st_size)])
        header = {**header, "layout": layout.to_json()}
        new = _rows_file(directory / FEATURES_NAME, header)
        wanted = np.zeros(length, np.bool_)
        wanted[new.missing()] = True  # the rows a migrate interrupted earlier moved stay
        try:
            for start in range(0, length, _MIGRATE_BATCH * 16):
                count = min(_MIGRATE_BATCH * 16, length - start)
                checks = np.frombuffer(read_at(fd, 8 * count, checks_at + 8 * start), "<u8")
                rows = np.frombuffer(read_at(fd, count * stride, rows_at + start * stride), np.uint8)
                rows = rows.reshape(count, stride)
                indices = np.arange(start, start + count)
                good = [
                    j
                    for j in np.flatnonzero(checks).tolist()
                    if xxhash.xxh3_64_intdigest(rows[j], start + j) | 1 == int(checks[j])
                ]
                dropped += int(np.count_nonzero(checks)) - len(good)
                good = [j for j in good if wanted[start + j]]
                moved += len(good)
                if good:
                    new.write(indices[good], _repack(rows[good], moves, layout.stride))
        except OSError as exc:
            raise StoreError(f"cannot write {directory / FEATURES_NAME}: {exc}") from exc
        finally:
            new.close()
    finally:
        os.close(fd)
    remove_file(old)
    return Migration(moved, dropped, [])


def _rows_file(path: Path, header: dict[str, Any]) -> RowsFile:
    """The rows file to move rows into: the one there if made for ``header`` (a migrate interrupted), or a new one.

    One made for other keys, or damaged, is replaced: the 1.2 file holds this cache's rows.

    Raises:
        StoreError: If it cannot be opened or made.
    """
    try:
        file = open_existing(path, header, lambda kind, message: None) if path.exists() else None
        return file or create_features(path, header)
    except (OSError, CorruptEntryError) as exc:
        raise StoreError(f"cannot make {path}: {exc}") from exc


def _layout_12(old: Any, stride: int) -> tuple[SampleLayout, list[tuple[int, int, int]]]:
    """Today's layout of the sample layout of a torchcache 1.2 features file, and each field's move.

    A move is ``(offset in a 1.2 row, offset in a row now, bytes)``.

    Raises:
        CorruptEntryError: If ``old`` is not a valid 1.2 layout for rows of ``stride`` bytes.
    """
    try:
        fields = [Field(f["name"], f["kind"], f["dtype"], tuple(f["shape"])) for f in old["fields"]]
        if fields[0].kind != "features" or old["input"] != fields[0].name:
            raise ValueError("the features are not its first field")
        layout = SampleLayout.placed(old["container"], old["names"], fields)
        layout = SampleLayout.from_json(layout.to_json())  # every kind, dtype and shape checked
        if layout.names != tuple(old["names"]):
            raise ValueError("its field names are not those of its container")
        offsets = {f["name"]: f["offset"] for f in old["fields"]}
        moves = [(offsets[f.name], f.offset, f.nbytes) for f in layout.fields]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # CorruptEntryError included
        raise CorruptEntryError(f"its sample layout is invalid ({str(exc)[:200]})") from None
    if not all(type(at) is int and 0 <= at <= stride - n for at, _, n in moves):
        raise CorruptEntryError("its sample layout puts a field outside the row")
    return layout, moves


def _repack(rows: np.ndarray[Any, Any], moves: list[tuple[int, int, int]], stride: int) -> np.ndarray[Any, Any]:
    """Rows of ``stride`` bytes holding each field of ``rows`` where ``moves`` put it."""
    out = np.zeros((len(rows), stride), np.uint8)
    for source, target, nbytes in moves:
        out[:, target : target + nbytes] = rows[:, source : source + nbytes]
    return out


def cmd_migrate(args: argparse.Namespace) -> int:
    """``torchcache migrate``: pack 1.0 entry files into packed stores, turn 1.2 features files into rows files.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 1 if damaged files were left or a cache could not be migrated, else 0.
    """
    if is_url(args.path):
        return remote_migrate(args.path)
    root = command_root(args.path)
    everything = find_caches(root)
    caches = [cache for cache in everything if cache.legacy_entries]
    features = [c.directory for c in everything if (c.directory / LEGACY_FEATURES_NAME).is_file()]
    datasets = [c for c in everything if c.meta.get("kind") == "dataset" and c.entries]
    nothing = f"nothing to migrate: no torchcache 1.0 entries, 1.2 features files or 1.2 samples under {root}"
    if not caches and not features and not datasets:
        print(nothing)
        return 0
    failures, converted = _migrate_datasets(datasets, root)
    if not caches and not features and not failures and not converted:  # every sample already in today's format
        print(nothing)
        return 0
    moved = dropped = 0
    damaged: list[Problem] = []
    for directory in features:
        try:
            done = migrate_features(directory)
        except (StoreError, OSError) as exc:
            failures.append(f"cannot migrate {directory}: {exc}")
            continue
        for problem in done.damaged:
            failures.append(f"removed {relative(problem.path, root)}: {problem.reason}; extraction computes its rows")
        if not done.damaged:
            print(f"moved {plural(done.moved, 'row')} of {relative(directory, root)} into its rows file")
        if done.dropped:
            print(f"{plural(done.dropped, 'damaged row')} of {relative(directory, root)} left out")
    reached = 0  # caches migrated, whole or in part
    progress = Progress(sum(c.legacy_entries for c in caches), "migrate")
    try:
        for cache in caches:
            try:
                done = migrate_cache(cache, progress.update)
            except StoreError as exc:  # the others are still migrated
                failures.append(f"cannot migrate {cache.directory}: {exc}")
                continue
            moved, dropped = moved + done.moved, dropped + done.dropped
            reached += done.failed is None or done.moved > 0
            damaged.extend(done.damaged)
            if done.failed is not None:
                again = "the rest wait in their files: run `torchcache migrate` again once it can be written"
                failures.append(f"cannot migrate {cache.directory}: {done.failed}; {again}")
    finally:
        progress.close()
    if caches:
        print(f"packed {plural(moved, 'entry', 'entries')} of {plural(reached, 'module cache')} under {root}")
    if dropped:
        print(f"{plural(dropped, 'entry', 'entries')} did not fit the size limit and were dropped")
    if damaged:
        rows = [[p.reason, relative(p.path, root)] for p in damaged]
        print(table(["REASON", "FILE"], rows))
        error(f"left {plural(len(damaged), 'file')} it could not migrate; `torchcache verify --fix` removes them")
    for failure in failures:
        error(failure)
    return 1 if damaged or failures else 0


def _migrate_datasets(caches: list[ModuleCache], root: Path) -> tuple[list[str], int]:
    """Convert the 1.2 samples of dataset caches; return what could not be done, and the samples converted."""
    failures = []
    converted = 0
    for cache in caches:
        try:
            store = open_store(cache.directory, UNLIMITED)  # a converted sample replaces its old frame, never another
            if store is None:
                continue
            with store:
                moved, dropped = migrate_samples(store)
        except OSError as exc:  # StoreError included
            failures.append(f"cannot migrate {cache.directory}: {exc}")
            continue
        converted += moved
        if moved:
            print(f"converted {plural(moved, 'sample')} of {relative(cache.directory, root)} to the current format")
        if dropped:
            failures.append(f"removed {plural(dropped, 'damaged sample')} of {relative(cache.directory, root)}")
    return failures, converted


def remote_migrate(url: str) -> int:
    """``torchcache migrate URL``: convert the torchcache 1.2 samples of every cache on a server or in a bucket."""
    moved = dropped = 0
    for namespace in remote_namespaces(url):
        try:
            with open_remote(url, namespace) as store:
                done, bad = migrate_samples(store)
        except OSError as exc:
            error(f"cannot migrate {namespace} on {redact_url(url)}: {exc}")
            return 1
        moved, dropped = moved + done, dropped + bad
    print(f"converted {plural(moved, 'sample')} on {redact_url(url)} to the current format")
    if dropped:
        error(f"removed {plural(dropped, 'damaged sample')}; the caches compute them again")
    return 1 if dropped else 0
