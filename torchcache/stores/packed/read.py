"""Batched reads of a packed store: one index pass, then ``pread`` in file order.

The index rows of a batch are read in one LMDB read transaction, checked for their
exact size and a length within bounds, sorted by segment and offset, and read with one
``pread`` each on cached descriptors. A record that fails its checks, or an index row
that points nowhere, makes that entry a miss from then on, reported once, and it is
removed from the index at this process's next write. A key whose segment vanished
between lookup and read (compacted away) is looked up once more.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from ...faults import Fault
from ..batched import Rows
from .format import HEADER, MAGIC, Found, decode_key, payload_of, record_size
from .index import ENTRY, Index
from .segments import MISSING, SegmentFiles

__all__ = ["EntryReader"]

_MAX_BAD = 1 << 16
_unpack = ENTRY.unpack
_ENTRY_SIZE = ENTRY.size
OnceReport = Callable[[Fault, str, "str | None"], None]
#: Rows of the ``entries`` table (:data:`ENTRY`) as one structured array.
_ENTRY_DTYPE = np.dtype([("seg", "<u4"), ("off", "<u4"), ("len", "<u4")])
_MAGIC = np.frombuffer(MAGIC, dtype=np.uint8)
_digest = xxhash.xxh3_64_intdigest


class EntryReader:
    """Reads batches of entries for one process, and remembers the damaged ones.

    Args:
        root: The store directory (for messages).
        files: This process's segment files.
        max_entry: The largest length an index row may claim.
        report: Called with ``(kind, message, once)``: a message with the same ``once``
            token is given only the first time.
    """

    def __init__(self, root: str, files: SegmentFiles, max_entry: int, report: OnceReport) -> None:
        self.root = root
        self.files = files
        self.max_entry = max_entry
        self.report = report
        #: Damaged entries, as (key, index row): misses from now on.
        self.bad: dict[tuple[bytes, bytes], None] = {}
        #: Index rows to remove at the next write, by key.
        self.doomed: dict[bytes, bytes] = {}
        self._gen = -1

    def read(self, index: Index, kbs: list[bytes]) -> list[bytes | memoryview | None]:
        """The payload of each key, ``None`` for a miss.

        Raises:
            lmdb.Error: If the index cannot be read.
        """
        out: list[bytes | memoryview | None] = [None] * len(kbs)
        again = self._fetch(self._locate(index, kbs, range(len(kbs))), kbs, out, retry=True)
        if again:  # their segment was compacted away between lookup and read
            self._fetch(self._locate(index, kbs, again), kbs, out, retry=False)
        return out

    def _sync(self, index: Index, txn: object) -> None:
        """Close the descriptors of segments removed since the last batch."""
        gen = index.generation(txn) if self.files.cached() else self._gen  # type: ignore[arg-type]
        if gen != self._gen:
            known = index.segment_table(txn)  # type: ignore[arg-type]
            for seg in self.files.cached():
                if seg not in known:
                    self.files.forget(seg)
            self._gen = gen

    def read_rows(self, index: Index, kbs: list[bytes], head_of: Callable[[memoryview], int | None]) -> Rows | None:
        """The found entries of a batch whose payloads all have one length, checked with numpy; else ``None``.

        The index rows (one ``txn.get`` per key) become one structured array; each
        segment's record heads (header, key and the first ``head`` payload bytes, ``head``
        being ``head_of(first payload)``) and the rest of every payload are gathered in
        one numpy call each, from a view of the mapping with an element starting at every
        byte; the heads are checked together, and each record's xxh3-64 over its payload
        is the only per-entry Python step. ``None`` (nothing reported) whenever the batch
        is not the common case: keys of mixed sizes, a key this process found damaged, a
        malformed index row, payloads of several lengths, a segment shorter than its rows,
        or a record that fails a check; :meth:`read` then reads it and reports what it finds.

        Raises:
            lmdb.Error: If the index cannot be read.
        """
        n = len(kbs)
        if not n:
            return None
        width = len(kbs[0])
        joined = b"".join(kbs)
        if len(joined) != n * width or (self.bad and not {kb for kb, _ in self.bad}.isdisjoint(kbs)):
            return None
        with index.begin() as txn:
            self._sync(index, txn)
            get = txn.get  # (a Cursor.getmulti is no faster on a batch not read just before)
            got = [get(kb) for kb in kbs]
        if None in got:  # some misses: keep the positions of the keys found
            positions = np.flatnonzero(np.fromiter((raw is not None for raw in got), bool, n))
        else:
            positions = np.arange(n)
        raws: list[bytes] = [raw for raw in got if raw is not None] if len(positions) < n else got  # type: ignore[assignment]
        m = len(raws)
        if not m:
            return Rows(positions, np.empty((0, 0), np.uint8), np.empty((0, 0), np.uint8))
        raw = b"".join(raws)
        if len(raw) != m * _ENTRY_SIZE or set(map(len, raws)) != {_ENTRY_SIZE}:
            return None
        entries = np.frombuffer(raw, dtype=_ENTRY_DTYPE)
        length = int(entries["len"][0])
        if length > self.max_entry or (entries["len"] != length).any():
            return None
        segs = entries["seg"]
        one = bool((segs == segs[0]).all())
        if one:
            groups = [(int(segs[0]), positions, entries["off"].astype(np.int64))]
        else:  # grouped by segment, in batch order within each
            by = np.argsort(segs, kind="stable")
            sorted_segs = segs[by]
            bounds = [0, *(np.flatnonzero(sorted_segs[1:] != sorted_segs[:-1]) + 1).tolist(), m]
            offs = entries["off"][by].astype(np.int64)
            groups = [(int(sorted_segs[g0]), by[g0:g1], offs[g0:g1]) for g0, g1 in itertools.pairwise(bounds)]
        skip = HEADER.size + width  # record header and key, then the payload
        views = []
        for seg, _, at in groups:
            end = int(at.max()) + skip + length
            try:
                view = self.files.view(seg, end)
            except OSError:  # the general path reads it again and reports what it finds
                return None
            if len(view) < end:
                return None
            views.append(view)
        start = int(groups[0][2][0]) + skip
        head = head_of(views[0][start : start + length])
        if head is None or not 0 <= head <= length:
            return None
        span, rest = skip + head, length - head
        heads = np.empty(m, f"V{span}")
        body = np.empty(m, f"V{rest}")
        checks = np.empty(m, np.uint64)
        found = kbs if m == n else [kbs[i] for i in positions.tolist()]
        seeds = [_digest(kb, length) for kb in found]  # each check's key part
        by_row = np.array(seeds, np.uint64) if not one else None
        where: slice | np.ndarray
        for (_, rows, at), view in zip(groups, views):
            # One element starting at every byte of the mapping: a gather by offsets copies records.
            size = len(view)
            if one:
                heads = np.ndarray((size - span + 1,), f"V{span}", view, 0, (1,))[at]
                body = np.ndarray((size - rest + 1,), f"V{rest}", view, 0, (1,))[at + span]
                where = slice(None)
            else:
                where = rows
                heads[rows] = np.ndarray((size - span + 1,), f"V{span}", view, 0, (1,))[at]
                body[rows] = np.ndarray((size - rest + 1,), f"V{rest}", view, 0, (1,))[at + span]
            # The record's checksum over its whole payload, read where it lies.
            checks[where] = [
                _digest(view[s : s + length], seed)
                for s, seed in zip((at + skip).tolist(), seeds if by_row is None else by_row[rows].tolist())
            ]
        head_rows = heads.view(np.uint8).reshape(m, span)
        stored = head_rows[:, : HEADER.size]
        keyed = np.frombuffer(joined, np.uint8).reshape(n, width)
        if not (
            (stored[:, :2] == _MAGIC).all()
            and (stored[:, 2] == width).all()
            and (stored[:, 3:7].copy().view("<u4").ravel() == length).all()
            and (head_rows[:, HEADER.size : skip] == (keyed if m == n else keyed[positions])).all()
            and (stored[:, 7:15].copy().view("<u8").ravel() == checks).all()
        ):
            return None
        return Rows(positions, head_rows[:, skip:], body.view(np.uint8).reshape(m, rest))

    def _locate(self, index: Index, kbs: list[bytes], positions: Sequence[int]) -> list[Found]:
        """Index rows of the keys at ``positions``, in file order."""
        found: list[Found] = []
        bad, limit = self.bad, self.max_entry
        with index.begin() as txn:
            self._sync(index, txn)
            get = txn.get  # the transaction's default table is the entries
            raws = [get(kbs[i]) for i in positions]
        for i, raw in zip(positions, raws):
            if raw is not None:
                kb = kbs[i]
                if bad and (kb, raw) in bad:
                    continue
                if len(raw) != _ENTRY_SIZE:
                    self.reject(kb, raw, "its index row is malformed")
                    continue
                seg, offset, length = _unpack(raw)
                if length > limit:
                    self.reject(kb, raw, f"its index row claims {length:,} bytes")
                else:
                    found.append((seg, offset, length, i, raw))
        found.sort()
        return found

    def _fetch(
        self, found: list[Found], kbs: list[bytes], out: list[bytes | memoryview | None], retry: bool
    ) -> list[int]:
        """Read and check the records of ``found`` into ``out``; return positions to look up again."""
        again: list[int] = []
        files = self.files
        try:
            failed = files.read_many(found, kbs, out)
        except OSError:
            failed = found
        for seg, offset, length, i, raw in failed:
            kb = kbs[i]
            path = files.path(seg)
            try:
                data = files.read(seg, offset, record_size(kb, length))
            except OSError as exc:
                self.report(Fault.READ, f"cannot read {path}: {exc}", f"r{seg}")
                continue
            if isinstance(data, str):
                if data == MISSING and retry:
                    again.append(i)
                elif data == "out of bounds":
                    self.reject(kb, raw, f"its index row points past the end of {path}")
                else:
                    self.report(Fault.SEGMENT, f"{path} is {data}; its entries are misses", f"s{seg}")
                    self.reject(kb, raw, None)
                continue
            payload = payload_of(data, kb, length)
            if payload is None:
                self.reject(kb, raw, f"its record in {path} fails its checksum")
            else:
                out[i] = payload
        return again

    def reject(self, kb: bytes, raw: bytes, reason: str | None) -> None:
        """Treat an entry as a miss from now on, report it once, remove it at the next write."""
        if (kb, raw) in self.bad:
            return
        if len(self.bad) >= _MAX_BAD:
            del self.bad[next(iter(self.bad))]
        self.bad[(kb, raw)] = None
        self.doomed[kb] = raw
        if reason is not None:
            self.report(Fault.CORRUPT, f"entry {decode_key(kb)} of {self.root} is a miss: {reason}", None)
