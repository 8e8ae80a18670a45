"""The disk tier: a :class:`DiskStore` plus encoding, background writes and batched reads.

Reads of a batch's misses run on a small shared thread pool (file reads and brotli
release the GIL) and land in one ``(n, row_bytes)`` buffer per batch, from which each
output leaf is a strided view: one copy per hit. Writes are encoded and written on a
:class:`BackgroundWriter`. When brotli keeps failing to pay for a layout, compression
is only retried now and then, so incompressible outputs cost no compression time.

Faults are reported through ``report(kind, message)``: a corrupt entry is removed and
becomes a miss; a read error becomes a miss; a write error turns writes off for this
tier. The engine turns each kind of report into one warning.
"""

from __future__ import annotations

import contextlib
import json
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

from ._fork import after_fork
from .codec import encode_frame, encode_header, parse_header, split_frame
from .errors import CorruptEntryError, StoreError
from .stores.disk import DiskStore
from .tree import Layout
from .writer import BackgroundWriter

__all__ = ["META_NAME", "DiskTier", "read_meta"]

META_NAME = "torchcache.json"
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


def read_meta(directory: Path) -> dict[str, Any] | None:
    """The metadata of a module directory, or ``None`` if it has none or it is invalid."""
    try:
        meta = json.loads((directory / META_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to a temporary file and rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


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

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        quality: int,
        meta: dict[str, Any],
        report: Callable[[str, str], None],
    ) -> None:
        self.directory = directory
        self.store = DiskStore(directory, max_bytes)
        self.quality = quality
        self.hits = 0
        self._report = report
        self._layouts: dict[bytes, Layout] = {}
        self._headers: dict[Layout, bytes] = {}
        self._raw_streak: dict[Layout, int] = {}
        self._writes_enabled = True
        self._last_touch = 0.0
        self._writer = BackgroundWriter(self._write_job, self._write_failed, workers=min(_WRITERS, os.cpu_count() or 1))
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if read_meta(directory) is None:
                write_json_atomic(directory / META_NAME, {**meta, "created": time.time(), "max_bytes": max_bytes})
            self.touch()
        except OSError as exc:
            raise StoreError(f"cannot use cache directory {directory}: {exc}") from exc

    def __repr__(self) -> str:
        return f"DiskTier({self.store!r})"

    def touch(self) -> None:
        """Mark the module directory as used now (its metadata file's mtime)."""
        self._last_touch = time.time()
        with contextlib.suppress(OSError):
            os.utime(self.directory / META_NAME)

    # -- reads -----------------------------------------------------------------------
    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except StoreError as exc:
            self._report("read", f"cannot read a cache entry, recomputing it: {exc}")
            return None

    def _decode(self, keys: Sequence[str], datas: Sequence[bytes | None]) -> list[_Frame | None]:
        frames: list[_Frame | None] = []
        for key, data in zip(keys, datas):
            frame = None
            if data is not None:
                try:
                    frame = split_frame(data)
                except CorruptEntryError as exc:
                    self._drop(key, exc)
            frames.append(frame)
        return frames

    def _drop(self, key: str, exc: Exception) -> None:
        with contextlib.suppress(StoreError):
            self.store.delete(key)
        self._report("corrupt", f"removed corrupt cache entry {self.store.path(key)} ({exc}); recomputing it")

    def read(self, keys: Sequence[str]) -> tuple[list[int], Layout | None, list[torch.Tensor]]:
        """Read entries for ``keys``.

        Files are read on the calling thread, chunk by chunk, and each chunk is checked
        and decompressed on the shared pool while the next one is read: reading is
        mostly Python (it holds the GIL), brotli is not, so the two overlap.

        Returns:
            The positions (into ``keys``) that were found, their common layout, and one
            ``(found, *shape)`` tensor per leaf at the stored dtype, on the CPU. Entries
            whose layout differs from the first one found are left out (recomputed).
        """
        n = len(keys)
        if n >= _PARALLEL_MIN_ITEMS:
            pool = _read_pool()
            size = max(_PARALLEL_MIN_ITEMS // 2, -(-n // _READ_CHUNKS))
            futures = []
            for start in range(0, n, size):
                part = keys[start : start + size]
                futures.append(pool.submit(self._decode, part, [self._get(key) for key in part]))
            frames = [frame for future in futures for frame in future.result()]
        else:
            frames = self._decode(keys, [self._get(key) for key in keys])
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
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptEntryError(f"invalid header: {exc}") from None
            self._layouts[header_bytes] = layout
        return layout

    # -- writes ----------------------------------------------------------------------
    def write(self, keys: Sequence[str], layout: Layout, leaves: Sequence[torch.Tensor]) -> None:
        """Queue entries for writing; ``leaves`` must be CPU tensors nobody else changes."""
        if not self._writes_enabled or not keys:
            return
        for start in range(0, len(keys), _WRITE_CHUNK):
            part = list(keys[start : start + _WRITE_CHUNK])
            chunk = [leaf[start : start + _WRITE_CHUNK] for leaf in leaves]
            self._writer.submit(_WriteJob(part, layout, chunk), layout.row_bytes * len(part))

    def _write_job(self, job: _WriteJob) -> None:
        if not self._writes_enabled:
            return
        layout, n = job.layout, len(job.keys)
        header = self._headers.get(layout)
        if header is None:
            header = self._headers[layout] = encode_header(layout.to_header())
        if len(job.leaves) == 1 and layout.row_bytes == layout.nbytes:
            packed = job.leaves[0].reshape(n, -1).view(torch.uint8).numpy()
        else:
            packed = np.zeros((n, layout.row_bytes), dtype=np.uint8)
            for leaf, off, spec in zip(job.leaves, layout.offsets, layout.leaves):
                packed[:, off : off + spec.nbytes] = leaf.reshape(n, -1).view(torch.uint8).numpy()
        streak = self._raw_streak.get(layout, 0)
        for i, key in enumerate(job.keys):
            attempt = streak < _GIVE_UP_AFTER or streak % _RETRY_EVERY == 0
            frame = encode_frame(header, memoryview(packed[i]), self.quality if attempt else None)
            if attempt:
                streak = streak + 1 if frame[5] == 0 else 0
            elif streak:
                streak += 1
            self.store.put(key, frame)
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
