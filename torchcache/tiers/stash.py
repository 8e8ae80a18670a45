"""Entries a shared store read beyond what a batch asked for, held in RAM until a later batch asks.

A bucket reads whole segments; once the local copy in front of it is full, the rest of
each segment waits in a :class:`Stash` of :data:`STASH_BYTES`, where the next batches of
a windowed order (:class:`~torchcache.datasets.sampler.WindowSampler`) find it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from .lookup import hits_of

__all__ = ["STASH_BYTES", "Stash"]

#: Bytes of entries a layered store holds in RAM, read with a batch's segments but not
#: asked for, while its local copy is full.
STASH_BYTES = 64 << 20


class Stash:
    """Entries read with a batch's segments but not asked for, in RAM, oldest out first; a hit takes one out.

    Each is a copy of its bytes, so the stash holds what it counts and no segment behind it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, extras: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Hold copies of ``extras`` (the oldest go past :attr:`max_bytes`; larger ones are not held)."""
        with self._lock:
            for key, data in extras:
                if len(data) > self.max_bytes:
                    continue
                old = self._entries.pop(key, None)
                self.nbytes += len(data) - (0 if old is None else len(old))
                self._entries[key] = bytes(data)
            while self.nbytes > self.max_bytes:
                self.nbytes -= len(self._entries.popitem(last=False)[1])

    def drop(self, keys: Sequence[str] | None) -> None:
        """Forget ``keys`` (``None``: everything)."""
        with self._lock:
            if keys is None:
                self._entries.clear()
                self.nbytes = 0
            for key in keys or ():
                data = self._entries.pop(key, None)
                self.nbytes -= 0 if data is None else len(data)

    def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[bytes | memoryview]]]:
        """The entries held of ``keys``, taken out (see :func:`~torchcache.tiers.lookup.look_up`)."""
        if not self._entries:
            return []
        with self._lock:
            taken = [self._entries.pop(key, None) for key in keys]
            self.nbytes -= sum(len(data) for data in taken if data is not None)
        return hits_of(taken)

    def keep(self, keys: Sequence[str], values: list[bytes | memoryview]) -> None:
        """Entries the shared store served are served: nothing to keep."""
