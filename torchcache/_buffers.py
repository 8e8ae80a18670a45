"""Large output buffers, used again once nothing refers to them.

glibc maps every allocation of 32 MiB or more afresh and unmaps it when it is freed, so a
batch of hits that large (64 items of ``(197, 768)`` float32 is 39 MB) costs the kernel
new zeroed pages at every call, and their unmapping: 12 ms of a 16 ms batch of memory
hits here. :func:`empty_rows` keeps the last few such buffers and hands one out again only
when its own list holds the last reference to it: no array, view, tensor or storage made
from it is alive, exactly as an allocator reuses freed memory. At most :data:`KEPT`
buffers are kept, so at most that many batches' bytes stay allocated while unused.

A new buffer is an anonymous ``mmap``, not numpy's allocation: numpy asks the kernel for
huge pages for large arrays (``madvise``), and where the kernel must first compact memory
to find them (transparent huge pages with ``defrag=madvise``, a common default), filling
a new 39 MB array took 80 ms here against 13 ms in plain pages.
"""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

import numpy as np

from ._fork import after_fork

__all__ = ["KEPT", "MIN_BYTES", "empty_rows"]

#: Buffers below this size come from ``np.empty`` (malloc reuses its heap for them).
MIN_BYTES = 32 << 20
#: Buffers kept for reuse.
KEPT = 2

_kept: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
_lock = threading.Lock()


def _new_buffer(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A buffer of ``nbytes`` in plain pages (every view made of it has it as its ``base``).

    Private: a forked child gets its own copy of the pages, as of memory from malloc (a
    shared map would let the parent's later hits write into a batch the child holds).
    """
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


def _count_when_alone() -> int:
    """What ``sys.getrefcount`` says of a buffer only a list holds (interpreters count the argument differently)."""
    alone = [_new_buffer(mmap.PAGESIZE)]
    return sys.getrefcount(alone[0])


_ALONE = _count_when_alone()


def _forget() -> None:
    """In a forked child: a new lock (another thread may have held this one) and no buffers."""
    global _lock
    _lock = threading.Lock()
    _kept.clear()


after_fork(_forget)


def empty_rows(count: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """An uninitialized ``(count, size)`` uint8 array, in a buffer used before where one is free.

    Example:
        >>> rows = empty_rows(2, 3)
        >>> rows.shape, rows.dtype
        ((2, 3), dtype('uint8'))
    """
    nbytes = count * size
    if nbytes < MIN_BYTES:
        return np.empty((count, size), dtype=np.uint8)
    with _lock:
        for i in range(len(_kept)):
            # Any view, tensor or storage made from it adds a reference.
            if _kept[i].nbytes == nbytes and sys.getrefcount(_kept[i]) == _ALONE:
                buffer = _kept.pop(i)
                break
        else:
            buffer = _new_buffer(nbytes)
        _kept.append(buffer)  # the most recently handed out last
        del _kept[:-KEPT]
        return buffer.reshape(count, size)
