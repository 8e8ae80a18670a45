"""The index of an object store cache: its manifests and tombstones, parsed, validated and merged.

Object names are ``<stamp>-<id><suffix>``: the stamp (upload time in nanoseconds, 20
digits) makes names sort by age. A manifest (``.tcm``) names its segment's (``.tcs``)
entries as ``[key, offset, length, xxh3-64]``; a tombstone (``.tcd``) names keys removed
from every manifest older than it. A checkpoint (``.tci``) is the merge of the manifests
and tombstones it names (``covers``), so that a reader starting from nothing reads one
object and the few manifests newer than it, not every manifest. All three are JSON,
validated before use.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from ..packed.format import is_key

__all__ = [
    "CHECKPOINT",
    "FORMAT",
    "MANIFEST",
    "SEGMENT",
    "TOMBSTONE",
    "Entry",
    "Index",
    "pack",
    "Read",
    "Taken",
    "parse",
    "parse_checkpoint",
    "ranged_reads",
    "take_all",
    "tombstone",
    "to_sweep",
]

FORMAT = "torchcache-objects"
SEGMENT, MANIFEST, TOMBSTONE, CHECKPOINT = ".tcs", ".tcm", ".tcd", ".tci"
_MAX_MANIFEST = 64 << 20
_MAX_CHECKPOINT = 1 << 30
#: A store key (:func:`~torchcache.stores.packed.format.is_key`), matched in one call.
_KEY = re.compile(r"[0-9a-f]{4,64}")
#: An object name as :meth:`~torchcache.stores.objects.bucket.Bucket.new_name` makes them, with a suffix.
_NAME = re.compile(r"[0-9]{20}-[0-9a-f]{1,32}\.tc[smd]")
_STAMP = re.compile(r"[0-9]{20}")


class Entry(NamedTuple):
    """Where an entry's bytes are: segment name, offset, length and digest."""

    segment: str
    offset: int
    length: int
    digest: int


class Read(NamedTuple):
    """One ranged read: a segment's bytes ``start:end``, holding the entries at these batch positions.

    A read may take a whole segment (``others``: the entries not asked for), so that a
    local copy takes all of it and later batches find it there.
    """

    segment: str
    start: int
    end: int
    entries: list[tuple[int, Entry]]
    others: list[tuple[str, int, int, int]]  #: ``(key, offset, length, digest)``

    def take(self, blob: bytes, out: list[bytes | memoryview | None]) -> tuple[list[int], list[tuple[str, memoryview]]]:
        """Fill ``out`` with the entries that pass their check; return the positions that fail, and the others."""
        view, failed = memoryview(blob), []
        for i, entry in self.entries:
            data = view[entry.offset - self.start : entry.offset - self.start + entry.length]
            if len(data) == entry.length and xxhash.xxh3_64_intdigest(data) == entry.digest:
                out[i] = data
            else:
                failed.append(i)
        others = []
        for key, offset, length, digest in self.others:
            data = view[offset - self.start : offset - self.start + length]
            if len(data) == length and xxhash.xxh3_64_intdigest(data) == digest:
                others.append((key, data))
        return failed, others


class Taken(NamedTuple):
    """What the reads of a batch gave beside its entries."""

    damaged: list[str]  #: keys whose bytes fail their digest
    extras: list[tuple[str, memoryview]]  #: entries of whole segments not asked for, that pass
    gone: set[str]  #: segments removed since the listing
    unreadable: str  #: a segment that could not be read ("" if none)


def take_all(reads: Sequence[Read], blobs: Sequence[object], keys: Sequence[str], out: list[Any]) -> Taken:
    """Fill ``out`` from the blobs of ``reads`` (bytes, or the exception each read raised)."""
    taken = Taken([], [], set(), "")
    for read, blob in zip(reads, blobs):
        if isinstance(blob, FileNotFoundError):
            taken.gone.add(read.segment)
        elif not isinstance(blob, bytes):
            taken = taken._replace(unreadable=f"{read.segment}: {blob}")
        else:
            failed, others = read.take(blob, out)
            taken.damaged.extend(keys[i] for i in failed)
            taken.extras.extend(others)
    return taken


