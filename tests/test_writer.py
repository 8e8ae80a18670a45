"""The background writer: order, flush, back-pressure, error reporting, the shared threads."""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import torchcache.tiers.writer as writer_module
from torchcache.tiers.writer import MAX_THREADS, THREAD_NAME, WRITER_NICENESS, BackgroundWriter, flush_all, stop_threads

# Generous bounds for waits that only end early when the writer misbehaves; no test
# depends on how long anything takes.
_HANG = 30.0


class _Recorder:
    """A sink that records jobs; jobs listed in ``gates`` wait for their event first."""

    def __init__(self) -> None:
        self.done: list[Any] = []
        self.errors: list[BaseException] = []
        self.gates: dict[Any, threading.Event] = {}
        self.started: dict[Any, threading.Event] = {}
        self.log: list[str] = []
        self.lock = threading.Lock()

    def gate(self, job: Any) -> threading.Event:
        self.gates[job] = threading.Event()
        self.started[job] = threading.Event()
        return self.gates[job]

    def sink(self, job: Any) -> None:
        if job in self.started:
            self.started[job].set()
        if job in self.gates:
            assert self.gates[job].wait(_HANG), f"job {job!r} was never released"
        if isinstance(job, BaseException):
            raise job
        with self.lock:
            self.done.append(job)
            self.log.append(f"done {job}")

    def on_error(self, exc: BaseException) -> None:
        self.errors.append(exc)


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    rec = _Recorder()
    yield rec
    for event in rec.gates.values():  # never leave the writer thread blocked
        event.set()


def test_jobs_run_in_submission_order(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error)
    for i in range(200):
        writer.submit(i, nbytes=10)
    assert writer.flush(timeout=_HANG)
    assert recorder.done == list(range(200))
    assert recorder.errors == []
    assert writer.pending == 0


def test_flush_waits_for_running_and_queued_jobs(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error)
    release = recorder.gate("first")
    writer.submit("first", nbytes=1)
    writer.submit("second", nbytes=1)
    assert recorder.started["first"].wait(_HANG)
    assert writer.flush(timeout=0) is False
    assert writer.pending == 2
    assert recorder.done == []
    release.set()
    assert writer.flush(timeout=_HANG) is True
    assert recorder.done == ["first", "second"]
    assert writer.pending == 0


def test_flush_with_nothing_submitted_returns_at_once(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error)
    assert writer.flush(timeout=0) is True
    assert writer.pending == 0


def test_submit_blocks_past_max_pending_bytes(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error, max_pending_bytes=100)
    release = recorder.gate("a")
    writer.submit("a", nbytes=60)
    assert recorder.started["a"].wait(_HANG)
    submitted = threading.Event()

    def submit_b() -> None:
        writer.submit("b", nbytes=60)  # 60 + 60 > 100: waits for "a" to be written
        with recorder.lock:
            recorder.log.append("submitted b")
        submitted.set()

    thread = threading.Thread(target=submit_b, daemon=True)
    thread.start()
    # A correct writer keeps "b" out until "a" is written, however long this waits.
    assert not submitted.wait(0.5)
    assert writer.pending == 1
    release.set()
    thread.join(_HANG)
    assert not thread.is_alive()
    assert writer.flush(timeout=_HANG)
    assert recorder.done == ["a", "b"]
    assert recorder.log.index("done a") < recorder.log.index("submitted b")


def test_submit_within_max_pending_bytes_does_not_block(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error, max_pending_bytes=100)
    release = recorder.gate("a")
    writer.submit("a", nbytes=40)
    writer.submit("b", nbytes=40)  # 80 <= 100: returns while "a" is still blocked
    writer.submit("c", nbytes=20)  # exactly 100
    assert writer.pending == 3
    assert recorder.done == []
    release.set()
    assert writer.flush(timeout=_HANG)
    assert recorder.done == ["a", "b", "c"]


def test_a_job_larger_than_the_limit_is_accepted_when_nothing_is_pending(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error, max_pending_bytes=10)
    writer.submit("huge", nbytes=1000)
    assert writer.flush(timeout=_HANG)
    writer.submit("huge again", nbytes=1000)
    assert writer.flush(timeout=_HANG)
    assert recorder.done == ["huge", "huge again"]


def test_many_submitters_all_get_through(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error, max_pending_bytes=50)

    def submit_all(t: int) -> None:
        for i in range(50):
            writer.submit((t, i), nbytes=20)

    threads = [threading.Thread(target=submit_all, args=(t,), daemon=True) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_HANG)
        assert not thread.is_alive()
    assert writer.flush(timeout=_HANG)
    assert sorted(recorder.done) == sorted((t, i) for t in range(4) for i in range(50))
    for t in range(4):  # each submitter's jobs stay in its order
        assert [i for s, i in recorder.done if s == t] == list(range(50))


