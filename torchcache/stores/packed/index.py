"""The packed store's index: an LMDB environment shared by every process that opens the store.

Three tables: ``entries`` maps a key to ``(segment, offset, payload length)``;
``segments`` maps a segment number to ``(sealed, end, live record bytes, live records,
stamp)``, the stamp being the index clock at the segment's last write; ``meta`` holds
the clock and the running totals. Writes commit atomically (``sync=False``: durable
against a killed process, not a power cut); nothing is unpickled, and every value is
checked for its exact size before it is unpacked. The map is sized from the store's
budget (:func:`map_size_for`) and doubled when full; the lock file's pages are allocated
before LMDB maps it (``ENOSPC``, not ``SIGBUS``, on a full file system). Only a checked
inconsistency (:data:`DAMAGE`, :class:`IndexDamageError`) means the file is damaged;
any other error opening it (``ENOMEM``, ``EAGAIN``, ``ENOSPC``) leaves it as it is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import lmdb

from ..._fork import ForkGate, after_fork
from ...errors import StoreError
from .format import HEADER, record_size
from .locks import opening_index

__all__ = [
    "DAMAGE",
    "ENTRY",
    "FORMAT",
    "INDEX_NAME",
    "MIN_MAP_SIZE",
    "Change",
    "Entry",
    "Index",
    "IndexDamageError",
    "IndexReplacedError",
    "Segment",
    "map_size_for",
    "open_index",
    "reserve_lock_file",
    "unpack_entry",
]

INDEX_NAME = "index.lmdb"
FORMAT = 1
#: The smallest map (address space, not disk): room for the index of about 300,000 entries.
MIN_MAP_SIZE = 32 << 20
#: The largest map sized from a budget (a map grows past it only when a write finds it full).
_MAX_MAP_SIZE = 1 << 36
#: Index bytes an entry may take (INDEX_ENTRY_BYTES of packed_evict) and the smallest entry sized for.
_ENTRY_INDEX_BYTES, _SIZED_ENTRY = 96, 1024
_MAX_READERS = 1024
#: Bytes of LMDB's lock file with 1,024 reader slots (192 + 64 per further slot), to a whole page.
_LOCK_BYTES = -(-(192 + 64 * (_MAX_READERS - 1)) // 4096) * 4096
#: LMDB errors that mean the index file failed a check of its content (others, such as
#: ENOMEM, too many readers or a full disk, do not).
DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.BadValsizeError,
)
ENTRY = struct.Struct("<III")
_SEGMENT = struct.Struct("<BQQQQ")
_U64 = struct.Struct("<Q")
_SEG_KEY = struct.Struct(">I")
_META = (b"format", b"clock", b"payload", b"records", b"files", b"gen", b"next_seg")
#: Counters above this are not taken from the index (they could never be reached).
_MAX_TOTAL = 1 << 60
_MAX_SEGMENT = (1 << 32) - 2
#: Bytes of a record beyond its payload: the header and a key of 2 to 33 bytes.
_MIN_RECORD, _MAX_RECORD = HEADER.size + 2, HEADER.size + 33
_BLOCK = 4096
_shared: dict[tuple[int, int], Index] = {}  # open environments of this process, by file identity
_shared_lock = threading.RLock()  # reentrant: a store the collector drops inside an open closes its use
_inherited: list[Index] = []  # environments inherited over fork: never used, closed before the next open
#: Transactions in flight in this process: a fork waits for them (a child that inherits one
#: cannot close its environment, and loses the store).
TRANSACTIONS = ForkGate()


class Entry(NamedTuple):
    """Where an entry's record lives."""

    seg: int
    offset: int
    length: int


class Segment(NamedTuple):
    """What the index knows of a segment file."""

    sealed: bool
    end: int
    live: int
    records: int
    stamp: int


