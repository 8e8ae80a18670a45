"""Cache statistics, as plain dataclasses (``dataclasses.asdict`` works on them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats", "TierStats"]


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
