"""The segment files of a packed store, as one process sees them.

Each process appends only to segments it created, so appends need no cross-process
lock: it holds a shared ``flock`` on each while it may still write to it, and a segment
is compacted or removed only under an exclusive ``flock`` that a live writer's shared
one forbids (a killed writer's lock goes with it). A record never changes once written
and segment numbers are never reused, so a descriptor or mapping of a file removed since
still reads the right bytes.

Batches are read from read-only shared mappings of the segments (a slice and a checksum
per record, no system call); single reads and whatever a mapping cannot serve use
``os.pread`` on cached descriptors. torchcache never shortens a segment below a record
that an index row pointed to, and a batch first checks each segment's size with one
``fstat``: a file found shorter than its mapping is mapped again at its size, and its
records past the end are misses. Like LMDB's own map of its index, a mapping cannot guard
against a file cut short by another program in the microseconds between that check and
the copy, or against a disk that fails under it: the kernel ends the process then
(``SIGBUS``), where ``pread`` would have raised.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from ..files import open_regular, read_at
from .format import HEADER, MAGIC, Found, parse_segment_name, segment_name
from .index import Change

__all__ = ["IRREGULAR", "MISSING", "TMP_PREFIX", "SegmentFiles", "Writer"]

MISSING = "missing"
IRREGULAR = "not a regular file"
_O_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_MAX_READERS = 256
_MAX_MAPS = 64  # each mapping holds a descriptor of its own
_EMPTY = memoryview(b"")
_MAX_MAP_BYTES = 1 << 33  # records start below 4 GiB
_digest = xxhash.xxh3_64_intdigest
_MAX_OFFSET = (1 << 32) - 1
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
#: Times a new segment's temporary file is made again after a sweep took it.
_CREATE_TRIES = 16
#: Temporary files of segments being created start with this.
TMP_PREFIX = ".seg-"


def _write_parts(fd: int, parts: list[bytes | memoryview], offset: int) -> int:
    """Write ``parts`` one after another at ``offset`` without joining them; return the end.

    Raises:
        OSError: If the write fails.
    """
    for start in range(0, len(parts), _IOV_MAX):
        chunk = parts[start : start + _IOV_MAX]
        want = sum(map(len, chunk))
        written = os.pwritev(fd, chunk, offset)
        if written < want:  # a short write: finish it piece by piece
            rest = memoryview(b"".join(chunk))[written:]
            pos = offset + written
            while rest:
                done = os.pwrite(fd, rest, pos)
                if done <= 0:  # no progress: the file system has no room (never loop on it)
                    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a write made no progress)")
                rest, pos = rest[done:], pos + done
        offset += want
    return offset


@dataclass
class Writer:
    """A segment this process appends to: its descriptor (holding a shared lock) and its end."""

    seg: int
    fd: int
    end: int = 0
    pending: int = field(default=0)


class SegmentFiles:
    """Reader descriptors and the writable segments of one store directory, in one process.

    Args:
        root: The store directory.
        segment_bytes: A segment is sealed once it holds this many bytes.
    """

    def __init__(self, root: str, segment_bytes: int) -> None:
        self.root = root
        self.segment_bytes = segment_bytes
        self.writer: Writer | None = None
        self._readers: dict[int, tuple[int, int]] = {}
        self._maps: dict[int, memoryview] = {}
        self._batch: list[Writer] = []

    def path(self, seg: int) -> str:
        """Where segment ``seg`` lives."""
        return os.path.join(self.root, segment_name(seg))

    # -- reads --------------------------------------------------------------------
    def read(self, seg: int, offset: int, size: int) -> bytes | str:
        """The ``size`` bytes at ``offset`` of a segment, or why they cannot be read.

        Returns:
            The bytes, or :data:`MISSING`, :data:`IRREGULAR` or ``"out of bounds"``.

        Raises:
            OSError: If the file exists and cannot be read.
        """
        cached = self._readers.get(seg) or self._open_reader(seg)
        if isinstance(cached, str):
            return cached
        fd, known = cached
        if offset + size > known:  # the segment may have grown since it was opened
            known = os.fstat(fd).st_size
            self._readers[seg] = (fd, known)
            if offset + size > known:
                return "out of bounds"
        return read_at(fd, size, offset)

    def _open_reader(self, seg: int) -> tuple[int, int] | str:
        """Open and cache a descriptor of a segment; or say why there is none.

        Raises:
            OSError: If the file exists and cannot be opened.
        """
        opened = open_regular(self.path(seg), follow_symlinks=False)
        if opened is None:
            return IRREGULAR if os.path.lexists(self.path(seg)) else MISSING
        if len(self._readers) >= _MAX_READERS:
            self.forget(next(iter(self._readers)))
        cached = self._readers[seg] = (opened[0], opened[1].st_size)
        return cached

    def read_many(self, found: list[Found], kbs: list[bytes], out: list[bytes | memoryview | None]) -> list[Found]:
        """Read the records of ``found`` (in file order) into ``out``.

        Each payload is a view of a read-only mapping of its segment.

        Returns:
            The items that were not read whole (missing file, a record past the end,
            or one that fails its checks), for :meth:`read` to look at one by one.

        Raises:
            OSError: If a file exists and cannot be read or mapped.
        """
        failed: list[Found] = []
        hsize, unpack, digest = HEADER.size, HEADER.unpack_from, _digest
        seg, view = -1, _EMPTY
        for item in found:
            if item[0] != seg:
                seg = item[0]
                view = self.view(seg, 0)
            _, offset, length, i, _ = item
            kb = kbs[i]
            start = offset + hsize + len(kb)
            end = start + length
            if end > len(view):
                view = self.view(seg, end)  # the segment may have grown since it was mapped
                if end > len(view):
                    failed.append(item)
                    continue
            magic, klen, plen, check = unpack(view, offset)  # payload_of, inlined: this loop is the hot path
            payload = view[start:end]
            if (
                magic == MAGIC
                and plen == length
                and klen == len(kb)
                and view[start - klen : start] == kb
                and digest(payload, digest(kb, length)) == check
            ):
                out[i] = payload
            else:
                failed.append(item)
        return failed

    def view(self, seg: int, need: int) -> memoryview:
        """A view of a read-only mapping of segment ``seg``, no longer than the file is now.

        The mapping is made again if the file is shorter than it (then the records past
        the end are misses) or has grown since and ``need`` bytes are wanted.

        Raises:
            OSError: If the file exists and cannot be read or mapped.
        """
        cached = self._readers.get(seg) or self._open_reader(seg)
        if isinstance(cached, str):
            return _EMPTY
        fd = cached[0]
        size = os.fstat(fd).st_size  # a mapping is read only within the file's size now
        self._readers[seg] = (fd, size)
        size = min(size, _MAX_MAP_BYTES)  # a giant (sparse) file: what lies past this is read with pread
        view = self._maps.get(seg)
        if view is not None and (len(view) > size or len(view) < min(need, size)):
            del self._maps[seg]  # views already given out keep the old mapping alive
            view = None
        if view is None:
            if size == 0:
                return _EMPTY
            if len(self._maps) >= _MAX_MAPS:
                del self._maps[next(iter(self._maps))]
            view = self._maps[seg] = memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ))
        return view

    def forget(self, seg: int) -> None:
        """Close the cached descriptor of a segment, if any."""
        self._maps.pop(seg, None)  # unmapped once no view of it is left
        cached = self._readers.pop(seg, None)
        if cached is not None:
            with contextlib.suppress(OSError):
                os.close(cached[0])

    def cached(self) -> list[int]:
        """Segments with a cached descriptor."""
        return list(self._readers)

    # -- writes -------------------------------------------------------------------
    def _new_writer(self, change: Change) -> Writer:
        """Create a segment file that carries this process's shared lock from its first moment.

        The file is made and locked under a temporary name, then linked to its segment
        name (a link never replaces a file): so a segment file that no one holds a lock
        on is an orphan, whatever its age. Another process's sweep may take the
        temporary file in the moment between its creation and its lock; then a new one
        is made.

        Raises:
            OSError: If it cannot be created.
        """
        for _ in range(_CREATE_TRIES):
            writer = self._try_new_writer(change)
            if writer is not None:
                return writer
        raise OSError(errno.EAGAIN, f"cannot create a segment in {self.root}: its temporary files kept being swept")

    def _try_new_writer(self, change: Change) -> Writer | None:
        """A new segment, or ``None`` if a sweep took the temporary file before it was linked."""
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, _O_CREATE, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # a sweep holds it and is removing it
                os.close(fd)
                return None
            for _ in range(64):
                seg = change.allocate_segment()
                try:
                    os.link(tmp, self.path(seg))
                except FileExistsError:
                    continue  # another process took that number and has not indexed it yet
                except FileNotFoundError:  # a sweep removed it before it was locked
                    os.close(fd)
                    return None
                return Writer(seg, fd)
            raise OSError(errno.EEXIST, f"no free segment number in {self.root}")
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def append(self, change: Change, records: Sequence[tuple[bytes, bytes | memoryview]]) -> list[tuple[int, int]]:
        """Write records (``(header and key, payload)`` pairs) to this process's segments.

        The segment rows in ``change`` are updated; the caller commits it and then calls
        :meth:`committed`, or :meth:`aborted` if anything failed.

        Returns:
            Each record's ``(segment, offset)``.

        Raises:
            OSError: If a file cannot be created or written.
        """
        places: list[tuple[int, int]] = []
        writer = self.writer if self.writer is not None else self._new_writer(change)
        self._batch = [writer]
        pos = start = writer.end
        parts: list[bytes | memoryview] = []
        groups: list[tuple[Writer, int, list[bytes | memoryview]]] = []
        for head, payload in records:
            size = len(head) + len(payload)
            if pos > 0 and (pos + size > self.segment_bytes or pos + size > _MAX_OFFSET):
                groups.append((writer, start, parts))
                change.seal(writer.seg)
                writer = self._new_writer(change)
                self._batch.append(writer)
                pos = start = 0
                parts = []
            places.append((writer.seg, pos))
            parts += (head, payload)
            pos += size
        groups.append((writer, start, parts))
        for group_writer, offset, group_parts in groups:
            end = _write_parts(group_writer.fd, group_parts, offset)
            group_writer.pending = end
            change.set_end(group_writer.seg, end)
        if pos >= self.segment_bytes:
            change.seal(writer.seg)
        return places

    def committed(self) -> None:
        """The index now holds the last :meth:`append`: advance ends, close sealed segments."""
        batch, self._batch = self._batch, []
        for writer in batch:
            writer.end = writer.pending
        last = batch[-1] if batch else self.writer
        for writer in batch[:-1]:
            os.close(writer.fd)  # sealed: its lock goes with it
        if last is not None and last.end >= self.segment_bytes:
            os.close(last.fd)
            last = None
        self.writer = last

    def aborted(self) -> None:
        """The last :meth:`append` was not committed: give its bytes back, remove the files it made."""
        batch, self._batch = self._batch, []
        for writer in batch:
            with contextlib.suppress(OSError):
                os.ftruncate(writer.fd, writer.end)
            if writer is not self.writer:
                with contextlib.suppress(OSError):  # no index row names it; else it is swept once it is old
                    os.unlink(self.path(writer.seg))  # under its lock, which no other process can hold
                os.close(writer.fd)

    def seal_writer(self) -> int | None:
        """Stop writing to the current segment (the caller seals its row); return its number."""
        writer, self.writer = self.writer, None
        if writer is None:
            return None
        os.close(writer.fd)
        return writer.seg

    def own(self) -> set[int]:
        """Segments this process writes to (in the current append, or next)."""
        own = {writer.seg for writer in self._batch}
        if self.writer is not None:
            own.add(self.writer.seg)
        return own

    # -- exclusive access -----------------------------------------------------------
    def lock(self, seg: int, mode: int = fcntl.LOCK_EX) -> int | None:
        """A descriptor holding a lock on a segment (exclusive: no live writer holds it), or ``None``.

        Raises:
            OSError: If it exists and cannot be opened.
        """
        opened = open_regular(self.path(seg), follow_symlinks=False)
        if opened is None:
            return None
        fd = opened[0]
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

    def remove(self, seg: int) -> None:
        """Remove a segment's file (already gone is fine).

        Raises:
            OSError: If it cannot be removed.
        """
        self.forget(seg)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(seg))

    def listed(self) -> dict[int, os.DirEntry[str]]:
        """The segment files in the directory, by number."""
        found: dict[int, os.DirEntry[str]] = {}
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for entry in entries:
                seg = parse_segment_name(entry.name)
                if seg is not None:
                    found[seg] = entry
        return found

    def orphans(self, known: set[int]) -> list[int]:
        """Segment files the index does not know and no live writer holds a lock on."""
        locks = self._lock_orphans(known)
        for fd in locks.values():
            os.close(fd)
        return list(locks)

    def _lock_orphans(self, known: set[int]) -> dict[int, int]:
        """Exclusive locks (descriptors to close) on the segment files not in ``known`` that no writer holds."""
        locks: dict[int, int] = {}
        own = self.own()
        for seg in self.listed():
            if seg not in known and seg not in own:
                fd = self.lock(seg)
                if fd is not None:
                    locks[seg] = fd
        return locks

    def sweep(self, known: Callable[[], set[int]]) -> int:
        """Remove orphaned segment files and temporary files; return how many.

        ``known`` reads the segments the index knows now. It is read again once the
        orphans' locks are held: a segment that a writer indexed after the first look
        (and sealed, letting go of its lock) is not an orphan.

        Raises:
            OSError: If the directory cannot be listed.
        """
        removed = 0
        locks = self._lock_orphans(known())
        try:
            indexed = known() if locks else set()
            for seg in locks.keys() - indexed:
                try:
                    self.remove(seg)
                    removed += 1
                except OSError:
                    pass
        finally:
            for fd in locks.values():
                os.close(fd)
        with os.scandir(self.root) as entries:
            temporary = [entry.path for entry in entries if entry.name.startswith(TMP_PREFIX)]
        for path in temporary:
            opened = open_regular(path, follow_symlinks=False)
            if opened is None:
                continue
            try:
                fcntl.flock(opened[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(path)
                removed += 1
            except OSError:
                pass
            finally:
                os.close(opened[0])
        return removed

    def close(self) -> None:
        """Close every descriptor (the shared lock on the current segment goes with it)."""
        for seg in list(self._readers):
            self.forget(seg)
        self._maps.clear()
        if self.writer is not None:
            with contextlib.suppress(OSError):
                os.close(self.writer.fd)
            self.writer = None

    def abandon(self) -> None:
        """In a forked child: close the inherited descriptors, keep none of the parent's state.

        The parent's shared locks stay: a ``flock`` lives until every copy of its
        descriptor is closed, and the parent still has its own.
        """
        self.close()
        self._batch = []
