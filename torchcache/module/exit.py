"""At interpreter exit: each cache used in the process flushed, its summary logged, unstored entries told."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING

from .._log import logger
from ..faults import Fault
from ..policy import plural

if TYPE_CHECKING:
    from .engine import Cache

__all__ = ["track"]

_caches: weakref.WeakSet[Cache] = weakref.WeakSet()


def track(cache: Cache) -> None:
    """Flush ``cache`` and log its summary at exit (it is not kept alive for that)."""
    _caches.add(cache)


def _summarize_at_exit() -> None:
    """Flush every cache and log its summary at INFO level (interpreter exit).

    Entries that a server did not take in this process (it was away or full) are counted
    in one warning per tier, whatever was warned before: none is lost silently.
    """
    told: set[int] = set()
    for cache in list(_caches):
        stats = cache.stats()
        if stats.hits or stats.misses:
            cache.flush()
            disk = cache._disk  # the tier this cache wrote through (None: in memory)
            if disk is not None and disk.unstored and id(disk) not in told:
                told.add(id(disk))
                cache.faults.warn(
                    Fault.UNSTORED,
                    f"{plural(len(disk.unstored), 'entry')} computed in this process could not be stored in "
                    f"{disk.where} (the server was away or full); they are computed again when next needed",
                )
            if logger.isEnabledFor(logging.INFO):
                logger.info(cache.summary().removeprefix("torchcache "))  # the logger's name says it


atexit.register(_summarize_at_exit)
