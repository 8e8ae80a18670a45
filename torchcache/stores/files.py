"""Reading files that anyone may have planted: never block, never read more than asked.

A FIFO opened for reading would block until a writer comes, and a device can be
endless: files are opened with ``O_NONBLOCK`` and read only when ``fstat`` says they
are regular files. Reads are positional and bounded by the caller.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = ["allocate", "create_whole", "identity", "open_regular", "pwrite_all", "read_at", "read_bounded"]

_O_READ = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_NOTHING_THERE = (errno.ENOENT, errno.ENOTDIR, errno.ENXIO)


def open_regular(path: str | os.PathLike[str], follow_symlinks: bool = True) -> tuple[int, os.stat_result] | None:
    """Open a file for reading without blocking; ``None`` if it is missing or not a regular file.

    Args:
        path: The file.
        follow_symlinks: Open the target of a symbolic link; with ``False`` a link is
            ``None`` (where ``O_NOFOLLOW`` exists).

    Returns:
        The open descriptor (the caller closes it) and its ``fstat``, or ``None``.

    Raises:
        OSError: If the file exists and cannot be opened for another reason.
    """
    flags = _O_READ if follow_symlinks else _O_READ | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in _NOTHING_THERE or (not follow_symlinks and exc.errno == errno.ELOOP):
            return None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def read_at(fd: int, size: int, offset: int = 0) -> bytes:
    """Read ``size`` bytes at ``offset``; fewer only if the file ends first.

    Raises:
        OSError: If the read fails.
    """
    data = os.pread(fd, size, offset)
    while len(data) < size:  # short reads: large files, some file systems
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def read_bounded(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """The bytes of a regular file of at most ``limit`` bytes; ``None`` if it is missing or not regular.

    Raises:
        OSError: If it cannot be read.
        ValueError: If it is larger than ``limit``.
    """
    opened = open_regular(path)
    if opened is None:
        return None
    fd, st = opened
    try:
        data = read_at(fd, min(st.st_size, limit) + 1)
        if len(data) > limit:
            raise ValueError(f"{max(st.st_size, len(data)):,} bytes, more than the {limit:,} expected at most")
        return data
    finally:
        os.close(fd)


def allocate(fd: int, size: int, *, fill: bool = False) -> None:
    """Give the first ``size`` bytes of a file their blocks now, so that a full disk fails here.

    Where the file system has no ``fallocate``, the bytes are written as zeros with
    ``fill`` (for a file written through a memory map, which must never fault), and left
    to later writes otherwise.

    Raises:
        OSError: If the file system has no room (``ENOSPC``) or another error occurs.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        if fill:
            zeros = bytes(min(size, 1 << 20))
            for at in range(0, size, len(zeros)):
                pwrite_all(fd, memoryview(zeros)[: min(len(zeros), size - at)], at)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``; a write that makes no progress is ``ENOSPC``, never a loop.

    Raises:
        OSError: If a write fails.
    """
    while len(data):
        written = os.pwrite(fd, data, offset)
        if written <= 0:  # no progress: the file system has no room
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a write made no progress)")
        data, offset = data[written:], offset + written


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells a file from one made at its path since: device, inode, size and modification time.

    An inode number alone does not: a file removed frees it for the next one made.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def create_whole(path: Path, size: int, head: bytes, allocated: int | None = None, mode: int = 0o644) -> int | None:
    """Make a file of ``size`` bytes that starts with ``head``, whole before anyone sees it.

    The file is made under a temporary name beside ``path``, the blocks of its first
    ``allocated`` bytes (default: all) allocated (a full disk fails here, not in a later
    write) and ``head`` written, then linked to ``path``; a link never replaces a file.

    Returns:
        A read-write descriptor of the new file (the caller closes it), or ``None`` if
        a file is already at ``path`` (another process made it first).

    Raises:
        OSError: If it cannot be made.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        os.ftruncate(fd, size)
        allocate(fd, size if allocated is None else allocated)
        pwrite_all(fd, memoryview(head), 0)
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            fd = -1
            return None
        made, fd = fd, -1
        return made
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
