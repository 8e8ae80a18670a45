"""The persistent tier: item outputs as checked frames in a batched byte store.

A batch of reads is one :meth:`~torchcache.stores.batched.BatchedStore.get_many` on the
calling thread (one index pass, one read per hit in file order); the frames are then
checked and decompressed in chunks on a small shared thread pool (brotli and numpy
release the GIL) and land in one ``(n, row_bytes)`` buffer, from which each output leaf
is a strided view: one copy per hit. Writes are encoded on the process's writer threads
(:class:`~torchcache.tiers.writer.BackgroundWriter`) and stored with one ``put_many`` per job.
Each item is stored raw, zero-elided or brotli-compressed, whichever pays
(:class:`~torchcache.tiers.frames.FrameCodec`).

Entries queued for writing are readable at once: until the writer has stored them,
:meth:`PersistentTier.read` takes them from the queue, so no reader of the tier misses them.

Faults are reported through ``report(kind, message)``: a damaged entry is removed and
becomes a miss; a read error becomes a miss; a store that refuses writes as a whole (no
space, read-only, gone) turns writes off for this tier; a server that is away for now
(:class:`~torchcache.errors.StoreUnavailableError`) loses that job's entries, reported, and
is tried again by the next one. The engine turns each kind of report into one warning.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._buffers import empty_rows
from .._fork import after_fork
from ..codec import MAX_ITEM_BYTES, MIN_ELIDE_BYTES
from ..errors import CorruptEntryError, StoreError, StoreUnavailableError
from ..faults import Fault, FaultLog, Report
from ..policy import plural
from ..stores.batched import BatchedStore
from ..tree import Layout
from .frames import Frame, FrameCodec, pack_rows
from .writer import BackgroundWriter, Unstored

__all__ = ["DiskLevel", "PersistentTier"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_PARALLEL_MIN_ITEMS = 32
#: Batches read by the general path after :meth:`BatchedStore.get_rows` declined one.
_ROWS_BACKOFF = 64
_READ_CHUNKS = 8
_WRITERS = 2
# Items per write job, one index transaction each. LMDB's file keeps room for about two
# transactions of copied pages, so smaller jobs keep the index smaller: at 200,000
# (768,) entries 192 takes 2.5 bytes per entry less than 256, for about 1 us per item of
# fill (benchmarks/RESULTS.md).
_WRITE_CHUNK = 192
_TOUCH_EVERY = 60.0
_MAX_SKIPPED = 1 << 16


def _decode_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="torchcache-read")
        return _pool


def _forget_pool_after_fork() -> None:
    """A forked child has none of the pool's threads: make a new pool when it needs one."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


after_fork(_forget_pool_after_fork)


@dataclass
class _WriteJob:
    keys: list[str]
    layout: Layout
    leaves: list[torch.Tensor]


