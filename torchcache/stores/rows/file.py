"""Rows of one size by dataset index, in one file, checked on every read.

The one store of fixed-size rows: the features file of :func:`~torchcache.extract_features`
and the RAM tier's file of a dataset's samples both use it. A row is any run of
``row_size`` bytes (a features row, a sample's frame); the file (:mod:`.format`) does
not look inside.

A batch is read with one gather of the checks, the slots and the rows from a read-only
map, then one xxh3 per row: a row is served only when its check matches, so a row
whose writer was killed, damaged on disk or never written is a miss, never a wrong
row. A writer takes an exclusive ``flock``, gives each new index the next slot, then
writes with ``pwrite`` the rows, and only then their checks. A row marked again after
damage is written into its own slot (a new one if the table that names it was damaged).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from ...errors import CorruptEntryError, StoreError
from ..files import pwrite_all
from .format import Geometry, Mapped, data_spans, digest, make_file, map_file, open_file, read_header, runs

__all__ = ["RowsFile", "RowsRead"]


class RowsRead(NamedTuple):
    """The rows of a batch of indices, as :meth:`RowsFile.read` gathered them.

    ``found`` are the positions (into the indices asked for) whose rows passed their
    check, ascending; ``rows`` holds those rows, a new ``(len(found), stride)`` uint8
    array, each row at :attr:`RowsFile.row_at` of its line. The other positions are
    ``missing`` (not written) or ``damaged`` (failing their check).
    """

    found: np.ndarray[Any, np.dtype[np.int64]]
    rows: np.ndarray[Any, np.dtype[np.uint8]]
    missing: list[int]
    damaged: list[int]


class RowsFile:
    """The rows of indices ``0 .. length - 1``, all of one size, in a file (or in anonymous memory).

    Use :meth:`create`, :meth:`open` or :meth:`in_memory`. Every method is safe from several
    threads and processes at once. The object pickles as its path and reopens the file
    where it is unpickled (a DataLoader worker).

    Attributes:
        path: The file (``None`` for rows kept in memory).
        header: The caller's JSON header.
        length: Indices.
        row_size: Bytes per row.
        capacity: Slots: rows the file holds at most.
        size: The file's size in bytes.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "rows.tcrows"
        >>> rows = RowsFile.create(path, {"what": "example"}, length=10, row_size=4)
        >>> rows.write(np.array([3, 7]), np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.uint8))
        0
        >>> got = RowsFile.open(path).read(np.array([7, 3, 5]))
        >>> got.found.tolist(), got.rows[:, :4].tolist(), got.missing, got.damaged
        ([0, 1], [[5, 6, 7, 8], [1, 2, 3, 4]], [2], [])
    """

    def __init__(
        self, path: Path | None, fd: int, header: dict[str, Any], length: int, row_size: int, head: int, capacity: int
    ) -> None:
        self.path, self.header = path, header
        self.length = length
        self.row_size = row_size
        self.head = head
        self.capacity = capacity
        self.geometry = Geometry.of(length, row_size, head, header)
        self.row_at, self.stride = self.geometry.row_at, self.geometry.stride
        self.size = self.geometry.rows_at + capacity * self.stride
        self._lock = threading.Lock()
        self._mapped: Mapped | None = map_file(fd, path, self.geometry, length, capacity)
        self._fd = fd  # owned from here on (a failed map leaves it to the caller, who closes it)

    def __repr__(self) -> str:
        where = "memory" if self.path is None else str(self.path)
        return f"RowsFile({where!r}, {self.count()} of {self.length} rows of {self.row_size} bytes)"

    # -- making and opening -----------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: Path,
        header: dict[str, Any],
        length: int,
        row_size: int,
        *,
        head: int = 0,
        capacity: int | None = None,
        allocate_rows: bool = True,
    ) -> RowsFile:
        """Make the file (or open the one another process made first at ``path``).

        Args:
            path: Where.
            header: JSON-able metadata of the caller, kept in the file's header.
            length: Indices.
            row_size: Bytes per row.
            head: The byte of a row to align to 16 bytes.
            capacity: Slots (default: ``length``).
            allocate_rows: Allocate the rows' blocks now too (a full disk fails here); else
                only the header and tables are, and the rows take room as they are written.

        Raises:
            OSError: If it cannot be made (a read-only directory, a full disk).
            CorruptEntryError: If another process made a file at ``path`` that is invalid.
            ValueError: If a size is out of range.
        """
        capacity = length if capacity is None else capacity
        fd = make_file(path, header, length, row_size, head, capacity, allocate_rows)
        if fd is None:  # another process made it first: use that one
            return cls.open(path)
        try:
            return cls(path, fd, header, length, row_size, head, capacity)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def in_memory(cls, header: dict[str, Any], length: int, row_size: int, head: int = 0) -> RowsFile:
        """Rows in anonymous memory (shared with forked workers, gone with the process)."""
        return cls(None, -1, header, length, row_size, head, length)

    @classmethod
    def open(cls, path: Path) -> RowsFile:
        """Open the file at ``path``, read-write if allowed, else read-only.

        Raises:
            FileNotFoundError: If there is none.
            CorruptEntryError: If it is not a valid rows file (the message says why).
            OSError: If it cannot be opened.
        """
        fd = open_file(path)
        try:
            header, length, row_size, head, capacity = read_header(fd)
            return cls(path, fd, header, length, row_size, head, capacity)
        except BaseException:
            os.close(fd)
            raise

    def __getstate__(self) -> dict[str, Any]:
        if self.path is None:
            raise TypeError("rows kept in memory cannot be sent to another process; use fork or num_workers=0")
        return {"path": self.path, "header": self.header}

    def __setstate__(self, state: dict[str, Any]) -> None:
        opened = RowsFile.open(state["path"])
        if opened.header != state["header"]:
            opened.close()
            raise CorruptEntryError(f"{state['path']} was replaced by another rows file")
        self.__dict__.update(opened.__dict__)
        opened._fd, opened._mapped = -1, None  # this object owns the descriptor now

    def __del__(self) -> None:  # a file dropped without close(): its descriptor goes with it (its map with the map)
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)

    # -- reads ------------------------------------------------------------------------
    def count(self) -> int:
        """Rows written (the holes of a sparse file are not read: they hold no check)."""
        mapped, spans = self._mapped, data_spans(self._fd, self.geometry.checks_at, self.length)
        return 0 if mapped is None else sum(int(np.count_nonzero(mapped.checks[a:b])) for a, b in spans)

    def written(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The indices of the rows written, ascending (the holes of a sparse file are not read)."""
        mapped, spans = self._mapped, data_spans(self._fd, self.geometry.checks_at, self.length)
        parts = [] if mapped is None else [np.flatnonzero(mapped.checks[a:b]) + a for a, b in spans]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)

    __len__ = count

    def __contains__(self, index: object) -> bool:
        if self._mapped is None or type(index) is not int or not 0 <= index < self.length:
            return False
        return bool(self._mapped.checks[index])

    @property
    def nbytes(self) -> int:
        """Bytes the file takes: its header and tables, and the slots handed out."""
        claimed = 0 if self._mapped is None else min(int(self._mapped.claimed[0]), self.capacity)
        return 0 if self._mapped is None else self.geometry.rows_at + claimed * self.stride

    def missing(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The indices of the rows not written, ascending."""
        if self._mapped is None:
            return np.arange(self.length, dtype=np.int64)
        return np.flatnonzero(self._mapped.checks == 0).astype(np.int64)

    def checks(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """The checks of the rows of ``indices`` as the file holds them now (0: not written)."""
        return np.zeros(len(indices), np.uint64) if self._mapped is None else self._mapped.checks[indices]

    def row_offset(self, index: int) -> int | None:
        """Where the row of ``index`` lies in the file (``None``: it has no slot)."""
        slot = 0 if self._mapped is None or not 0 <= index < self.length else int(self._mapped.slots[index])
        return None if not 0 < slot <= self.capacity else self.geometry.rows_at + (slot - 1) * self.stride + self.row_at

    def read(self, indices: np.ndarray[Any, Any]) -> RowsRead:
        """Gather and check the rows of ``indices`` (each in ``0 .. length - 1``).

        Raises:
            StoreError: If the file is closed, or was cut short since it was opened.
        """
        mapped = self._views()
        checks = mapped.checks[indices]
        if checks.all():  # usually: every row written
            present, missing, wanted = np.arange(len(indices)), [], indices
        else:
            present = np.flatnonzero(checks)
            missing = np.flatnonzero(checks == 0).tolist()
            if not len(present):
                return RowsRead(present, np.empty((0, self.stride), np.uint8), missing, [])
            wanted, checks = indices[present], checks[present]
        rows = _gather(mapped, mapped.slots[wanted], self.capacity)
        bad = _failing(rows[:, self.row_at : self.row_at + self.row_size], wanted, checks)  # a view per row
        if not bad:
            return RowsRead(present, rows, missing, [])
        damaged: list[int] = []
        for j in bad:  # read again: on a processor that orders stores weakly, a check may show before its row
            index = int(wanted[j])
            check, slot = int(mapped.checks[index]), int(mapped.slots[index]) - 1
            row = mapped.rows[slot].copy() if 0 <= slot < self.capacity else None
            if row is not None and check and digest(row[self.row_at : self.row_at + self.row_size], index) == check:
                rows[j] = row
            else:
                (damaged if check else missing).append(int(present[j]))
        if damaged or len(missing) > len(indices) - len(present):
            keep = np.isin(present, [*damaged, *missing], invert=True)
            present, rows = present[keep], rows[keep]
            missing.sort()
        return RowsRead(present, rows, missing, damaged)

    def damaged(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The indices of the written rows that fail their check, ascending (reads every written row).

        Raises:
            StoreError: If the file is closed, or was cut short since it was opened.
        """
        mapped = self._views()
        written = self.written()
        slots = mapped.slots[written].astype(np.int64) - 1
        outside = (slots < 0) | (slots >= self.capacity)
        in_map = map(mapped.rows[:, self.row_at : self.row_at + self.row_size].__getitem__, np.where(outside, 0, slots))
        failing = _failing(in_map, written, mapped.checks[written]) if self.capacity else []  # hashed in the map
        again = written[sorted({*failing, *np.flatnonzero(outside).tolist()})]
        return np.asarray(again[self.read(again).damaged], np.int64)  # read again, as read() does

    def _views(self) -> Mapped:
        mapped = self._mapped
        if mapped is None:
            raise StoreError("the rows file is closed")
        if self.path is not None and os.fstat(self._fd).st_size < self.size:
            raise StoreError(f"{self.path} was cut short while open")
        return mapped

    # -- writes -----------------------------------------------------------------------
    def write(self, indices: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], max_bytes: int | None = None) -> int:
        """Write the rows of ``indices`` that are not written yet, then mark them.

        Args:
            indices: Indices in ``0 .. length - 1``.
            rows: ``(len(indices), row_size)`` uint8, one row per index.
            max_bytes: The most bytes the file may take (see :attr:`nbytes`): new rows get
                no slot beyond it. Default: its capacity.

        Returns:
            How many rows found no room (0: every row not yet written was written).

        Raises:
            OSError: If the file cannot be written (read-only, a full disk).
        """
        mapped = self._views()
        indices = np.asarray(indices, np.int64)
        with self._locked():
            todo = np.flatnonzero(mapped.checks[indices] == 0)
            if len(todo) > 1:
                unique, once = np.unique(indices[todo], return_index=True)
                if len(unique) < len(todo):  # an index given twice: written once
                    todo = np.sort(todo[once])
            targets = indices[todo]
            slots = mapped.slots[targets].astype(np.int64) - 1
            for k in np.flatnonzero(slots >= 0).tolist():  # written again: into its slot, if the slot is its own
                if slots[k] >= self.capacity or np.count_nonzero(mapped.slots == slots[k] + 1) > 1:
                    slots[k] = -1  # a damaged table: a new slot
            new = np.flatnonzero(slots < 0)
            first = int(mapped.claimed[0])
            limit = self.capacity if max_bytes is None else self.geometry.capacity(max_bytes, self.capacity)
            if len(new) > limit - first:  # no room: slots that no index names (a damaged table) are reused
                new = new[_reuse_slots(self, mapped.slots, targets, slots, new, min(first, limit)) :]
            granted = max(0, min(len(new), limit - first))
            unstored = len(new) - granted
            if unstored:  # no room for the last new ones: they are left out
                keep = np.isin(np.arange(len(todo)), new[granted:], invert=True)
                todo, targets, slots, new = todo[keep], targets[keep], slots[keep], new[:granted]
            if granted:  # the next slots, named in the table before anything is written to them
                slots[new] = np.arange(first, first + granted)
                self._write_at(self.geometry.claimed_at, np.asarray([first + granted], "<u8"))
                self._write_column(self.geometry.slots_at, 4, targets[new], (slots[new] + 1).astype("<u4"))
            if not len(todo):
                return unstored
            if self.row_at == 0 and rows.shape == (len(todo), self.stride) and rows.flags.c_contiguous:
                block = lines = rows  # every row, laid out as the file's lines: written as given
            else:
                block = np.zeros((len(todo), self.stride), np.uint8)
                lines = block[:, self.row_at : self.row_at + self.row_size]
                lines[:] = rows if len(todo) == len(rows) else rows[todo]
            checks = _checks(lines, targets)
            for start, stop in runs(slots):  # rows, a run of consecutive slots at a time (new ones: one run)
                self._write_at(self.geometry.rows_at + int(slots[start]) * self.stride, block[start:stop])
            self._write_column(self.geometry.checks_at, 8, targets, checks.astype("<u8"))
        return unstored

    def unmark(self, indices: list[int] | np.ndarray[Any, Any]) -> None:
        """Mark rows as not written (damaged ones), so that they are written again.

        Raises:
            OSError: If the file cannot be written.
        """
        if len(targets := np.asarray(indices, np.int64)):
            with self._locked():
                self._write_column(self.geometry.checks_at, 8, targets, np.zeros(len(targets), "<u8"))

    def _write_column(self, at: int, width: int, indices: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> None:
        """Write one table entry of ``width`` bytes per index, a run of consecutive indices at a time."""
        order = np.argsort(indices, kind="stable")
        for start, stop in runs(indices := indices[order]):
            self._write_at(at + width * int(indices[start]), values[order[start:stop]])

    def _write_at(self, offset: int, data: np.ndarray[Any, Any]) -> None:
        raw = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]
        if self._fd >= 0:
            pwrite_all(self._fd, raw, offset)
        elif self._mapped is not None:  # rows in memory
            self._mapped.map[offset : offset + len(raw)] = raw

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._fd >= 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if self._fd >= 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap and close the file (rows already read stay valid: they are copies)."""
        with self._lock:
            mapped, self._mapped = self._mapped, None
            if mapped is not None:
                with contextlib.suppress(BufferError):  # arrays still view it: unmapped when they go
                    mapped.map.close()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _gather(mapped: Mapped, slots: np.ndarray[Any, Any], capacity: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A new array of the rows in ``slots`` (each the slot + 1, as the table holds them), in one gather.

    A slot of 0 (none) or past the end reads another row, which fails its check.
    """
    if not capacity:
        return np.zeros((len(slots), mapped.rows.shape[1]), np.uint8)
    at = slots.astype(np.int64)
    np.clip(at - 1, 0, capacity - 1, out=at)
    return torch.index_select(mapped.gatherable, 0, torch.from_numpy(at)).numpy()  # type: ignore[no-any-return]


