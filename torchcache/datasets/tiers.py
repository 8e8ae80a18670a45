"""The tiers of a sample cache: where each sample goes, fault handling, hit counters.

A tier's budget is its store's: the tier writes, and the store keeps what fits. A
local tier's packed store does not evict (``evict="none"``): a full tier keeps what it
holds and takes no more, so with more samples than room a fixed subset stays cached,
the hit rate is the fraction cached, and a full tier costs no write work. (Evicting
instead, with shuffled epochs, would rewrite the tier all the time for the same hit
rate.) A shared store (Redis, a bucket) keeps its own policy; a write it did not keep
whole, or kept by evicting others, also marks the tier full. A tier that fails to write warns once and is only read
from then on, in that process.

The RAM tier of a dataset of known length keeps the samples whose frames share the
first frame's size in a :class:`~torchcache.stores.rows.RowsFile` (one row per index,
no index transaction) and the others in its packed store. The two share the tier's
budget: the rows file takes rows while the budget minus the store's bytes has room, and
the store's budget is what the rows file leaves. Each holds its part under its own lock;
only writers of both kinds at once (a dataset whose samples vary in size) can pass the
budget, by at most one batch each.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch.utils.data

from .._fork import SharedArray
from .._log import logger
from ..errors import ConfigError, CorruptEntryError, StoreError, StoreUnavailableError
from ..faults import Fault, FaultLog
from ..stores.batched import BatchedStore
from ..stores.packed.index import INDEX_NAME
from ..stores.packed.store import PackedStore
from ..stores.rows import RowsFile
from ..tiers.layered import LayeredStore
from .decode import decode_rows, decode_samples, frame_head
from .encode import is_sample_1_2
from .keys import store_key
from .rows import SampleRows
from .shm import usable_bytes

__all__ = ["HitCounters", "SampleTier", "placement", "samples_from_slots", "segment_bytes"]


_SLOTS = 65  # counter slots: the main process, then DataLoader workers by id


class HitCounters(SharedArray):
    """Hits per tier and misses, summed over the processes that share this object.

    Each DataLoader worker counts in its own slot of shared memory (inherited by forked
    workers, handed to spawned ones), so the sum covers the workers too. Copies made
    other than for a new process count afresh. The counts are for reports: threads of
    one process share a slot without a lock.
    """

    typecode, size = "q", _SLOTS * 3

    def add(self, memory: int, disk: int, misses: int) -> None:
        """Count hits of each tier and misses, in this process's slot."""
        info = torch.utils.data.get_worker_info()
        base = 0 if info is None else 3 * (1 + info.id % (_SLOTS - 1))
        array = self.array
        array[base] += memory
        array[base + 1] += disk
        array[base + 2] += misses

    def totals(self) -> tuple[int, int, int]:
        """Memory hits, disk hits and misses, summed over every slot."""
        values = list(self.array)
        return sum(values[0::3]), sum(values[1::3]), sum(values[2::3])