def test_errors_go_to_on_error_and_later_jobs_still_run(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error)
    boom = OSError("disk full")
    writer.submit(1, nbytes=1)
    writer.submit(boom, nbytes=1)
    writer.submit(2, nbytes=1)
    assert writer.flush(timeout=_HANG)
    assert recorder.errors == [boom]
    writer.submit(3, nbytes=1)
    writer.submit(ValueError("bad entry"), nbytes=1)
    writer.submit(4, nbytes=1)
    assert writer.flush(timeout=_HANG)
    assert recorder.done == [1, 2, 3, 4]
    assert [type(e) for e in recorder.errors] == [OSError, ValueError]
    assert str(recorder.errors[1]) == "bad entry"


def test_failed_jobs_release_their_pending_bytes(recorder: _Recorder) -> None:
    writer = BackgroundWriter(recorder.sink, recorder.on_error, max_pending_bytes=100)
    for _ in range(5):
        writer.submit(RuntimeError("write failed"), nbytes=90)
    writer.submit("after", nbytes=90)
    assert writer.flush(timeout=_HANG)
    assert recorder.done == ["after"]
    assert len(recorder.errors) == 5


def test_an_error_in_on_error_does_not_stop_the_writer(recorder: _Recorder) -> None:
    def bad_on_error(exc: BaseException) -> None:
        recorder.errors.append(exc)
        raise RuntimeError("reporting failed too")

    writer = BackgroundWriter(recorder.sink, bad_on_error)
    writer.submit(KeyError("first"), nbytes=1)
    writer.submit("next", nbytes=1)
    assert writer.flush(timeout=_HANG)
    assert recorder.done == ["next"]
    assert len(recorder.errors) == 1


def _priority() -> int:
    """The scheduling priority (niceness) of the calling thread."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


_linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread priorities are a Linux feature"
)


@_linux_only
def test_writer_threads_run_at_a_lower_priority_than_the_caller(pool: writer_module._Pool) -> None:
    seen: list[int] = []
    writer = BackgroundWriter(lambda job: seen.append(_priority()), lambda exc: None)
    writer.submit("job", 1)
    assert writer.flush(_HANG)
    assert seen == [min(_priority() + WRITER_NICENESS, 19)]


@_linux_only
def test_a_writer_thread_started_by_a_writer_thread_is_lowered_once(pool: writer_module._Pool) -> None:
    seen: dict[str, int] = {}
    errors: list[BaseException] = []
    inner_done = threading.Event()

    def inner_sink(job: str) -> None:
        seen[job] = _priority()
        inner_done.set()

    inner = BackgroundWriter(inner_sink, errors.append)

    def outer_sink(job: str) -> None:
        seen[job] = _priority()
        # This thread is busy until "inner" is written, so a second thread, started by
        # this one, writes it.
        inner.submit("inner", nbytes=1)
        assert inner_done.wait(_HANG), "no second thread wrote the inner job"

    outer = BackgroundWriter(outer_sink, errors.append)
    outer.submit("outer", nbytes=1)
    assert outer.flush(_HANG) and inner.flush(_HANG)
    assert errors == []
    lowered = min(_priority() + WRITER_NICENESS, 19)
    assert seen == {"outer": lowered, "inner": lowered}


# -- the threads: shared by every writer, bounded, holding nothing while idle ------------------
@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[writer_module._Pool]:
    """A pool of writer threads of this test's own; its threads are stopped afterwards."""
    own = writer_module._Pool()
    monkeypatch.setattr(writer_module, "_pool", own)
    yield own
    stop_threads()


