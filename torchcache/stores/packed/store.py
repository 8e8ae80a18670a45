"""A packed disk store: many entries per file, one LMDB index, shared by every process.

Entries are records appended to segment files (``seg-<n>.tcs``), each process to its
own, so appends take no cross-process lock; an LMDB index (``index.lmdb``) maps each
key to its record and keeps the totals and the segment table. A batch costs one index
transaction and one ``pwritev``, or one index pass and one ``pread`` per hit in file
order. A record is indexed only after it is written and carries a checksum, so readers
see whole entries or none, and a torn or flipped record is a miss, reported once. A
put is visible to every process and safe from ``kill -9`` when it returns.

The budget (record bytes plus the index's share) spans runs and processes. Eviction
drops whole segments, the most recently written first (MRU): "used" means written, by
any process; reads do not count, so they never write. Deleted and replaced entries
leave dead bytes, compacted away once the files pass the budget by 5 %: the disk
stays within 1.1 times the budget. ``docs/how-it-works.md`` (The packed disk store) has the design.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from ..._fork import renew_lock_after_fork
from ..._log import logger
from ...errors import ConfigError, StoreError
from ...faults import Fault, Report, full_hint
from ...policy import format_size, parse_size
from ..batched import BatchedStore, Rows, VerifyReport
from ..pins import named_pins
from . import upkeep
from .evict import INDEX_ENTRY_BYTES, NoRoom, Pinned, Victims, evict, fitting, index_charge, keep_within_bounds, release
from .format import decode_key, encode_key, encode_keys, encode_records, record_size
from .index import Change, Index, IndexReplacedError, map_size_for
from .opening import IndexHandle
from .read import EntryReader
from .segments import SegmentFiles
from .verify import verify_settled

__all__ = ["INDEX_ENTRY_BYTES", "MAX_ENTRY_BYTES", "PackedStore"]

#: The largest entry stored by default; a longer length in the index is a lie and is not read.
MAX_ENTRY_BYTES = 1 << 28
_CHUNK_KEYS = 4096
#: Times a write that finds the index's map full grows it and writes again.
_GROW_TRIES = 8


def _default_report(kind: str, message: str) -> None:
    logger.warning("%s: %s", kind, message)


class PackedStore(BatchedStore):
    """Entries packed into append-only segment files under one LMDB index.

    Args:
        directory: The store directory (created if missing).
        max_bytes: The budget, in bytes or as a string such as ``"2GB"``.
        report: Called with ``(kind, message)`` for each fault, once: ``"corrupt"`` (an entry failed its
            checks and is a miss), ``"segment"`` (a segment file is missing or not a regular file),
            ``"index"`` (the index was damaged and rebuilt), ``"read"`` (a read failed). Logged by default.
        evict: ``"mru"`` (the most recently written segment goes first), ``"lru"`` (the least),
            or ``"none"``: a full store keeps what it holds and takes what fits of a write.
        segment_bytes: Seal a segment once it holds this many bytes; by default 1/64 of
            the budget, between 64 KiB and 256 MiB (1/16 of budgets under 1 MiB).
        max_entry_bytes: Larger entries are not stored, and an index row that claims a
            larger one is not read (so a lying index cannot make a read exhaust memory).
        readonly: Read the index as it is: nothing is written, sealed, removed or rebuilt.

    Raises:
        ConfigError: If an argument is invalid.
        StoreError: If the directory cannot be created.

    Example:
        >>> import tempfile
        >>> store = PackedStore(tempfile.mkdtemp(), "1MB")
        >>> store.put_many([("abcd01", b"spam"), ("abcd02", b"eggs")])
        2
        >>> [None if v is None else bytes(v) for v in store.get_many(["abcd01", "abcd03"])]
        [b'spam', None]
        >>> len(store), store.nbytes
        (2, 8)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int | float | str,
        *,
        report: Report | None = None,
        evict: str = "mru",
        segment_bytes: int | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        readonly: bool = False,
    ) -> None:
        if evict not in ("mru", "lru", "none"):
            raise ConfigError(f"evict must be 'mru', 'lru' or 'none', got {evict!r}")
        self.directory = Path(directory)
        self.max_bytes = parse_size(max_bytes, "max_bytes")
        # 1/64 of the budget, at least 64 KiB; small budgets get segments of 1/16 (at least
        # 256 bytes), so that whole-segment eviction still keeps most of what fits.
        default_segment = min(max(self.max_bytes // 64, min(1 << 16, max(self.max_bytes // 16, 256))), 1 << 28)
        self.segment_bytes = int(segment_bytes) if segment_bytes else default_segment
        if self.segment_bytes <= 0:
            raise ConfigError(f"segment_bytes must be positive, got {segment_bytes!r}")
        self._max_entry = min(self.max_bytes, int(max_entry_bytes))
        self._root = os.fspath(self.directory)
        self._report_fn = report if report is not None else _default_report
        self._recent = evict != "lru"
        self._keep = evict == "none"
        #: The keys whose entries eviction keeps: by default, those unsent files here name (a local copy's).
        self.pinned: Pinned | None = functools.partial(named_pins, self.directory)
        self._lock = threading.RLock()
        renew_lock_after_fork(self, "_lock")
        self._files = SegmentFiles(self._root, self.segment_bytes)
        self._reported: set[str | None] = set()
        self._reader = EntryReader(self._root, self._files, int(max_entry_bytes), self._report)
        self._handle = IndexHandle(
            self._root, self._files, self._report, self._forget_doomed, map_size_for(self.max_bytes), readonly
        )
        try:
            if not readonly:  # else only read: a missing directory holds nothing
                os.makedirs(self._root, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store directory {self._root}: {exc}") from exc
        with self._lock:
            self._handle.ensure(write=False)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._handle.release()

    def __repr__(self) -> str:
        try:
            used = f"{format_size(self.nbytes)} in {len(self)} entries"
        except Exception:  # noqa: BLE001 - a repr must not raise
            used = "unavailable"
        return f"PackedStore({self._root!r}, max_bytes={format_size(self.max_bytes)}, used={used})"

    # -- opening ------------------------------------------------------------------
    def _report(self, kind: Fault, message: str, once: str | None = None) -> None:
        if once is not None and once in self._reported:
            return
        self._reported.add(once)  # None too, which is never looked up
        self._report_fn(kind, message)

    def _forget_doomed(self) -> None:
        self._reader.doomed = {}

    # -- reads --------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The stored bytes of each key (a view of the record read), ``None`` for a miss.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """
        kbs = encode_keys(list(keys))
        if not kbs:
            return []
        with self._lock:
            index = self._handle.ensure(write=False)
            if index is not None:
                try:
                    return self._reader.read(index, kbs)
                except lmdb.Error as exc:
                    self._handle.failed(exc)
        return [None] * len(kbs)

    def get_rows(self, keys: Sequence[str], head_of: Callable[[memoryview], int | None]) -> Rows | None:
        """The found entries of a batch as arrays, if their payloads have one length (:meth:`BatchedStore.get_rows`).

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """
        kbs = encode_keys(list(keys))
        with self._lock:
            index = self._handle.ensure(write=False)
            if index is not None:
                try:
                    return self._reader.read_rows(index, kbs, head_of)
                except lmdb.Error as exc:
                    self._handle.failed(exc)
        return None

    def __contains__(self, key: object) -> bool:
        try:
            kb = encode_key(key)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
        with self._lock:
            index = self._handle.ensure(write=False)
            if index is None:
                return False
            try:
                with index.begin() as txn:
                    raw = txn.get(kb, db=index.entries)
            except lmdb.Error:
                return False
            return raw is not None and (kb, raw) not in self._reader.bad

    def keys(self) -> Iterator[str]:
        """Iterate over the stored keys, read from the index 4,096 at a time."""
        start = b""
        while True:
            with self._lock:
                index = self._handle.ensure(write=False)
                if index is None:
                    return
                chunk: list[bytes] = []
                with index.begin() as txn:
                    for kb, _ in index.iter_entries(txn, start):
                        chunk.append(kb)
                        if len(chunk) >= _CHUNK_KEYS:
                            break
            yield from (decode_key(kb) for kb in chunk)
            if len(chunk) < _CHUNK_KEYS:
                return
            start = chunk[-1] + b"\0"

    def __len__(self) -> int:
        return self.usage()["entries"]

    @property
    def nbytes(self) -> int:
        """Payload bytes of the live entries (every process's)."""
        return self.usage()["payload"]

    def usage(self) -> dict[str, int]:
        """What the index counts, every process's writes included.

        Returns:
            ``entries``, ``payload`` (live payload bytes), ``records`` (live record bytes,
            headers included), ``files`` (bytes of segment files; what they hold beyond
            ``records`` is reclaimable by compaction) and ``index`` (the index's share of
            the budget).
        """
        with self._lock:
            index = self._handle.ensure(write=False)
            if index is None:
                return {"entries": 0, "payload": 0, "records": 0, "files": 0, "index": 0}
            with index.begin() as txn:
                totals, count = index.totals(txn), index.count(txn)
            charge = index_charge(index.file_bytes(), count)
        return {
            "entries": count,
            **{name: totals[name.encode()] for name in ("payload", "records", "files")},
            "index": charge,
        }

    @property
    def disk_bytes(self) -> int:
        """Bytes the index and segment files take on disk (allocated blocks)."""
        return upkeep.disk_bytes(self._root)

    # -- writes -------------------------------------------------------------------
    def _change(self) -> tuple[Index, Change]:
        """Begin a write transaction with this process's rejected entries removed.

        Raises:
            StoreError: If the store cannot be written.
        """
        for attempt in range(3):
            opened = self._handle.ensure(write=True)
            assert opened is not None  # _ensure(write=True) raises instead
            index = opened
            try:
                change = index.change()
                break
            except IndexReplacedError:  # compacted by another process: open the new file
                if attempt == 2:
                    raise StoreError(f"cannot write the index of {self._root}: it keeps being replaced") from None
            except lmdb.Error as exc:
                raise StoreError(f"cannot write the index of {self._root}: {exc}") from exc
        try:
            for kb, raw in self._reader.doomed.items():
                entry = change.lookup(kb)
                if entry is not None and change.txn.get(kb, db=index.entries) == raw:
                    change.remove(kb, entry)
        except BaseException:
            change.abort()
            raise
        return index, change

    def _commit(self, change: Change) -> None:
        change.commit()
        self._reader.doomed.clear()

    def _grow(self, index: Index) -> bool:
        """Double the index's map after a write found it full (no transaction open); whether it grew."""
        try:
            index.grow()
        except lmdb.Error as exc:
            self._report(Fault.INDEX, f"cannot grow the map of the index of {self._root}: {exc}", "grow")
            return False
        return True

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Store entries under the budget (see :meth:`BatchedStore.put_many`).

        Every item is appended, then whole segments are evicted until the budget holds
        (with MRU, the most recently written first, which may be this batch's own); with
        ``evict="none"``, only the first ones that fit, checked in the write transaction.
        Where only segments of :attr:`pinned` entries are left to evict, nothing is stored.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreError: If the storage cannot be written; nothing of this call is visible.
        """
        kbs = encode_keys([key for key, _ in items])
        plan: dict[bytes, bytes | memoryview] = {}
        limit = self.max_bytes - INDEX_ENTRY_BYTES
        for kb, (_, data) in zip(kbs, items):
            plan.pop(kb, None)
            if record_size(kb, len(data)) <= limit and len(data) <= self._max_entry:
                plan[kb] = data
        if not plan:
            return 0
        with self._lock:
            for attempt in range(_GROW_TRIES):
                index, change = self._change()
                victims: Victims = []
                try:
                    kbs, datas = list(plan), list(plan.values())
                    kbs, datas = fitting(index, change, kbs, datas, self.max_bytes) if self._keep else (kbs, datas)
                    if not kbs:  # full; an index bloated with free pages is still compacted
                        change.abort()
                        self._trim(index)
                        return 0
                    places = self._files.append(change, encode_records(kbs, datas))
                    change.add_many(kbs, places, list(map(len, datas)))
                    victims, evicted = evict(index, change, self._files, self.max_bytes, self._recent, self.pinned)
                    self._commit(change)
                except BaseException as exc:
                    with contextlib.suppress(lmdb.Error):
                        change.abort()
                    self._files.aborted()
                    release(self._files, victims, remove=False)
                    if isinstance(exc, NoRoom):  # no room but the only copies of other entries
                        return 0
                    if isinstance(exc, lmdb.MapFullError) and attempt + 1 < _GROW_TRIES and self._grow(index):
                        continue  # the index outgrew its map: write the batch again in a larger one
                    if isinstance(exc, (OSError, lmdb.Error)):
                        raise StoreError(f"cannot write to {self._root}: {exc}{full_hint(self._root)}") from exc
                    raise
                break
            self._files.committed()
            release(self._files, victims, remove=True)
            self._trim(index)
        return len(kbs) - len(evicted.intersection(kbs))

    def _trim(self, index: Index | None) -> None:
        """Keep the store within its budget (:func:`keep_within_bounds`), on the new index too after a compaction."""
        try:
            for _ in range(2):
                if index is not None:
                    keep_within_bounds(index, self._files, self.max_bytes, self._recent, self._report, self.pinned)
                    index = self._handle.ensure(write=True) if index.replaced() else None
        except (lmdb.Error, OSError) as exc:
            raise StoreError(f"cannot compact the store {self._root}: {exc}") from exc

    def trim(self) -> None:
        """Evict and compact now until the budget holds (otherwise done by each :meth:`put_many`).

        Raises:
            StoreError: If the store cannot be written.
        """
        with self._lock:
            self._trim(self._handle.ensure(write=True))

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove entries; return how many were present.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreError: If the storage cannot be written.
        """
        kbs = encode_keys(list(keys))
        if not kbs:
            return 0
        with self._lock:
            _, change = self._change()
            removed = 0
            try:
                for kb in kbs:
                    entry = change.lookup(kb)
                    if entry is not None:
                        change.remove(kb, entry)
                        removed += 1
                self._commit(change)
            except lmdb.Error as exc:
                with contextlib.suppress(lmdb.Error):
                    change.abort()
                if isinstance(exc, lmdb.MapFullError):
                    self._grow(change.index)  # the next write has room
                raise StoreError(f"cannot write to the store {self._root}: {exc}{full_hint(self._root)}") from exc
        return removed

    def flush(self) -> None:
        """Remove the entries this process found damaged from the index (a put is durable when it returns)."""
        with self._lock:
            self._flush_quietly()

    def _flush_quietly(self) -> None:
        if not self._reader.doomed:
            return
        try:
            _, change = self._change()
            self._commit(change)
        except (StoreError, lmdb.Error):  # a read-only or vanished store: nothing to record
            self._reader.doomed.clear()

    def clear(self) -> None:
        """Remove every entry and every segment file no live writer holds.

        Raises:
            StoreError: If the storage cannot be written.
        """
        with self._lock:
            index, change = self._change()
            try:
                change.clear()
                self._commit(change)
            except lmdb.Error as exc:
                with contextlib.suppress(lmdb.Error):
                    change.abort()
                if isinstance(exc, lmdb.MapFullError):
                    self._grow(index)
                raise StoreError(f"cannot clear the store {self._root}: {exc}") from exc
            self._files.seal_writer()
            self._reader.bad.clear()
            upkeep.remove_unindexed(index, self._files, wait=True)

    def close(self) -> None:
        """Flush, seal this process's segment, close the index and every file (reopened if used again)."""
        with self._lock:
            if self._handle.forked():
                return
            self._flush_quietly()
            index, writer = self._handle.index, self._files.writer
            if index is not None and writer is not None and not index.readonly:
                with contextlib.suppress(lmdb.Error):  # sealed while still locked: no one evicted it meanwhile
                    change = index.change()
                    change.seal(writer.seg)
                    change.commit()
            self._files.seal_writer()
            self._handle.drop()

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every entry's record and checksum, the totals and the files.

        Raises:
            StoreError: If ``fix`` is set and the store cannot be written.
        """
        with self._lock:
            index = self._handle.ensure(write=fix)
            if index is None:
                problem = "the index cannot be opened" if os.path.isdir(self._root) else f"{self._root} is gone"
                return VerifyReport(problems=[problem])
            if fix:
                self._flush_quietly()
            try:
                return verify_settled(index, lambda: self._handle.ensure(write=fix), self._files, fix)
            except (lmdb.Error, OSError) as exc:
                raise StoreError(f"cannot verify the store {self._root}: {exc}") from exc
