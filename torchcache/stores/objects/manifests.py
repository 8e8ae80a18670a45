"""The objects that describe an object store cache: manifests, tombstones and checkpoints, made and validated.

Object names are ``<stamp>-<id><suffix>``: the stamp (upload time in nanoseconds, 20
digits) makes names sort by age. A manifest (``.tcm``) names its segment's (``.tcs``)
entries as ``[key, offset, length, digest]``, the digest being the xxh3-64 of the entry's
bytes seeded with the xxh3-64 of its key (:func:`digest`: bytes under another key fail
it, whatever a manifest says); a tombstone (``.tcd``) names keys removed
from every manifest older than it. A checkpoint (``.tci``) is the merge of the manifests
and tombstones it names (``covers``), so that a reader starting from nothing reads one
object and the few manifests newer than it, not every manifest. All three are JSON,
validated before use.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import xxhash

from ..packed.format import is_key

if TYPE_CHECKING:
    from .index import Index

__all__ = [
    "CHECKPOINT",
    "FORMAT",
    "MANIFEST",
    "UNJUDGED",
    "SEGMENT",
    "TOMBSTONE",
    "VERSION",
    "Entry",
    "digest",
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
#: What an index object of a later format version, or larger than this version reads, is: left
#: for the torchcache that wrote it (never removed as damaged).
UNJUDGED = ("written by a newer torchcache", "larger than this torchcache reads")
#: Version 2 binds each digest to its key; objects of version 1 (no binding) are not read.
VERSION = 2
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

    def take(
        self, blob: bytes, keys: Sequence[str], out: list[bytes | memoryview | None]
    ) -> tuple[list[int], list[tuple[str, memoryview]]]:
        """Fill ``out`` with the entries that pass their check; return the positions that fail, and the others."""
        view, failed = memoryview(blob), []
        for i, entry in self.entries:
            data = view[entry.offset - self.start : entry.offset - self.start + entry.length]
            if len(data) == entry.length and digest(keys[i], data) == entry.digest:
                out[i] = data
            else:
                failed.append(i)
        others = []
        for key, offset, length, expected in self.others:
            data = view[offset - self.start : offset - self.start + length]
            if len(data) == length and digest(key, data) == expected:
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
            failed, others = read.take(blob, keys, out)
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


def to_sweep(names: set[str], older_than_s: float | None, invalid: dict[str, str] | None = None) -> list[str]:
    """What ``prune`` sweeps: every checkpoint but the newest, and the segments a killed writer left.

    Those are segments without a manifest stamped over ``older_than_s`` seconds ago (``None``:
    none). A checkpoint ``invalid`` names as a newer torchcache's (:data:`UNJUDGED`) stays.
    """
    newer = {name for name, why in (invalid or {}).items() if why.startswith(UNJUDGED)}
    found = [n for n in sorted(n for n in names if n.endswith(CHECKPOINT))[:-1] if n not in newer]
    if older_than_s is None:
        return found
    older_than_ns = time.time_ns() - int(older_than_s * 1e9)
    for name in names:
        base = name.removesuffix(SEGMENT)
        if name.endswith(SEGMENT) and base + MANIFEST not in names:
            stamp = base.split("-", 1)[0]
            if stamp.isdigit() and int(stamp) < older_than_ns:
                found.append(name)
    return found


def digest(key: str, data: bytes | memoryview) -> int:
    """An entry's digest: the xxh3-64 of its bytes, seeded with the xxh3-64 of its key."""
    return xxhash.xxh3_64_intdigest(data, xxhash.xxh3_64_intdigest(key.encode()))


def pack(items: dict[str, bytes | memoryview]) -> tuple[bytes, bytes]:
    """A segment holding ``items`` (key to payload) and its manifest."""
    entries: list[list[Any]] = []
    offset = 0
    for key, data in items.items():
        entries.append([key, offset, len(data), digest(key, data)])
        offset += len(data)
    body = {"format": FORMAT, "version": VERSION, "bytes": offset, "entries": entries}
    return b"".join(bytes(data) for data in items.values()), json.dumps(body, separators=(",", ":")).encode()


def tombstone(keys: list[str]) -> bytes:
    """The tombstone of ``keys``."""
    return json.dumps({"format": FORMAT, "version": VERSION, "deleted": keys}).encode()


def _read(body: object, limit: int, what: str) -> dict[str, Any] | str:
    """The JSON object of a manifest, tombstone or checkpoint of this format, or what is wrong with it."""
    if not isinstance(body, bytes):
        return "unreadable"
    if len(body) > limit:  # perhaps a newer torchcache's: not read, never judged damaged
        return f"{UNJUDGED[1]} ({len(body)} bytes)"
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # a planted object nested past the parser's depth
        return f"not JSON: {type(exc).__name__}"
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(data, dict) and data.get("format") == FORMAT and type(version) is int and version > VERSION:
        return f"{UNJUDGED[0]} (format version {version})"
    if not isinstance(data, dict) or data.get("format") != FORMAT or version != VERSION:
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
