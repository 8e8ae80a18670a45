"""The file of a features cache: one row of fixed size per dataset index, checked on every read.

The file (``features.tcfeat``)::

    header     magic, version, JSON length, dataset length, row stride, checks and rows
               offsets, file size (little-endian), the JSON header (the sample layout,
               the keys and names it was made for), and the xxh3_64 of all of these
    checks     one uint64 per index: 0 while the row is not written, else the row's
               xxh3_64 seeded by its index, with the lowest bit set
    rows       ``stride`` bytes per index, at ``rows_at + index * stride``

A batch of indices is read with one gather of the checks and one of the rows from a
read-only map of the file, then one xxh3 per row: a row is served only when its check
matches, so a row whose writer was killed (written, not yet marked), damaged on disk,
or never computed is a miss, never a wrong sample. Writers compute outside any lock,
then, under an exclusive ``flock``, write the rows still unmarked with ``pwrite`` and
only then their checks; a marked row is never written again, so readers need no lock.
The file is made whole under a temporary name, with its blocks allocated, and linked
into place: no process sees a partial header, and a full disk is an error when it is
made, not a fault while it is written. The header is parsed as JSON and checked
against the file's size; nothing in the file is unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ...errors import CorruptEntryError, StoreError
from ..files import create_whole, pwrite_all, read_at
from .layout import SampleLayout

__all__ = ["FEATURES_NAME", "FeatureFile", "runs"]

FEATURES_NAME = "features.tcfeat"
_MAGIC = b"TCFEATS1"
_VERSION = 1
_HEAD = struct.Struct("<8sIIQQQQQ")  # magic, version, JSON length, length, stride, checks at, rows at, size
_U64 = struct.Struct("<Q")
_PAGE = 4096
_MAX_JSON = 1 << 20
_MAX_FILE = 1 << 50
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def _up(value: int, to: int) -> int:
    return -(-value // to) * to


def _layout_of(length: int, stride: int, json_len: int) -> tuple[int, int, int]:
    """The offsets of the checks and the rows, and the file's size."""
    checks_at = _up(_HEAD.size + json_len + 8, _PAGE)
    rows_at = checks_at + _up(8 * length, _PAGE)
    return checks_at, rows_at, rows_at + length * stride


