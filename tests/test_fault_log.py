"""FaultLog: faults reported from any thread become one warning per kind and tier, on the caller's thread."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest

from torchcache import CacheWarning
from torchcache.faults import Fault, FaultLog, SharedWarnings


def caught(action: object) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert callable(action)
        action()
    return [str(w.message) for w in seen if issubclass(w.category, CacheWarning)]


def test_one_warning_per_kind_and_tier() -> None:
    log = FaultLog("net")

    def faults() -> None:
        log.warn(Fault.WRITE, "disk full")
        log.warn(Fault.WRITE, "disk still full")
        log.warn(Fault.WRITE, "memory tier read-only", "memory")
        log.warn(Fault.CORRUPT, "a bad entry")

    assert caught(faults) == [
        "torchcache (net): disk full",
        "torchcache (net): memory tier read-only",
        "torchcache (net): a bad entry",
    ]
    assert log.warned(Fault.WRITE) and log.warned(Fault.WRITE, "memory")
    assert not log.warned(Fault.WRITE, "disk") and not log.warned(Fault.READ)


def test_faults_reported_from_another_thread_are_warned_at_emit() -> None:
    log = FaultLog("net")
    thread = threading.Thread(target=log.report, args=(Fault.READ, "server away", "disk"))
    thread.start()
    thread.join()
    assert not log.warned(Fault.READ, "disk")
    assert caught(log.emit) == ["torchcache (net): server away"]
    assert log.warned(Fault.READ, "disk") and caught(log.emit) == []


def test_the_warning_points_at_the_callers_line() -> None:
    log = FaultLog("net")
    with pytest.warns(CacheWarning) as record:
        log.warn(Fault.OPEN, "cannot open")
    assert record[0].filename == __file__


def test_kinds_are_their_names_as_text() -> None:
    assert Fault.CORRUPT == "corrupt" and f"{Fault.INDEX}" == "index"
    assert len({fault.value for fault in Fault}) == len(Fault)


@pytest.mark.slow  # a forked process
def test_a_fault_reported_before_a_fork_is_warned_by_the_parent_not_by_the_child() -> None:
    import multiprocessing

    log = FaultLog("net")
    log.report(Fault.READ, "the server is unreachable")  # then the server came back, and workers were forked
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child() -> None:
        log.report(Fault.WRITE, "disk full")  # one of the child's own
        sender.send(caught(log.emit))

    process = context.Process(target=child)
    process.start()
    assert receiver.poll(60)
    assert receiver.recv() == ["torchcache (net): disk full"]
    process.join(60)
    assert caught(log.emit) == ["torchcache (net): the server is unreachable"]


def test_a_write_failure_on_a_full_file_system_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchcache.faults import full_hint

    real = os.statvfs(tmp_path)
    assert full_hint(tmp_path) == ("" if real.f_bavail * real.f_frsize >= 1 << 20 else " (the file system is full)")

    class Full:
        f_bavail, f_frsize = 3, 4096  # 12 KiB left: LMDB's commit fails with EIO, not ENOSPC

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    assert full_hint(tmp_path) == " (the file system is full)"
    assert full_hint(tmp_path / "gone") == " (the file system is full)"


def test_logs_sharing_flags_warn_once_between_them_and_a_pickled_copy_starts_afresh() -> None:
    import pickle

    shared = SharedWarnings()
    first, second = FaultLog("a", shared), FaultLog("a", shared)  # as a DataLoader worker and its parent
    with pytest.warns(CacheWarning, match="disk is full"):
        first.warn(Fault.WRITE, "disk is full", "disk")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.warn(Fault.WRITE, "disk is full", "disk")  # logged at DEBUG: the other one warned
    assert second.warned(Fault.WRITE, "disk")
    with pytest.warns(CacheWarning, match="cannot read"):
        second.warn(Fault.READ, "cannot read", "disk")  # another kind
    with pytest.warns(CacheWarning, match="memory is full"):
        second.warn(Fault.WRITE, "memory is full", "memory")  # another tier
    copy = FaultLog("a", pickle.loads(pickle.dumps(shared)))  # not handed to a new process: its own flags
    with pytest.warns(CacheWarning, match="disk is full"):
        copy.warn(Fault.WRITE, "disk is full", "disk")
