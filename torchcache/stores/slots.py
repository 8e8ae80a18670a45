"""Frames of one size in numbered slots of one file: the RAM tier's store for a dataset's samples.

A dataset whose samples all encode to frames of one size (fixed shapes, the common
case) is served from a file of slots on a RAM-backed file system instead of the
packed store: no index transaction, no per-sample lookup. A batch of indices costs one
vectorized read of the slot table, one gather of the slots into a new buffer, and one
xxh3 per sample over the copy, which verifies it.

The file (``slots.tcslot``)::

    header page   magic, version, frame size, frame offset in a slot, slot stride,
                  dataset length, slots, table and slot offsets, xxh3 of these;
                  at byte 512 the number of slots handed out so far; at byte 520
                  a flag set once a sample of the dataset went to the packed store
                  beside the file (until then readers leave that store closed)
    table         one little-endian int32 per dataset index: 0 for none, else slot + 1
    slots         ``stride`` bytes each: the xxh3_64 of the frame seeded by the index
                  (8 bytes), 8 zero bytes, padding, the frame (so that the sample's
                  data starts 16-byte aligned), padding

The file is made whole under a temporary name and linked into place, so no process
sees a partial header; the header page and the table are allocated when it is made, so
that writing to them never faults on a full file system; slot bytes are written with
``pwrite``, whose failure is an error, not a signal. Writers take slots from the
counter under an exclusive ``flock`` (slots are never reused: a full file takes no
more), write the frames and their checksums, and only then publish them in the table.
A reader checks each frame against its checksum and index: a slot that is torn (its
writer was killed), unpublished or damaged is a miss, never a wrong sample. Nothing in
the file is unpickled; every field of the header is checked against the file's size.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import StoreError
from .files import allocate, pwrite_all, read_at

__all__ = ["SLOTS_NAME", "SlotStore", "slot_layout"]

SLOTS_NAME = "slots.tcslot"
_MAGIC = b"TCSLOTS1"
_VERSION = 1
_HEAD = struct.Struct("<8sIIIIQQQQ")  # magic, version, frame size, frame offset, stride, length, slots, table, slots at
_U64 = struct.Struct("<Q")
_CLAIMED_AT = 512
_SPILLED_AT = 520
_PAGE = 4096
_ALIGN = 16
_CHECK = 16  # checksum and zero bytes before the frame's padding
_MAX_STRIDE = 1 << 30
_MAX_FILE = 1 << 46
_O_OPEN = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)

Report = Callable[[str, str], None]


def _up(value: int, to: int) -> int:
    return -(-value // to) * to


def slot_layout(frame_size: int, head: int, length: int) -> tuple[int, int, int]:
    """The frame offset in a slot, the slot stride and the offset of the first slot.

    Args:
        frame_size: Bytes per frame.
        head: Bytes of the frame before the sample's data (aligned to 16 in the slot).
        length: The dataset's length (entries of the table).

    Example:
        >>> slot_layout(6944, 35, 20_000)
        (29, 6976, 86016)
    """
    frame_at = _CHECK + (-head % _ALIGN)
    return frame_at, _up(frame_at + frame_size, _ALIGN), _PAGE + _up(4 * length, _PAGE)


class SlotStore:
    """The frames of samples ``0 .. length - 1``, all of one size, in one file of slots.

    The file is made by the first :meth:`put_many` (its frames fix the size), or opened
    when another process of the job made it. Every method is safe from several threads
    and processes at once.

    Args:
        directory: The RAM tier's directory.
        length: The dataset's length.
        max_bytes: The file's size: header, table and slots (the tier's budget).
        report: Called with ``(kind, message)`` for a damaged slot or an unusable file.
    """

    def __init__(self, directory: str | os.PathLike[str], length: int, max_bytes: int, report: Report) -> None:
        self.directory = Path(directory)
        self.path = self.directory / SLOTS_NAME
        self.length = length
        self.max_bytes = max_bytes
        self._report = report
        self._lock = threading.Lock()
        self._fd = -1
        self._map: Any = None
        self._table: np.ndarray[Any, np.dtype[np.int32]] | None = None
        self._slots: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._claimed: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._spilled: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self.frame_size = 0
        self.frame_at = 0
        self.stride = 0
        self.capacity = 0
        self.slots_at = 0
        #: ``False`` once the file proved unusable (it is then left alone).
        self.usable = True
        self._open()

    def __repr__(self) -> str:
        return f"SlotStore({str(self.path)!r}, {self.capacity} slots of {self.stride} bytes)"

    # -- opening --------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the file exists and is open (its frame size is known)."""
        return self._table is not None

    def attach(self) -> bool:
        """Open the file if another process made it since; whether it is ready."""
        with self._lock:
            return self._open()

    def _open(self) -> bool:
        """Open the file if another process made it; ``False`` if there is none (or it is unusable)."""
        if self._table is not None:
            return True
        if not self.usable:
            return False
        try:
            fd = os.open(self.path, _O_OPEN)
        except FileNotFoundError:
            return False
        except OSError as exc:
            return self._unusable(f"cannot open it ({exc})")
        try:
            problem = self._adopt(fd)
        except (OSError, ValueError) as exc:
            problem = str(exc)
        if problem is not None:
            os.close(fd)
            return self._unusable(problem)
        return True

    def _adopt(self, fd: int) -> str | None:
        """Check the header of an open file and map it; the reason it is unusable, or ``None``."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return "it is not a regular file of this user"
        head = read_at(fd, _HEAD.size + 8)
        if len(head) < _HEAD.size + 8:
            return "its header is cut short"
        fields = _HEAD.unpack_from(head)
        magic, version, frame_size, frame_at, stride, length, capacity, table_at, slots_at = fields
        if magic != _MAGIC or version != _VERSION:
            return "it is not a slot file of this version"
        if _U64.unpack_from(head, _HEAD.size)[0] != xxhash.xxh3_64_intdigest(head[: _HEAD.size]):
            return "its header fails its checksum"
        if (
            length != self.length
            or not 0 < frame_size < _MAX_STRIDE
            or not _CHECK <= frame_at < _CHECK + _ALIGN
            or stride != _up(frame_at + frame_size, _ALIGN)
            or table_at != _PAGE
            or slots_at != _PAGE + _up(4 * length, _PAGE)
            or slots_at + capacity * stride > min(st.st_size, _MAX_FILE)
        ):
            return "its header does not describe the file"
        if st.st_blocks * 512 < slots_at:  # made elsewhere without its pages: writing them could SIGBUS
            try:
                os.posix_fallocate(fd, 0, slots_at)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    return f"its header and table cannot be given their pages ({exc.strerror})"
        self._map_file(fd, frame_size, frame_at, stride, capacity, slots_at)
        return None

    def _map_file(self, fd: int, frame_size: int, frame_at: int, stride: int, capacity: int, slots_at: int) -> None:
        size = slots_at + capacity * stride
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd = fd
        self.frame_size, self.frame_at, self.stride = frame_size, frame_at, stride
        self.capacity, self.slots_at = capacity, slots_at
        self._claimed = np.ndarray((1,), np.uint64, buffer=self._map, offset=_CLAIMED_AT)
        self._spilled = np.ndarray((1,), np.uint64, buffer=self._map, offset=_SPILLED_AT)
        self._slots = np.ndarray((capacity, stride), np.uint8, buffer=self._map, offset=slots_at)
        self._table = np.ndarray((self.length,), np.int32, buffer=self._map, offset=_PAGE)

    def shortfall(self) -> int | None:
        """Samples this budget would hold beyond the open file's slots (a file made for a smaller budget).

        ``None`` while the file is not open.
        """
        if self._table is None:
            return None
        return max(0, min((self.max_bytes - self.slots_at) // self.stride, self.length) - self.capacity)

    @property
    def spilled(self) -> bool:
        """Whether the packed store beside the file may hold samples (``True`` while the file is not open)."""
        spilled = self._spilled
        return spilled is None or bool(spilled[0])

    def mark_spilled(self) -> None:
        """Note in the file, before a sample goes to the packed store beside it, that the store is in use."""
        spilled = self._spilled
        if spilled is not None and not spilled[0]:
            spilled[0] = 1

    def _unusable(self, why: str) -> bool:
        self.usable = False
        self._report("slots", f"the slot file {self.path} is not used: {why}")
        return False

    def create(self, frame_size: int, head: int) -> bool:
        """Make the file for frames of ``frame_size`` bytes (or open the one another process made).

        Returns:
            Whether the file is ready (``False``: the budget holds no slot, or the file
            cannot be made, which is reported).
        """
        with self._lock:
            if self._open():
                return True
            if not self.usable:
                return False
            frame_at, stride, slots_at = slot_layout(frame_size, head, self.length)
            capacity = (self.max_bytes - slots_at) // stride if stride < _MAX_STRIDE else 0
            if capacity <= 0:
                return False
            # Slack for samples that two processes stored at once (one slot is then lost).
            capacity = min(capacity, self.length + self.length // 16 + 64, (_MAX_FILE - slots_at) // stride)
            tmp = self.directory / f".{SLOTS_NAME}.{os.getpid()}.tmp"
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            except OSError as exc:
                return self._unusable(f"cannot create it ({exc})")
            try:
                head_bytes = _HEAD.pack(
                    _MAGIC, _VERSION, frame_size, frame_at, stride, self.length, capacity, _PAGE, slots_at
                )
                os.ftruncate(fd, slots_at + capacity * stride)
                allocate(fd, slots_at, fill=True)  # header and table: written through the mapping, never a fault
                os.pwrite(fd, head_bytes + _U64.pack(xxhash.xxh3_64_intdigest(head_bytes)), 0)
                try:
                    os.link(tmp, self.path)
                except FileExistsError:  # another process made it first: use that one
                    os.close(fd)
                    fd = -1
                    return self._open()
                self._map_file(fd, frame_size, frame_at, stride, capacity, slots_at)
                fd = -1
                return True
            except OSError as exc:
                return self._unusable(f"cannot create it ({exc})")
            finally:
                if fd >= 0:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    # -- reads ----------------------------------------------------------------------
    def read(self, indices: Sequence[int]) -> tuple[list[int], memoryview]:
        """Copy the checked slots of ``indices`` into a new buffer.

        Returns:
            The positions (into ``indices``) found, and a writable buffer that holds their
            slots one after the other, :attr:`stride` bytes apart, each frame at
            :attr:`frame_at` (the sample's data 16-byte aligned when the buffer is).

        Raises:
            StoreError: If the file was cut short since it was opened.
        """
        table, slots = self._table, self._slots
        if table is None or slots is None or not indices:
            return [], memoryview(b"")
        wanted = np.fromiter(indices, np.int64, len(indices))
        inside = (wanted >= 0) & (wanted < self.length)
        numbers = np.zeros(len(wanted), np.int64)
        numbers[inside] = table[wanted[inside]]
        present = np.flatnonzero((numbers > 0) & (numbers <= self.capacity))
        if not len(present):
            return [], memoryview(b"")
        if os.fstat(self._fd).st_size < self.slots_at + self.capacity * self.stride:
            raise StoreError(f"{self.path} was cut short")
        stride, at, size = self.stride, self.frame_at, self.frame_size
        rows = np.empty((len(present), stride), np.uint8)  # not zeroed: every byte is copied over
        np.take(slots, numbers[present] - 1, axis=0, out=rows, mode="clip")  # in range: checked above
        checks = rows[:, :8].copy().view(np.uint64).ravel().tolist()
        view = rows.reshape(-1).data
        digest = xxhash.xxh3_64_intdigest
        bad = [
            j
            for j, (index, check, start) in enumerate(
                zip(wanted[present].tolist(), checks, range(at, at + len(checks) * stride, stride))
            )
            if digest(view[start : start + size], index) != check
        ]
        positions = present.tolist()
        if not bad:
            return positions, view
        self._recheck(wanted, numbers, [positions[j] for j in bad])
        keep = sorted(set(range(len(positions))) - set(bad))
        return [positions[j] for j in keep], rows[keep].reshape(-1).data  # the good rows, packed again

    def _recheck(self, wanted: np.ndarray[Any, Any], numbers: np.ndarray[Any, Any], bad: list[int]) -> None:
        """Unpublish the slots that still fail their check when read again, and report them.

        A slot is read twice before it is called damaged: on a processor that orders
        stores weakly, a reader may see a slot published before its bytes.
        """
        assert self._slots is not None and self._table is not None
        still = []
        for position in bad:
            index, slot = int(wanted[position]), int(numbers[position]) - 1
            row = bytes(self._slots[slot])
            frame = row[self.frame_at : self.frame_at + self.frame_size]
            if xxhash.xxh3_64_intdigest(frame, index) != _U64.unpack_from(row)[0]:
                still.append(position)
                with self._lock:
                    if int(self._table[index]) == slot + 1:
                        self._table[index] = 0  # computed and written again
        if still:
            self._report("corrupt", f"{len(still)} damaged slots in {self.path}: recomputed")

    def __contains__(self, index: object) -> bool:
        table = self._table
        if table is None or type(index) is not int or not 0 <= index < self.length:
            return False
        return 0 < int(table[index]) <= self.capacity

    def __len__(self) -> int:
        """Samples published in the table."""
        table = self._table
        return 0 if table is None else int(np.count_nonzero(table))

    @property
    def nbytes(self) -> int:
        """Bytes the file takes: header and table, and the slots handed out."""
        claimed = self._claimed
        if claimed is None:
            return 0
        return self.slots_at + min(int(claimed[0]), self.capacity) * self.stride

    # -- writes ---------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[int, bytes | memoryview]], max_bytes: int) -> int:
        """Store frames of :attr:`frame_size` bytes by index, within ``max_bytes`` for the whole file.

        Indices already stored, out of range, or with frames of another size are passed
        over. Returns how many items could not be stored for want of room (0: all that
        could be stored were).

        Raises:
            OSError: If the slots cannot be written (a full file system).
        """
        table = self._table
        if table is None or self._claimed is None:
            return 0
        size = self.frame_size
        todo: dict[int, bytes | memoryview] = {}
        for index, frame in items:
            if 0 <= index < self.length and len(frame) == size and not table[index] and index not in todo:
                todo[index] = frame
        if not todo:
            return 0
        limit = min(self.capacity, max(0, (max_bytes - self.slots_at) // self.stride))
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                first = int(self._claimed[0])
                count = max(0, min(len(todo), limit - first))
                self._claimed[0] = first + count
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        if not count:
            return len(todo)
        indices = list(todo)[:count]
        rows = np.zeros((count, self.stride), np.uint8)
        frames = np.frombuffer(b"".join(todo[i] for i in indices), np.uint8).reshape(count, size)
        rows[:, self.frame_at : self.frame_at + size] = frames
        digest = xxhash.xxh3_64_intdigest
        checks = [digest(frames[j], index) for j, index in enumerate(indices)]
        rows[:, :8] = np.asarray(checks, np.uint64).view(np.uint8).reshape(count, 8)
        pwrite_all(self._fd, memoryview(rows.data).cast("B"), self.slots_at + first * self.stride)
        table[np.asarray(indices, np.int64)] = np.arange(first + 1, first + count + 1, dtype=np.int32)
        return len(todo) - count

    def drop(self, index: int) -> None:
        """Unpublish a sample (its slot is not reused)."""
        if self._table is not None and 0 <= index < self.length:
            self._table[index] = 0

    def close(self) -> None:
        """Unmap and close the file (views of it already handed out stay valid)."""
        with self._lock:
            self._table = self._slots = self._claimed = self._spilled = None
            if self._map is not None:
                with contextlib.suppress(BufferError):  # arrays still view it: unmapped when they go
                    self._map.close()
                self._map = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
