"""Whether an index file is safe to map, checked before LMDB maps it."""

from __future__ import annotations

import os
import stat

import lmdb

__all__ = ["cut_short"]


def cut_short(path: str) -> str | None:
    """Why the index file at ``path`` cannot be mapped safely, or ``None``.

    LMDB maps the index into memory, and a process that touches a page beyond the end of
    a file cut short dies of ``SIGBUS``. So, before it is opened, the file's length is
    checked against what its header (read with ``pread``, not mapped) says it holds. A
    file LMDB cannot read at all is not reported here: opening it fails and it is rebuilt.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None  # not a file LMDB can map (opening it fails, and it is replaced)
    except OSError:
        return None
    try:  # read-only and without the lock file: nothing is written, no other use is disturbed
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=3)
    except lmdb.Error:
        return None  # unreadable (opening it fails as damaged), or open in this process already
    try:
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except lmdb.Error:
        return None
    finally:
        env.close()
    try:  # measured after the header: a writer grows the file before it commits a header
        size = os.stat(path).st_size
    except OSError:
        return None
    return f"cut short: {size:,} bytes, its header describes {needed:,}" if size < needed else None
