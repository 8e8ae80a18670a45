"""A local store in front of a shared one: repeated hits never cross the network.

:class:`LayeredStore` keeps a local copy (a :class:`~torchcache.stores.packed.store.PackedStore`
on a node's disk) of the entries of a shared store (a Redis server or cluster, a bucket) that this
machine read or wrote. A batch is looked up in the local copy first and only its misses
go to the server, in one round trip; the entries found there are copied into the local
copy. Writes go to both.

The shared store is the authority on what the cache holds (``len``, ``keys``, its
budget); the local copy holds a subset, under its own budget, with its own MRU
eviction (never of an entry the shared store did not take: :mod:`~torchcache.stores.unsent`).
An entry is the output of a keyed computation, so a copy is never stale: an entry the
server evicted or another job cleared is still correct where a copy has it.

A shared store may read more than a batch asks for (a bucket's whole segments): the local
copy keeps the rest while it has room. Once it is full, the rest waits in a small
*stash* in RAM (:mod:`~torchcache.tiers.stash`, oldest out first), where the next batches of a
windowed order (:class:`~torchcache.datasets.sampler.WindowSampler`) find it: each
segment is then fetched once per epoch, not once per batch. While the local copy has
room, those entries are written to it by a background thread, and the next batches find
them in RAM until they are: the reads that fetched them never wait on the local disk
(unless :data:`PENDING_BYTES` are still waiting to be written).

Faults of the local copy (a full or read-only disk, a damaged file) are reported once
under the kind ``"local"`` and turn the copy off for this process; the shared store
keeps working. Faults of the shared store reach the caller as they would without a
copy, while local hits keep being served.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence

from .._gc import collector_paused
from ..errors import StoreError
from ..faults import Fault, Report
from ..stores.batched import BatchedStore, VerifyReport
from ..stores.packed.store import PackedStore
from ..stores.unsent import Unsent
from .lookup import hits_of, look_up
from .stash import STASH_BYTES, Stash

__all__ = ["PENDING_BYTES", "LayeredStore"]

#: Bytes of such entries waiting to be written to the local copy before a read that
#: fetched more waits for the writer.
PENDING_BYTES = 256 << 20
#: Bytes the background writer puts in the local copy at a time, holding its lock: a read of
#: the copy waits for one such piece at most (16 MiB kept a first epoch's reads from a
#: bucket waiting 90 ms at once; 4 MiB, 20 ms, for the same total).
_PIECE_BYTES = 4 << 20


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
        self.stash = Stash(stash_bytes)
        self.pending = _Pending(self)
        #: Hits served by the local copy and by the shared store, in this process.
        self.served = [0, 0]
        #: What the local copy holds and the shared store did not take: sent up once it takes writes.
        self.unsent = Unsent(getattr(near, "directory", None))
        self.unsent.sender = self._send_unsent
        if isinstance(near, PackedStore):  # the only copy of an unsent entry: the copy's eviction keeps it
            near.pinned = self.unsent.pinned

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
            # What waits to be written first: the local copy's reads would wait for its writer.
            for tier, positions, datas in look_up((self.pending, near, self.stash, _Far(self)), keys).parts:
                self.served[int(tier > 1)] += len(positions)  # the stash's hits came from the shared store
                for i, data in zip(positions, datas):
                    found[i] = data
            extras = self.far.take_extras()  # the rest of whole segments the shared store read
            if extras and self.far.prefetch:  # the local copy had room: written in the background
                self.pending.add(extras)
            elif extras:
                self.stash.add(extras)
        return found

    def placement(self, keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
        """The shared store's placement of the keys the local copy lacks (``None`` for those it has).

        With ``shared``, of every key: the local copy is left out.
        """
        near = self.near if self._near_on and not shared else None
        lacking = [i for i, key in enumerate(keys) if near is None or (key not in near and key not in self.pending)]
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
        keys = [key for key, _ in items]
        if self._near_on:
            try:
                self.near.put_many(items)
            except StoreError as exc:
                self._near_failed(exc, "write")
        with self.unsent.flying(keys):  # until the shared store has them, the copy's eviction keeps them
            try:
                stored = self.far.put_many(items)
            except StoreError:
                if self._near_on:  # on this machine only: sent up once the shared store takes writes again
                    kept = [key for key in keys if key in self.near]
                    self.unsent.add(kept)
                    self.unsent.dropped += len(keys) - len(kept)  # the copy had no room for them either
                raise
        self._send_unsent(limit=4096)
        return stored

    def send_up(self, keys: Sequence[str]) -> int:
        """Upload now what the local copy holds of ``keys`` (the shared store lacks them), with the keys that wait.

        Returns:
            How many were sent; those that were not wait with the others (:attr:`unsent`).

        Raises:
            StoreError: As the shared store's ``put_many``.
        """
        if not self._near_on:
            return 0
        self.unsent.add([key for key in keys if key in self.near])  # those it lacks are not the copy's to send
        return self.unsent.send(self.near.get_many, self.far.put_many, now=True)

    def _send_unsent(self, limit: int | None = None) -> None:
        """Send what the shared store did not take (its faults are its own to report; the keys wait)."""
        if self._near_on and len(self.unsent):
            if limit is None:  # a flush, or the end: one try now, whatever the backoff of an outage just over
                self.far.end_write_backoff()
            with contextlib.suppress(StoreError):
                self.unsent.send(self.near.get_many, self.far.put_many, limit, now=limit is None)

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove entries from both; return how many the shared store had.

        Raises:
            StoreError: If either store cannot be written (the entry is then not trusted).
        """
        self.stash.drop(keys)
        self.pending.drain()
        self.near.delete_many(keys)
        return self.far.delete_many(keys)

    def clear(self) -> None:
        """Remove every entry from both.

        Raises:
            StoreError: If either store cannot be written.
        """
        self.stash.drop(None)
        self.pending.drain()
        self.near.clear()
        self.far.clear()

    def flush(self) -> None:
        """Make both stores' writes visible to other processes (the local copy's background writes first)."""
        self.pending.drain()
        self.near.flush()
        self._send_unsent()
        self.unsent.save()
        self.far.flush()

    def close(self) -> None:
        """Close both (the local copy's background writes done first, the stash emptied); they reopen if used again."""
        self.stash.drop(None)
        self.pending.drain()
        self._send_unsent()
        self.unsent.save()
        try:
            self.near.close()
        finally:
            self.far.close()

    def verify(self, fix: bool = False) -> VerifyReport:
        """Verify both stores; the local copy's problems are named so.

        Raises:
            StoreError: If ``fix`` is set and either store cannot be written.
        """
        self.pending.drain()
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