def ranged_reads(keys: Sequence[str], index: Index, whole: bool = True, gap: int = 1 << 20) -> list[Read]:
    """The reads of the entries of a batch of keys that ``index`` knows.

    With ``whole``, every segment touched is read whole (for a local copy to keep the
    rest: a shuffled first epoch then reads each segment once). Otherwise a segment whose
    wanted entries span more than half of it is read whole too (the rest is kept for the
    batches after: a windowed order, :class:`~torchcache.datasets.sampler.WindowSampler`,
    asks for it next), and the others' wanted entries are read in runs: entries less
    than ``gap`` bytes apart share one range (a request costs more than a megabyte read
    with it).
    """
    by_segment: dict[str, list[tuple[int, Entry]]] = {}
    for i, entry in enumerate(index.find(keys)):
        if entry is not None:
            by_segment.setdefault(entry.segment, []).append((i, entry))
    reads, full = [], set()
    for segment, found in by_segment.items():
        size = index.segments.get(segment, 0)
        span = max(e.offset + e.length for _, e in found) - min(e.offset for _, e in found)
        if size and (whole or 2 * span > size):
            full.add(segment)
            reads.append(Read(segment, 0, size, found, []))
            continue
        found.sort(key=lambda item: item[1].offset)
        run: list[tuple[int, Entry]] = []
        for item in found:
            if run and item[1].offset - (run[-1][1].offset + run[-1][1].length) > gap:
                reads.append(Read(segment, run[0][1].offset, max(e.offset + e.length for _, e in run), run, []))
                run = []
            run.append(item)
        reads.append(Read(segment, run[0][1].offset, max(e.offset + e.length for _, e in run), run, []))
    if full:
        asked = set(keys)
        for read in reads:
            if read.segment in full:
                read.others.extend(member for member in index.members(read.segment) if member[0] not in asked)
    return reads


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
    """What the manifests and tombstones read so far say the bucket holds.

    The entries are kept as arrays (:class:`_Columns`, about 70 bytes an entry), not
    one Python object each: an index of a million entries takes tens of megabytes and
    gives the garbage collector nothing to walk. Merged manifests wait in a list until
    the next question, then are merged in one sort: for each key the newest manifest's
    entry, unless a tombstone newer than it names the key.
    """

    def __init__(self) -> None:
        self.segments: dict[str, int] = {}  # segment name -> bytes
        self.seen: set[str] = set()  # manifests and tombstones read
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
        """Merge one manifest, tombstone or checkpoint; return what is wrong with it instead, if anything."""
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
        """The checkpoint of what this index holds; it covers every manifest and tombstone read."""
        columns = self._settled()
        held: dict[str, list[list[Any]]] = {segment: [] for segment in self.segments}
        names = self._names
        for key, number, offset, length, digest in zip(*(column.tolist() for column in columns[:5])):
            held[names[number]].append([key.decode(), offset, length, digest])
        self.covered = set(self.seen)
        body = {
            "format": FORMAT,
            "version": 1,
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
        if not self.seen:
            yield sorted(n for n in names if n.endswith(CHECKPOINT))[-1:]
        yield sorted(n for n in names if n.endswith((MANIFEST, TOMBSTONE)) and n not in self.seen)

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


def to_sweep(names: set[str], older_than_ns: int | None) -> list[str]:
    """What ``prune`` sweeps: every checkpoint but the newest, and the segments a killed writer left.

    Those are segments without a manifest stamped before ``older_than_ns`` (``None``: none).
    """
    found = sorted(n for n in names if n.endswith(CHECKPOINT))[:-1]
    if older_than_ns is None:
        return found
    for name in names:
        base = name.removesuffix(SEGMENT)
        if name.endswith(SEGMENT) and base + MANIFEST not in names:
            stamp = base.split("-", 1)[0]
            if stamp.isdigit() and int(stamp) < older_than_ns:
                found.append(name)
    return found


def pack(items: dict[str, bytes | memoryview]) -> tuple[bytes, bytes]:
    """A segment holding ``items`` (key to payload) and its manifest."""
    entries: list[list[Any]] = []
    offset = 0
    for key, data in items.items():
        entries.append([key, offset, len(data), xxhash.xxh3_64_intdigest(data)])
        offset += len(data)
    body = {"format": FORMAT, "version": 1, "bytes": offset, "entries": entries}
    return b"".join(bytes(data) for data in items.values()), json.dumps(body, separators=(",", ":")).encode()


def tombstone(keys: list[str]) -> bytes:
    """The tombstone of ``keys``."""
    return json.dumps({"format": FORMAT, "version": 1, "deleted": keys}).encode()


def _read(body: object, limit: int, what: str) -> dict[str, Any] | str:
    """The JSON object of a manifest, tombstone or checkpoint of this format, or what is wrong with it."""
    if not isinstance(body, bytes) or len(body) > limit:
        return "unreadable or too large"
    try:
        data = json.loads(body)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
        return f"not a torchcache {what} of a known version"
    return data


def parse(body: object, name: str) -> dict[str, Any] | str:
    """A manifest or tombstone, validated, or what is wrong with it."""
    data = _read(body, _MAX_MANIFEST, "manifest")
    if isinstance(data, str):
        return data
    if name.endswith(TOMBSTONE):
        deleted = data.get("deleted")
        if not isinstance(deleted, list) or not all(isinstance(k, str) and is_key(k) for k in deleted):
            return "invalid deleted keys"
        return data
    problem = _entries_problem(data.get("bytes"), data.get("entries"))
    return data if problem is None else problem


def _entries_problem(size: object, entries: object) -> str | None:
    """What is wrong with a segment's size and entries (``[key, offset, length, digest]``), if anything."""
    if type(size) is not int or not 0 <= size < 1 << 62 or not isinstance(entries, list):
        return "invalid size or entries"
    for entry in entries:
        if type(entry) is not list or len(entry) != 4:
            return f"invalid entry {str(entry)[:80]}"
        key, offset, length, digest = entry
        if (
            type(key) is not str
            or _KEY.fullmatch(key) is None
            or type(offset) is not int
            or type(length) is not int
            or type(digest) is not int
            or offset < 0
            or length < 0
            or offset + length > size
            or not 0 <= digest < 1 << 64
        ):
            return f"invalid entry {str(entry)[:80]}"
    return None


def parse_checkpoint(body: object) -> dict[str, Any] | str:
    """A checkpoint, validated, or what is wrong with it."""
    data = _read(body, _MAX_CHECKPOINT, "checkpoint")
    if isinstance(data, str):
        return data
    covers, segments, deleted = data.get("covers"), data.get("segments"), data.get("deleted")
    if not isinstance(covers, list) or not all(type(n) is str and _NAME.fullmatch(n) for n in covers):
        return "invalid names covered"
    if not isinstance(deleted, list) or not all(_is_deletion(d) for d in deleted):
        return "invalid deleted keys"
    if not isinstance(segments, list):
        return "invalid segments"
    for segment in segments:
        if type(segment) is not list or len(segment) != 3 or type(segment[0]) is not str:
            return f"invalid segment {str(segment)[:80]}"
        if not _NAME.fullmatch(segment[0]) or not segment[0].endswith(SEGMENT):
            return f"invalid segment name {segment[0][:80]!r}"
        problem = _entries_problem(segment[1], segment[2])
        if problem is not None:
            return problem
    return data


def _is_deletion(item: object) -> bool:
    """Whether ``item`` is ``[key, stamp]``: a key and the stamp of the newest tombstone naming it."""
    if type(item) is not list or len(item) != 2:
        return False
    key, stamp = item
    return type(key) is str and is_key(key) and type(stamp) is str and _STAMP.fullmatch(stamp) is not None
