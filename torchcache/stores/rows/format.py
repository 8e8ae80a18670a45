"""The rows file on disk: where everything lies, its checked header, making and mapping it.

The file, little-endian::

    header    magic "TCROWS01", version u32, JSON length u32, length, row size,
              row offset in a slot, capacity (u64 each), the JSON header (the
              caller's, canonical), the xxh3_64 of all of these; then, 8-byte
              aligned, the number of slots handed out (u64)
    checks    one u64 per index, page-aligned: 0 while the row is not written,
              else the xxh3_64 of the row seeded by its index, lowest bit set
    slots     one u32 per index, page-aligned: 0 for none, else the slot + 1
    rows      ``capacity`` slots of ``stride`` bytes, page-aligned; a row sits at
              its offset in the slot, so that its byte ``head`` is 16-byte aligned

A file is made whole under a temporary name and linked into place, its header and
tables allocated (a full file system fails there, not in a later write). Nothing in it
is unpickled; the header is checked, then checked against the file's size, before
anything is mapped.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import struct
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from ...errors import CorruptEntryError
from ..files import create_whole, read_at

__all__ = ["MAGIC", "Geometry", "Mapped", "digest", "make_file", "map_file", "open_file", "read_header", "runs"]

#: The first bytes of every rows file.
MAGIC = b"TCROWS01"
_VERSION = 1
_HEAD = struct.Struct("<8sIIQQQQ")  # magic, version, JSON length, length, row size, row offset, capacity
_U64 = struct.Struct("<Q")
_PAGE = 4096
ALIGN = 16
_MAX_JSON = 1 << 20
MAX_ROW = 1 << 30
MAX_LENGTH = 1 << 50
_O_OPEN = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def _up(value: int, to: int) -> int:
    return -(-value // to) * to


def _encode(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


class Geometry(NamedTuple):
    """Where everything lies in a rows file (byte offsets), from its length, row size and header."""

    row_at: int
    stride: int
    claimed_at: int
    checks_at: int
    slots_at: int
    rows_at: int

    @classmethod
    def of(cls, length: int, row_size: int, head: int, header: dict[str, Any]) -> Geometry:
        """The geometry of a file of ``length`` indices and rows of ``row_size`` bytes.

        Args:
            length: Indices (the dataset's length).
            row_size: Bytes per row.
            head: The byte of a row that is to be 16-byte aligned (0: the row's start).
            header: The JSON header.

        Example:
            >>> Geometry.of(1000, 3070, 35, {"kind": "samples"})
            Geometry(row_at=13, stride=3088, claimed_at=80, checks_at=4096, slots_at=12288, rows_at=16384)
        """
        row_at = -head % ALIGN
        claimed_at = _up(_HEAD.size + len(_encode(header)) + 8, 8)
        checks_at = _up(claimed_at + 8, _PAGE)
        slots_at = checks_at + _up(8 * length, _PAGE)
        rows_at = slots_at + _up(4 * length, _PAGE)
        return cls(row_at, _up(row_at + row_size, ALIGN), claimed_at, checks_at, slots_at, rows_at)

    def capacity(self, max_bytes: int, length: int) -> int:
        """The slots a file of at most ``max_bytes`` bytes holds (at most ``length``; 0: not even its tables)."""
        return max(0, min(length, (max_bytes - self.rows_at) // self.stride))


def make_file(
    path: Path, header: dict[str, Any], length: int, row_size: int, head: int, capacity: int, allocate_rows: bool
) -> int | None:
    """Make a rows file at ``path``; a read-write descriptor of it, or ``None`` if a file is already there.

    Raises:
        OSError: If it cannot be made (a read-only directory, a full disk).
        ValueError: If a size is out of range.
    """
    if not (0 < row_size <= MAX_ROW and 0 <= head < MAX_ROW and 0 <= capacity <= length <= MAX_LENGTH):
        raise ValueError(f"invalid rows file: {length} indices, {capacity} slots of {row_size} bytes")
    text = _encode(header)
    g = Geometry.of(length, row_size, head, header)
    size = g.rows_at + capacity * g.stride
    first = _HEAD.pack(MAGIC, _VERSION, len(text), length, row_size, g.row_at, capacity) + text
    allocated = size if allocate_rows else g.rows_at
    mode = 0o644 if allocate_rows else 0o600
    return create_whole(path, size, first + _U64.pack(xxhash.xxh3_64_intdigest(first)), allocated, mode)


def open_file(path: Path) -> int:
    """A descriptor of the file at ``path``: read-write if allowed, else read-only.

    Raises:
        OSError: If it cannot be opened (``FileNotFoundError`` if there is none).
    """
    try:
        return os.open(path, _O_OPEN)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) or exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
        return os.open(path, (_O_OPEN & ~os.O_RDWR) | os.O_RDONLY)


def read_header(fd: int) -> tuple[dict[str, Any], int, int, int, int]:
    """The checked header of an open rows file: its JSON, length, row size, head and capacity.

    Raises:
        CorruptEntryError: If it is not a valid header of this version.
    """
    head = read_at(fd, _HEAD.size)
    if len(head) < _HEAD.size:
        raise CorruptEntryError("its header is cut short")
    magic, version, json_len, length, row_size, row_at, capacity = _HEAD.unpack(head)
    if magic != MAGIC or version != _VERSION:
        raise CorruptEntryError("it is not a rows file of this version")
    if json_len > _MAX_JSON or not 0 < row_size <= MAX_ROW or row_at >= ALIGN or not capacity <= length <= MAX_LENGTH:
        raise CorruptEntryError("its header gives sizes out of range")
    rest = read_at(fd, json_len + 8, _HEAD.size)
    if len(rest) < json_len + 8:
        raise CorruptEntryError("its header is cut short")
    text = rest[:json_len]
    if _U64.unpack_from(rest, json_len)[0] != xxhash.xxh3_64_intdigest(head + text):
        raise CorruptEntryError("its header fails its checksum")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise CorruptEntryError("its header is not valid JSON") from None
    if not isinstance(header, dict) or _encode(header) != text:
        raise CorruptEntryError("its header is not a JSON object in canonical form")
    return header, length, row_size, -row_at % ALIGN, capacity


class Mapped(NamedTuple):
    """A rows file mapped into memory (read-only), and the views of its parts."""

    map: mmap.mmap
    claimed: np.ndarray[Any, np.dtype[np.uint64]]
    checks: np.ndarray[Any, np.dtype[np.uint64]]
    slots: np.ndarray[Any, np.dtype[np.uint32]]
    rows: np.ndarray[Any, np.dtype[np.uint8]]
    gatherable: torch.Tensor  # ``rows`` as a tensor: gathered on every core torch has (``np.take`` uses one)


def map_file(fd: int, path: Path | None, g: Geometry, length: int, capacity: int) -> Mapped:
    """Map a rows file (``fd`` -1: anonymous memory of its size, writable and shared with forked children).

    Raises:
        CorruptEntryError: If the file is not a regular file, or shorter than its header says.
    """
    size = g.rows_at + capacity * g.stride
    if fd < 0:
        whole = mmap.mmap(-1, size)
    else:
        st = os.fstat(fd)  # another user's file is read as well (a shared features cache): the map is read-only
        if not stat.S_ISREG(st.st_mode):
            raise CorruptEntryError(f"{path} is not a regular file")
        if st.st_size < size:
            raise CorruptEntryError(f"{path} is cut short ({st.st_size:,} of {size:,} bytes)")
        whole = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    rows = np.ndarray((capacity, g.stride), np.uint8, buffer=whole, offset=g.rows_at)
    with warnings.catch_warnings():  # torch says once that the map is read-only; the tensor is only ever read
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        gatherable = torch.from_numpy(rows)
    return Mapped(
        whole,
        np.ndarray((1,), np.uint64, buffer=whole, offset=g.claimed_at),
        np.ndarray((length,), np.uint64, buffer=whole, offset=g.checks_at),
        np.ndarray((length,), np.uint32, buffer=whole, offset=g.slots_at),
        rows,
        gatherable,
    )


def data_spans(fd: int, at: int, length: int) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges of the ``length`` 8-byte checks at ``at`` in file ``fd`` that hold data.

    The holes of a sparse file read as zeros (rows not written) and are skipped without
    being read: a planted file claiming 2**40 rows costs what it really holds. Every check
    is in one range where the file system cannot tell (``fd`` -1: memory).
    """
    whole, end = [(0, length)], at + 8 * length
    if fd < 0 or not hasattr(os, "SEEK_DATA"):
        return whole
    spans, pos = [], at
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos
                break
            return whole
        if data >= end:
            break
        spans.append(((data - at) // 8, min(length, -(-(hole - at) // 8))))
        pos = hole
    return spans


def digest(row: Any, index: int) -> int:
    """The check of a row: its xxh3_64 seeded by its index, lowest bit set (0 means "not written")."""
    return xxhash.xxh3_64_intdigest(row, index) | 1


def runs(indices: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """``(start, stop)`` positions of the runs of consecutive values in ``indices`` (each one more than the last).

    Example:
        >>> runs(np.array([3, 4, 5, 9, 10, 20]))
        [(0, 3), (3, 5), (5, 6)]
    """
    if not len(indices):
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = [0, *breaks.tolist()]
    return list(zip(starts, [*breaks.tolist(), len(indices)], strict=True))