class _Pending:
    """Entries on their way into the local copy, written by one background thread; found here until they are.

    A read that hands over more while :data:`PENDING_BYTES` wait waits for the writer. A
    forked child starts with nothing pending (its parent writes what it fetched).
    """

    def __init__(self, layered: LayeredStore) -> None:
        self.layered = layered
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self.nbytes = 0
        self._entries: dict[str, bytes | memoryview] = {}
        self._queue: deque[Sequence[tuple[str, bytes | memoryview]]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._writing = False

    def _mine(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's writer is not here
            self._reset()

    def __contains__(self, key: object) -> bool:
        self._mine()
        return key in self._entries

    def add(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Hand ``items`` to the writer (waiting while too many bytes wait already).

        A child process (a DataLoader or ``multiprocessing.Pool`` worker) writes them
        itself: it is terminated soon after its last task, and a writer still at work
        would lose what it had not written.
        """
        self._mine()
        if multiprocessing.parent_process() is not None:
            self._keep(items)
            return
        with self._cond:
            self._cond.wait_for(lambda: self.nbytes <= PENDING_BYTES or not self._writing)
            for key, data in items:  # every byte queued counts, an entry queued twice too
                self._entries[key] = data
                self.nbytes += len(data)
            self._queue.append(items)
            if self._writing:
                return
            self._writing = True
            try:  # not a daemon: the interpreter waits for it at exit, so what was fetched is kept
                threading.Thread(target=self._write, name="torchcache-local-copy", daemon=False).start()
                return
            except RuntimeError:  # no thread to be had (too many, or the interpreter is exiting)
                self._queue.clear()
                self._entries.clear()
                self.nbytes, self._writing = 0, False
        self._keep(items)  # no writer: written here

    def _keep(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Write ``items`` to the local copy now (a fault of the copy turns it off)."""
        _Near(self.layered).keep([key for key, _ in items], [data for _, data in items])

    def _write(self) -> None:
        """Write what is queued, in pieces of :data:`_PIECE_BYTES` (the store's lock is let go between).

        Entries stay here until the queue is empty, so reads find them in RAM and not
        behind the writer on the local copy's lock.
        """
        while True:
            with self._cond:
                if not self._queue:
                    self._entries.clear()
                    self.nbytes = 0
                    self._writing = False
                    self._cond.notify_all()
                    return
                items = self._queue.popleft()
            for piece in _pieces(items):
                try:
                    self._keep(piece)
                except Exception as exc:  # noqa: BLE001 - whatever it is, the copy is off and nothing waits forever
                    self.layered._near_failed(StoreError(f"{type(exc).__name__}: {exc}"), "write")

    def drain(self) -> None:
        """Wait until everything handed over is written (or the local copy failed)."""
        self._mine()
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)

    def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[bytes | memoryview]]]:
        self._mine()
        if not self._entries:
            return []
        with self._cond:
            return hits_of([self._entries.get(key) for key in keys])

    def keep(self, keys: Sequence[str], values: list[bytes | memoryview]) -> None:
        """Entries the shared store served are served: nothing to keep."""


def _pieces(items: Sequence[tuple[str, bytes | memoryview]]) -> Iterator[Sequence[tuple[str, bytes | memoryview]]]:
    """``items`` in runs of about :data:`_PIECE_BYTES`."""
    start, size = 0, 0
    for i, (_, data) in enumerate(items):
        size += len(data)
        if size >= _PIECE_BYTES:
            yield items[start : i + 1]
            start, size = i + 1, 0
    if start < len(items):
        yield items[start:]


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
        half = near.max_bytes // 2 - self.layered.pending.nbytes  # what waits to be written counts too
        # Payload bytes first: counted in the index, where disk bytes take a listing.
        far.prefetch = self.layered.near_enabled and near.nbytes < half and near.disk_bytes < half
        return hits_of(far.get_many(keys))

    def keep(self, keys: Sequence[str], values: list[bytes | memoryview]) -> None:
        raise AssertionError("the shared store is the last tier")