class FeatureFile:
    """The rows of a features cache, in a file (or in anonymous memory when no file can be made).

    Use :meth:`create` or :meth:`open`. Every method is safe from several threads and
    processes at once. The object pickles as its path and reopens the file where it is
    unpickled (a DataLoader worker).

    Attributes:
        path: The file (``None`` for rows kept in memory).
        header: The JSON header: ``layout``, ``length`` and the keys it was made for.
        layout: The sample layout of the rows.
        length: Rows (the dataset's length).
    """

    def __init__(self, path: Path | None, fd: int, header: dict[str, Any], writable: bool) -> None:
        self.path = path
        self.header = header
        self.layout = SampleLayout.from_json(header.get("layout"))
        self.length: int = header["length"]
        self.stride = self.layout.stride
        self._fd = fd
        self._writable = writable
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._map: mmap.mmap | None = None
        self._checks: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._rows: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self.checks_at, self.rows_at, self.size = _layout_of(self.length, self.stride, len(_encode(header)))
        self._map_rows()

    def __repr__(self) -> str:
        where = "memory" if self.path is None else str(self.path)
        return f"FeatureFile({where!r}, {self.length} rows of {self.stride} bytes, {self.count()} written)"

    # -- making and opening -----------------------------------------------------------
    @classmethod
    def create(cls, path: Path, header: dict[str, Any]) -> FeatureFile:
        """Make the file for ``header`` (or open the one another process made first).

        Raises:
            OSError: If it cannot be made (a read-only directory, a full disk).
            CorruptEntryError: If another process made a file at ``path`` that is invalid.
        """
        text = _encode(header)
        length, stride = header["length"], header["layout"]["stride"]
        checks_at, rows_at, size = _layout_of(length, stride, len(text))
        head = _HEAD.pack(_MAGIC, _VERSION, len(text), length, stride, checks_at, rows_at, size) + text
        fd = create_whole(path, size, head + _U64.pack(xxhash.xxh3_64_intdigest(head)))
        if fd is None:  # another process made it first: use that one
            return cls.open(path)
        try:
            return cls(path, fd, header, writable=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def in_memory(cls, header: dict[str, Any]) -> FeatureFile:
        """Rows for ``header`` in anonymous memory (shared with forked workers, gone with the process)."""
        return cls(None, -1, header, writable=True)

    @classmethod
    def open(cls, path: Path) -> FeatureFile:
        """Open the file at ``path``, read-write if allowed, else read-only.

        Raises:
            FileNotFoundError: If there is no file.
            CorruptEntryError: If it is not a valid features file (the message says why).
            OSError: If it cannot be opened.
        """
        writable = True
        try:
            fd = os.open(path, (_O_READ & ~os.O_RDONLY) | os.O_RDWR)
        except (PermissionError, OSError) as exc:
            if isinstance(exc, FileNotFoundError) or exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            fd, writable = os.open(path, _O_READ), False
        try:
            header = _read_header(fd)
            made = cls(path, fd, header, writable)
        except BaseException:
            os.close(fd)
            raise
        return made

    def _map_rows(self) -> None:
        if self.path is None:
            self._map = mmap.mmap(-1, self.size)
        else:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise CorruptEntryError(f"{self.path} is not a regular file of this user")
            if st.st_size < self.size:
                raise CorruptEntryError(f"{self.path} is cut short ({st.st_size} of {self.size} bytes)")
            self._map = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        self._checks = np.ndarray((self.length,), np.uint64, buffer=self._map, offset=self.checks_at)
        self._rows = np.ndarray((self.length, self.stride), np.uint8, buffer=self._map, offset=self.rows_at)

    def __getstate__(self) -> dict[str, Any]:
        if self.path is None:
            raise TypeError("features kept in memory cannot be sent to another process; use fork or num_workers=0")
        return {"path": self.path, "header": self.header}

    def __setstate__(self, state: dict[str, Any]) -> None:
        opened = FeatureFile.open(state["path"])
        if opened.header != state["header"]:
            opened.close()
            raise CorruptEntryError(f"{state['path']} was replaced by another features file")
        self.__dict__.update(opened.__dict__)

    # -- reads ------------------------------------------------------------------------
    def count(self) -> int:
        """Rows written."""
        checks = self._checks
        return 0 if checks is None else int(np.count_nonzero(checks))

    def missing(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The indices of the rows not written, ascending."""
        checks = self._checks
        if checks is None:
            return np.arange(self.length, dtype=np.int64)
        return np.flatnonzero(checks == 0).astype(np.int64)

    def checks(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """The checks of the rows of ``indices`` as the file holds them now (0: not written)."""
        checks = self._checks
        return np.zeros(len(indices), np.uint64) if checks is None else checks[indices]

    def damaged(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The indices of the written rows that fail their check, ascending (reads the whole file, copying nothing).

        Raises:
            StoreError: If the file is closed or was cut short since it was opened.
        """
        checks_view, rows_view = self._checks, self._rows
        if checks_view is None or rows_view is None:
            raise StoreError("the features file is closed")
        if self.path is not None and os.fstat(self._fd).st_size < self.size:
            raise StoreError(f"{self.path} was cut short while open")
        digest, stride = xxhash.xxh3_64_intdigest, self.stride
        checks = checks_view.tolist()
        with rows_view.reshape(-1).data as view:  # released before the file can close
            bad = [
                index
                for index, check in enumerate(checks)
                if check and digest(view[index * stride : (index + 1) * stride], index) | 1 != check
            ]
        if bad:  # read again, as read() does: a check may show before its row on some processors
            _, _, still = self.read(np.asarray(bad, np.int64))
            bad = [bad[j] for j in still]
        return np.asarray(bad, np.int64)

    def read(self, indices: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], list[int], list[int]]:
        """Gather and check the rows of ``indices`` (in range).

        Returns:
            The rows (a new ``(len(indices), stride)`` uint8 array), the positions whose
            rows are not written, and the positions whose rows fail their check (damaged).

        Raises:
            StoreError: If the file was cut short since it was opened.
        """
        checks_view, rows_view = self._checks, self._rows
        if checks_view is None or rows_view is None:
            raise StoreError("the features file is closed")
        if self.path is not None and os.fstat(self._fd).st_size < self.size:
            raise StoreError(f"{self.path} was cut short while open")
        checks = checks_view[indices]
        rows = np.take(rows_view, indices, axis=0)
        stride = self.stride
        view = rows.reshape(-1).data
        digest = xxhash.xxh3_64_intdigest
        missing: list[int] = []
        bad: list[int] = []
        for j, (index, check, start) in enumerate(
            zip(indices.tolist(), checks.tolist(), range(0, len(indices) * stride, stride))
        ):
            if digest(view[start : start + stride], index) | 1 != check:
                (bad if check else missing).append(j)
        if bad:  # read again: on a processor that orders stores weakly, a check may show before its row
            still = []
            for j in bad:
                index = int(indices[j])
                check, row = int(checks_view[index]), rows_view[index].copy()
                if check and digest(row, index) | 1 == check:
                    rows[j] = row
                elif check:
                    still.append(j)
                else:
                    missing.append(j)
            bad = still
        return rows, missing, bad

    # -- writes -----------------------------------------------------------------------
    def write(self, indices: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> int:
        """Write the rows of ``indices`` that are not written yet, then mark them; how many were written.

        Raises:
            OSError: If the file cannot be written (read-only, a full disk).
        """
        checks_view = self._checks
        if checks_view is None:
            raise StoreError("the features file is closed")
        if not self._writable:
            raise OSError(errno.EROFS, f"{self.path} is open read-only")
        digest = xxhash.xxh3_64_intdigest
        with self._locked():
            todo = np.flatnonzero(checks_view[indices] == 0)
            if not len(todo):
                return 0
            whole = len(todo) == len(indices)  # the common case: no copy
            targets = indices if whole else indices[todo]
            block = np.ascontiguousarray(rows if whole else rows[todo])
            flat, stride = memoryview(block.reshape(-1)), block.shape[1]  # type: ignore[arg-type]
            samples = (flat[at : at + stride] for at in range(0, len(todo) * stride, stride))
            checks = np.fromiter(map(digest, samples, targets.tolist()), np.uint64, len(todo)) | np.uint64(1)
            spans = runs(targets)
            for start, stop in spans:  # the rows first, then their checks
                first = int(targets[start])
                self._write_at(self.rows_at + first * self.stride, block[start:stop])
            for start, stop in spans:
                self._write_at(self.checks_at + 8 * int(targets[start]), checks[start:stop])
        return len(todo)

    def unmark(self, indices: list[int]) -> None:
        """Mark rows as not written (damaged ones), so that they are computed again.

        Raises:
            OSError: If the file cannot be written.
        """
        zero = np.zeros(1, np.uint64)
        with self._locked():
            for index in indices:
                self._write_at(self.checks_at + 8 * index, zero)

    def _write_at(self, offset: int, data: np.ndarray[Any, Any]) -> None:
        raw = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]
        if self._fd < 0:
            assert self._map is not None
            self._map[offset : offset + len(raw)] = raw
        else:
            pwrite_all(self._fd, raw, offset)

    @contextlib.contextmanager
    def _locked(self) -> Any:
        with self._lock:
            if self._fd < 0:
                yield
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap and close the file (rows already read stay valid: they are copies)."""
        with self._lock:
            self._checks = self._rows = None
            if self._map is not None:
                with contextlib.suppress(BufferError):
                    self._map.close()
                self._map = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _encode(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _read_header(fd: int) -> dict[str, Any]:
    """The checked JSON header of an open features file.

    Raises:
        CorruptEntryError: If it is not a valid header of this version.
    """
    head = read_at(fd, _HEAD.size)
    if len(head) < _HEAD.size:
        raise CorruptEntryError("its header is cut short")
    magic, version, json_len, length, stride, checks_at, rows_at, size = _HEAD.unpack(head)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptEntryError("it is not a features file of this version")
    if json_len > _MAX_JSON or length > _MAX_FILE or stride > _MAX_FILE:
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
    if not isinstance(header, dict) or header.get("length") != length or type(length) is not int:
        raise CorruptEntryError("its header does not describe the file")
    layout = SampleLayout.from_json(header.get("layout"))
    if layout.stride != stride or (checks_at, rows_at, size) != _layout_of(length, stride, json_len):
        raise CorruptEntryError("its header does not describe the file")
    if _encode(header) != text:
        raise CorruptEntryError("its header is not in canonical form")
    return header


def runs(indices: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """``(start, stop)`` positions of the runs of consecutive values in ascending ``indices``."""
    if not len(indices):
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = [0, *breaks.tolist()]
    return list(zip(starts, [*breaks.tolist(), len(indices)], strict=True))
