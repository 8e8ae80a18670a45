"""The index of an object store cache: what its manifests, tombstones and checkpoints say it holds.

The entries are kept as arrays (one row an entry: key, segment, offset, length, digest
and the stamp of the manifest that named it), not one Python object each: an index of a
million entries takes tens of megabytes and gives the garbage collector nothing to walk.
Merged manifests wait in a list until the next question, then are merged in one sort:
for each key the newest manifest's entry, unless a tombstone newer than it names the key.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .manifests import CHECKPOINT, FORMAT, MANIFEST, SEGMENT, TOMBSTONE, VERSION, Entry, parse, parse_checkpoint

__all__ = ["Index", "pending"]


class _Columns(NamedTuple):
    """Entries as arrays, one row each: sorted by key, one row per key once settled."""

    keys: np.ndarray[Any, Any]  #: ``S<width>``: the hex keys as ASCII bytes
    seg: np.ndarray[Any, Any]  #: int32: the segment's number (:attr:`Index._names`)
    offset: np.ndarray[Any, Any]  #: int64
    length: np.ndarray[Any, Any]  #: int64
    digest: np.ndarray[Any, Any]  #: uint64
    stamp: np.ndarray[Any, Any]  #: int64: of the manifest that named the entry


def _no_columns() -> _Columns:
    return _Columns(np.empty(0, "S4"), *(np.empty(0, t) for t in (np.int32, np.int64, np.int64, np.uint64, np.int64)))


class Index:
    """What the manifests and tombstones read so far say the bucket holds (see the module's description)."""

    def __init__(self) -> None:
        self.segments: dict[str, int] = {}  # segment name -> bytes
        self.seen: set[str] = set()  # manifests and tombstones read
        self.invalid: dict[str, str] = {}  # index objects read that cannot be used, and why (not read again)
        self.deleted: dict[str, int] = {}  # key -> stamp of the latest tombstone naming it
        self.covered: set[str] = set()  # what the newest checkpoint read or written covers
        self._names: list[str] = []  # segment names by number
        self._numbers: dict[str, int] = {}
        self._columns = _no_columns()
        self._pending: list[_Columns] = []  # merged, not yet settled
        self._by_segment: tuple[_Columns, np.ndarray[Any, Any], list[int]] | None = None
        self._lock = threading.RLock()

    # -- questions ----------------------------------------------------------------
    def _settled(self) -> _Columns:
        """The entries, with every manifest and tombstone merged so far."""
        with self._lock:
            if self._pending:
                self._columns = _merge([self._columns, *self._pending], self.deleted)
                self._pending, self._by_segment = [], None
            return self._columns

    def _rows(self, keys: Sequence[str]) -> tuple[_Columns, np.ndarray[Any, np.dtype[np.int64]]]:
        """The row of each key (-1: not in the index)."""
        columns = self._settled()
        n, width = len(columns.keys), columns.keys.dtype.itemsize
        if not n or not keys:
            return columns, np.full(len(keys), -1, np.int64)
        # a key wider than every stored one, or not ASCII, is in no row (and must not be cut to fit one)
        needles = np.array([k if len(k) <= width and k.isascii() else "" for k in keys], f"S{width}")
        at = np.minimum(np.searchsorted(columns.keys, needles), n - 1)
        return columns, np.where((columns.keys[at] == needles) & (needles != b""), at, -1)

    def find(self, keys: Sequence[str]) -> list[Entry | None]:
        """Where each key's bytes are (``None``: not known to be in the bucket)."""
        columns, rows = self._rows(keys)
        names = self._names
        return [
            None
            if row < 0
            else Entry(
                names[columns.seg[row]], *map(int, (columns.offset[row], columns.length[row], columns.digest[row]))
            )
            for row in rows.tolist()
        ]

    def missing(self, keys: Sequence[str]) -> bool:
        """Whether any of ``keys`` is not in the index."""
        return bool((self._rows(keys)[1] < 0).any())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and not self.missing([key])

    def __len__(self) -> int:
        return len(self._settled().keys)

    def keys(self) -> list[str]:
        """The keys, in sorted order."""
        return [key.decode() for key in self._settled().keys.tolist()]

    def nbytes(self) -> int:
        """Payload bytes of the entries."""
        return int(self._settled().length.sum())

    def members(self, segment: str) -> list[tuple[str, int, int, int]]:
        """The visible entries of a segment, as ``(key, offset, length, digest)``."""
        with self._lock:
            columns = self._settled()
            number = self._numbers.get(segment)
            if number is None:
                return []
            if self._by_segment is None or self._by_segment[0] is not columns:  # rows by segment, and where each starts
                order = np.argsort(columns.seg, kind="stable")
                starts = np.searchsorted(columns.seg[order], np.arange(len(self._names) + 1)).tolist()
                self._by_segment = (columns, order, starts)
            _, order, starts = self._by_segment
        rows = order[starts[number] : starts[number + 1]]
        keys = [key.decode() for key in columns.keys[rows].tolist()]
        return list(zip(keys, *(column[rows].tolist() for column in columns[2:5])))

    def placement(self, keys: Sequence[str]) -> list[tuple[str, int] | None]:
        """Each key's segment and that segment's bytes (``None``: not known to be in the bucket)."""
        sizes = self.segments
        return [None if e is None else (e.segment, sizes.get(e.segment, 0)) for e in self.find(keys)]

    def checkpoint_due(self) -> bool:
        """Whether a writer should upload a checkpoint: 16 manifests and tombstones read are not covered by one.

        Past 128, an eighth of those the last checkpoint covered: the checkpoints a
        cache's warming uploads add up to a few times its final index, not one per write.
        """
        return len(self.seen) - len(self.seen & self.covered) >= max(16, len(self.covered) // 8)

    # -- merging ------------------------------------------------------------------
    def apply(self, name: str, body: object) -> str | None:
        """Merge one manifest, tombstone or checkpoint; return what is wrong with it instead, if anything.

        An object that is not valid is remembered (:attr:`invalid`): objects never change.
        """
        problem = self._apply(name, body)
        if problem is not None:
            self.invalid[name] = problem
        return problem

    def _apply(self, name: str, body: object) -> str | None:
        if name.endswith(CHECKPOINT):
            return self.load(body)
        stamp = _stamp(name)
        if stamp is None:
            return "not named <stamp>-<id>"
        parsed = parse(body, name)
        if isinstance(parsed, str):
            return parsed
        with self._lock:
            self.seen.add(name)
            if name.endswith(TOMBSTONE):
                self._delete((key, stamp) for key in parsed["deleted"])
            else:
                self._add(name.removesuffix(MANIFEST) + SEGMENT, parsed["bytes"], parsed["entries"], stamp)
        return None

    def _delete(self, deletions: Iterable[tuple[str, int]]) -> None:
        deleted = self.deleted
        for key, stamp in deletions:
            if deleted.get(key, -1) < stamp:
                deleted[key] = stamp
        self._pending.append(_no_columns())  # the next question settles them

    def _add(self, segment: str, size: int, entries: list[list[Any]], stamp: int) -> None:
        self.segments[segment] = size
        number = self._numbers.get(segment)
        if number is None:
            number = self._numbers[segment] = len(self._names)
            self._names.append(segment)
        n = len(entries)
        keys, offsets, lengths, digests = zip(*entries) if n else ((), (), (), ())
        self._pending.append(
            _Columns(
                np.array(keys, "S") if n else np.empty(0, "S4"),
                np.full(n, number, np.int32),
                np.array(offsets, np.int64),
                np.array(lengths, np.int64),
                np.array(digests, np.uint64),
                np.full(n, stamp, np.int64),
            )
        )

    def load(self, body: object) -> str | None:
        """Merge a checkpoint; return what is wrong with it instead, if anything (nothing is merged then)."""
        parsed = parse_checkpoint(body)
        if isinstance(parsed, str):
            return parsed
        stamps = [_stamp(segment) for segment, _, _ in parsed["segments"]]
        if None in stamps or any(_stamp(f"{stamp}-") is None for _, stamp in parsed["deleted"]):
            return "a stamp past 63 bits"
        with self._lock:
            self._delete((key, int(stamp)) for key, stamp in parsed["deleted"])
            for (segment, size, entries), stamp in zip(parsed["segments"], stamps):
                self._add(segment, size, entries, stamp)  # type: ignore[arg-type]
            self.seen.update(parsed["covers"])
            self.covered = set(parsed["covers"])
        return None

    def checkpoint(self) -> bytes:
        """The checkpoint of what this index holds (segments of size 0 left out); it covers every object read."""
        columns = self._settled()
        # A segment the listing did not show (removed from the bucket): left out, as its entries cannot be read
        held: dict[str, list[list[Any]]] = {segment: [] for segment, size in self.segments.items() if size}
        names = self._names
        for key, number, offset, length, digest in zip(*(column.tolist() for column in columns[:5])):
            rows = held.get(names[number])
            if rows is not None:
                rows.append([key.decode(), offset, length, digest])
        self.covered = set(self.seen)
        body = {
            "format": FORMAT,
            "version": VERSION,
            "covers": sorted(self.covered),
            "segments": [[segment, self.segments[segment], entries] for segment, entries in sorted(held.items())],
            "deleted": sorted((key, f"{stamp:020d}") for key, stamp in self.deleted.items()),
        }
        return json.dumps(body, separators=(",", ":")).encode()

    def unread(self, names: set[str]) -> Iterator[list[str]]:
        """The index objects of a listing not read yet, in two rounds, each to be applied before the next.

        A reader starting from nothing first reads the newest checkpoint, then the
        manifests and tombstones that it does not cover.
        """
        self.invalid = {name: why for name, why in self.invalid.items() if name in names}
        if not self.seen:
            yield sorted(n for n in names if n.endswith(CHECKPOINT) and n not in self.invalid)[-1:]
        yield pending(self, names)

    def forget(self, segments: set[str], keys: Sequence[str] = ()) -> None:
        """Drop segments (removed from the bucket) and the entries they held, and the entries of ``keys``."""
        if not segments and not keys:
            return
        with self._lock:
            columns = self._settled()
            for segment in segments:
                self.segments.pop(segment, None)
            numbers = [self._numbers[s] for s in segments if s in self._numbers]
            keep = ~np.isin(columns.seg, numbers)
            if keys:
                rows = self._rows(keys)[1]
                keep[rows[rows >= 0]] = False
            self._columns = _Columns(*(column[keep] for column in columns))
            self._by_segment = None

    def sized(self, sizes: dict[str, int]) -> None:
        """Count each segment at the size a listing gave its object (0: not listed), not what its manifest claims."""
        for segment in self.segments:
            self.segments[segment] = sizes.get(segment, 0)

    def drop_gone(self, listed: set[str]) -> None:
        """Forget the segments whose manifest a listing no longer shows (pruned by another writer)."""
        self.seen &= listed
        gone = {s for s in self.segments if s.removesuffix(SEGMENT) + MANIFEST not in listed}
        if gone:
            self.forget(gone)

    def oldest_over(self, max_bytes: int) -> list[str]:
        """The oldest segments to remove for the rest to fit ``max_bytes``."""
        total = sum(self.segments.values())
        doomed = []
        for segment in sorted(self.segments):
            if total <= max_bytes:
                break
            total -= self.segments[segment]
            doomed.append(segment)
        return doomed

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self.segments.clear()
            self.seen.clear()
            self.invalid.clear()
            self.deleted.clear()
            self.covered.clear()
            self._names.clear()
            self._numbers.clear()
            self._columns, self._pending, self._by_segment = _no_columns(), [], None


def _merge(parts: list[_Columns], deleted: dict[str, int]) -> _Columns:
    """One row per key, sorted: its newest entry (the first merged of equally new ones), unless deleted after it."""
    width = max(part.keys.dtype.itemsize for part in parts)
    merged = _Columns(*(np.concatenate(column) for column in zip(*parts)))
    keys = merged.keys.astype(f"S{width}")
    arrival = np.arange(len(keys))
    order = np.lexsort((-arrival, merged.stamp, keys))  # by key, then stamp; the first merged last among equals
    keys = keys[order]
    last = np.ones(len(keys), bool)
    last[:-1] = keys[1:] != keys[:-1]
    rows = order[last]
    keep = np.ones(len(rows), bool)
    if deleted and len(rows):
        names = [key for key in deleted if len(key) <= width]
        gone = np.array(names, f"S{width}")
        at = np.minimum(np.searchsorted(keys[last], gone), len(rows) - 1)
        hit = keys[last][at] == gone
        stamps = np.array([deleted[key] for key in names], np.int64)
        doomed = at[hit][merged.stamp[rows[at[hit]]] <= stamps[hit]]
        keep[doomed] = False
    rows = rows[keep]
    return _Columns(keys[last][keep], *(column[rows] for column in merged[1:]))


def _stamp(name: str) -> int | None:
    """The stamp an object name starts with (``<digits>-``), if it is one that fits in 63 bits."""
    head = name.split("-", 1)[0]
    if not head.isascii() or not head.isdigit() or "-" not in name:
        return None
    stamp = int(head)
    return stamp if stamp < 1 << 63 else None


def pending(index: Index, names: set[str]) -> list[str]:
    """The manifests and tombstones of a listing that ``index`` has not read yet (nor found invalid)."""
    done = index.seen | index.invalid.keys()
    return sorted(n for n in names if n.endswith((MANIFEST, TOMBSTONE)) and n not in done)