def _checks(rows: Iterable[Any], indices: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Each row's check (:func:`~.format.digest`), one hash call per row and nothing else per row.

    ``rows`` is a 2-d array (hashed row by row: iterating it makes the views in C) or a list
    of buffers.
    """
    got = np.fromiter(map(xxhash.xxh3_64_intdigest, rows, indices.tolist()), np.uint64, len(indices))
    return got | np.uint64(1)


def _failing(rows: Iterable[Any], indices: np.ndarray[Any, Any], checks: np.ndarray[Any, Any]) -> list[int]:
    """The positions ``j`` whose row (the ``j``-th buffer of ``rows``) does not match ``checks[j]``."""
    differ = _checks(rows, indices) != checks
    return np.flatnonzero(differ).tolist() if differ.any() else []  # type: ignore[no-any-return]


def _reuse_slots(
    file: RowsFile,
    table: np.ndarray[Any, Any],
    targets: np.ndarray[Any, Any],
    slots: np.ndarray[Any, Any],
    new: np.ndarray[Any, Any],
    upto: int,
) -> int:
    """Give the rows ``new`` the slots below ``upto`` that no index names in ``table``; return how many got one.

    Two indices named one slot (a damaged table): one of them is written again, and the
    slot it named before is free, though every slot was claimed.
    """
    free = np.setdiff1d(np.arange(upto), table[table > 0].astype(np.int64) - 1)[: len(new)]
    reused = new[: len(free)]
    slots[reused] = free
    file._write_column(file.geometry.slots_at, 4, targets[reused], (free + 1).astype("<u4"))
    return len(reused)
