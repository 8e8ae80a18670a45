"""Background writes on a small process-wide pool of threads, with bounded pending bytes.

Writing on threads lets the forward pass go on while brotli and the file system work
(both release the GIL). Each :class:`BackgroundWriter` has its own queue, its own bound
on pending bytes (``submit`` blocks while more than ``max_pending_bytes`` wait, so memory
stays bounded when the disk is slower than the model), its own ``flush`` and its own
error callback. The threads that run the jobs are shared by every writer of the process,
at most :data:`MAX_THREADS` of them, so a process that makes many caches does not collect
threads. Writers take turns, and a writer with ``workers=1`` never has two jobs running,
so its jobs run in submission order.

A thread ends after :data:`IDLE_TIMEOUT` seconds without work and holds no job, and no
error of a job, while it waits: a thread that still held tensors when the interpreter
shut down could abort the process. At interpreter exit every writer is flushed (saying
what it waits for once that takes more than :data:`REPORT_AFTER` seconds), then the
threads are stopped and joined; a job submitted after that runs on the caller's thread.
A crash loses pending writes but never leaves a partial entry: a store indexes an
entry only after it is written whole.

Errors of a job are never raised on a pool thread: they go to the writer's
``on_error`` (the engine turns them into one warning, on the caller's thread) before
the job counts as done, so a ``flush`` that returns has seen them reported.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._fork import after_fork, at_process_end, renew_lock_after_fork
from .._log import logger
from ..policy import format_size

__all__ = ["BackgroundWriter", "Unstored", "flush_all"]

#: How much nicer than the thread that starts them writer threads run on Linux (19 is the lowest priority).
WRITER_NICENESS = 10
#: Seconds a writer thread waits for work before it ends.
IDLE_TIMEOUT = 5.0
#: The most writer threads one process runs, whatever the number of writers.
MAX_THREADS = max(2, min(4, os.cpu_count() or 1))
#: Seconds :func:`flush_all` waits before it says what it is waiting for.
REPORT_AFTER = 1.0
#: The name of every writer thread.
THREAD_NAME = "torchcache-writer"
_DEFAULT_PENDING = 256 * 2**20
_JOIN_TIMEOUT = 30.0

_writers: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()
#: Per thread: on a writer thread, ``base_priority`` is the priority it was lowered from.
_thread_state = threading.local()


class _Pool:
    """The writer threads of this process and the writers that have a job to start.

    One lock guards the pool and the queues and counters of every writer. Threads wait
    on ``work`` for a ready writer; ``submit`` and ``flush`` wait on ``progress`` for
    jobs to end.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.progress = threading.Condition(self.lock)
        self.ready: deque[BackgroundWriter] = deque()
        self.threads: set[threading.Thread] = set()
        self.idle = 0
        self.stopped = False

    def offer(self, writer: BackgroundWriter) -> None:
        """Queue ``writer`` for a thread if it has a job it may start now (lock held)."""
        if writer._jobs and not writer._offered and writer._busy < writer._workers:
            writer._offered = True
            self.ready.append(writer)

    def wake(self) -> bool:
        """Get threads to the ready writers: wake idle ones, start one if needed (lock held).

        Returns:
            ``False`` if no thread will run the ready jobs (the pool is stopped, or no
            thread exists and none can be started); the caller then runs them itself.
        """
        if not self.ready:
            return True
        if self.idle:
            self.work.notify(min(self.idle, len(self.ready)))
        if self.stopped:
            return bool(self.threads)
        if self.idle < len(self.ready) and len(self.threads) < MAX_THREADS:
            thread = threading.Thread(target=_serve, args=(self, _base_priority()), name=THREAD_NAME, daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter shutdown: no new threads
                return bool(self.threads)
            self.threads.add(thread)
        return True

    def run_next(self, wait: bool) -> bool:
        """Run one job of the writer that waited longest.

        Args:
            wait: Wait up to :data:`IDLE_TIMEOUT` for a job (a pool thread); without it,
                return at once when there is none (a caller running jobs itself).

        Returns:
            ``False`` if there was no job to run; a pool thread then ends.
        """
        with self.lock:
            deadline = time.monotonic() + IDLE_TIMEOUT
            while wait and not self.ready and not self.stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.idle += 1
                try:
                    self.work.wait(remaining)
                finally:
                    self.idle -= 1
            if not self.ready:
                if wait:
                    self.threads.discard(threading.current_thread())
                return False
            writer = self.ready.popleft()
            writer._offered = False
            job, nbytes = writer._jobs.popleft()
            writer._busy += 1
            self.offer(writer)
            self.wake()
        # The job lives in this frame only: it is gone before the thread waits again.
        try:
            writer._run(job)
        finally:
            del job
            with self.lock:
                writer._busy -= 1
                writer._pending_bytes -= nbytes
                self.offer(writer)
                self.wake()
                # Nor the writer, before a flush can return: its owner, let go after the flush,
                # is freed at once (with it the store's files and their locks).
                del writer
                self.progress.notify_all()
        return True


def _serve(pool: _Pool, base: int | None) -> None:
    """The loop of one writer thread, lowered from the ``base`` priority (see :func:`_base_priority`)."""
    _lower_priority(base)
    while pool.run_next(wait=True):
        pass


_pool = _Pool()


class BackgroundWriter:
    """Runs ``sink(job)`` for submitted jobs on the process's writer threads.

    Args:
        sink: Called with each job on a writer thread.
        on_error: Called with the exception if ``sink`` raises.
        max_pending_bytes: Back-pressure threshold for ``submit``.
        workers: Jobs of this writer that may run at once. With one, jobs run in
            submission order; with more, jobs overlap (``sink`` must then be thread-safe).
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
        self._workers = max(1, workers)
        self._jobs: deque[tuple[Any, int]] = deque()
        self._pending_bytes = 0
        self._busy = 0
        self._offered = False
        _writers.add(self)
        _keep_exit_hook_first()

    def _reset_after_fork(self) -> None:
        """Forget the parent's queue (the parent writes its own jobs)."""
        self._jobs.clear()
        self._pending_bytes = 0
        self._busy = 0
        self._offered = False

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet written."""
        with _pool.lock:
            return len(self._jobs) + self._busy

    def submit(self, job: Any, nbytes: int) -> None:
        """Queue a job; block while too many bytes are pending."""
        pool = _pool
        with pool.lock:
            while self._pending_bytes and self._pending_bytes + nbytes > self._max_pending:
                pool.progress.wait()
            self._jobs.append((job, nbytes))
            self._pending_bytes += nbytes
            pool.offer(self)
            served = pool.wake()
        del job
        if not served:
            while pool.run_next(wait=False):
                pass

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job is done; return ``False`` on timeout."""
        pool = _pool
        with pool.lock:
            return pool.progress.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self, job: Any) -> None:
        """Run one job; hand its error, if any, to ``on_error``."""
        try:
            self._sink(job)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
            try:
                self._on_error(exc)
            except Exception:  # noqa: BLE001 # pragma: no cover - last resort
                logger.exception("error while reporting a write failure")


