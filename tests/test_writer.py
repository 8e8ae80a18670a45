"""The background writer: order, flush, back-pressure and error reporting."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from torchcache.writer import WRITER_NICENESS, BackgroundWriter

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
    threads = [
        threading.Thread(target=lambda t=t: [writer.submit((t, i), nbytes=20) for i in range(50)], daemon=True)
        for t in range(4)
    ]
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are a Linux feature")
def test_writer_threads_run_at_a_lower_priority_than_the_caller() -> None:
    seen: list[int] = []

    def sink(job: Any) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    writer = BackgroundWriter(sink, lambda exc: None)
    writer.submit("job", 1)
    assert writer.flush(_HANG)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(caller + WRITER_NICENESS, 19)]
