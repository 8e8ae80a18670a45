"""The two cross-process locks of a packed store beside LMDB's own write lock.

``compact.lock`` is held exclusively by the one process that compacts segments, sweeps
orphaned files or replaces the index. ``index.lock`` is held while an index is opened
(shared) and while one is replaced (exclusive): LMDB opens its lock file and its data
file one after the other, and a process that opened one of an old pair and one of a
new pair would write the new index under the old lock. Both are ``flock`` locks on
empty files, so a killed holder lets go of them. Taken in this order: ``compact.lock``,
``index.lock``, LMDB's write lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator

__all__ = ["INDEX_LOCK_NAME", "LOCK_NAME", "LOCK_NAMES", "exclusive", "opening_index"]

LOCK_NAME = "compact.lock"
INDEX_LOCK_NAME = "index.lock"
LOCK_NAMES = (LOCK_NAME, INDEX_LOCK_NAME)
#: How long a lock is waited for when the caller waits.
WAIT_SECONDS = 30.0


def _take(fd: int, mode: int, wait: bool) -> bool:
    """Take a ``flock`` on ``fd``, polling for at most :data:`WAIT_SECONDS` if ``wait``."""
    deadline = time.monotonic() + (WAIT_SECONDS if wait else 0.0)
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def _open(root: str, name: str) -> int:
    """A descriptor of the lock file ``name`` (made if missing), or -1 where none can be had.

    A lock file this process may not write (another user's) is opened for reading, which
    is enough for ``flock``; something other than a regular file at its path is replaced.
    """
    path = os.path.join(root, name)
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK
    for _ in range(2):
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                fd = os.open(path, flags | nofollow, 0o644)
            except OSError:
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            break
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return -1  # a regular file that cannot be opened at all: leave it
        except FileNotFoundError:
            return -1  # cannot be made (a read-only directory)
        except OSError:
            return -1
        with contextlib.suppress(OSError):  # a FIFO, link or directory someone put there
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    return -1


@contextlib.contextmanager
def exclusive(root: str, wait: bool, name: str = LOCK_NAME) -> Iterator[bool]:
    """Hold a lock file of the store exclusively; yield whether it was taken.

    Without ``wait``, give up at once if another process holds it; with it, poll for at
    most 30 s.
    """
    fd = _open(root, name)
    if fd < 0:
        yield False
        return
    try:
        yield _take(fd, fcntl.LOCK_EX, wait)
    finally:
        os.close(fd)


@contextlib.contextmanager
def opening_index(root: str) -> Iterator[bool]:
    """Hold ``index.lock`` shared while an index is opened; yield whether opening may go on.

    Waits at most 30 s (a replacement holds it for milliseconds). Where no lock file can
    be made (a read-only directory, where no index is replaced either), opening goes on.
    """
    fd = _open(root, INDEX_LOCK_NAME)
    if fd < 0:
        yield True
        return
    try:
        yield _take(fd, fcntl.LOCK_SH, wait=True)
    finally:
        os.close(fd)