class SampleTier:
    """One store (and, for a RAM tier, its rows file), with its faults.

    Args:
        name: ``"memory"`` or ``"disk"``, for messages.
        store: The store, or a function that opens it: then it is opened on first use
            (a RAM tier whose samples are all in slots never opens its store in a
            DataLoader worker), and if it cannot be, the tier warns once and keeps to
            its slots.
        budget: The tier's budget in bytes: what its store counts (records and the
            index's share) plus the rows file's bytes.
        faults: Where faults are warned about.
        slots: The rows file for the samples of a dataset (keys that are indices), if any.
        reserve_in: For a RAM tier, its directory: the tier takes no more samples once they
            would leave less than a quarter of that file system free (DataLoader workers
            pass batches through ``/dev/shm``, and other caches share it).
    """

    def __init__(
        self,
        name: str,
        store: BatchedStore | Callable[[], BatchedStore],
        budget: int,
        faults: FaultLog,
        slots: SampleRows | None = None,
        reserve_in: Path | None = None,
    ) -> None:
        self.name = name
        self.reserve_in = reserve_in
        self._store: BatchedStore | None = None
        self._opener: Callable[[], BatchedStore] | None = None
        if callable(store):
            self._opener = store
        else:
            self._store = store
        self._open_lock = threading.Lock()
        self.budget = budget
        self.faults = faults
        self.slots = slots
        self.writable = True
        self.full = False

    @property
    def store(self) -> BatchedStore | None:
        """The packed store, opened now if it was not (``None`` if it cannot be)."""
        if self._store is None and self._opener is not None:
            with self._open_lock:
                if self._store is None and self._opener is not None:
                    try:
                        self._store = self._opener()
                    except (OSError, lmdb.Error, ConfigError) as exc:  # StoreError is an OSError
                        self._opener = None
                        self.faults.warn(
                            Fault.OPEN,
                            f"cannot open the {self.name} tier's store ({exc}); only its rows file is used",
                            self.name,
                        )
        return self._store

    @property
    def accepting(self) -> bool:
        """Whether the tier takes new entries (it is neither full nor failed, in this process)."""
        return self.writable and not self.full

    def _slots_only(self) -> bool:
        """Whether every sample of the tier is in its rows file: the store beside it was never opened."""
        slots = self.slots
        return slots is not None and slots.file is not None and not (slots.path.parent / INDEX_NAME).exists()

    def _store_used(self) -> int:
        if self._slots_only():
            return 0
        store = self.store
        if not isinstance(store, PackedStore):
            return 0 if store is None else store.nbytes
        usage = store.usage()
        return usage["records"] + usage["index"]

    def _rows(self) -> RowsFile | None:
        return None if self.slots is None else self.slots.file

    def __len__(self) -> int:
        """Entries in the store and the rows file."""
        store, rows = self.store, self._rows()
        return (0 if store is None else len(store)) + (0 if rows is None else len(rows))

    @property
    def nbytes(self) -> int:
        """Bytes of the store's entries and of the rows file."""
        store, rows = self.store, self._rows()
        return (0 if store is None else store.nbytes) + (0 if rows is None else rows.nbytes)

    def __contains__(self, key: object) -> bool:
        rows = self._rows()
        if rows is not None and type(key) is str and len(key) == 16 and int(key, 16) in rows:
            return True
        if self._slots_only():
            return False
        store = self.store
        return store is not None and key in store

    def slots_ready(self) -> RowsFile | None:
        """The rows file, if it exists now (another process of the job may have made it)."""
        slots = self.slots
        if slots is None:
            return None
        return slots.file if slots.file is not None else slots.attach()  # not `or`: a file's truth counts its rows

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The stored frames of ``keys`` (``None`` for a miss; all misses if the store fails)."""
        try:
            if self._slots_only():  # the usual RAM tier: its store is not even opened
                return [None] * len(keys)
            store = self.store
            return [None] * len(keys) if store is None else store.get_many(keys)
        except Exception as exc:  # noqa: BLE001 - a fault of the cache never fails a sample (OSError, lmdb.Error...)
            what = str(exc) if isinstance(exc, (OSError, lmdb.Error)) else f"{type(exc).__name__}: {exc}"
            self.faults.warn(Fault.READ, f"cannot read the {self.name} tier ({what}); samples are computed", self.name)
            return [None] * len(keys)

    def placement(self, keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
        """The store's placement of ``keys`` (:meth:`~torchcache.stores.batched.BatchedStore.placement`)."""
        try:
            store = None if self._slots_only() else self.store
            return [None] * len(keys) if store is None else store.placement(keys, shared)
        except Exception as exc:  # noqa: BLE001 - an order is only a hint: any fault leaves it plain
            message = f"cannot read the {self.name} tier ({exc}); the order is a plain shuffle"
            self.faults.warn(Fault.READ, message, self.name)
            return [None] * len(keys)

    def find(self, keys: Sequence[str]) -> list[tuple[list[int], list[tuple[bytes | memoryview, Any]]]]:
        """The samples of ``keys``, each with its frame; a frame that does not decode is a warned miss."""
        frames = self.get_many(keys)
        at = [i for i, frame in enumerate(frames) if frame is not None]
        hits, values = [], []
        for i, sample in zip(at, decode_samples([frames[i] for i in at]) if at else ()):  # type: ignore[misc]
            if isinstance(sample, CorruptEntryError) and is_sample_1_2(frames[i]):  # type: ignore[arg-type]
                message = (
                    "the cache holds samples of torchcache 1.2, in a format this version does not read; they are "
                    "computed again (and replace them when written): run `torchcache migrate` on it to keep them"
                )
                self.faults.warn(Fault.DECODE, message, self.name)
            elif isinstance(sample, CorruptEntryError):
                self.faults.warn(Fault.DECODE, f"a cached sample is damaged ({sample}); recomputed", self.name)
                self.drop(keys[i])
            else:
                hits.append(i)
                values.append((frames[i], sample))
        return [(hits, values)] if hits else []  # type: ignore[list-item]

    def keep(self, keys: Sequence[str], values: list[tuple[bytes | memoryview, Any]]) -> None:
        """Store the frames of samples found in a slower tier."""
        self.put_many([(key, frame) for key, (frame, _) in zip(keys, values)])

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Write the items; once the store keeps fewer than it was given, take no more."""
        if not items or not self.accepting:
            return
        if self.reserve_in is not None and not _leaves_room(self.reserve_in, sum(len(f) for _, f in items)):
            self.full = True
            where = self.reserve_in
            logger.info("the %s tier would leave less than a quarter of %s free: samples go uncached", self.name, where)
            return
        try:
            if self.slots is not None and self.slots.usable:
                items = self._put_rows(self.slots, items)
                if not items or self.full:
                    return
            store = self.store
            if store is None:
                return
            rows = self._rows()
            if rows is not None and isinstance(store, PackedStore):
                store.max_bytes = max(0, self.budget - rows.nbytes)  # what the rows file leaves
            if _full_after(store, items, store.put_many(items)):
                self.full = True
                logger.info("the %s tier %s is full: later samples are not cached there", self.name, store)
        except (OSError, lmdb.Error) as exc:  # StoreError is an OSError
            remote = bool(getattr(self.store, "remote", False))
            copied = remote and bool(getattr(self.store, "near_enabled", False))  # the local copy kept them
            retried = remote and (isinstance(exc, StoreUnavailableError) or copied)
            self.writable = retried  # a server that is away may come back; a disk that failed does not
            later = "samples are computed, not cached there, from now on"
            if retried:
                later = "the local copy keeps them, sent up later" if copied else "retried later"
            self.faults.warn(Fault.WRITE, f"cannot write to the {self.name} tier ({exc}); {later}", self.name)

    def _put_rows(
        self, slots: SampleRows, items: Sequence[tuple[str, bytes | memoryview]]
    ) -> Sequence[tuple[str, bytes | memoryview]]:
        """Store in the rows file what it takes; return the items for the packed store.

        The first frame stored fixes the rows' size; frames of other sizes, and keys that
        are not indices of the dataset, go to the packed store.

        Raises:
            OSError: If the rows cannot be written.
        """

        def index_of(key: str) -> int:  # store keys of indices have 16 digits
            index = int(key, 16) if len(key) == 16 else -1
            return index if index < slots.length else -1

        rows = slots.attach()
        if rows is None:
            first = next((frame for key, frame in items if index_of(key) >= 0), None)
            head = None if first is None else frame_head(first)
            rows = None if first is None or head is None else slots.create(len(first), head)
            if rows is None:
                return items
        indices: list[int] = []
        frames: list[bytes | memoryview] = []
        rest: list[tuple[str, bytes | memoryview]] = []
        for key, frame in items:
            index = index_of(key)
            if index >= 0 and len(frame) == rows.row_size:
                indices.append(index)
                frames.append(frame)
            else:
                rest.append((key, frame))
        if not indices:
            return rest
        block = np.frombuffer(b"".join(frames), np.uint8).reshape(len(frames), rows.row_size)
        if rows.write(np.asarray(indices, np.int64), block, self.budget - self._store_used()):
            self.full = True
            logger.info("the %s tier %s is full: later samples are not cached there", self.name, rows.path)
        return rest

    def drop(self, key: str) -> None:
        """Remove a damaged entry, if the tier can be written."""
        rows = self._rows()
        if rows is not None and len(key) == 16 and int(key, 16) < rows.length:
            with contextlib.suppress(OSError):
                rows.unmark([int(key, 16)])
        store = self.store
        if store is not None:
            with contextlib.suppress(OSError, lmdb.Error):
                store.delete_many([key])

    def flush(self) -> None:
        """Make the store's writes durable, if it was opened (slots are written through)."""
        if self._store is not None:
            self._store.flush()

    def close(self) -> None:
        """Close the store (if it was opened) and the slots."""
        if self._store is not None:
            self._store.close()
        if self.slots is not None:
            self.slots.close()


