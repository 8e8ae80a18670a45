"""Eviction order and size parsing.

A policy only orders keys; the tier that owns it keeps the byte budget and runs one
loop: ``if size > max: do not store; while used + size > max: evict(policy.victim())``.
The default policy is MRU (most recently used goes first): with shuffled epochs over
more items than fit, LRU would evict every item just before it is needed again, while
MRU keeps a stable subset and settles near a hit rate of capacity / items.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterator
from decimal import Decimal, DecimalException
from typing import Generic, TypeVar

import numpy as np

from .errors import ConfigError

__all__ = ["MAX_SIZE", "LruPolicy", "MruPolicy", "format_size", "parse_size", "plural"]

K = TypeVar("K", bound=Hashable)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}
#: The largest byte count accepted (2**64, more than any file system holds).
MAX_SIZE = 2**64
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Parse a byte count given as a number or a string such as ``"2GB"`` or ``"500MiB"``.

    Args:
        value: Bytes as an int or float (``1e9``), or a string with a decimal (KB, MB, GB,
            TB) or binary (KiB, MiB, GiB, TiB) unit.
        name: The argument name used in error messages.

    Returns:
        The number of bytes, rounded down.

    Raises:
        ConfigError: If the value is negative, not a number, larger than :data:`MAX_SIZE`,
            or has an unknown unit.

    Example:
        >>> parse_size("2GB"), parse_size("500MiB"), parse_size(1e9)
        (2000000000, 524288000, 1000000000)
    """
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be a byte count such as 1e9 or '2GB', got {value!r}")
    if isinstance(value, (np.integer, np.floating)):  # a size computed with numpy
        value = value.item()
    if isinstance(value, int):
        number = Decimal(value)
        unit = 1
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite, non-negative byte count, got {value!r}")
        number = Decimal(value)
        unit = 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit_name = match.group(2).upper() if match else None
        if match is None or unit_name not in _UNITS:
            raise ConfigError(f"{name} must be a byte count such as 1e9, '2GB' or '500MiB', got {value!r}")
        number = Decimal(match.group(1))  # exact: "2.01kB" is 2010 bytes, not 2009
        unit = _UNITS[unit_name]
    else:
        raise ConfigError(
            f"{name} must be a byte count (int, float or a string such as '2GB'), got {type(value).__name__}"
        )
    if number < 0:
        raise ConfigError(f"{name} must be a finite, non-negative byte count, got {value!r}")
    try:
        # Compare exponents first: "1e999999999" would overflow the decimal context.
        if number.adjusted() > 30 or number * unit > MAX_SIZE:
            raise DecimalException
    except DecimalException:
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise ConfigError(f"{name} must be at most {MAX_SIZE} bytes (about 18 EB), got {shown!r}") from None
    return int(number * unit)


_PLURALS = {"entry": "entries", "miss": "misses", "index": "indexes"}


def plural(n: int, word: str, many: str = "") -> str:
    """``n`` (thousands separated) and ``word``, or its plural (``many``, else ``word + "s"``) unless ``n`` is 1."""
    return f"{n:,} {word if n == 1 else many or _PLURALS.get(word, word + 's')}"


def format_size(num_bytes: float) -> str:
    """Format a byte count for humans, with decimal units.

    Example:
        >>> format_size(0), format_size(1536), format_size(2.5e9)
        ('0 B', '1.5 kB', '2.5 GB')
    """
    size = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


class MruPolicy(Generic[K]):
    """Orders keys so that the most recently used one is evicted first.

    Example:
        >>> p = MruPolicy[str]()
        >>> for k in "abc":
        ...     p.add(k)
        >>> p.touch("a")
        >>> p.victim()
        'a'
    """

    evicts_recent = True

    def __init__(self) -> None:
        self._order: dict[K, None] = {}

    def add(self, key: K) -> None:
        """Record a new key as the most recent one."""
        self._order.pop(key, None)
        self._order[key] = None

    def touch(self, key: K) -> None:
        """Mark a known key as just used; unknown keys are ignored."""
        order = self._order
        if key in order:
            del order[key]
            order[key] = None

    def discard(self, key: K) -> None:
        """Forget a key, if known."""
        self._order.pop(key, None)

    def victim(self) -> K:
        """Remove and return the key to evict next.

        Raises:
            KeyError: If no key is known.
        """
        if not self._order:
            raise KeyError("no key to evict")
        key = next(reversed(self._order)) if self.evicts_recent else next(iter(self._order))
        del self._order[key]
        return key

    def clear(self) -> None:
        """Forget every key."""
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        """Iterate from the least to the most recently used key."""
        return iter(list(self._order))


class LruPolicy(MruPolicy[K]):
    """Orders keys so that the least recently used one is evicted first."""

    evicts_recent = False
