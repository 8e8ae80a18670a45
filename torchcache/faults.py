"""Faults of the cache become one warning per kind, on the caller's thread.

Writer and reader threads *report* faults (a full disk, a corrupt entry); the thread
that calls the cache *emits* them as a :class:`~torchcache.errors.CacheWarning` (once
per kind, later ones at DEBUG level) and a log line. Reporting takes only its own
lock, never the cache's: a caller may hold the cache lock while it waits for the very
thread that reports (``clear()``, a re-key after ``load_state_dict()``).
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ._fork import SharedArray, renew_lock_after_fork
from ._log import logger
from .errors import CacheWarning

__all__ = ["Fault", "FaultLog", "Report", "SharedWarnings", "full_hint", "user_stacklevel"]

_LIBRARY_DIRS = (str(Path(__file__).parent), str(Path(torch.__file__).parent))


class Fault(enum.StrEnum):
    """A kind of fault: a cache warns once per kind (and tier), later ones at DEBUG level."""

    OPEN = "open"  #: a store, tier or file cannot be opened
    READ = "read"  #: a read failed (an I/O error, a server that went away)
    WRITE = "write"  #: a write failed (a full or read-only disk)
    CREATE = "create"  #: a file cannot be made
    CORRUPT = "corrupt"  #: an entry or row failed its check
    DECODE = "decode"  #: a checked entry cannot be decoded
    SEGMENT = "segment"  #: a segment file is damaged
    INDEX = "index"  #: a store's index is damaged, outgrown or rebuilt
    META = "meta"  #: a metadata file cannot be written or was replaced
    LOCAL = "local"  #: the local copy of a shared store failed
    UNAVAILABLE = "unavailable"  #: a server does not answer
    ROWS = "rows"  #: a rows file is not used
    SIZE = "size"  #: a size asked for does not fit
    DIGESTS = "digests"  #: input digests cannot be written
    LEGACY = "legacy"  #: a cache of an older version, read once migrated
    BUDGET = "budget"  #: a size limit cannot be kept
    REKEY = "rekey"  #: a module's key changed while it was in use
    LAYOUT = "layout"  #: cached outputs do not match those just computed
    SHAPES = "shapes"  #: outputs whose shapes vary are kept whole
    LISTS = "lists"  #: a list as long as the batch is keyed whole
    GRAD = "grad"  #: outputs that need gradients are not cached
    TRAIN = "train"  #: a module in training mode with stochastic layers
    UNCACHED = "uncached"  #: a call that cannot be cached
    REBUILD = "rebuild"  #: cached outputs name a class this process cannot rebuild
    UNSTORED = "unstored"  #: entries computed could not be stored
    REFUSED = "refused"  #: a server refused a write (it is full)


#: Called with a kind and a message, from any thread (:meth:`FaultLog.report`, or a store's own).
Report = Callable[[Fault, str], None]


class SharedWarnings(SharedArray):
    """Which faults the processes of one cache warned about: a flag per kind and tier, in shared memory.

    Shared with the cache's DataLoader workers (forked or spawned), so that a fault every
    worker meets (a full disk) is one warning, not one per worker.
    """

    _TIERS = ("", "memory", "disk")  # any other place shares one flag a kind
    typecode, size = "B", len(Fault) * (len(_TIERS) + 1)

    def first(self, kind: Fault, where: str) -> bool:
        """Mark ``kind`` in ``where`` as warned; whether no process had marked it before."""
        tiers = SharedWarnings._TIERS
        slot = list(Fault).index(kind) * (len(tiers) + 1) + (tiers.index(where) if where in tiers else len(tiers))
        first = not self.array[slot]
        self.array[slot] = 1
        return first


class FaultLog:
    """Faults of one cache: reported from any thread, warned about once per kind.

    Args:
        name: The cache's name, the prefix of every message.
        shared: Flags shared with the cache's other processes (DataLoader workers): a
            fault one of them warned about is logged at DEBUG level in the others.
    """

    def __init__(self, name: str, shared: SharedWarnings | None = None) -> None:
        self.name = name
        self.shared = shared
        self._warned: set[tuple[Fault, str]] = set()
        self._pending: list[tuple[Fault, str, str, int]] = []  # with the process that reported it
        self._lock = threading.Lock()
        renew_lock_after_fork(self, "_lock")

    def report(self, kind: Fault, message: str, where: str = "") -> None:
        """Record a fault from any thread; :meth:`emit` warns about it."""
        with self._lock:
            self._pending.append((kind, message, where, os.getpid()))

    def warned(self, kind: Fault, where: str = "") -> bool:
        """Whether a fault of ``kind`` (in the tier ``where``) was warned about."""
        return (kind, where) in self._warned

    def warn(self, kind: Fault, message: str, where: str = "") -> None:
        """Warn now, once per kind and tier ``where`` (later ones are logged at DEBUG level)."""
        text = f"torchcache ({self.name}): {message}"
        if (kind, where) in self._warned or (self.shared is not None and not self.shared.first(kind, where)):
            self._warned.add((kind, where))
            logger.debug(text)
            return
        self._warned.add((kind, where))
        logger.warning(text)
        warnings.warn(text, CacheWarning, stacklevel=user_stacklevel())

    def emit(self) -> None:
        """Warn about the faults this process reported since the last call (not those a forked parent had left)."""
        if self._pending:
            with self._lock:
                faults, self._pending = self._pending, []
            here = os.getpid()
            for kind, message, where, pid in faults:
                if pid == here:
                    self.warn(kind, message, where)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside torchcache and torch."""
    frame = sys._getframe(2)  # the caller of the function that warns
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def full_hint(path: str | os.PathLike[str]) -> str:
    """`` (the file system is full)`` where ``path``'s file system has under 1 MiB free, else ``""``.

    LMDB reports a commit that found no room as an input/output error.
    """
    try:
        stats = os.statvfs(path)
    except OSError:
        return ""
    return " (the file system is full)" if stats.f_bavail * stats.f_frsize < 1 << 20 else ""
