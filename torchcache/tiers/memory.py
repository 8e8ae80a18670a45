"""The memory tier: item outputs kept in contiguous slabs, gathered with one copy.

Unlike the byte stores, the memory tier holds tensors: items of one layout sit as rows
of one slab per leaf, so a batch of hits is one ``index_select`` per leaf into a new
tensor (the only copy a hit makes). ``nbytes`` counts the rows that hold entries and
their index: :data:`ENTRY_BYTES` per entry (its key, its place and its turn in the MRU
order, measured), so that a budget holds for small outputs too.

The budget bounds what the slabs allocate, not only the rows in use: the capacity of
every slab together (:attr:`MemoryTier.allocated_bytes`) and the index never exceed
``max_bytes``, whatever the number of layouts. Slabs grow by doubling, capped by the budget that the
other slabs leave; rows freed by eviction are reused; a slab whose last row goes is
released. When a slab must grow and the others hold the room, the slabs with the most
unused rows are compacted (their live rows move to a smaller tensor). The one overhead
(:data:`CAPACITY_OVERHEAD`, 0) is transient: while a slab is grown or compacted, its old
and new tensors both exist until the copy is done. Rows move only inside :meth:`put`,
under ``lock``, so ``(slab, row)`` pairs from :meth:`find` stay valid while it is held.

Freed slabs are handed back to the system: glibc's allocator raises its threshold for
serving large blocks from the heap each time one is freed, and slabs of changing sizes
then fragment the heap (resident memory twice the budget was measured with outputs
whose width changes from call to call). After a slab of several MB is released or
compacted, ``malloc_trim`` returns the free pages (on glibc; elsewhere nothing happens).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Sequence

import torch

from .._fork import renew_lock_after_fork
from ..policy import MruPolicy
from ..tree import Layout
from .batch import index_tensor, run_start

__all__ = ["CAPACITY_OVERHEAD", "ENTRY_BYTES", "MemoryLevel", "MemoryTier", "Slab"]

#: Resident bytes of one entry's index in Python (its key, its place, its row number, its MRU
#: turn): 265-290 allocated (tracemalloc), 450-575 resident once entries come and go (the
#: allocator's pools fragment, dict tables do not shrink; 4-byte outputs, 0.3-1.4 M entries).
ENTRY_BYTES = 640

_MIN_ROWS = 16
#: How far, as a fraction of ``max_bytes``, the slabs' allocated capacity may exceed the
#: budget between calls (0: never; see the module docstring for the transient copy).
CAPACITY_OVERHEAD = 0.0
#: Bytes of slabs freed at once from which the free pages are handed back to the system.
TRIM_BYTES = 4 << 20


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


_trim = _load_trim()


def release_freed(nbytes: int) -> None:
    """Hand the heap's free pages back to the system after ``nbytes`` of slabs were freed (if many)."""
    if _trim is not None and nbytes >= TRIM_BYTES:
        _trim(0)


