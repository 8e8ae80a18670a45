"""Cache statistics, as plain dataclasses (``dataclasses.asdict`` works on them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._log import logger
from .policy import format_size, plural

__all__ = ["SUMMARY_INTERVAL", "CacheStats", "PeriodicSummary", "TierStats", "format_summary"]

#: Seconds between the INFO-level summaries a cache logs while it is being used.
SUMMARY_INTERVAL = 60.0


@dataclass(frozen=True)
class TierStats:
    """One tier: entries held, bytes held, its byte budget, and items served from it."""

    entries: int
    bytes: int
    max_bytes: int
    hits: int


@dataclass(frozen=True)
class CacheStats:
    """A decorated module's or function's cache.

    ``hits`` and ``misses`` count batch items over every tier; ``disk`` is ``None`` when
    the cache is not persistent.
    """

    hits: int
    misses: int
    hit_rate: float
    memory: TierStats
    disk: TierStats | None


def format_summary(name: str, key: str | None, stats: CacheStats) -> str:
    """A one-line summary: hits, misses, hit rate, and each tier against its budget."""
    tiers = [f"memory {_tier(stats.memory)}"]
    if stats.disk is not None:
        tiers.append(f"disk {_tier(stats.disk)}")
    return (
        f"torchcache {name} [{key or '-'}]: {plural(stats.hits, 'hit')}, {plural(stats.misses, 'miss')}, "
        f"hit rate {stats.hit_rate:.1%}; {'; '.join(tiers)}"
    )


def _tier(tier: TierStats) -> str:
    return f"{plural(tier.entries, 'entry')} {format_size(tier.bytes)}/{format_size(tier.max_bytes)}"


class PeriodicSummary:
    """Logs a cache's one-line summary at INFO level once every :data:`SUMMARY_INTERVAL` seconds."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def tick(self, summary: Callable[[], str]) -> None:
        """Log ``summary()`` (made only then) if the interval has passed since the last one."""
        now = time.monotonic()
        if now - self._last >= SUMMARY_INTERVAL:
            self._last = now
            if logger.isEnabledFor(logging.INFO):
                logger.info(summary().removeprefix("torchcache "))  # the logger's name says it
