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
    from ..tiers.persistent import PersistentTier
    from .engine import Cache

__all__ = ["track"]

_caches: weakref.WeakSet[Cache] = weakref.WeakSet()


def track(cache: Cache) -> None:
    """Flush ``cache`` and log its summary at exit (it is not kept alive for that)."""
    _caches.add(cache)


def _summarize_at_exit() -> None:
    """Flush every cache and log its summary at INFO level (interpreter exit).

    Entries that a server did not take (it was away, full or refused them) are counted in
    one warning per tier, whatever was warned before: none is lost silently.
    """
    told: set[int] = set()
    for cache in list(_caches):
        if cache._hits or cache._misses:  # counters, not stats(): those may ask a server
            cache.flush()
            disk = cache._disk  # the tier this cache wrote through (None: in memory)
            if disk is not None and id(disk) not in told:
                told.add(id(disk))
                _tell_unstored(cache, disk)
            if logger.isEnabledFor(logging.INFO):
                logger.info(cache.summary().removeprefix("torchcache "))  # the logger's name says it


def _tell_unstored(cache: Cache, disk: PersistentTier) -> None:
    copy = getattr(disk.store, "near_enabled", False)  # a local copy keeps them (unless it failed)
    unsent = getattr(disk.store, "unsent", None) if copy else None
    cause = f"could not be stored in {disk.where} (the server was away, full or refused them)"
    if unsent is not None and len(unsent):
        cache.faults.warn(
            Fault.UNSTORED,
            f"{plural(len(unsent), 'entry')} of the local copy {cause}; the copy keeps them, and the next process "
            "that uses it sends them once the server takes writes",
        )
    if unsent is not None and unsent.dropped:
        cache.faults.warn(
            Fault.UNSTORED,
            f"{plural(unsent.dropped, 'entry')} {cause}, and are not kept to send (the local copy had no room "
            "beside the entries it keeps to send, or they were removed from it): other machines compute them again",
            "dropped",
        )
    elif unsent is None and disk.unstored:
        cache.faults.warn(
            Fault.UNSTORED,
            f"{plural(len(disk.unstored), 'entry')} computed in this process {cause}; they are computed again when "
            "next needed",
        )


atexit.register(_summarize_at_exit)
