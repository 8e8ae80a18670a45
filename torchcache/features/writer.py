"""The rows of an extraction, written in a thread of their own while the next batch is computed.

Filling a batch's rows, hashing their checks, writing them and their input digests is
CPU work of the main process that the backbone would otherwise wait for (a GPU idles
through it). (The inputs are hashed before the backbone runs, as they are collated: a
backbone may change them.) :class:`BatchWriter` does it in one background thread, one batch
at a time: :meth:`BatchWriter.submit` first waits for the batch before (and raises what it
raised), so writes keep their order, the rows buffer is reused, and at most one batch
of outputs is held beside the one being computed.

A backbone that runs on the CPU with torch's threads on every core leaves no core for
that thread: it would take one from torch's thread pool, whose every parallel region
then waits for the thread it preempted (an extraction of 100,000 samples on 2 cores,
in ``benchmarks/linear_probe.py``'s setting, took a median 1.17x an uncached epoch with
the thread and 1.14x writing in line, over six alternating rounds). Such batches are
written in line, between the backbone's batches (:func:`background_pays`).

The order within a batch is that of :class:`~torchcache.stores.rows.RowsFile`: rows,
then their checks, then the digests that name those checks, so a process killed at any
point leaves no entry without its row.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from ..faults import Fault, FaultLog
from ..stores.features.digests import DIGESTS_NAME, DigestFile, pack_digests
from ..stores.features.file import features_in_memory
from ..stores.features.layout import SampleLayout
from ..stores.rows import RowsFile
from .reuse import open_digests

__all__ = ["Batch", "BatchWriter", "background_pays"]


class Batch(NamedTuple):
    """A batch to write: its samples' indices, the backbone's outputs, their other fields and input digests."""

    layout: SampleLayout
    indices: np.ndarray[Any, Any]
    features: torch.Tensor
    columns: list[list[Any]]
    digests: list[bytes | None]


class BatchWriter:
    """Writes batches of rows to a features file (and their digests beside it) in a background thread.

    Args:
        file: The file to write to, or ``None`` until :meth:`start` gives one (the first
            batch's outputs decide its layout).
        faults: Where a file that cannot be written is reported; the rows then go on in
            memory, as :func:`keep_in_memory` moves them.
    """

    def __init__(self, file: RowsFile | None, faults: FaultLog) -> None:
        self.file = file
        self._given = file
        self._faults = faults
        self._digests: DigestFile | None = None if file is None else self._open_digests(file)
        self._rows = np.zeros((0, 0), np.uint8)  # a batch's rows, filled again for each (the gaps stay zero)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="torchcache-features")
        self._pending: Future[None] | None = None

    def start(self, file: RowsFile) -> None:
        """Write to ``file``, made once the first batch's outputs were known."""
        self.file = file
        self._digests = self._open_digests(file)

    def _open_digests(self, file: RowsFile) -> DigestFile | None:
        """The input digests beside ``file``; one that cannot be made or used is a warning."""
        digests = open_digests(file)
        if digests is None and file.path is not None:
            where = file.path.with_name(DIGESTS_NAME)
            self._faults.warn(Fault.DIGESTS, f"cannot make or use {where}: rows are kept without their input digests")
        return digests

    def submit(self, batch: Batch) -> None:
        """Write a batch: once the one before is written, in the background (or now: :func:`background_pays`).

        Raises:
            ConfigError: (or what else the batch before raised) If its samples, or the
                batch before's, did not fit the layout.
        """
        self._wait()
        if background_pays(batch.features):
            self._pending = self._pool.submit(self._write, batch)
        else:
            self._write(batch)

    def close(self, *, failed: bool = False) -> RowsFile | None:
        """Wait for the batch being written and let go of the thread; the file the rows went to.

        Args:
            failed: The extraction is being left on an error: the batch's own error (if
                any) is not raised over it, and a file made here is closed.
        """
        try:
            if failed:
                with contextlib.suppress(Exception):
                    self._wait()
            else:
                self._wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._digests is not None:
                self._digests.close()
                self._digests = None
            if failed and self.file is not None and self.file is not self._given:
                self.file.close()
        return self.file

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write(self, batch: Batch) -> None:
        layout, indices, features, columns, digests = batch
        assert self.file is not None
        count = len(indices)
        if len(self._rows) < count or self._rows.shape[1] != layout.stride:
            self._rows = np.zeros((count, layout.stride), np.uint8)
        rows = self._rows[:count]
        layout.fill(rows, features, columns)
        try:
            self.file.write(indices, rows)
        except OSError as exc:
            self._faults.warn(Fault.WRITE, f"cannot write to {self.file.path} ({exc}): the features are kept in memory")
            self.file = keep_in_memory(self.file)
            self.file.write(indices, rows)
            if self._digests is not None:  # they would name rows that are not on disk
                self._digests.close()
                self._digests = None
        if self._digests is not None:  # once the rows are marked: each entry names its row's check
            try:
                self._digests.write(indices, pack_digests(digests), self.file.checks(indices))
            except OSError as exc:
                path = self._digests.path
                self._faults.warn(Fault.DIGESTS, f"cannot write to {path} ({exc}): rows are kept without them")
                self._digests.close()
                self._digests = None


def background_pays(features: torch.Tensor) -> bool:
    """Whether a batch's rows are better written in the background than in line.

    They are, unless the backbone ran on the CPU with as many torch threads as this
    process has cores (then a writer thread would preempt one of them).
    """
    if features.device.type != "cpu":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return torch.get_num_threads() < cores


def keep_in_memory(file: RowsFile) -> RowsFile:
    """A features file in memory holding the rows of ``file`` that read back whole; ``file`` is closed."""
    memory = features_in_memory(file.header)
    written = file.written()
    for start in range(0, len(written), 4096):
        part = written[start : start + 4096]
        found, rows, _, _ = file.read(part)
        memory.write(part[found], rows)
    file.close()
    return memory