def _blocks(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def unpack_entry(value: bytes | memoryview | None) -> Entry | None:
    """An index value as an :class:`Entry`; ``None`` if absent or not exactly an entry's size."""
    return None if value is None or len(value) != ENTRY.size else Entry._make(ENTRY.unpack(value))


def _unpack_segment(value: bytes | memoryview | None) -> Segment | None:
    if value is None or len(value) != _SEGMENT.size:
        return None
    row = Segment._make(_SEGMENT.unpack(value))  # with values no segment could have, it is not believed
    return None if row.sealed > 1 or max(row[1:]) > _MAX_TOTAL else row._replace(sealed=bool(row.sealed))


def _u64(value: bytes | memoryview | None) -> int:
    return _U64.unpack(value)[0] if value is not None and len(value) == _U64.size else 0


class IndexReplacedError(lmdb.Error):
    """The index file was replaced (compacted or rebuilt by another process) after this process opened it."""


class IndexDamageError(StoreError):
    """The index file, or its lock file, is not a regular file: it is replaced, like a damaged one."""


def map_size_for(max_bytes: int) -> int:
    """The map an index of a store with a budget of ``max_bytes`` opens with.

    Twice what the index of a full store of 1 KiB entries takes (96 bytes each), at
    least :data:`MIN_MAP_SIZE` and at most 64 GiB; a store of smaller entries grows it
    when a write finds it full (:meth:`Index.grow`).

    Example:
        >>> map_size_for(10**9) // 2**20, map_size_for(10**6) // 2**20
        (178, 32)
    """
    wanted = 2 * (max(0, int(max_bytes)) // _SIZED_ENTRY) * _ENTRY_INDEX_BYTES
    return _blocks(min(_MAX_MAP_SIZE, max(MIN_MAP_SIZE, wanted)))


def open_index(root: str, readonly: bool, map_size: int = MIN_MAP_SIZE) -> Index:
    """Open (or create) the index of a store directory.

    The index file must be a regular file (or absent): LMDB would block reading a FIFO.

    Args:
        root: The store directory.
        readonly: Open it for reading only.
        map_size: The address space to map it in (raised to the file's size and room to grow).

    Raises:
        IndexDamageError: If the index or its lock file is not a regular file.
        lmdb.Error: If LMDB refuses the file (damaged, another format, no access, no memory).
        OSError: If the lock file cannot be given its pages (a full file system), or the
            directory stays locked for 30 s.
    """
    path = os.path.join(root, INDEX_NAME)
    for name in (path, path + "-lock"):
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise IndexDamageError(errno.EINVAL, f"{name} is not a regular file")
    with _shared_lock:
        _close_inherited()
        try:
            st = os.stat(path)
            shared = _shared.get((st.st_dev, st.st_ino))
        except FileNotFoundError:
            shared = None
        if shared is not None:  # LMDB allows one environment per file and process: share it
            shared.users += 1
            return shared
        with opening_index(root) as locked:  # no index is replaced while it is opened
            if not locked:
                raise OSError(errno.EAGAIN, f"{root} stayed locked while its index was being replaced")
            try:
                index = Index(path, readonly=readonly, lock=True, map_size=map_size)
            except (lmdb.Error, StoreError):
                if not readonly:
                    raise
                index = Index(path, readonly=True, lock=False, map_size=map_size)  # no lock file to write
        _shared[index.identity] = index
        return index


def _forget_shared() -> None:
    """In a forked child: set the parent's environments aside, unused, to close before the next open.

    Not here: a close at the fork can wait forever (py-lmdb waits for the operations in
    flight, and one another thread of the parent had begun never ends in the child).
    """
    global _shared_lock
    _inherited.extend(_shared.values())
    _shared.clear()
    _shared_lock = threading.RLock()


def _close_inherited() -> None:
    """Close this process's copies of inherited environments (LMDB opens a file once per process).

    Each on a thread, waited for 2 s: one stuck leaves its store unavailable here, not a hang.
    """
    while _inherited:
        closer = threading.Thread(target=_close_quietly, args=(_inherited.pop(),), daemon=True)
        closer.start()
        closer.join(2.0)


def _close_quietly(index: Index) -> None:
    with contextlib.suppress(Exception):
        index.env.close()
        os.close(index._fd)


after_fork(_forget_shared)


def reserve_lock_file(path: str) -> None:
    """Give LMDB's lock file its pages before LMDB maps and writes it (a hole would be a SIGBUS).

    Allocating pages leaves what they hold as it is: safe while other processes use the
    file. Where it cannot be opened for writing, LMDB fails the same way (and the index is
    read without the lock); a file system without ``fallocate`` is left to LMDB.

    Raises:
        StoreError: If the file system has no room for the pages (``ENOSPC``).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.posix_fallocate(fd, 0, _LOCK_BYTES)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise StoreError(exc.errno, f"cannot allocate the index lock file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


class Index:
    """An open LMDB environment with the store's three tables.

    Args:
        path: The index file.
        readonly: Open it for reading only.
        lock: Use LMDB's lock file (readers then take a slot in it).
        map_size: The address space to map it in; raised to twice the file's size.

    Raises:
        lmdb.Error: If LMDB cannot open it.
        StoreError: If the lock file cannot be given its pages (a full file system).
    """

    def __init__(self, path: str, readonly: bool, lock: bool, map_size: int = MIN_MAP_SIZE) -> None:
        self.path = path
        self.readonly = readonly
        with contextlib.suppress(OSError):
            map_size = max(map_size, 2 * os.stat(path).st_size)  # room to grow beyond what it holds
        if lock:  # readers write their slot in it too
            reserve_lock_file(path + "-lock")
        self.env = lmdb.open(
            path,
            map_size=_blocks(map_size),
            subdir=False,
            readonly=readonly,
            lock=lock,
            sync=False,
            metasync=False,
            readahead=True,
            meminit=False,
            max_dbs=3,
            max_readers=_MAX_READERS,
            mode=0o644,
        )
        try:
            if not readonly:
                self.env.reader_check()  # slots of readers that were killed
            create = not readonly
            self.entries = self.env.open_db(b"entries", create=create)
            self.segments = self.env.open_db(b"segments", create=create)
            self.meta = self.env.open_db(b"meta", create=create)
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # the file mapped, wherever it goes
        except BaseException:
            self.env.close()
            raise
        st = os.fstat(self._fd)
        self.identity = (st.st_dev, st.st_ino)
        self.users, self._size = 1, st.st_size  # never less, but for a file cut by another program (LMDB only grows it)

    def close(self) -> None:
        """Give this use of the environment back; it closes when no store of this process uses it."""
        with _shared_lock:
            self.users -= 1
            if self.users > 0:
                return
            if _shared.get(self.identity) is self:
                del _shared[self.identity]
        self.env.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def begin(self) -> Iterator[lmdb.Transaction[bytes]]:
        """A read transaction for the block: a consistent snapshot, without a lock.

        Its default table is ``entries`` (``txn.get(kb)`` reads an entry; py-lmdb parses
        a ``db=`` argument on every call).

        Raises:
            lmdb.Error: If it cannot begin.
        """
        TRANSACTIONS.enter()
        try:
            with self._begin(db=self.entries) as txn:
                yield txn
        finally:
            TRANSACTIONS.leave()

    def change(self) -> Change:
        """Begin a write transaction (the store's one cross-process lock).

        The lock is LMDB's, in the lock file that outlives a replaced index file: holding
        it, a writer checks that the file it opened is still the index, so that nothing is
        committed to one that another process compacted away meanwhile.

        Raises:
            IndexReplacedError: If the index file was replaced: open it again.
            lmdb.Error: If it cannot begin.
        """
        TRANSACTIONS.enter()
        try:
            txn = self._begin(write=True)
            if self.replaced():
                txn.abort()
                raise IndexReplacedError(f"{self.path} was replaced since it was opened")
            return Change(self, txn)
        except BaseException:
            TRANSACTIONS.leave()
            raise

    def _begin(self, **options: Any) -> lmdb.Transaction[bytes]:
        """A transaction, unless the file was cut shorter than it was (its pages would kill the process: SIGBUS)."""
        with contextlib.suppress(OSError):  # the file mapped, by its descriptor: a path replaced is not it
            size = os.fstat(self._fd).st_size
            if size < self._size:
                raise lmdb.CorruptedError(f"{self.path} was cut shorter than its pages by another program")
            self._size = size
        try:
            return self.env.begin(**options)
        except lmdb.MapResizedError:  # another process grew the map past this one's
            self.env.set_mapsize(0)
            return self.env.begin(**options)

    def replaced(self) -> bool:
        """Whether the index file at :attr:`path` is no longer the one this environment opened."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    @property
    def map_size(self) -> int:
        """The address space the index is mapped in (its largest size until it grows)."""
        return int(self.env.info()["map_size"])

    def grow(self) -> None:
        """Double the map, after a write found it full (call with no transaction open).

        Every process that opens the index later, or begins a transaction after it grew
        beyond their map, maps the new size.

        Raises:
            lmdb.Error: If it cannot be mapped at that size (no address space left).
        """
        self.env.set_mapsize(_blocks(2 * self.map_size))

    def file_bytes(self) -> int:
        """Bytes the index takes on disk, and its lock file beyond the fixed pages allocated for it."""
        total = 0
        for name, fixed in ((self.path, 0), (self.path + "-lock", _LOCK_BYTES)):
            with contextlib.suppress(OSError):
                total += max(0, os.stat(name).st_blocks * 512 - fixed)
        return total

    def stored_totals(self, txn: lmdb.Transaction[bytes]) -> dict[bytes, int]:
        """The meta counters as stored, unchecked (what :func:`verify` compares with the entries)."""
        return {name: _u64(txn.get(name, db=self.meta)) for name in _META}

    def totals(self, txn: lmdb.Transaction[bytes]) -> dict[bytes, int]:
        """The meta counters as seen by ``txn``, checked.

        The byte totals must agree with the entry count (``payload <= records``, and the
        record bytes beyond the payload between the smallest and largest header and key
        per entry) and ``files`` with the segment table; totals that do not (planted, or
        written by a broken process) are recomputed from the entries and segments. A
        clock, generation or next segment number out of range is taken from the segment
        table. A write transaction then stores the recomputed values.
        """
        totals = self.stored_totals(txn)
        table = self.segment_table(txn)
        files = sum(_blocks(row.end) for row in table.values())
        count = self.count(txn)
        payload, records = totals[b"payload"], totals[b"records"]
        extra = records - payload
        if (
            totals[b"files"] != files
            or not payload <= records <= files
            or not count * _MIN_RECORD <= extra <= count * _MAX_RECORD
        ):
            totals[b"payload"], totals[b"records"] = self._recount(txn)
            totals[b"files"] = files
        if totals[b"clock"] > _MAX_TOTAL:
            totals[b"clock"] = max((row.stamp for row in table.values() if row.stamp <= _MAX_TOTAL), default=0)
        if totals[b"gen"] > _MAX_TOTAL:
            totals[b"gen"] = 0
        last = max(table, default=0)
        if not last < totals[b"next_seg"] <= _MAX_SEGMENT:
            totals[b"next_seg"] = last + 1
        return totals

    def _recount(self, txn: lmdb.Transaction[bytes]) -> tuple[int, int]:
        """Payload and record bytes of the entries (a malformed row counts as nothing)."""
        payload = records = 0
        for kb, entry in self.iter_entries(txn):
            if entry is not None:
                payload += entry.length
                records += record_size(kb, entry.length)
        return payload, records

    def generation(self, txn: lmdb.Transaction[bytes]) -> int:
        """The count of segment removals, as seen by ``txn``."""
        return _u64(txn.get(b"gen", db=self.meta))

    def segment_table(self, txn: lmdb.Transaction[bytes]) -> dict[int, Segment]:
        """Every segment the index knows, by number (malformed rows are left out)."""
        found: dict[int, Segment] = {}
        for key, value in txn.cursor(db=self.segments):
            seg = _unpack_segment(value)
            if seg is not None and len(key) == _SEG_KEY.size:
                found[_SEG_KEY.unpack(key)[0]] = seg
        return found

    def iter_entries(self, txn: lmdb.Transaction[bytes], start: bytes = b"") -> Iterator[tuple[bytes, Entry | None]]:
        """Entries in key order from ``start`` (a malformed value gives ``None``)."""
        cursor = txn.cursor(db=self.entries)
        if not cursor.set_range(start):
            return
        for key, value in cursor:
            yield key, unpack_entry(value)

    def count(self, txn: lmdb.Transaction[bytes]) -> int:
        """Entries in the index."""
        return int(txn.stat(self.entries)["entries"])


class Change:
    """One write transaction over the index, keeping the totals and segment rows in step.

    Every change to entries goes through :meth:`add_many`, :meth:`remove` and
    :meth:`move`, and to segments through :meth:`set_end`, :meth:`seal` and
    :meth:`drop_segment`; :meth:`commit` writes the totals and the changed segment rows
    once. Each transaction advances the clock by one.
    """

    def __init__(self, index: Index, txn: lmdb.Transaction[bytes]) -> None:
        self.index = index
        self.txn = txn
        totals = index.totals(txn)
        self.fresh = totals[b"format"] == 0
        self.clock = totals[b"clock"] + 1
        self.payload, self.records, self.files, self.gen = (
            totals[k] for k in (b"payload", b"records", b"files", b"gen")
        )
        self.next_seg = max(1, totals[b"next_seg"])
        self.count = index.count(txn)
        self._segs: dict[int, list[int]] = {}
        self._dropped: set[int] = set()
        self._open = True  # in TRANSACTIONS until committed, aborted or dropped

    def _end(self) -> None:
        if self.__dict__.pop("_open", False):
            TRANSACTIONS.leave()

    __del__ = _end

    # -- segments -----------------------------------------------------------------
    def segment(self, seg: int) -> list[int]:
        """The mutable row ``[sealed, end, live, records, stamp]`` of a segment (new: all zero)."""
        row = self._segs.get(seg)
        if row is None:
            found = _unpack_segment(self.txn.get(_SEG_KEY.pack(seg), db=self.index.segments))
            row = [0, 0, 0, 0, 0] if found is None else [int(found.sealed), *found[1:]]
            self._segs[seg] = row
            self._dropped.discard(seg)
        return row

    def set_end(self, seg: int, end: int) -> None:
        """Record that a segment's file now ends at ``end`` (written now, for the eviction order)."""
        row = self.segment(seg)
        self.files += _blocks(end) - _blocks(row[1])
        row[1] = end
        row[4] = self.clock

    def seal(self, seg: int) -> None:
        """Mark a segment as written to no more."""
        self.segment(seg)[0] = 1

    def drop_segment(self, seg: int) -> None:
        """Forget a segment (its file is about to be removed)."""
        row = self.segment(seg)
        self.files -= _blocks(row[1])
        del self._segs[seg]
        self._dropped.add(seg)
        self.gen += 1

    def allocate_segment(self) -> int:
        """A segment number no one has used (as far as this index knows)."""
        seg = self.next_seg
        self.next_seg += 1
        return seg

    def table(self) -> dict[int, Segment]:
        """Every segment row as this transaction sees it, changes included."""
        table = self.index.segment_table(self.txn)
        for seg in self._dropped:
            table.pop(seg, None)
        for seg, row in self._segs.items():
            table[seg] = Segment(bool(row[0]), *row[1:])
        return table

    # -- entries ------------------------------------------------------------------
    def lookup(self, kb: bytes) -> Entry | None:
        """The entry of a key, or ``None``."""
        return unpack_entry(self.txn.get(kb, db=self.index.entries))

    def remove(self, kb: bytes, entry: Entry) -> None:
        """Remove a key found as ``entry``."""
        self.txn.delete(kb, db=self.index.entries)
        self._account(kb, entry, -1)

    def _account(self, kb: bytes, entry: Entry, sign: int) -> None:
        size = record_size(kb, entry.length)
        row = self.segment(entry.seg)
        row[2] = max(0, row[2] + sign * size)
        row[3] = max(0, row[3] + sign)
        self.payload = max(0, self.payload + sign * entry.length)
        self.records = max(0, self.records + sign * size)
        self.count += sign

    def add_many(self, kbs: Sequence[bytes], places: Sequence[tuple[int, int]], lengths: Sequence[int]) -> None:
        """Index new records of distinct keys, replacing older ones, with one pass of accounting."""
        replace, entries, pack = self.txn.replace, self.index.entries, ENTRY.pack
        replaced: list[tuple[bytes, bytes]] = []
        for kb, (seg, offset), length in zip(kbs, places, lengths):
            old = replace(kb, pack(seg, offset, length), db=entries)
            if old is not None:
                replaced.append((kb, old))
        payload = sum(lengths)
        records = payload + sum(map(len, kbs)) + HEADER.size * len(kbs)
        segs = {seg for seg, _ in places}
        per_seg: dict[int, list[int]] = {}
        if len(segs) == 1:  # the common case: the whole batch went to one segment
            per_seg[segs.pop()] = [records, len(kbs)]
        else:
            for kb, (seg, _), length in zip(kbs, places, lengths):
                acc = per_seg.setdefault(seg, [0, 0])
                acc[0] += HEADER.size + len(kb) + length
                acc[1] += 1
        for kb, raw in replaced:
            old_entry = unpack_entry(raw)
            if old_entry is not None:
                self._account(kb, old_entry, -1)
        for seg, (size, count) in per_seg.items():
            row = self.segment(seg)
            row[2] += size
            row[3] += count
        self.payload += payload
        self.records += records
        self.count += len(kbs)

    def move(self, kb: bytes, entry: Entry, seg: int, offset: int) -> None:
        """Point an entry at a copy of its record."""
        self._account(kb, entry, -1)
        moved = entry._replace(seg=seg, offset=offset)
        self.txn.put(kb, ENTRY.pack(*moved), db=self.index.entries)
        self._account(kb, moved, 1)

    def remove_segment_entries(self, seg: int, kbs: Sequence[bytes]) -> list[bytes]:
        """Remove the entries of ``kbs`` that live in ``seg``; return the keys removed.

        If rows of ``seg`` remain (``kbs`` came from a scan that stopped at a damaged
        record), every entry is looked at once to find them.
        """
        removed = []
        for kb in kbs:
            entry = self.lookup(kb)
            if entry is not None and entry.seg == seg:
                self.remove(kb, entry)
                removed.append(kb)
        if self.segment(seg)[3] > 0:
            stale = [(kb, e) for kb, e in self.index.iter_entries(self.txn) if e is not None and e.seg == seg]
            for kb, entry in stale:
                self.remove(kb, entry)
                removed.append(kb)
        return removed

    # -- the transaction ----------------------------------------------------------
    def commit(self) -> None:
        """Write the totals and segment rows, and commit.

        Raises:
            lmdb.Error: If LMDB cannot commit (the transaction is aborted).
        """
        try:
            put, meta, segments = self.txn.put, self.index.meta, self.index.segments
            for seg in self._dropped:
                self.txn.delete(_SEG_KEY.pack(seg), db=segments)
            for seg, row in self._segs.items():
                put(_SEG_KEY.pack(seg), _SEGMENT.pack(*row), db=segments)
            values = (FORMAT, self.clock, self.payload, self.records, self.files, self.gen, self.next_seg)
            for name, value in zip(_META, values):
                put(name, _U64.pack(value), db=meta)
            self.txn.commit()
        except BaseException:
            self.txn.abort()
            raise
        finally:
            self._end()

    def abort(self) -> None:
        """Drop every change of this transaction."""
        try:
            self.txn.abort()
        finally:
            self._end()

    def clear(self) -> None:
        """Remove every entry and segment row (the clock keeps going)."""
        for db in (self.index.entries, self.index.segments):
            self.txn.drop(db, delete=False)
        self._segs.clear()
        self._dropped.clear()
        self.payload = self.records = self.files = self.count = 0
        self.gen += 1
