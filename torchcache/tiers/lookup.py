"""Look a batch of keys up in tiers, fastest first, and copy hits up to the faster tiers.

Every product keeps its entries in tiers ordered by speed: the decorator in memory over
disk, a cached dataset in RAM over disk, a Redis store behind a local copy. A batch is
looked up in the first tier, its misses in the next, and so on; the hits of a slower tier
are copied into each faster one (so the next epoch finds them there), and what no tier
holds is left for the caller to compute. :func:`look_up` is that loop, once, for all of
them. A tier is any object with ``find`` and ``keep`` (:class:`Tier`); its faults are its
own to report (a tier that cannot be read finds nothing, one that cannot be written keeps
nothing), so a fault never fails the lookup.

Example:
    >>> class Dict:
    ...     def __init__(self, entries): self.entries = entries
    ...     def find(self, keys):
    ...         at = [i for i, k in enumerate(keys) if k in self.entries]
    ...         return [(at, [self.entries[keys[i]] for i in at])] if at else []
    ...     def keep(self, keys, values): self.entries.update(zip(keys, values))
    >>> fast, slow = Dict({"a": 1}), Dict({"b": 2})
    >>> look_up([fast, slow], ["a", "b", "c"])
    Lookup(parts=[Part(tier=0, positions=[0], values=[1]), Part(tier=1, positions=[1], values=[2])], missing=[2])
    >>> fast.entries
    {'a': 1, 'b': 2}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

__all__ = ["Lookup", "Part", "Tier", "hits_of", "look_up"]

K = TypeVar("K")
V = TypeVar("V")
K_contra = TypeVar("K_contra", contravariant=True)


class Tier(Protocol[K_contra, V]):
    """What :func:`look_up` needs of a tier: find a batch of keys, keep hits found below."""

    def find(self, keys: Sequence[K_contra]) -> list[tuple[list[int], V]]:
        """The hits among ``keys``: parts of (positions into ``keys``, their values)."""
        ...

    def keep(self, keys: Sequence[K_contra], values: V) -> None:
        """Store entries found in a slower tier (``values`` as its ``find`` returned them)."""
        ...


class Part(NamedTuple, Generic[V]):
    """Hits of one tier: which tier, the positions into the batch, their values."""

    tier: int
    positions: list[int]
    values: V


class Lookup(NamedTuple, Generic[V]):
    """The result of :func:`look_up`: the hits, part by part, and the positions no tier holds (ascending)."""

    parts: list[Part[V]]
    missing: list[int]


def look_up(
    tiers: Sequence[Tier[K, V]],
    keys: Sequence[K],
    *,
    pending: list[int] | None = None,
    searched: int = 0,
    agree: Callable[[V, V], bool] | None = None,
) -> Lookup[V]:
    """Look ``keys`` up in ``tiers`` in order and copy each tier's hits into the faster ones.

    Args:
        tiers: The tiers, fastest first.
        keys: The batch's keys.
        pending: The positions still to look up, ascending (default: all of them).
        searched: How many of the first tiers were already searched for this batch by
            the caller (a fast path of its own): they only receive copies.
        agree: ``agree(first, value)`` says whether a part found later can be served
            with the first one (the decorator's parts must share one layout); a part
            that does not agree is left missing and not copied up.

    Returns:
        The hits and the positions that were found nowhere.
    """
    todo = list(range(len(keys))) if pending is None else pending
    parts: list[Part[V]] = []
    for level in range(searched, len(tiers)):
        if not todo:
            break
        found = tiers[level].find([keys[i] for i in todo])
        taken: set[int] = set()
        for at, values in found:
            if agree is not None and parts and not agree(parts[0].values, values):
                continue
            positions = [todo[j] for j in at]
            parts.append(Part(level, positions, values))
            taken.update(positions)
            if level:
                batch_keys = [keys[p] for p in positions]
                for upper in tiers[:level]:
                    upper.keep(batch_keys, values)
        if taken:
            todo = [i for i in todo if i not in taken] if len(taken) < len(todo) else []
    return Lookup(parts, todo)


def hits_of(values: Sequence[V | None]) -> list[tuple[list[int], list[V]]]:
    """The parts a :meth:`Tier.find` returns for per-key results (``None``: a miss).

    Example:
        >>> hits_of([b"x", None, b"z"])
        [([0, 2], [b'x', b'z'])]
    """
    at = [i for i, value in enumerate(values) if value is not None]
    return [(at, [values[i] for i in at])] if at else []  # type: ignore[misc]
