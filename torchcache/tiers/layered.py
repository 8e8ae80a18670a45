"""A local store in front of a shared one: repeated hits never cross the network.

:class:`LayeredStore` keeps a local copy (a :class:`~torchcache.stores.packed.store.PackedStore`
on a node's disk) of the entries of a shared store (a Redis server or cluster, a bucket) that this
machine read or wrote. A batch is looked up in the local copy first and only its misses
go to the server, in one round trip; the entries found there are copied into the local
copy. Writes go to both.

The shared store is the authority on what the cache holds (``len``, ``keys``, its
budget); the local copy holds a subset, under its own budget, with its own MRU
eviction. An entry is the output of a keyed computation, so a copy is never stale: an
entry the server evicted or another job cleared is still correct where a copy has it.

A shared store may read more than a batch asks for (a bucket's whole segments): the local
copy keeps the rest while it has room. Once it is full, the rest waits in a small
*stash* in RAM (:data:`STASH_BYTES`, oldest out first), where the next batches of a
windowed order (:class:`~torchcache.datasets.sampler.WindowSampler`) find it: each
segment is then fetched once per epoch, not once per batch.

Faults of the local copy (a full or read-only disk, a damaged file) are reported once
under the kind ``"local"`` and turn the copy off for this process; the shared store
keeps working. Faults of the shared store reach the caller as they would without a
copy, while local hits keep being served.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from .._gc import collector_paused
from ..errors import StoreError
from ..faults import Fault, Report
from ..stores.batched import BatchedStore, VerifyReport
from .lookup import hits_of, look_up

__all__ = ["STASH_BYTES", "LayeredStore"]

#: Bytes of entries a layered store holds in RAM, read with a batch's segments but not
#: asked for, while its local copy is full.
STASH_BYTES = 64 << 20


class LayeredStore(BatchedStore):
    """A local copy in front of a shared store.

    Args:
        near: The local copy (on this machine's disk).
        far: The shared store (on a server); its budget is the store's budget.
        report: Called with ``("local", message)`` when the local copy fails.
    """

    remote = True

    def __init__(self, near: BatchedStore, far: BatchedStore, report: Report, stash_bytes: int = STASH_BYTES) -> None:
        self.near = near
        self.far = far
        self.max_bytes = far.max_bytes
        self._report = report
        self._near_on = True
        self._lock = threading.Lock()
        self.stash = _Stash(stash_bytes)
        #: Hits served by the local copy and by the shared store, in this process.
        self.served = [0, 0]

    def __repr__(self) -> str:
        return f"LayeredStore(near={self.near!r}, far={self.far!r})"

    @property
    def near_enabled(self) -> bool:
        """Whether the local copy is still used (a fault turns it off)."""
        return self._near_on

    def _near_failed(self, exc: StoreError, doing: str) -> None:
        with self._lock:
            if not self._near_on:
                return
            self._near_on = False
        self._report(Fault.LOCAL, f"cannot {doing} the local copy {self.near} ({exc}); using the shared store alone")

    # -- reads --------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """Each key's bytes from the local copy, else from the shared store (then copied locally)."""
        found: list[bytes | memoryview | None] = [None] * len(keys)
        near = _Near(self)
        with collector_paused():  # whole segments fetched and copied: a burst of short-lived objects
            for tier, positions, datas in look_up((near, self.stash, _Far(self)), keys).parts:
                self.served[min(tier, 1)] += len(positions)  # the stash's hits came from the shared store
                for i, data in zip(positions, datas):
                    found[i] = data
            extras = self.far.take_extras()  # the rest of whole segments the shared store read
            if extras and self.far.prefetch:  # the local copy had room
                near.keep([key for key, _ in extras], [data for _, data in extras])
            elif extras:
                self.stash.add(extras)
        return found

    def placement(self, keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
        """The shared store's placement of the keys the local copy lacks (``None`` for those it has).

        With ``shared``, of every key: the local copy is left out.
        """
        near = self.near if self._near_on and not shared else None
        lacking = [i for i, key in enumerate(keys) if near is None or key not in near]
        out: list[tuple[str, int] | None] = [None] * len(keys)
        for i, place in zip(lacking, self.far.placement([keys[i] for i in lacking])):
            out[i] = place
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.far

    def reads_failing(self, retry: bool = False) -> bool:
        """Whether the last read of the shared store failed (``retry``: send its next read at once)."""
        return self.far.reads_failing(retry)

    def keys(self) -> Iterator[str]:
        """The shared store's keys."""
        return self.far.keys()

    def __len__(self) -> int:
        """Entries in the shared store."""
        return len(self.far)

    @property
    def nbytes(self) -> int:
        """Payload bytes in the shared store."""
        return self.far.nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes the local copy takes on disk."""
        return self.near.disk_bytes

    # -- writes -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Store entries in the local copy and in the shared store.

        Returns:
            How many are in the shared store when the call returns.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreError: As the shared store's ``put_many`` (the local copy has them).
        """
        if self._near_on:
            try:
                self.near.put_many(items)
            except StoreError as exc:
                self._near_failed(exc, "write")
        return self.far.put_many(items)

    def send_up(self, keys: Sequence[str]) -> int:
        """Upload what the local copy holds of ``keys`` and the shared store lacks (its write failed); return how many.

        Raises:
            StoreError: As the shared store's ``put_many``.
        """
        lacking = [key for key in keys if key not in self.far and key in self.near] if self._near_on else []
        sent = 0
        for start in range(0, len(lacking), 256):
            chunk = lacking[start : start + 256]
            items = [(key, data) for key, data in zip(chunk, self.near.get_many(chunk)) if data is not None]
            sent += self.far.put_many(items)
        return sent

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove entries from both; return how many the shared store had.

        Raises:
            StoreError: If either store cannot be written (the entry is then not trusted).
        """
        self.stash.drop(keys)
        self.near.delete_many(keys)
        return self.far.delete_many(keys)

    def clear(self) -> None:
        """Remove every entry from both.

        Raises:
            StoreError: If either store cannot be written.
        """
        self.stash.drop(None)
        self.near.clear()
        self.far.clear()

    def flush(self) -> None:
        """Make both stores' writes visible to other processes."""
        self.near.flush()
        self.far.flush()

    def close(self) -> None:
        """Close both (and empty the stash); they reopen if used again."""
        self.stash.drop(None)
        try:
            self.near.close()
        finally:
            self.far.close()

    def verify(self, fix: bool = False) -> VerifyReport:
        """Verify both stores; the local copy's problems are named so.

        Raises:
            StoreError: If ``fix`` is set and either store cannot be written.
        """
        far = self.far.verify(fix)
        near = self.near.verify(fix)
        bad = list(dict.fromkeys(far.bad + near.bad))
        problems = far.problems + [f"local copy: {problem}" for problem in near.problems]
        return VerifyReport(entries=far.entries, bad=bad, problems=problems, fixed=far.fixed or near.fixed)


class _Near:
    """The local copy as a tier: a fault turns it off and finds or keeps nothing."""

    def __init__(self, layered: LayeredStore) -> None:
        self.layered = layered

    def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[bytes | memoryview]]]:
        if not self.layered.near_enabled:
            return []
        try:
            return hits_of(self.layered.near.get_many(keys))
        except StoreError as exc:
            self.layered._near_failed(exc, "read")
            return []

    def keep(self, keys: Sequence[str], values: list[bytes | memoryview]) -> None:
        if self.layered.near_enabled:
            try:
                self.layered.near.put_many(list(zip(keys, values)))
            except StoreError as exc:
                self.layered._near_failed(exc, "write")