def _base_priority() -> int | None:
    """The priority a writer thread started now is lowered from, where the OS sets it per thread (Linux).

    That is the calling thread's priority, or, on a writer thread (which starts one when
    other writers wait), the priority its own thread was lowered from: lowered once from
    the caller's, never again from an already lowered one. ``None`` where there is none.
    """
    base: int | None = getattr(_thread_state, "base_priority", None)
    if base is not None or not (sys.platform.startswith("linux") and hasattr(os, "getpriority")):
        return base
    with contextlib.suppress(OSError):
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return None


def _lower_priority(base: int | None) -> None:
    """Lower this thread's scheduling priority below ``base``, where the OS sets it per thread (Linux).

    Compression and file writes then use the cores the model leaves idle instead of
    slowing its forward pass: an intra-op thread pool waits for its slowest thread, so
    a writer that takes a core from one of them stalls them all. The writes still
    happen: when the forward pass waits (on ``submit`` back-pressure, ``flush`` or
    anything else), the writer threads have the cores.
    """
    if base is None or not hasattr(os, "setpriority"):
        return
    _thread_state.base_priority = base
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(base + WRITER_NICENESS, 19))


def flush_all() -> None:
    """Wait until every writer of this process has done every job submitted to it.

    Runs at interpreter exit and when a multiprocessing child ends. Once that takes more
    than :data:`REPORT_AFTER` seconds, it says what it waits for, with the number of
    pending jobs and bytes: a warning on the ``torchcache`` logger and a line on stderr.
    """
    writers = list(_writers)
    deadline = time.monotonic() + REPORT_AFTER
    if all(writer.flush(timeout=max(0.0, deadline - time.monotonic())) for writer in writers):
        return
    with _pool.lock:
        jobs = sum(len(writer._jobs) + writer._busy for writer in writers)
        nbytes = sum(writer._pending_bytes for writer in writers)
    if jobs:
        message = (
            f"torchcache: waiting for {jobs} pending background write job{'s' if jobs != 1 else ''} "
            f"({format_size(nbytes)}, {nbytes} bytes) to finish"
        )
        logger.warning(message)
        with contextlib.suppress(Exception):
            print(message, file=sys.stderr, flush=True)
    for writer in writers:
        writer.flush()


def stop_threads(timeout: float = _JOIN_TIMEOUT) -> None:
    """Let the writer threads finish their queued jobs, end, and join them.

    Jobs submitted afterwards run on the thread that submits them.
    """
    pool = _pool
    with pool.lock:
        pool.stopped = True
        pool.work.notify_all()
        threads = list(pool.threads)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout)


def _at_exit() -> None:
    """Flush every writer, then stop and join the writer threads (interpreter exit)."""
    flush_all()
    stop_threads()


def _keep_exit_hook_first() -> None:
    """Make :func:`_at_exit` the last hook registered, so that it runs first at exit.

    Hooks that run before it (a cache's exit summary) would otherwise wait for the writes
    without saying so, and hooks that run after it find the threads already stopped.
    """
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a new pool, and empty queues."""
    global _pool
    _pool = _Pool()
    for writer in list(_writers):
        writer._reset_after_fork()


class Unstored:
    """The keys whose writes a server refused, until a later write stores them (past ``bound``, only counted)."""

    def __init__(self, bound: int = 1 << 18) -> None:
        #: The keys held (at most ``bound``; more are only counted).
        self.held: set[str] = set()
        self._more = 0
        self._bound = bound
        self._lock = threading.Lock()
        renew_lock_after_fork(self, "_lock")

    def __len__(self) -> int:
        return len(self.held) + self._more

    def refused(self, keys: list[str]) -> None:
        """Note keys whose write failed."""
        with self._lock:
            if len(self.held) < self._bound:
                self.held.update(keys)
            else:  # a long outage: counted, not held
                self._more += len(set(keys))

    def stored(self, keys: list[str]) -> None:
        """Note keys written since."""
        if self.held:
            with self._lock:
                self.held.difference_update(keys)

    def found(self, keys: Sequence[str], positions: Sequence[int], store: object) -> None:
        """Note the keys at ``positions`` read from ``store``: its server holds them after all.

        A hit of a local copy in use (a store whose ``near_enabled``) proves nothing: it is not noted.
        """
        if self.held and not getattr(store, "near_enabled", False):
            self.stored([keys[i] for i in positions])


atexit.register(_at_exit)
at_process_end(flush_all)
after_fork(_after_fork_in_child)