def _poll(condition: Callable[[], bool], timeout: float = _HANG) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds (checked every few ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_fifty_writers_share_a_bounded_number_of_threads(pool: writer_module._Pool) -> None:
    ran_on: set[threading.Thread] = set()
    lock = threading.Lock()

    def sink(job: Any) -> None:
        with lock:
            ran_on.add(threading.current_thread())
        assert len(pool.threads) <= MAX_THREADS

    writers = [BackgroundWriter(sink, lambda exc: None) for _ in range(50)]
    for i, writer in enumerate(writers):
        writer.submit(i, nbytes=1)
        writer.submit(-i, nbytes=1)
        assert len(pool.threads) <= MAX_THREADS
    for writer in writers:
        assert writer.flush(timeout=_HANG)
    assert 1 <= len(ran_on) <= MAX_THREADS
    assert {thread.name for thread in ran_on} == {THREAD_NAME}


def test_a_blocked_writer_does_not_hold_up_the_others(pool: writer_module._Pool, recorder: _Recorder) -> None:
    slow = BackgroundWriter(recorder.sink, recorder.on_error)
    release = recorder.gate("stuck")
    slow.submit("stuck", nbytes=1)
    slow.submit("after stuck", nbytes=1)
    assert recorder.started["stuck"].wait(_HANG)
    others = [BackgroundWriter(recorder.sink, recorder.on_error) for _ in range(5)]
    for i, other in enumerate(others):
        other.submit(i, nbytes=1)
    for other in others:
        assert other.flush(timeout=_HANG)
    assert sorted(recorder.done) == list(range(5))
    assert slow.flush(timeout=0) is False
    release.set()
    assert slow.flush(timeout=_HANG)
    assert recorder.done[-2:] == ["stuck", "after stuck"]


def test_a_writer_with_two_workers_runs_two_jobs_at_once(pool: writer_module._Pool) -> None:
    second_started = threading.Event()
    done: list[str] = []

    def sink(job: str) -> None:
        if job == "first":
            assert second_started.wait(_HANG), "the second job never ran beside the first"
        else:
            second_started.set()
        done.append(job)

    writer = BackgroundWriter(sink, lambda exc: None, workers=2)
    writer.submit("first", nbytes=1)
    writer.submit("second", nbytes=1)
    assert writer.flush(timeout=_HANG)
    assert done == ["second", "first"]


class _Payload:
    """A job (or the data of a failed job's error) that tests can watch with a weak reference."""


class _JobFailed(Exception):
    def __init__(self, payload: _Payload) -> None:
        super().__init__("write failed")
        self.payload = payload


@pytest.mark.parametrize("fails", [False, True], ids=["written", "failed"])
def test_an_idle_thread_holds_no_job(pool: writer_module._Pool, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    monkeypatch.setattr(writer_module, "IDLE_TIMEOUT", 600.0)  # the thread stays, idle, for the test
    ran_on: list[threading.Thread] = []
    errors: list[str] = []

    def sink(job: _Payload) -> None:
        ran_on.append(threading.current_thread())
        if fails:
            raise _JobFailed(job)

    writer = BackgroundWriter(sink, lambda exc: errors.append(type(exc).__name__))
    job = _Payload()
    ref = weakref.ref(job)
    writer.submit(job, nbytes=1)
    del job
    assert writer.flush(timeout=_HANG)
    assert errors == (["_JobFailed"] if fails else [])

    def job_freed() -> bool:
        gc.collect()
        return ref() is None

    assert _poll(job_freed), "an idle writer thread still holds its last job"
    assert ran_on[0].is_alive()  # freed while the thread waits, not when it ends


def test_threads_end_after_the_idle_timeout_and_new_ones_start(
    pool: writer_module._Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "IDLE_TIMEOUT", 0.01)
    ran_on: list[threading.Thread] = []
    writer = BackgroundWriter(lambda job: ran_on.append(threading.current_thread()), lambda exc: None)
    writer.submit("a", nbytes=1)
    assert writer.flush(timeout=_HANG)
    assert _poll(lambda: not ran_on[0].is_alive() and not pool.threads)
    writer.submit("b", nbytes=1)
    assert writer.flush(timeout=_HANG)
    assert len(ran_on) == 2 and ran_on[1] is not ran_on[0]


def test_stop_threads_joins_them_and_later_jobs_run_on_the_caller(pool: writer_module._Pool) -> None:
    ran_on: list[threading.Thread] = []
    writer = BackgroundWriter(lambda job: ran_on.append(threading.current_thread()), lambda exc: None)
    writer.submit("before", nbytes=1)
    assert writer.flush(timeout=_HANG)
    stop_threads()
    assert not ran_on[0].is_alive()
    assert not pool.threads
    writer.submit("after", nbytes=1)
    assert ran_on[1] is threading.current_thread()
    assert writer.flush(timeout=0)
    assert writer.pending == 0


class _Records(logging.Handler):
    """Keeps the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def torchcache_records() -> Iterator[list[logging.LogRecord]]:
    """Records of the ``torchcache`` logger at WARNING and above, during the test."""
    handler = _Records()
    log = logging.getLogger("torchcache")
    level = log.level
    log.setLevel(logging.WARNING)
    log.addHandler(handler)
    yield handler.records
    log.removeHandler(handler)
    log.setLevel(level)


def test_flush_all_says_what_it_waits_for(
    pool: writer_module._Pool,
    monkeypatch: pytest.MonkeyPatch,
    torchcache_records: list[logging.LogRecord],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(writer_module, "REPORT_AFTER", 0.01)

    def sink(job: str) -> None:
        # held until flush_all has said what it waits for: it must say it, then wait
        assert _poll(lambda: bool(torchcache_records)), "flush_all never said what it waits for"

    writer = BackgroundWriter(sink, lambda exc: None)
    writer.submit("slow", nbytes=300)
    writer.submit("queued", nbytes=200)
    flush_all()
    assert writer.pending == 0
    (record,) = torchcache_records
    assert record.levelno == logging.WARNING
    assert "2 pending background write jobs" in record.getMessage()
    assert "500 bytes" in record.getMessage()
    assert record.getMessage() in capsys.readouterr().err


def test_flush_all_with_nothing_pending_says_nothing(
    pool: writer_module._Pool,
    monkeypatch: pytest.MonkeyPatch,
    torchcache_records: list[logging.LogRecord],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(writer_module, "REPORT_AFTER", 0.0)
    writer = BackgroundWriter(lambda job: None, lambda exc: None)
    writer.submit("quick", nbytes=1)
    assert writer.flush(timeout=_HANG)
    flush_all()
    assert torchcache_records == []
    assert "pending background write" not in capsys.readouterr().err
