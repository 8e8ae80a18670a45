"""The index of an object store cache: its manifests and tombstones, parsed, validated and merged.

Object names are ``<stamp>-<id><suffix>``: the stamp (upload time in nanoseconds, 20
digits) makes names sort by age. A manifest (``.tcm``) names its segment's (``.tcs``)
entries as ``[key, offset, length, xxh3-64]``; a tombstone (``.tcd``) names keys removed
from every manifest older than it. Both are JSON, validated before use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import xxhash

from ..packed.format import is_key

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SEGMENT",
    "TOMBSTONE",
    "Entry",
    "Index",
    "pack",
    "Read",
    "parse",
    "ranged_reads",
    "tombstone",
    "unfinished",
]

FORMAT = "torchcache-objects"
SEGMENT, MANIFEST, TOMBSTONE = ".tcs", ".tcm", ".tcd"
_MAX_MANIFEST = 64 << 20
#: A store key (:func:`~torchcache.stores.packed.format.is_key`), matched in one call.
_KEY = re.compile(r"[0-9a-f]{4,64}")


class Entry(NamedTuple):
    """Where an entry's bytes are: segment name, offset, length, digest, and the stamp of its manifest."""

    segment: str
    offset: int
    length: int
    digest: int
    stamp: str


class Read(NamedTuple):
    """One ranged read: a segment's bytes ``start:end``, holding the entries at these batch positions.

    A read of most of a segment reads all of it (``others``: the entries not asked for),
    so that a local copy takes the whole segment and later batches find it there.
    """

    segment: str
    start: int
    end: int
    entries: list[tuple[int, Entry]]
    others: list[tuple[str, Entry]]

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
        for key, entry in self.others:
            data = view[entry.offset - self.start : entry.offset - self.start + entry.length]
            if len(data) == entry.length and xxhash.xxh3_64_intdigest(data) == entry.digest:
                others.append((key, data))
        return failed, others


def ranged_reads(keys: Sequence[str], index: Index, whole: bool = True, gap: int = 1 << 20) -> list[Read]:
    """The reads of the entries of a batch of keys that ``index`` knows.

    With ``whole``, a segment whose wanted entries span more than half of it is read
    whole (for a local copy to keep the rest). Otherwise each segment's wanted entries
    are read in runs: entries less than ``gap`` bytes apart share one range (a request
    costs more than a megabyte read with it).
    """
    by_segment: dict[str, list[tuple[int, Entry]]] = {}
    for i, key in enumerate(keys):
        entry = index.entries.get(key)
        if entry is not None:
            by_segment.setdefault(entry.segment, []).append((i, entry))
    reads, full = [], set()
    for segment, found in by_segment.items():
        start, end = min(e.offset for _, e in found), max(e.offset + e.length for _, e in found)
        size = index.segments.get(segment, 0)
        if whole and size and end - start > size // 2:
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
        asked = {id(e) for found in by_segment.values() for _, e in found}
        by_name = {read.segment: read for read in reads if read.segment in full}
        for key, entry in index.entries.items():
            if entry.segment in full and id(entry) not in asked:
                by_name[entry.segment].others.append((key, entry))
    return reads


class Index:
    """What the manifests and tombstones read so far say the bucket holds."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.segments: dict[str, int] = {}  # segment name -> bytes
        self.seen: set[str] = set()  # manifests and tombstones read
        self.deleted: dict[str, str] = {}  # key -> stamp of the latest tombstone naming it

    def apply(self, name: str, body: object) -> str | None:
        """Merge one manifest or tombstone; return what is wrong with it instead, if anything."""
        self.seen.add(name)
        stamp = name.split("-", 1)[0]
        parsed = parse(body, name)
        if isinstance(parsed, str):
            return parsed
        if name.endswith(TOMBSTONE):
            for key in parsed["deleted"]:
                if self.deleted.get(key, "") < stamp:
                    self.deleted[key] = stamp
                entry = self.entries.get(key)
                if entry is not None and entry.stamp < stamp:
                    del self.entries[key]
            return None
        segment = name.removesuffix(MANIFEST) + SEGMENT
        self.segments[segment] = parsed["bytes"]
        for key, offset, length, digest in parsed["entries"]:
            old = self.entries.get(key)
            if (old is None or old.stamp < stamp) and self.deleted.get(key, "") < stamp:
                self.entries[key] = Entry(segment, offset, length, digest, stamp)
        return None

    def forget(self, segments: set[str]) -> None:
        """Drop segments (removed from the bucket) and the entries they held."""
        for segment in segments:
            self.segments.pop(segment, None)
        for key in [k for k, e in self.entries.items() if e.segment in segments]:
            del self.entries[key]

    def drop_gone(self, listed: set[str]) -> None:
        """Forget the manifests read before that a listing no longer shows (pruned by another writer)."""
        gone = {n for n in self.seen if n not in listed}
        if gone:
            self.seen -= gone
            self.forget({n.removesuffix(MANIFEST) + SEGMENT for n in gone if n.endswith(MANIFEST)})

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
        self.entries.clear()
        self.segments.clear()
        self.seen.clear()
        self.deleted.clear()


def unfinished(names: set[str], older_than_ns: int) -> list[str]:
    """Segments without a manifest stamped before ``older_than_ns`` (uploads a killed writer left)."""
    found = []
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


def parse(body: object, name: str) -> dict[str, Any] | str:
    """A manifest or tombstone, validated, or what is wrong with it."""
    if not isinstance(body, bytes) or len(body) > _MAX_MANIFEST:
        return "unreadable or too large"
    try:
        data = json.loads(body)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
        return "not a torchcache manifest of a known version"
    if name.endswith(TOMBSTONE):
        deleted = data.get("deleted")
        if not isinstance(deleted, list) or not all(isinstance(k, str) and is_key(k) for k in deleted):
            return "invalid deleted keys"
        return data
    size, entries = data.get("bytes"), data.get("entries")
    if type(size) is not int or size < 0 or not isinstance(entries, list):
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
    return data