class PersistentTier:
    """Entries of one module in a byte store.

    Args:
        store: Where frames are kept (shared by every cache of this module key).
        quality: brotli quality for new entries.
        report: Called with ``(kind, message)`` for faults.
        where: The store's location for messages (never a password).
        touch: Marks the cache as used now (for ``torchcache ls``); called now and then.
    """

    # Pending rows, by key: the write job that holds the item and its row in the job.
    _pending: dict[str, tuple[_WriteJob, int]]

    def __init__(
        self,
        store: BatchedStore,
        quality: int,
        report: Report,
        *,
        where: str,
        touch: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.where = where
        self.codec = FrameCodec(quality)
        self._report = report
        self._touch = touch
        self._last_touch = time.monotonic()
        self._writes_enabled = True
        self._pending = {}
        self._pending_lock = threading.Lock()
        self._skipped: set[str] = set()  # damaged entries that could not be removed
        self._rows_backoff = 0  # batches to read by the general path before get_rows is tried again
        #: Entries a remote store did not take (away or full), since the tier was made.
        self.unstored = Unstored()  # entries whose writes the server refused: counted in the exit warning
        self._writer = BackgroundWriter(self._write_job, self._write_failed, workers=min(_WRITERS, os.cpu_count() or 1))

    def __repr__(self) -> str:
        return f"PersistentTier({self.store!r})"

    def touch(self) -> None:
        """Mark the cache as used now."""
        self._last_touch = time.monotonic()
        if self._touch is not None:
            self._touch()

    def _touch_now_and_then(self) -> None:
        if time.monotonic() - self._last_touch > _TOUCH_EVERY:
            self.touch()

    # -- reads -----------------------------------------------------------------------
    def _fetch(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """Stored frames of ``keys`` (``None``: a miss)."""
        skipped = self._skipped
        wanted = [key for key in keys if key not in skipped] if skipped else keys
        try:
            found = self.store.get_many(wanted)
        except StoreError as exc:
            self._report(Fault.READ, f"cannot read cache entries, recomputing them: {exc}")
            found = [None] * len(wanted)
        if len(wanted) == len(keys):
            return found
        by_key = dict(zip(wanted, found))
        return [by_key.get(key) for key in keys]

    def _drop(self, keys: Sequence[str], exc: Exception) -> None:
        """Remove damaged entries from the store."""
        removed = True
        try:
            self.store.delete_many(keys)
        except StoreError:
            removed = False
        if not removed:  # read-only: this process reads them no more, until it writes them anew
            if len(self._skipped) + len(keys) > _MAX_SKIPPED:
                self._skipped.clear()
            self._skipped.update(keys)
        what = "removed" if removed else "cannot remove; this process skips"
        self._report(Fault.CORRUPT, f"{len(keys)} corrupt entries in {self.where} ({exc}): {what} them, recomputing")

    def _queued(self, keys: Sequence[str]) -> dict[int, Frame]:
        """Frames of the ``keys`` whose writes are still queued, by position."""
        with self._pending_lock:
            found = {i: self._pending[key] for i, key in enumerate(keys) if key in self._pending}
        frames: dict[int, Frame] = {}
        for i, (job, row) in found.items():
            packed = pack_rows(job.layout, [leaf[row : row + 1] for leaf in job.leaves], 1)
            frames[i] = (self.codec.header_of(job.layout), packed[0].tobytes())
        return frames

    def _decode(
        self, datas: Sequence[bytes | memoryview | None]
    ) -> tuple[list[Frame | CorruptEntryError | None], np.ndarray | None]:
        """Check and decode frames: raw ones and small zero-elided ones here, others on the pool.

        Compressed payloads are decoded into the rows of one array: small zero-elided
        rows all at once on this thread (:meth:`FrameCodec.unelide_many`), the others in
        chunks on the shared pool. The array is returned when every compressed frame
        landed there (one size), so that the caller need not copy them again.
        """
        frames: list[Any] = self.codec.decode_many(datas, raw_only=True)
        packed = [i for i, frame in enumerate(frames) if isinstance(frame, (bytes, memoryview))]
        if not packed:
            return frames, None
        todo = [frames[i] for i in packed]
        # The row size comes from the first frame decoded in full (its header checked),
        # never from a prefix alone: a planted prefix must not size an allocation.
        first: Any = self.codec.decode_many(todo[:1])[0]
        raw_len = len(first[1]) if isinstance(first, tuple) else 0
        rows = empty_rows(len(todo), raw_len) if raw_len else None
        decoded: list[Any] = [None] * len(todo)
        landed = [False] * len(todo)

        def land(j: int, frame: Any) -> None:
            if rows is not None and isinstance(frame, tuple) and len(frame[1]) == raw_len:
                row, payload = rows[j], np.frombuffer(frame[1], dtype=np.uint8)
                if payload.ctypes.data != row.ctypes.data:
                    row[:] = payload  # not unelided in place
                frame = (frame[0], memoryview(row))
                landed[j] = True
            decoded[j] = frame

        def work(chunk: list[int]) -> None:
            outs = None if rows is None else [rows[j] for j in chunk]
            for j, frame in zip(chunk, self.codec.decode_many([todo[j] for j in chunk], outs=outs)):
                land(j, frame)

        land(0, first)
        rest = list(range(1, len(todo)))
        if rows is not None and rest:
            header = first[0]
            if raw_len < MIN_ELIDE_BYTES or len(rest) < 2:
                # Small zero-elided rows: rebuilt together here, which costs less than one pool task.
                done = self.codec.unelide_many(todo[1:], header, rows[1:])
            else:
                # Large ones: vectorized too (unelide_rows), in one contiguous share per core. Many
                # small numpy calls per row (unelide's chunks) on several threads fight for the GIL
                # and run slower than one thread.
                cores = min(_READ_CHUNKS, os.cpu_count() or 1)
                cut = [1 + (len(rest) * k) // cores for k in range(cores + 1)]
                pool = _decode_pool()
                shares = [(a, b) for a, b in itertools.pairwise(cut) if b > a]
                parts = [pool.submit(self.codec.unelide_many, todo[a:b], header, rows[a:b]) for a, b in shares]
                done = np.concatenate([part.result() for part in parts])
            for j in np.flatnonzero(done).tolist():
                decoded[j + 1], landed[j + 1] = (header, memoryview(rows[j + 1])), True
            rest = [j for j in rest if not done[j - 1]]
        if len(rest) < _PARALLEL_MIN_ITEMS:
            work(rest)
        else:
            size = max(_PARALLEL_MIN_ITEMS // 2, -(-len(rest) // _READ_CHUNKS))
            pool = _decode_pool()
            futures = [pool.submit(work, rest[at : at + size]) for at in range(0, len(rest), size)]
            for future in futures:
                future.result()
        for i, frame in zip(packed, decoded):
            frames[i] = frame
        every = len(packed) == sum(data is not None for data in datas)  # no raw frame, no damaged prefix
        return frames, rows if every and all(landed) else None

    def read(self, keys: Sequence[str]) -> tuple[list[int], Layout | None, list[torch.Tensor]]:
        """Read entries for ``keys``, from the write queue or from the store.

        Returns:
            The positions (into ``keys``) that were found, their common layout, and one
            ``(found, *shape)`` tensor per leaf at the stored dtype, on the CPU. Entries
            whose layout differs from the first one found are left out (recomputed).
        """
        n = len(keys)
        frames: list[Frame | CorruptEntryError | None] = [None] * n
        queued = self._queued(keys) if self._pending else {}
        for i, queued_frame in queued.items():
            frames[i] = queued_frame
        if not queued and not self._skipped and self._rows_backoff <= 0:
            as_rows = self._read_rows(keys)
            if as_rows is not None:
                return as_rows
        self._rows_backoff -= 1
        todo = [i for i in range(n) if i not in queued] if queued else list(range(n))
        if todo:
            datas = self._fetch([keys[i] for i in todo])
            decoded, rows = self._decode(datas)
            for i, frame in zip(todo, decoded):
                frames[i] = frame
        else:
            rows = None
        positions, layout, payloads = self._select(keys, frames)
        if layout is None:
            return [], None, []
        if rows is not None and not queued and len(positions) == len(rows) and layout.row_bytes == rows.shape[1]:
            return self._found(positions, layout, rows)  # every hit decoded into its row already
        # One copy, in C: every payload joined into one writable buffer.
        buffer = np.frombuffer(bytearray().join(payloads), dtype=np.uint8).reshape(len(payloads), layout.row_bytes)
        return self._found(positions, layout, buffer)

    def _read_rows(self, keys: Sequence[str]) -> tuple[list[int], Layout | None, list[torch.Tensor]] | None:
        """Raw frames of one layout, read and checked as arrays (:meth:`BatchedStore.get_rows`), or ``None``."""
        try:
            got = self.store.get_rows(keys, self.codec.raw_head)
        except StoreError:
            return None  # read again by the general path, which reports it
        if got is None:  # compressed frames, several layouts, damage: the general path, for a while
            self._rows_backoff = _ROWS_BACKOFF
            return None
        positions, heads, rows = got
        if not len(positions):
            return [], None, []
        layout = self.codec.raw_layout(heads)
        if layout is None or layout.row_bytes != rows.shape[1]:
            self._rows_backoff = _ROWS_BACKOFF
            return None
        return self._found(positions.tolist(), layout, rows)

    def _found(
        self, positions: list[int], layout: Layout, rows: np.ndarray
    ) -> tuple[list[int], Layout, list[torch.Tensor]]:
        """One ``(found, *shape)`` tensor per leaf, viewed from the ``(found, row_bytes)`` uint8 ``rows``."""
        if rows.strides[0] % 16 or rows.ctypes.data % 16:  # a dtype view needs aligned rows
            rows = rows.copy()  # (not ascontiguousarray: one row with an odd stride counts as contiguous)
        table = torch.from_numpy(rows)
        leaves = [
            table[:, off : off + leaf.nbytes].view(leaf.dtype).reshape(len(positions), *leaf.shape)
            if leaf.nbytes
            else torch.empty((len(positions), *leaf.shape), dtype=leaf.dtype)  # no bytes to view
            for leaf, off in zip(layout.leaves, layout.offsets)
        ]
        self._touch_now_and_then()
        return positions, layout, leaves

    def _select(
        self, keys: Sequence[str], frames: Sequence[Frame | CorruptEntryError | None]
    ) -> tuple[list[int], Layout | None, list[bytes | memoryview]]:
        """The found frames of the first layout met; damaged ones are dropped."""
        positions: list[int] = []
        payloads: list[bytes | memoryview] = []
        damaged: list[str] = []
        error: Exception | None = None
        layout: Layout | None = None
        layout_header = b""
        for i, frame in enumerate(frames):
            if frame is None:
                continue
            if isinstance(frame, CorruptEntryError):
                damaged.append(keys[i])
                error = frame
                continue
            header_bytes, payload = frame
            if layout is None or header_bytes != layout_header:
                entry_layout = self.codec.layout_of(header_bytes)  # decode() parsed it already
                if layout is None:
                    layout, layout_header = entry_layout, header_bytes
                elif entry_layout != layout:
                    continue
            positions.append(i)
            payloads.append(payload)
        if damaged:
            self._drop(damaged, error or CorruptEntryError("damaged"))
        return positions, layout, payloads

    # -- writes ----------------------------------------------------------------------
    def write(self, keys: Sequence[str], layout: Layout, leaves: Sequence[torch.Tensor]) -> None:
        """Queue entries for writing; ``leaves`` must be CPU tensors nobody else changes.

        Items larger than :data:`~torchcache.codec.MAX_ITEM_BYTES` are not written.
        """
        if not self._writes_enabled or not keys or layout.row_bytes > MAX_ITEM_BYTES:
            return
        for start in range(0, len(keys), _WRITE_CHUNK):
            part = list(keys[start : start + _WRITE_CHUNK])
            job = _WriteJob(part, layout, [leaf[start : start + _WRITE_CHUNK] for leaf in leaves])
            with self._pending_lock:
                for row, key in enumerate(part):
                    self._pending[key] = (job, row)
            self._writer.submit(job, layout.row_bytes * len(part))

    def _write_job(self, job: _WriteJob) -> None:
        try:
            if self._writes_enabled:
                frames = self.codec.encode(job.layout, pack_rows(job.layout, job.leaves, len(job.keys)))
                try:
                    self.store.put_many(list(zip(job.keys, frames)))
                    if self._skipped:
                        self._skipped.difference_update(job.keys)
                    self.unstored.stored(job.keys)
                except StoreUnavailableError as exc:
                    self._not_stored(job, Fault.UNAVAILABLE, exc)
                except StoreError as exc:
                    if not self.store.remote:
                        raise  # a disk that refuses writes: writes off (_write_failed)
                    self._not_stored(job, Fault.REFUSED, exc)
                self._touch_now_and_then()
        finally:
            with self._pending_lock:
                for key in job.keys:
                    entry = self._pending.get(key)
                    if entry is not None and entry[0] is job:
                        del self._pending[key]

    def _not_stored(self, job: _WriteJob, kind: Fault, exc: StoreError) -> None:
        self.unstored.refused(job.keys)
        self._report(kind, f"{exc}; {plural(len(set(job.keys)), 'entry')} not stored (later writes try again)")

    def _write_failed(self, exc: BaseException) -> None:
        self._writes_enabled = False
        self._report(
            Fault.WRITE, f"cannot write to the cache {self.where} ({exc}); entries are kept in memory only from now on"
        )

    def flush(self) -> None:
        """Wait until every queued entry is stored, and make it visible to other processes."""
        self._writer.flush()
        try:
            self.store.flush()
        except StoreError as exc:
            self._report(Fault.WRITE, f"cannot flush the cache {self.where}: {exc}")

    @property
    def pending(self) -> int:
        """Write jobs not finished yet."""
        return self._writer.pending

    def clear(self) -> None:
        """Remove every entry (after pending writes finish).

        Raises:
            StoreError: If the store cannot be written.
        """
        self._writer.flush()
        self.store.clear()


class DiskLevel:
    """The disk tier, for rows of one layout (that of the memory hits, when there are some).

    A read that fails is a warning and finds nothing: a fault of the cache never fails a call.
    """

    def __init__(self, disk: PersistentTier, layout: Layout | None, faults: FaultLog) -> None:
        self.disk = disk
        self.layout = layout
        self.faults = faults

    def find(self, keys: Sequence[bytes]) -> list[tuple[list[int], tuple[Layout, list[torch.Tensor]]]]:
        """The rows stored for ``keys`` (of this level's layout, if it has one)."""
        try:
            found_at, layout, leaves = self.disk.read(hexed := list(map(bytes.hex, keys)))
            if self.disk.unstored.held:  # keys whose writes a server refused: found there after all?
                self.disk.unstored.found(hexed, found_at, self.disk.store)
        except Exception as exc:  # noqa: BLE001 - a fault of the cache never fails the call
            self.faults.warn(Fault.READ, f"cannot read cache entries, recomputing: {type(exc).__name__}: {exc}")
            return []
        finally:
            self.faults.emit()
        if not found_at or layout is None or (self.layout is not None and layout != self.layout):
            return []
        return [(found_at, (layout, leaves))]

    def keep(self, keys: Sequence[bytes], values: tuple[Layout, list[torch.Tensor]]) -> None:
        """Not used: the disk is the last tier (computed rows reach it through the writer)."""
        raise AssertionError("the disk is the last tier")