def samples_from_slots(
    tier: SampleTier, rows: RowsFile, keys: Sequence[int | str], results: list[Any], faults: FaultLog
) -> set[int]:
    """Fill ``results`` from the rows file of a tier for the keys that are indices; return their positions."""
    length = rows.length
    ints = [i for i, key in enumerate(keys) if type(key) is int and 0 <= key < length]
    if not ints:
        return set()
    wanted = np.fromiter((keys[i] for i in ints), np.int64, len(ints))
    try:
        found, gathered, _, damaged = rows.read(wanted)
    except Exception as exc:  # noqa: BLE001 - a fault of the cache never fails a sample
        what = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        faults.warn(Fault.READ, f"cannot read the {tier.name} tier's rows ({what}); samples are computed", tier.name)
        return set()
    if damaged:
        faults.warn(Fault.CORRUPT, f"{len(damaged)} damaged rows in {rows.path}: recomputed", tier.name)
        for position in damaged:
            tier.drop(store_key(keys[ints[position]]))
    if not len(found):
        return set()
    buf = gathered.reshape(-1).data
    stride, at, size = rows.stride, rows.row_at, rows.row_size
    samples: list[Any] | None = decode_rows(buf, len(found), stride, at, size)
    places = [ints[position] for position in found.tolist()]
    if samples is not None:  # the common case: every frame alike
        for i, sample in zip(places, samples):
            results[i] = sample
        return set(places)
    view = memoryview(buf)  # frames of several structures (or one that is not a sample): one by one
    hit = set()
    for i, sample in zip(
        places, decode_samples([view[j * stride + at : j * stride + at + size] for j in range(len(found))])
    ):
        if isinstance(sample, CorruptEntryError):
            faults.warn(Fault.DECODE, f"a cached sample is damaged ({sample}); recomputed", tier.name)
            tier.drop(store_key(keys[i]))
        else:
            results[i] = sample
            hit.add(i)
    return hit


