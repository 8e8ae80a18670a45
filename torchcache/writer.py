"""A background thread that encodes and writes entries, with bounded pending bytes.

Writing on a thread lets the forward pass go on while brotli and the file system work
(both release the GIL). Pending work is bounded: ``submit`` blocks while more than
``max_pending_bytes`` wait, so memory stays bounded when the disk is slower than the
model. ``flush`` waits until everything submitted is written; interpreter exit flushes
every writer. A crash loses pending writes but never leaves a partial entry, because
each entry is written to a temporary file and renamed.

Errors in the thread are never raised there: they are handed to ``on_error`` (the
engine turns them into one warning, on the caller's thread).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ._fork import after_fork
from ._log import logger

__all__ = ["BackgroundWriter", "flush_all"]

_writers: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()
_DEFAULT_PENDING = 256 * 2**20
#: How much nicer than the thread that starts them writer threads run on Linux (19 is the lowest priority).
WRITER_NICENESS = 10


class BackgroundWriter:
    """Runs ``sink(job)`` for submitted jobs on one daemon thread, in order.

    Args:
        sink: Called with each job on a writer thread.
        on_error: Called with the exception if ``sink`` raises.
        max_pending_bytes: Back-pressure threshold for ``submit``.
        workers: Writer threads. With one, jobs run in submission order; with more, jobs
            overlap (``sink`` must then be thread-safe).
    """

    def __init__(
        self,
        sink: Callable[[Any], None],
        on_error: Callable[[BaseException], None],
        max_pending_bytes: int = _DEFAULT_PENDING,
        workers: int = 1,
    ) -> None:
        self._sink = sink
        self._on_error = on_error
        self._max_pending = max_pending_bytes
        self._jobs: deque[tuple[Any, int]] = deque()
        self._pending_bytes = 0
        self._busy = 0
        self._cond = threading.Condition()
        self._workers = max(1, workers)
        self._threads = 0
        _writers.add(self)

    def _reset_after_fork(self) -> None:
        """Forget the parent's threads and queue (the parent writes its own jobs)."""
        self._cond = threading.Condition()
        self._jobs.clear()
        self._pending_bytes = 0
        self._busy = 0
        self._threads = 0

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet written."""
        with self._cond:
            return len(self._jobs) + self._busy

    def submit(self, job: Any, nbytes: int) -> None:
        """Queue a job; block while too many bytes are pending."""
        with self._cond:
            while self._pending_bytes and self._pending_bytes + nbytes > self._max_pending:
                self._cond.wait()
            self._jobs.append((job, nbytes))
            self._pending_bytes += nbytes
            if self._threads < min(self._workers, len(self._jobs) + self._busy):
                self._threads += 1
                threading.Thread(target=self._run, name="torchcache-writer", daemon=True).start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job is done; return ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: bool(self._jobs), timeout=5.0):
                    self._threads -= 1
                    return
                job, nbytes = self._jobs.popleft()
                self._busy += 1
            try:
                self._sink(job)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
                try:
                    self._on_error(exc)
                except Exception:  # noqa: BLE001 # pragma: no cover - last resort
                    logger.exception("torchcache: error while reporting a write failure")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._pending_bytes -= nbytes
                    self._cond.notify_all()


def _lower_priority() -> None:
    """Lower this thread's scheduling priority, where the OS sets it per thread (Linux).

    Compression and file writes then use the cores the model leaves idle instead of
    slowing its forward pass: an intra-op thread pool waits for its slowest thread, so
    a writer that takes a core from one of them stalls them all. The writes still
    happen: when the forward pass waits (on ``submit`` back-pressure, ``flush`` or
    anything else), the writer threads have the cores.
    """
    if sys.platform.startswith("linux") and hasattr(os, "setpriority"):
        thread = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, thread, min(os.getpriority(os.PRIO_PROCESS, thread) + WRITER_NICENESS, 19))


def flush_all() -> None:
    """Flush every live writer (run at interpreter exit)."""
    for writer in list(_writers):
        writer.flush()


def _after_fork_in_child() -> None:
    for writer in list(_writers):
        writer._reset_after_fork()


class _FlushAtProcessExit:
    """Flush in multiprocessing's exit finalizers too.

    Forked multiprocessing children (DataLoader workers on Linux) end with ``os._exit``,
    which skips ``atexit``, but run multiprocessing's exit finalizers first. A child
    starts with none of the parent's finalizers, so the registration is made again in
    each child, after fork.
    """

    def register(self) -> None:
        multiprocessing.util.Finalize(None, flush_all, exitpriority=0)


atexit.register(flush_all)
_flush_at_process_exit = _FlushAtProcessExit()
_flush_at_process_exit.register()
multiprocessing.util.register_after_fork(_flush_at_process_exit, _FlushAtProcessExit.register)
# A forked child (a DataLoader worker on Linux) has none of the parent's threads: a
# writer that counted on them would wait forever in flush().
after_fork(_after_fork_in_child)
