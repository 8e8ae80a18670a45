"""One persistent tier per module directory, disk settings and process, shared by the caches of that key.

Caches with the same key (two instances of one model, a deep copy, a re-created
function) then see each other's entries, pending writes included, and faults of the
tier reach each of them. A tier lives while a cache uses it.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

from .._fork import after_fork
from ..errors import StoreError
from ..faults import FaultLog
from .local import open_local_tier
from .persistent import PersistentTier

__all__ = ["SharedTier", "open_shared_tier"]


class SharedTier:
    """A persistent tier and the fault logs of the caches that use it."""

    def __init__(self) -> None:
        self.tier: PersistentTier | None = None
        self.users: weakref.WeakSet[FaultLog] = weakref.WeakSet()
        self.lock = threading.Lock()

    def report(self, kind: str, message: str) -> None:
        """Hand a fault of the tier to every cache that uses it."""
        for faults in list(self.users):
            faults.report(kind, message)


_tiers: weakref.WeakValueDictionary[str, SharedTier] = weakref.WeakValueDictionary()
_tiers_lock = threading.Lock()


def _new_locks_after_fork() -> None:
    global _tiers_lock
    _tiers_lock = threading.Lock()
    for shared in list(_tiers.values()):
        shared.lock = threading.Lock()


after_fork(_new_locks_after_fork)


def open_shared_tier(
    directory: Path, max_bytes: int, quality: int, meta: dict[str, Any], faults: FaultLog
) -> tuple[SharedTier, PersistentTier | None]:
    """The shared tier of ``directory`` with these disk settings, created at first use.

    Returns:
        The shared tier (keep a reference while using it) and its persistent tier, or ``None``
        when the directory cannot be used (``faults`` was warned).
    """
    key = f"{directory}|{max_bytes}|{quality}"
    with _tiers_lock:
        shared = _tiers.get(key)
        if shared is None:
            shared = _tiers[key] = SharedTier()
    shared.users.add(faults)
    with shared.lock:
        if shared.tier is None:
            try:
                shared.tier = open_local_tier(directory, max_bytes, quality, meta, shared.report)
            except StoreError as exc:
                faults.warn("write", f"{exc}; caching in memory only")
        return shared, shared.tier
