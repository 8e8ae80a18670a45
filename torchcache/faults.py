"""Faults of the cache become one warning per kind, on the caller's thread.

Writer and reader threads *report* faults (a full disk, a corrupt entry); the thread
that calls the cache *emits* them as a :class:`~torchcache.errors.CacheWarning` (once
per kind, later ones at DEBUG level) and a log line. Reporting takes only its own
lock, never the cache's: a caller may hold the cache lock while it waits for the very
thread that reports (``clear()``, a re-key after ``load_state_dict()``).
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path

import torch

from ._fork import renew_lock_after_fork
from ._log import logger
from .errors import CacheWarning

__all__ = ["FaultLog"]

_LIBRARY_DIRS = (str(Path(__file__).parent), str(Path(torch.__file__).parent))


class FaultLog:
    """Faults of one cache: reported from any thread, warned about once per kind.

    Args:
        name: The cache's name, the prefix of every message.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.warned: set[str] = set()
        self._pending: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        renew_lock_after_fork(self, "_lock")

    def report(self, kind: str, message: str) -> None:
        """Record a fault from any thread; :meth:`emit` warns about it."""
        with self._lock:
            self._pending.append((kind, message))

    def warn(self, kind: str, message: str) -> None:
        """Warn now, once per kind (later faults of that kind are logged at DEBUG level)."""
        text = f"torchcache ({self.name}): {message}"
        if kind in self.warned:
            logger.debug(text)
            return
        self.warned.add(kind)
        logger.warning(text)
        warnings.warn(text, CacheWarning, stacklevel=_user_stacklevel())

    def emit(self) -> None:
        """Warn about the faults reported since the last call."""
        if self._pending:
            with self._lock:
                faults, self._pending = self._pending, []
            for kind, message in faults:
                self.warn(kind, message)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside torchcache and torch."""
    frame = sys._getframe(2)  # the caller of the function that warns
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
