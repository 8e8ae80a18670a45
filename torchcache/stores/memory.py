"""The memory tier: item outputs kept in contiguous slabs, gathered with one copy.

Unlike the byte stores, the memory tier holds tensors: items of one layout sit as rows
of one slab per leaf, so a batch of hits is one ``index_select`` per leaf into a new
tensor (the only copy a hit makes). Slabs grow by doubling up to what the byte budget
allows, and rows freed by eviction are reused; a slab whose last row is evicted is
released. ``nbytes`` counts the rows that hold entries.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .._fork import renew_lock_after_fork
from ..batch import index_tensor
from ..policy import MruPolicy
from ..tree import Layout

__all__ = ["MemoryTier", "Slab"]

_MIN_ROWS = 16


class Slab:
    """Rows of one layout: one ``(capacity, *shape)`` tensor per leaf."""

    __slots__ = ("capacity", "count", "device", "free", "layout", "leaves", "live")

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.capacity = 0
        self.count = 0
        self.live = 0
        self.free: list[int] = []
        self.leaves: list[torch.Tensor] = [
            torch.empty((0, *leaf.shape), dtype=leaf.dtype, device=device) for leaf in layout.leaves
        ]

    def allocate(self, n: int, max_rows: int) -> list[int]:
        """Return ``n`` free row indices, growing the slab when needed."""
        rows = self.free[-n:] if n else []
        del self.free[len(self.free) - len(rows) :]
        need = n - len(rows)
        if need:
            if self.count + need > self.capacity:
                # Doubling copies each row once on average. The room allocated ahead of use
                # is never written until rows land there, so it takes no resident memory.
                grown = max(self.count + need, 2 * self.capacity, _MIN_ROWS)
                self._grow(min(grown, max(max_rows, self.count + need)))
            rows.extend(range(self.count, self.count + need))
            self.count += need
        self.live += n
        return rows

    def _grow(self, capacity: int) -> None:
        grown = []
        for leaf, old in zip(self.layout.leaves, self.leaves):
            new = torch.empty((capacity, *leaf.shape), dtype=leaf.dtype, device=self.device)
            if self.count:
                new[: self.count].copy_(old[: self.count])
            grown.append(new)
        self.leaves = grown
        self.capacity = capacity

    def release(self, row: int) -> None:
        """Return a row to the free list."""
        self.free.append(row)
        self.live -= 1


class MemoryTier:
    """Item outputs in memory, under a byte budget, with MRU eviction.

    Args:
        max_bytes: The budget for stored item bytes; 0 disables the tier.
        device: Where to keep outputs; ``None`` keeps them on the device they came from.
    """

    def __init__(self, max_bytes: int, device: torch.device | None = None) -> None:
        self.max_bytes = int(max_bytes)
        self.device = device
        self._index: dict[bytes, tuple[Slab, int]] = {}
        self._policy: MruPolicy[bytes] = MruPolicy()
        self._slabs: dict[tuple[Layout, str], Slab] = {}
        self._used = 0
        self.lock = threading.RLock()
        renew_lock_after_fork(self, "lock")

    def __repr__(self) -> str:
        return (
            f"MemoryTier(device={self.device}, max_bytes={self.max_bytes}, "
            f"nbytes={self._used}, entries={len(self._index)})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the stored items."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def find(self, keys: Sequence[bytes]) -> list[tuple[Slab, int] | None]:
        """Look keys up; every key found is marked as just used."""
        get = self._index.get
        found = [get(k) for k in keys]
        order = self._policy._order
        for key, hit in zip(keys, found):
            if hit is not None:
                del order[key]
                order[key] = None
        return found

    def put(self, keys: Sequence[bytes], layout: Layout, leaves: Sequence[torch.Tensor]) -> int:
        """Store items ``keys[i]`` whose outputs are ``leaf[i]`` for each leaf.

        Keys already present are skipped. When the budget is short, the most recently used
        entries are evicted; items that still do not fit are not stored.

        Returns:
            The number of items stored.
        """
        row_bytes = layout.nbytes
        if self.max_bytes <= 0 or row_bytes > self.max_bytes:
            return 0
        index = self._index
        seen: set[bytes] = set()
        positions = []
        for i, key in enumerate(keys):
            if key not in index and key not in seen:
                seen.add(key)
                positions.append(i)
        fit = self.max_bytes // row_bytes if row_bytes else len(positions)
        positions = positions[:fit]
        if not positions:
            return 0
        need = len(positions) * row_bytes
        while self._used + need > self.max_bytes:
            self._evict(self._policy.victim())
        device = self.device if self.device is not None else leaves[0].device
        slab_key = (layout, str(device))
        slab = self._slabs.get(slab_key)
        if slab is None:
            slab = self._slabs[slab_key] = Slab(layout, torch.device(device))
        max_rows = self.max_bytes // row_bytes if row_bytes else len(positions) + slab.count
        rows = slab.allocate(len(positions), max_rows)
        src_index = None if len(positions) == len(keys) else index_tensor(positions, leaves[0].device)
        dst_index = index_tensor(rows, device)
        for dst, src, spec in zip(slab.leaves, leaves, layout.leaves):
            values = src if src_index is None else src.index_select(0, src_index)
            dst.index_copy_(0, dst_index, values.to(device=device, dtype=spec.dtype))
        for pos, row in zip(positions, rows):
            key = keys[pos]
            index[key] = (slab, row)
            self._policy.add(key)
        self._used += need
        return len(positions)

    def _evict(self, key: bytes) -> None:
        slab, row = self._index.pop(key)
        slab.release(row)
        self._used -= slab.layout.nbytes
        if slab.live == 0:
            self._slabs.pop((slab.layout, str(slab.device)), None)

    def discard(self, key: bytes) -> None:
        """Remove one entry, if present."""
        if key in self._index:
            self._policy.discard(key)
            self._evict(key)

    def clear(self) -> None:
        """Remove every entry and release the slabs."""
        self._index.clear()
        self._policy.clear()
        self._slabs.clear()
        self._used = 0
