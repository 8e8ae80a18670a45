"""Exceptions and the warning class of torchcache.

Every exception derives from :class:`TorchCacheError` and also from the builtin
exception a user would naturally catch, so ``except ValueError`` keeps working.
Faults of the cache itself (a corrupt file, a full disk) never reach the caller
of a cached forward pass: they become a :class:`CacheWarning` and a recompute.
"""

from __future__ import annotations

__all__ = [
    "CacheLookupError",
    "CacheWarning",
    "ConfigError",
    "CorruptEntryError",
    "KeyingError",
    "StoreError",
    "StoreUnavailableError",
    "TorchCacheError",
]


class TorchCacheError(Exception):
    """Base class of every exception raised by torchcache."""


class ConfigError(TorchCacheError, ValueError):
    """An argument of the decorator or of a store has an invalid value."""


class KeyingError(TorchCacheError, TypeError, ValueError):
    """An input or output cannot be turned into a cache key or entry.

    It is both a :class:`TypeError` and a :class:`ValueError`: torchcache 0.6 raised
    ``ValueError`` for calls it could not key, so ``except ValueError`` keeps working.

    Attributes:
        path: Where the value that cannot be keyed was found (``Net.encoder.lock``), when known.
    """

    path: str | None = None


class CorruptEntryError(TorchCacheError, ValueError):
    """A stored entry failed its frame or checksum validation."""


class StoreError(TorchCacheError, OSError):
    """A store could not read or write its backing storage."""


class StoreUnavailableError(StoreError):
    """A store's server cannot be reached for now; it may come back, so writes are retried later."""


class CacheLookupError(TorchCacheError, LookupError):
    """No cache, or more than one, under a root matches what was asked for."""


class CacheWarning(UserWarning):
    """The cache degraded (an entry was dropped, a tier was disabled); results are unaffected."""
