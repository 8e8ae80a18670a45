"""The disk tier: a :class:`DiskStore` plus encoding, background writes and batched reads.

Reads of a batch's misses run on a small shared thread pool (file reads and brotli
release the GIL) and land in one ``(n, row_bytes)`` buffer per batch, from which each
output leaf is a strided view: one copy per hit. Writes are encoded and written on a
:class:`BackgroundWriter`. Each item is stored raw, zero-elided (sparse outputs: cheap
to encode, decoded at memory speed) or brotli-compressed, whichever the codec finds
pays. When brotli keeps failing to pay for a layout, it is only retried now and then,
so outputs it does not shrink cost no brotli time.

Entries queued for writing are readable at once: until the writer has stored them,
:meth:`DiskTier.read` takes them from the queue, so no reader of the tier misses them.

Faults are reported through ``report(kind, message)``: a corrupt entry is removed (or,
where it cannot be, skipped from then on) and becomes a miss; a read error becomes a
miss; an entry that cannot be written (a directory at its path) stays a miss; only an
error of the disk as a whole (no space, no quota, read-only, no permission) turns writes
off for this tier. A damaged ``torchcache.json`` is replaced. The engine turns each kind
of report into one warning.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._fork import after_fork
from ..codec import (
    CODEC_BROTLI,
    MAX_ITEM_BYTES,
    MIN_ELIDE_BYTES,
    PREFIX_SIZE,
    encode_frame,
    encode_header,
    frame_length,
    parse_header,
    split_frame,
    word_size,
)
from ..errors import CorruptEntryError, StoreError
from ..meta import META_NAME, is_disk_wide, load_meta, write_json_atomic
from ..stores.disk import DiskStore
from ..tree import ALIGN, Layout
from ..writer import BackgroundWriter

__all__ = ["DiskTier"]

_UTIME_NOFOLLOW = os.utime in os.supports_follow_symlinks

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_PARALLEL_MIN_ITEMS = 32
_READ_CHUNKS = 8
_RETRY_EVERY = 32
_GIVE_UP_AFTER = 8
_WRITERS = 2
_WRITE_CHUNK = 64


def _read_pool() -> ThreadPoolExecutor:
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


_Frame = tuple[bytes, bytes | memoryview]  # header bytes, payload


@dataclass
class _WriteJob:
    keys: list[str]
    layout: Layout
    leaves: list[torch.Tensor]


class DiskTier:
    """Entries of one module on disk.

    Args:
        directory: The module directory (``<root>/<module key>``).
        max_bytes: Byte budget for its entry files.
        quality: brotli quality for new entries.
        meta: Metadata written to ``torchcache.json`` when the directory is new.
        report: Called with ``(kind, message)`` for faults.

    Raises:
        StoreError: If the directory cannot be created.
    """

    # Pending rows, by key: the write job that holds the item and its row in the job.
    _pending: dict[str, tuple[_WriteJob, int]]

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        quality: int,
        meta: dict[str, Any],
        report: Callable[[str, str], None],
    ) -> None:
        self.directory = directory
        self.store = DiskStore(directory, max_bytes, frame_length=frame_length, prefix_size=PREFIX_SIZE)
        self.quality = quality
        self.hits = 0
        self._report = report
        self._layouts: dict[bytes, Layout] = {}
        self._headers: dict[Layout, bytes] = {}
        self._raw_streak: dict[Layout, int] = {}
        self._words: dict[Layout, int] = {}
        self._writes_enabled = True
        self._last_touch = 0.0
        self._pending = {}
        self._pending_lock = threading.Lock()
        self._writer = BackgroundWriter(self._write_job, self._write_failed, workers=min(_WRITERS, os.cpu_count() or 1))
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot use cache directory {directory}: {exc}") from exc
        self._ensure_meta({**meta, "created": time.time(), "max_bytes": max_bytes})
        self.touch()

    def _ensure_meta(self, meta: dict[str, Any]) -> None:
        """Write the metadata file if it is missing or damaged (a damaged one is reported)."""
        current, problem = load_meta(self.directory)
        if current is not None and problem is None:
            return
        path = self.directory / META_NAME
        try:
            write_json_atomic(path, meta)
        except OSError as exc:
            if is_disk_wide(exc):
                self._writes_enabled = False
                self._report(
                    "write",
                    f"cannot write to the disk cache {self.directory} ({exc}); new entries are kept in memory only",
                )
            else:
                self._report(
                    "meta", f"cannot write the metadata file {path} ({exc}); entries are still read and written"
                )
            return
        if problem is not None:
            self._report("meta", f"replaced the damaged metadata file {path} ({problem})")

    def __repr__(self) -> str:
        return f"DiskTier({self.store!r})"

    def touch(self) -> None:
        """Mark the module directory as used now (its metadata file's mtime)."""
        self._last_touch = time.time()
        with contextlib.suppress(OSError):  # never through a planted link, where the OS allows it
            os.utime(self.directory / META_NAME, follow_symlinks=not _UTIME_NOFOLLOW)

    # -- reads -----------------------------------------------------------------------
    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except StoreError as exc:
            self._report("read", f"cannot read a cache entry, recomputing it: {exc}")
        except CorruptEntryError as exc:
            self._drop(key, exc)
        return None

    def _row_bytes(self, header_bytes: bytes) -> int:
        return self._layout_of(header_bytes).row_bytes

    def _decode(self, keys: Sequence[str], datas: Sequence[bytes | None]) -> list[_Frame | None]:
        frames: list[_Frame | None] = []
        for key, data in zip(keys, datas):
            frame = None
            if data is not None:
                try:
                    frame = split_frame(data, raw_size=self._row_bytes)
                except CorruptEntryError as exc:
                    self._drop(key, exc)
            frames.append(frame)
        return frames

    def _drop(self, key: str, exc: Exception) -> None:
        path = self.store.path(key)
        if self.store.reject(key):
            self._report("corrupt", f"removed corrupt cache entry {path} ({exc}); recomputing it")
        else:
            self._report(
                "corrupt",
                f"corrupt cache entry {path} ({exc}) cannot be removed; this process skips it and recomputes it",
            )

    def _queued(self, keys: Sequence[str]) -> dict[int, _Frame]:
        """Frames of the ``keys`` whose writes are still queued, by position."""
        with self._pending_lock:
            found = {i: self._pending[key] for i, key in enumerate(keys) if key in self._pending}
        frames: dict[int, _Frame] = {}
        for i, (job, row) in found.items():
            layout = job.layout
            packed = np.zeros(layout.row_bytes, dtype=np.uint8)
            for leaf, off, spec in zip(job.leaves, layout.offsets, layout.leaves):
                packed[off : off + spec.nbytes] = leaf[row].reshape(-1).view(torch.uint8).numpy()
            frames[i] = (self._header_of(layout), packed.tobytes())
        return frames

    def read(self, keys: Sequence[str]) -> tuple[list[int], Layout | None, list[torch.Tensor]]:
        """Read entries for ``keys``, from the write queue or from their files.

        Files are read on the calling thread, chunk by chunk, and each chunk is checked
        and decompressed on the shared pool while the next one is read: reading is
        mostly Python (it holds the GIL), brotli is not, so the two overlap.

        Returns:
            The positions (into ``keys``) that were found, their common layout, and one
            ``(found, *shape)`` tensor per leaf at the stored dtype, on the CPU. Entries
            whose layout differs from the first one found are left out (recomputed).
        """
        n = len(keys)
        frames: list[_Frame | None] = [None] * n
        queued = self._queued(keys) if self._pending else {}
        for i, queued_frame in queued.items():
            frames[i] = queued_frame
        todo = [i for i in range(n) if i not in queued] if queued else range(n)
        if len(todo) >= _PARALLEL_MIN_ITEMS:
            pool = _read_pool()
            size = max(_PARALLEL_MIN_ITEMS // 2, -(-len(todo) // _READ_CHUNKS))
            futures = []
            for start in range(0, len(todo), size):
                part = [keys[i] for i in todo[start : start + size]]
                futures.append(pool.submit(self._decode, part, [self._get(key) for key in part]))
            decoded = [frame for future in futures for frame in future.result()]
        else:
            part = [keys[i] for i in todo]
            decoded = self._decode(part, [self._get(key) for key in part])
        for i, decoded_frame in zip(todo, decoded):
            frames[i] = decoded_frame
        positions: list[int] = []
        payloads: list[bytes | memoryview] = []
        layout: Layout | None = None
        layout_header = b""
        for i, frame in enumerate(frames):
            if frame is None:
                continue
            header_bytes, payload = frame
            if layout is None or header_bytes != layout_header:
                try:
                    entry_layout = self._layout_of(header_bytes)
                except CorruptEntryError as exc:
                    self._drop(keys[i], exc)
                    continue
                if len(payload) != entry_layout.row_bytes:
                    self._drop(keys[i], CorruptEntryError("payload size does not match its header"))
                    continue
                if layout is None:
                    layout, layout_header = entry_layout, header_bytes
                elif entry_layout != layout:
                    continue
            positions.append(i)
            payloads.append(payload)
        if layout is None:
            return [], None, []
        buffer = np.empty((len(payloads), layout.row_bytes), dtype=np.uint8)
        for row, payload in zip(buffer, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        rows = torch.from_numpy(buffer)
        leaves = [
            rows[:, off : off + leaf.nbytes].view(leaf.dtype).reshape(len(payloads), *leaf.shape)
            for leaf, off in zip(layout.leaves, layout.offsets)
        ]
        self.hits += len(positions)
        if time.time() - self._last_touch > 60:
            self.touch()
        return positions, layout, leaves

    def _layout_of(self, header_bytes: bytes) -> Layout:
        layout = self._layouts.get(header_bytes)
        if layout is None:
            try:
                layout = Layout.from_header(parse_header(header_bytes))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptEntryError(f"invalid header: {exc}") from None
            except RecursionError:
                raise CorruptEntryError("invalid header: nested too deeply") from None
            self._layouts[header_bytes] = layout
        return layout

    def _header_of(self, layout: Layout) -> bytes:
        header = self._headers.get(layout)
        if header is None:
            header = self._headers[layout] = encode_header(layout.to_header())
            self._layouts.setdefault(header, layout)
        return header

    def _word_of(self, layout: Layout) -> int | None:
        """The zero-elision word size for rows of ``layout``; ``None``: rows too small to elide."""
        if layout.row_bytes < MIN_ELIDE_BYTES:
            return None
        word = self._words.get(layout)
        if word is None:
            word = self._words[layout] = word_size(
                [leaf.dtype.itemsize for leaf in layout.leaves],
                [-(-leaf.nbytes // ALIGN) * ALIGN for leaf in layout.leaves],
            )
        return word

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

    def _unqueue(self, job: _WriteJob, keys: Sequence[str]) -> None:
        """Forget pending rows of ``job`` (not those a later job queued for the same keys)."""
        with self._pending_lock:
            for key in keys:
                entry = self._pending.get(key)
                if entry is not None and entry[0] is job:
                    del self._pending[key]

    def _write_job(self, job: _WriteJob) -> None:
        try:
            if self._writes_enabled:
                self._write_entries(job)
        finally:
            self._unqueue(job, job.keys)

    def _write_entries(self, job: _WriteJob) -> None:
        layout, n = job.layout, len(job.keys)
        header = self._header_of(layout)
        if len(job.leaves) == 1 and layout.row_bytes == layout.nbytes:
            packed = job.leaves[0].reshape(n, -1).view(torch.uint8).numpy()
        else:
            packed = np.zeros((n, layout.row_bytes), dtype=np.uint8)
            for leaf, off, spec in zip(job.leaves, layout.offsets, layout.leaves):
                packed[:, off : off + spec.nbytes] = leaf.reshape(n, -1).view(torch.uint8).numpy()
        streak = self._raw_streak.get(layout, 0)
        word = self._word_of(layout)
        for i, key in enumerate(job.keys):
            attempt = streak < _GIVE_UP_AFTER or streak % _RETRY_EVERY == 0
            frame = encode_frame(header, memoryview(packed[i]), self.quality if attempt else None, word)
            if attempt:
                streak = streak + 1 if frame[5] != CODEC_BROTLI else 0
            elif streak:
                streak += 1
            try:
                self.store.put(key, frame)
            except StoreError as exc:
                if is_disk_wide(exc):
                    raise
                self._report("entry", f"{exc}; that entry is recomputed when needed, the others are written")
            self._unqueue(job, (key,))
        self._raw_streak[layout] = streak
        if time.time() - self._last_touch > 60:
            self.touch()

    def _write_failed(self, exc: BaseException) -> None:
        self._writes_enabled = False
        self._report(
            "write",
            f"cannot write to the disk cache {self.directory} ({exc}); entries are kept in memory only from now on",
        )

    def flush(self) -> None:
        """Wait until every queued entry is on disk."""
        self._writer.flush()

    @property
    def pending(self) -> int:
        """Write jobs not finished yet."""
        return self._writer.pending

    def clear(self) -> None:
        """Remove every entry file (after pending writes finish)."""
        self.flush()
        self.store.clear()
