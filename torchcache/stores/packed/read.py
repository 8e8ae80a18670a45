"""Batched reads of a packed store: one index pass, then ``pread`` in file order.

The index rows of a batch are read in one LMDB read transaction, checked for their
exact size and a length within bounds, sorted by segment and offset, and read with one
``pread`` each on cached descriptors. A record that fails its checks, or an index row
that points nowhere, makes that entry a miss from then on, reported once, and it is
removed from the index at this process's next write. A key whose segment vanished
between lookup and read (compacted away) is looked up once more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .format import decode_key, payload_of, record_size
from .index import ENTRY, Index
from .segments import MISSING, SegmentFiles

__all__ = ["EntryReader"]

_MAX_BAD = 1 << 16
_unpack = ENTRY.unpack
_ENTRY_SIZE = ENTRY.size
Found = tuple[int, int, int, int, bytes]  # segment, offset, payload length, position in the batch, index row
Report = Callable[[str, str, "str | None"], None]


class EntryReader:
    """Reads batches of entries for one process, and remembers the damaged ones.

    Args:
        root: The store directory (for messages).
        files: This process's segment files.
        max_entry: The largest length an index row may claim.
        report: Called with ``(kind, message, once)``: a message with the same ``once``
            token is given only the first time.
    """

    def __init__(self, root: str, files: SegmentFiles, max_entry: int, report: Report) -> None:
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

    def _locate(self, index: Index, kbs: list[bytes], positions: Sequence[int]) -> list[Found]:
        """Index rows of the keys at ``positions``, in file order."""
        found: list[Found] = []
        bad, limit = self.bad, self.max_entry
        with index.begin() as txn:
            gen = index.generation(txn) if self.files.cached() else self._gen
            if gen != self._gen:  # segments were removed: close their descriptors
                known = index.segment_table(txn)
                for seg in self.files.cached():
                    if seg not in known:
                        self.files.forget(seg)
                self._gen = gen
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
                self.report("read", f"cannot read {path}: {exc}", f"r{seg}")
                continue
            if isinstance(data, str):
                if data == MISSING and retry:
                    again.append(i)
                elif data == "out of bounds":
                    self.reject(kb, raw, f"its index row points past the end of {path}")
                else:
                    self.report("segment", f"{path} is {data}; its entries are misses", f"s{seg}")
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
            self.report("corrupt", f"entry {decode_key(kb)} of {self.root} is a miss: {reason}", None)