def fill_tier(
    tiers: Sequence[SampleTier],
    keys: Sequence[int | str],
    compute_many: Callable[[list[Any]], Sequence[Any]],
    encode: Callable[[object, object], bytes],
    faults: FaultLog,
) -> int:
    """Put the samples of ``keys`` that the disk tier lacks into it; return how many were computed.

    What the disk tier's local copy holds and its shared store lacks (written while the
    server was away) is sent from the copy; the rest is computed, and put in RAM too.
    """
    disk = next((tier for tier in tiers if tier.name == "disk"), None)
    if disk is None:
        return 0
    skeys = [store_key(key) for key in keys]
    lacking = [i for i, skey in enumerate(skeys) if skey not in disk]
    if lacking and isinstance(disk.store, LayeredStore):
        try:
            disk.store.send_up([skeys[i] for i in lacking])
        except StoreError as exc:
            faults.warn(Fault.UNAVAILABLE, f"cannot upload the local copy's samples ({exc})", "disk")
        lacking = [i for i in lacking if skeys[i] not in disk]
    if lacking:
        computed = compute_many([keys[i] for i in lacking])
        items = [(skeys[i], encode(sample, keys[i])) for i, sample in zip(lacking, computed)]
        for tier in [tier for tier in tiers if tier.accepting]:
            tier.put_many(items)
    return len(lacking)


def placement(tiers: Sequence[SampleTier], keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
    """Where the slowest of ``tiers`` would fetch each key from; ``None`` for those a faster tier holds.

    With ``shared``, what this machine holds is left out: every process of a distributed
    job, whatever its local copy holds, gets the same placement. See
    :meth:`~torchcache.stores.batched.BatchedStore.placement`.
    """
    if not tiers:
        return [None] * len(keys)
    todo = [i for i, key in enumerate(keys) if shared or not any(key in tier for tier in tiers[:-1])]
    out: list[tuple[str, int] | None] = [None] * len(keys)
    for i, place in zip(todo, tiers[-1].placement([keys[i] for i in todo], shared)):
        out[i] = place
    return out


def segment_bytes(budget: int) -> int:
    """The segment size of a tier's store: 1/16 of its budget, at most 256 MiB (0: the store's default).

    A tier keeps samples within its budget rather than evicting, so its segments can be
    four times the size a module cache's store takes (1/64): a random batch then touches
    fewer segments, and each costs an ``fstat`` and a mapping lookup per batch (at a
    141.88 MB budget, 15 segments against 57: 7.8 against 8.9 us per cached sample). A
    store whose budget shrank on a later run evicts in steps of one segment.
    """
    return min(budget // 16, 1 << 28)


def _leaves_room(directory: Path, nbytes: int) -> bool:
    """Whether writing ``nbytes`` more leaves a quarter of the file system of ``directory`` free."""
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return True  # a write says what is wrong
    return not vfs.f_blocks or (vfs.f_bavail * vfs.f_frsize - nbytes) * 4 >= usable_bytes(vfs)  # 0: no limit


def _full_after(store: BatchedStore, items: Sequence[tuple[str, bytes | memoryview]], kept: int) -> bool:
    """Whether a write shows the store full: it evicted others, or left out a sample not too large for its budget."""
    if store.evicted_by_last_put:
        return True
    if kept >= len({key for key, _ in items}):
        return False
    return any(len(data) <= store.max_bytes // 2 and key not in store for key, data in items)