class Slab:
    """Rows of one layout: one ``(capacity, *shape)`` tensor per leaf.

    Rows ``[0, count)`` have been handed out; those not in ``free`` hold the entry whose
    key is ``keys[row]``.
    """

    __slots__ = ("capacity", "count", "device", "free", "keys", "layout", "leaves", "live")

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.capacity = 0
        self.count = 0
        self.live = 0
        self.free: list[int] = []
        self.keys: list[bytes | None] = []
        self.leaves: list[torch.Tensor] = [
            torch.empty((0, *leaf.shape), dtype=leaf.dtype, device=device) for leaf in layout.leaves
        ]

    @property
    def spare(self) -> int:
        """Rows that can take an entry without growing the slab."""
        return self.capacity - self.live

    @property
    def nbytes(self) -> int:
        """Bytes the slab's tensors allocate."""
        return self.capacity * self.layout.nbytes

    def allocate(self, keys: Sequence[bytes]) -> list[int]:
        """Hand out one row per key (free rows first); the slab must have the room.

        Raises:
            ValueError: If ``keys`` has more items than :attr:`spare`.
        """
        n = len(keys)
        if n > self.spare:
            raise ValueError(f"a slab with {self.spare} spare rows cannot take {n} entries; grow it first")
        rows = self.free[-n:] if n else []
        del self.free[len(self.free) - len(rows) :]
        need = n - len(rows)
        rows.extend(range(self.count, self.count + need))
        self.count += need
        self.keys.extend([None] * need)
        for row, key in zip(rows, keys):
            self.keys[row] = key
        self.live += n
        return rows

    def grow(self, capacity: int) -> None:
        """Reallocate with room for ``capacity`` rows; rows keep their indices."""
        grown = []
        for leaf, old in zip(self.layout.leaves, self.leaves):
            new = torch.empty((capacity, *leaf.shape), dtype=leaf.dtype, device=self.device)
            if self.count:
                new[: self.count].copy_(old[: self.count])
            grown.append(new)
        self.leaves = grown
        self.capacity = capacity

    def compact(self) -> list[tuple[bytes, int]]:
        """Move the live rows to the front of tensors of exactly that many rows.

        Returns:
            ``(key, new row)`` for every entry of the slab.
        """
        rows = [row for row, key in enumerate(self.keys) if key is not None]
        index = index_tensor(rows, self.device)
        self.leaves = [leaf.index_select(0, index) for leaf in self.leaves]
        self.keys = [self.keys[row] for row in rows]
        self.capacity = self.count = self.live = len(rows)
        self.free = []
        return [(key, row) for row, key in enumerate(self.keys) if key is not None]

    def release(self, row: int) -> None:
        """Return a row to the free list."""
        self.free.append(row)
        self.keys[row] = None
        self.live -= 1