class _Stash:
    """Entries read with a batch's segments but not asked for, in RAM, oldest out first; a hit takes one out.

    Each is a copy of its bytes, so the stash holds what it counts and no segment behind it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, extras: Sequence[tuple[str, bytes | memoryview]]) -> None:
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
        if not self._entries:
            return []
        with self._lock:
            taken = [self._entries.pop(key, None) for key in keys]
            self.nbytes -= sum(len(data) for data in taken if data is not None)
        return hits_of(taken)

    def keep(self, keys: Sequence[str], values: list[bytes | memoryview]) -> None:
        """Entries the shared store served are served: nothing to keep."""


class _Far:
    """The shared store as a tier: its faults reach the caller.

    Its reads fetch every segment a batch touches whole (``prefetch``) only while the local
    copy has room to keep the rest: while its files take less than half its budget. Once
    it is full, a bucket still reads whole the segments a batch spans most of, and the
    rest goes to the stash.
    """

    def __init__(self, layered: LayeredStore) -> None:
        self.layered = layered

    def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[bytes | memoryview]]]:
        near, far = self.layered.near, self.layered.far
        half = near.max_bytes // 2  # payload bytes first: counted in the index, where disk bytes take a listing
        far.prefetch = self.layered.near_enabled and near.nbytes < half and near.disk_bytes < half
        return hits_of(far.get_many(keys))

    def keep(self, keys: Sequence[str], values: list[bytes | memoryview]) -> None:
        raise AssertionError("the shared store is the last tier")
