"""The index of a packed store as one process holds it: opened lazily, reopened when replaced.

Every call first checks that this is still the process that opened the index (a forked
child starts afresh: LMDB forbids using a parent's environment) and that the index
file is still the one opened (``stat``: device and inode). If it was replaced (rebuilt
by another process) it is reopened; if the directory vanished, reads are misses and
writes raise. Opening a writable index seals the segments of writers that died and
removes orphaned files (see :func:`~torchcache.stores.packed.upkeep.seal_orphans`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable

import lmdb

from ...errors import StoreError
from ...faults import Fault
from . import locks, upkeep
from .index import DAMAGE, INDEX_NAME, MIN_MAP_SIZE, Index, IndexReplacedError, open_index
from .segments import SegmentFiles

__all__ = ["DAMAGE", "RETRY_SECONDS", "IndexHandle"]

#: How long a store whose index could not be opened stays unavailable before it is tried again.
RETRY_SECONDS = 60.0


class IndexHandle:
    """The open index of a store directory in this process.

    Args:
        root: The store directory.
        files: This process's segment files of that directory.
        report: Called with ``(kind, message, once)`` for faults.
        on_fork: Called in a forked child to drop state that belongs to the parent.
        map_size: The address space to map the index in (see
            :func:`~torchcache.stores.packed.index.map_size_for`).
        readonly: Open the index as it is, for reading only (nothing sealed, removed or rebuilt).
    """

    def __init__(
        self,
        root: str,
        files: SegmentFiles,
        report: Callable[[Fault, str, str | None], None],
        on_fork: Callable[[], None],
        map_size: int = MIN_MAP_SIZE,
        readonly: bool = False,
    ) -> None:
        self.root = root
        self.readonly = readonly
        self.map_size = map_size
        self.path = os.path.join(root, INDEX_NAME)
        self.files = files
        self.report = report
        self.on_fork = on_fork
        self.pid = os.getpid()
        self.index: Index | None = None
        self._retry_at = 0.0  # after an open that waited for a lock in vain: not tried again before then

    def forked(self) -> bool:
        """Whether this is a forked child of the process that opened the index (then start afresh)."""
        if self.pid == os.getpid():
            return False
        self.index = None  # the index module keeps the parent's environment, unused
        self.files.abandon()
        self.on_fork()
        self.pid = os.getpid()
        return True

    def drop(self) -> None:
        """Close this process's files and its use of the index."""
        if self.index is not None:
            self.files.close()
            with contextlib.suppress(lmdb.Error):
                self.index.close()
            self.index = None

    def ensure(self, write: bool) -> Index | None:
        """The open index, reopened if it changed; ``None`` if the directory is gone.

        Raises:
            StoreError: If ``write`` and the store cannot be written.
        """
        self.forked()
        try:
            st = os.stat(self.path)
            identity: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            identity = None
        index = self.index
        # a writer may have found the environment of a read-only store of this process, since closed
        upgrade = write and index is not None and index.readonly and not self.readonly and os.access(self.root, os.W_OK)
        if (index is None or identity != index.identity or upgrade) and (
            index is not None or time.monotonic() >= self._retry_at
        ):
            self.drop()
            index = self.index = self._open() if os.path.isdir(self.root) else None
            if index is not None and not index.readonly and not self.readonly:
                with contextlib.suppress(lmdb.Error, OSError):
                    upkeep.seal_orphans(index, self.files)  # what writers that died left
        if write:
            if index is None:
                raise StoreError(errno.ENOENT, f"the store directory {self.root} is gone or its index cannot be opened")
            if index.readonly:
                raise StoreError(errno.EROFS, f"the store directory {self.root} is read-only")
        return index

    def _open(self) -> Index | None:
        """Open the index; rebuild it from the segments if it is new or was damaged.

        An index that cannot be opened for another reason (no memory or address space, a
        full disk, its opening lock held) is left as it is: the store is unavailable
        (reported once), and opening is tried again at the next use, or, after a try that
        waited for a lock, at the first use :data:`RETRY_SECONDS` later.
        """
        started = time.monotonic()
        try:
            if self.readonly:
                return open_index(self.root, readonly=True, map_size=self.map_size)
            for attempt in range(3):
                try:
                    return upkeep.open_or_recover(
                        self.root, lambda kind, message: self.report(kind, message, None), self.map_size
                    )
                except (FileNotFoundError, IndexReplacedError):  # replaced by another process meanwhile
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")  # pragma: no cover
        except (lmdb.Error, OSError) as exc:
            waited = time.monotonic() - started >= min(1.0, locks.WAIT_SECONDS)  # a lock held: each try would wait
            self._retry_at = time.monotonic() + RETRY_SECONDS if waited else 0.0
            self.report(
                Fault.INDEX,
                f"cannot open the index of {self.root} ({exc}); the store is unavailable"
                + (f" for {RETRY_SECONDS:.0f} s" if waited else "")
                + ", reads miss",
                "open",
            )
            return None

    def failed(self, exc: Exception) -> None:
        """LMDB failed in a read: if the index is damaged, replace it on next use."""
        if not isinstance(exc, DAMAGE):
            self.report(Fault.READ, f"cannot read the index of {self.root} ({exc}); recomputing", f"fail{exc}")
            return
        self.report(Fault.INDEX, f"the index of {self.root} is damaged ({exc}); rebuilding it", f"fail{exc}")
        index = self.index
        self.drop()
        if index is not None and not index.readonly:
            with contextlib.suppress(OSError):
                upkeep.discard_index(self.root, index.identity)

    def release(self) -> None:
        """Give back descriptors and the index when the store is dropped (not in a forked child)."""
        if self.pid == os.getpid():
            self.files.close()
            if self.index is not None:
                self.index.close()
                self.index = None