class MemoryTier:
    """Item outputs in memory, under a byte budget, with MRU eviction.

    Args:
        max_bytes: The budget for stored item bytes and for the slabs that hold them;
            0 disables the tier.
        device: Where to keep outputs; ``None`` keeps them on the device they came from.
        entry_bytes: What one entry's index costs, charged to the budget.
    """

    def __init__(self, max_bytes: int, device: torch.device | None = None, entry_bytes: int = ENTRY_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self.entry_bytes = entry_bytes
        self.device = device
        self._index: dict[bytes, tuple[Slab, int]] = {}
        self._policy: MruPolicy[bytes] = MruPolicy()
        self._slabs: dict[tuple[Layout, str], Slab] = {}
        self._used = 0
        self._allocated = 0
        self.lock = threading.RLock()
        renew_lock_after_fork(self, "lock")

    def __repr__(self) -> str:
        return (
            f"MemoryTier(device={self.device}, max_bytes={self.max_bytes}, "
            f"nbytes={self._used}, allocated={self._allocated}, entries={len(self._index)})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the stored items, and ``entry_bytes`` for each one's index."""
        return self._used

    @property
    def allocated_bytes(self) -> int:
        """Bytes the slabs allocate (stored items and rows kept for reuse)."""
        return self._allocated

    def slabs(self) -> list[Slab]:
        """The slabs in use."""
        return list(self._slabs.values())

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def find(self, keys: Sequence[bytes]) -> list[tuple[Slab, int] | None]:
        """Look keys up; every key found is marked as just used."""
        if not self._index:
            return [None] * len(keys)
        get = self._index.get
        found = [get(k) for k in keys]
        order = self._policy._order
        for key, hit in zip(keys, found):
            if hit is not None:
                del order[key]
                order[key] = None
        return found

    @torch.inference_mode(False)  # slabs are plain tensors, written whatever mode the call runs in
    def put(self, keys: Sequence[bytes], layout: Layout, leaves: Sequence[torch.Tensor]) -> int:
        """Store items ``keys[i]`` whose outputs are ``leaf[i]`` for each leaf.

        Keys already present are skipped. When the budget is short, the most recently used
        entries are evicted; items that still do not fit are not stored.

        Returns:
            The number of items stored.
        """
        row_bytes = layout.nbytes
        if self.max_bytes <= 0 or row_bytes + self.entry_bytes > self.max_bytes:
            return 0
        index = self._index
        seen: set[bytes] = set()
        positions = []
        for i, key in enumerate(keys):
            if key not in index and key not in seen:
                seen.add(key)
                positions.append(i)
        positions = positions[: self.max_bytes // (row_bytes + self.entry_bytes)]
        if not positions:
            return 0
        need = len(positions) * (row_bytes + self.entry_bytes)
        while self._used + need > self.max_bytes:
            self._evict(self._policy.victim())
        device = self.device if self.device is not None else leaves[0].device
        slab_key = (layout, str(device))
        slab = self._slabs.get(slab_key)
        if slab is None:
            slab = self._slabs[slab_key] = Slab(layout, torch.device(device))
        if slab.spare < len(positions):
            self._grow(slab, slab.live + len(positions))
        new_keys = [keys[pos] for pos in positions]
        rows = slab.allocate(new_keys)
        src_index = None if len(positions) == len(keys) else index_tensor(positions, leaves[0].device)
        # rows handed out at the end of a slab are one slice: a plain copy, 5x faster than index_copy_
        dst_index = None if run_start(rows) is not None else index_tensor(rows, device)
        for dst, src, spec in zip(slab.leaves, leaves, layout.leaves):
            values = (src if src_index is None else src.index_select(0, src_index)).to(device=device, dtype=spec.dtype)
            if dst_index is None:
                dst.narrow(0, rows[0], len(rows)).copy_(values)
            else:
                dst.index_copy_(0, dst_index, values)
        for key, row in zip(new_keys, rows):
            index[key] = (slab, row)
            self._policy.add(key)
        self._used += need
        over = self._allocated + len(index) * self.entry_bytes - self.max_bytes
        if over > 0:  # the new entries' index took room that unused rows held
            self._reclaim(over, keep=None)
        return len(positions)

    def _grow(self, slab: Slab, minimum: int) -> None:
        """Give ``slab`` room for ``minimum`` rows, within the budget the other slabs leave.

        Doubling (at least ``_MIN_ROWS`` rows) copies each row once on average. When the
        other slabs hold the room, the ones with the most unused rows are compacted first;
        the eviction before this call made sure that is enough.
        """
        row_bytes = slab.layout.nbytes
        target = max(minimum, 2 * slab.capacity, _MIN_ROWS)
        if row_bytes:  # the index of the entries there will be takes its share first
            limit = (
                int(self.max_bytes * (1 + CAPACITY_OVERHEAD))
                - (len(self._index) + minimum - slab.live) * self.entry_bytes
            )
            room = limit - (self._allocated - slab.nbytes)
            if room < minimum * row_bytes:
                self._reclaim(minimum * row_bytes - room, keep=slab)
                room = limit - (self._allocated - slab.nbytes)
            target = max(minimum, min(target, room // row_bytes))
        before = slab.nbytes
        self._allocated -= before
        slab.grow(target)
        self._allocated += slab.nbytes
        if slab.device.type == "cpu":
            release_freed(before)  # the slab's old tensors

    def _reclaim(self, nbytes: int, keep: Slab | None) -> None:
        """Compact slabs other than ``keep``, most unused bytes first, to free ``nbytes``."""
        others = sorted(
            (s for s in self._slabs.values() if s is not keep and s.spare),
            key=lambda s: s.spare * s.layout.nbytes,
            reverse=True,
        )
        for other in others:
            if nbytes <= 0:
                return
            before = other.nbytes
            for key, row in other.compact():
                self._index[key] = (other, row)
            self._allocated -= before - other.nbytes
            nbytes -= before - other.nbytes
            release_freed(before - other.nbytes)

    def _evict(self, key: bytes) -> None:
        slab, row = self._index.pop(key)
        slab.release(row)
        self._used -= slab.layout.nbytes + self.entry_bytes
        if slab.live == 0:
            self._slabs.pop((slab.layout, str(slab.device)), None)
            self._allocated -= slab.nbytes
            if slab.device.type == "cpu":
                release_freed(slab.nbytes)

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
        freed, self._allocated = self._allocated, 0
        release_freed(freed)


class MemoryLevel:
    """The memory tier: keeps rows found on disk (it is searched before the lookup)."""

    def __init__(self, memory: MemoryTier) -> None:
        self.memory = memory

    def find(self, keys: Sequence[bytes]) -> list[tuple[list[int], tuple[Layout, list[torch.Tensor]]]]:
        """Not used: the engine searches the memory tier itself, under its lock."""
        raise AssertionError("the engine searches the memory tier itself")

    def keep(self, keys: Sequence[bytes], values: tuple[Layout, list[torch.Tensor]]) -> None:
        """Store rows found on disk, as far as the budget allows."""
        if self.memory.max_bytes > 0:
            with self.memory.lock:
                self.memory.put(keys, values[0], values[1])
