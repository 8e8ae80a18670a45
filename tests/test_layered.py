"""A local copy in front of a shared store: ``local_cache_dir`` with a Redis ``persistent_cache_dir``."""

from __future__ import annotations

import fcntl
import gc
import io
import json
import multiprocessing
import os
import shutil
import signal
import stat
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import RAMP_DATASET, Counting, cached, run_python
from tests.store_helpers import ReferenceStore, Reports, charged, key, value
from torchcache import CachedDataset, CacheWarning, ConfigError, torchcache
from torchcache.cli.main import main
from torchcache.errors import StoreError, StoreUnavailableError
from torchcache.meta import load_meta
from torchcache.stores import pins as pins_module
from torchcache.stores import unsent as unsent_module
from torchcache.stores.packed.format import encode_key
from torchcache.stores.packed.store import PackedStore
from torchcache.stores.unsent import Unsent, count_unsent
from torchcache.tiers import layered as layered_module
from torchcache.tiers.layered import LayeredStore

#: A process id in names of files left by processes that ended (a file's owner is told by its lock, not by this).
DEAD_PID = 4_194_300


class CountingStore(ReferenceStore):
    """The reference store, counting the keys it was asked for."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.asked: list[str] = []

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        self.asked += keys
        return super().get_many(keys)


class BrokenStore(ReferenceStore):
    """A local store whose disk fails on every read and write."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        raise StoreError("disk gone")

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        raise StoreError("disk gone")


@pytest.fixture
def layers(tmp_path: Path) -> Iterator[tuple[LayeredStore, CountingStore, Reports]]:
    reports = Reports()
    far = CountingStore(10**7)
    store = LayeredStore(PackedStore(tmp_path / "near", 10**7, report=reports), far, reports)
    yield store, far, reports
    store.close()


def test_entries_read_from_the_shared_store_are_then_served_locally(
    layers: tuple[LayeredStore, CountingStore, Reports],
) -> None:
    store, far, reports = layers
    far.put_many([(key(i), value(i)) for i in range(20)])
    got = store.get_many([key(i) for i in range(25)])
    assert [None if v is None else bytes(v) for v in got] == [value(i) for i in range(20)] + [None] * 5
    far.asked.clear()
    again = store.get_many([key(i) for i in range(25)])
    assert [bytes(v) for v in again[:20]] == [value(i) for i in range(20)]
    assert far.asked == [key(i) for i in range(20, 25)]  # only the misses crossed over
    assert reports.seen == []


class AwayStore(ReferenceStore):
    """A shared store whose server can be sent away: its writes then fail as a Redis server's would."""

    away = False

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        if self.away:
            raise StoreUnavailableError("the server is away")
        return super().put_many(items)


def test_what_the_shared_store_did_not_take_is_sent_up_after_its_next_write(tmp_path: Path) -> None:
    far = AwayStore(10**7)
    store = LayeredStore(PackedStore(tmp_path / "near", 10**7), far, Reports())
    far.away = True
    with pytest.raises(StoreUnavailableError):
        store.put_many([(key(i), value(i)) for i in range(10)])  # kept by the local copy only
    assert len(far) == 0 and [bytes(v or b"") for v in store.get_many([key(3)])] == [value(3)]
    far.away = False
    store.put_many([(key(10), value(10))])  # the server takes writes again: what it missed follows
    assert sorted(far.keys()) == sorted(key(i) for i in range(11))
    assert [bytes(v or b"") for v in far.get_many([key(i) for i in range(10)])] == [value(i) for i in range(10)]
    assert not list((tmp_path / "near").glob("unsent-*"))  # all sent: no file names them
    store.close()
    assert not list((tmp_path / "near").glob("unsent-*"))


def test_the_copy_never_evicts_what_the_shared_store_did_not_take(tmp_path: Path) -> None:
    far = AwayStore(10**7)
    near = PackedStore(tmp_path / "near", 60_000, segment_bytes=10_000)
    store = LayeredStore(near, far, Reports())
    far.away = True
    taken: list[str] = []
    for start in range(0, 200, 10):  # 200 kB through a 60 kB copy while the server is away
        with pytest.raises(StoreUnavailableError):
            store.put_many([(key(i), value(i)) for i in range(start, start + 10)])
        taken += [key(i) for i in range(start, start + 10) if key(i) in near]
        assert charged(near) <= 60_000
    assert len(taken) >= 40 and all(k in near for k in taken)  # their only copy: kept, later writes refused
    assert len(store.unsent) == len(taken) and store.unsent.dropped == 200 - len(taken)
    far.away = False
    store.put_many([(key(999), value(999))])  # the server is back: every entry the copy took reaches it
    assert set(taken) <= set(far.keys()) and store.unsent.dropped == 200 - len(taken)
    for start in range(300, 400, 10):  # sent: the copy evicts them as it needs again
        store.put_many([(key(i), value(i)) for i in range(start, start + 10)])
    assert not set(taken) <= set(near.keys()) and charged(near) <= 60_000
    store.close()


def test_the_copy_keeps_entries_another_process_has_not_sent_yet(tmp_path: Path) -> None:
    far = ReferenceStore(10**7)
    near = PackedStore(tmp_path / "near", 60_000, segment_bytes=10_000)
    store = LayeredStore(near, far, Reports())
    store.put_many([(key(i), value(i)) for i in range(30)])
    other = Unsent(tmp_path / "near")  # as another process sharing the copy: its server refused these
    others = [key(i) for i in range(30, 45)]
    store.put_many([(k, value(30 + n)) for n, k in enumerate(others)])
    other.add(others[:5])  # named in its file at once, not at its next save
    other.add(others[5:])  # appended to it
    for start in range(100, 200, 5):  # the newest segments first (MRU): those holding the other's entries
        store.put_many([(key(i), value(i)) for i in range(start, start + 5)])
    assert all(k in near for k in others) and charged(near) <= 60_000
    store.close()


def test_a_copy_opened_over_its_budget_keeps_what_an_ended_process_left_unsent(tmp_path: Path) -> None:
    from torchcache.tiers.local import trimmed

    first = PackedStore(tmp_path / "near", 200_000, segment_bytes=10_000)
    first.put_many([(key(i), value(i)) for i in range(100)])
    left = Unsent(tmp_path / "near")
    left.add([key(i) for i in range(100)])  # its server was away; then the process ended
    del left
    gc.collect()
    first.close()
    near = trimmed(PackedStore(tmp_path / "near", 40_000, segment_bytes=10_000), Reports())  # a smaller budget
    assert all(key(i) in near for i in range(100))  # the only copies: kept over the budget
    far = ReferenceStore(10**7)
    store = LayeredStore(near, far, Reports())
    store.flush()  # the server takes them; then the budget holds again
    assert sorted(far.keys()) == sorted(key(i) for i in range(100)) and store.unsent.dropped == 0
    store.put_many([(key(500), value(500))])
    assert charged(near) <= 40_000
    store.close()


class SlowAwayStore(AwayStore):
    """A server away whose writes fail only after the copy was written meanwhile (another thread's reads)."""

    meanwhile: Any = None

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        self.meanwhile()
        return super().put_many(items)


def test_a_batch_on_its_way_to_the_shared_store_is_not_evicted_meanwhile(tmp_path: Path) -> None:
    far = SlowAwayStore(10**7)
    far.away = True
    near = PackedStore(tmp_path / "near", 60_000, segment_bytes=10_000)
    store = LayeredStore(near, far, Reports())
    far.meanwhile = lambda: None
    near.put_many([(key(i), value(i)) for i in range(40)])  # sent long ago: the copy may evict these
    batch = [(key(i), value(i)) for i in range(100, 130)]
    taken: list[str] = []

    def fill() -> None:  # the local copy's background writer, keeping what reads fetched
        taken.extend(k for k, _ in batch if k in near)  # what the copy took of the batch
        for start in range(200, 300, 5):
            store.pending.add([(key(i), value(i)) for i in range(start, start + 5)])
        store.pending.drain()

    far.meanwhile = fill
    with pytest.raises(StoreUnavailableError):
        store.put_many(batch)
    assert len(taken) >= 10 and all(k in near for k in taken)
    assert len(store.unsent) == len(taken) and store.unsent.dropped == 30 - len(taken)
    store.close()


def test_a_file_that_could_not_be_written_is_written_whole_with_the_next_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = Unsent(tmp_path)
    real = unsent_module._append
    monkeypatch.setattr(unsent_module, "_append", lambda fd, keys: (_ for _ in ()).throw(OSError(28, "full")))
    held.add([key(1), key(2)])  # the disk was full: named nowhere
    assert not list(tmp_path.glob("unsent-*.keys")) and len(held) == 2
    monkeypatch.setattr(unsent_module, "_append", real)
    held.add([key(3)])
    (named,) = tmp_path.glob("unsent-*.keys")
    assert sorted(named.read_text().split()) == sorted(key(i) for i in (1, 2, 3))


def test_a_file_naming_mostly_sent_keys_is_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unsent_module, "SLACK", 10)
    held = Unsent(tmp_path)
    for i in range(0, 100, 10):
        held.add([key(j) for j in range(i, i + 10)])
    copy = {key(i): value(i) for i in range(100)}
    sent: list[str] = []
    held.send(lambda keys: [copy[k] for k in keys], lambda items: sent.extend(k for k, _ in items) or 0, limit=30)
    (named,) = tmp_path.glob("unsent-*.keys")
    assert len(named.read_text().split()) == 100  # 100 named, 70 held: within twice and the slack
    held.send(lambda keys: [copy[k] for k in keys], lambda items: sent.extend(k for k, _ in items) or 0, limit=30)
    (named,) = tmp_path.glob("unsent-*.keys")
    assert sorted(named.read_text().split()) == sorted(set(copy) - set(sent)) and len(sent) == 60


def test_the_files_of_other_processes_are_read_from_where_the_last_read_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = Unsent(tmp_path)
    other.add([key(1)])
    asked: list[int] = []
    real = pins_module.read_at
    monkeypatch.setattr(pins_module, "read_at", lambda fd, size, offset=0: asked.append(size) or real(fd, size, offset))
    assert encode_key(key(1)) in pins_module.named_pins(tmp_path) and asked == [33]
    assert encode_key(key(1)) in pins_module.named_pins(tmp_path) and asked == [33, 0]  # nothing new: nothing read
    other.add([key(2), key(3)])
    pins = pins_module.named_pins(tmp_path)
    assert all(encode_key(key(i)) in pins for i in (1, 2, 3)) and asked == [33, 0, 66]
    assert encode_key(key(1)) not in pins_module.named_pins(tmp_path, list(tmp_path.glob("unsent-*")))
    writing = tmp_path / f"unsent-{DEAD_PID}-0a1b2c3d.keys"
    writing.write_text(key(5) + "\n" + key(6)[:10])  # a line being appended: read once it is whole
    pins = pins_module.named_pins(tmp_path)
    assert encode_key(key(5)) in pins and encode_key(key(6)[:10]) not in pins
    with writing.open("a") as f:
        f.write(key(6)[10:] + "\n")
    assert encode_key(key(6)) in pins_module.named_pins(tmp_path)


def test_an_append_that_fails_halfway_leaves_no_half_line_and_the_next_file_names_every_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = Unsent(tmp_path)
    held.add([key(1)])
    real = os.write

    def half(fd: int, data: Any) -> int:
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(unsent_module.os, "write", half)
    held.add([key(2), key(3)])  # the disk full halfway through the line, and still full
    monkeypatch.setattr(unsent_module.os, "write", real)
    assert [p.read_text() for p in tmp_path.glob("unsent-*")] == [key(1) + "\n"]  # cut back, no partial file
    held.add([key(4)])
    lines = [line for p in tmp_path.glob("unsent-*.keys") for line in p.read_text().splitlines()]
    assert set(lines) == {key(i) for i in (1, 2, 3, 4)}  # every line a whole key, every key held named

    failed: list[int] = []

    def once(fd: int, data: Any) -> int:
        if failed:
            return real(fd, data)
        failed.append(real(fd, bytes(data[:10])))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(unsent_module.os, "write", once)
    held.add([key(5)])  # space came back at once: a new file names every key now, not at the next add
    lines = [line for p in tmp_path.glob("unsent-*.keys") for line in p.read_text().splitlines()]
    assert set(lines) == {key(i) for i in (1, 2, 3, 4, 5)}


def test_a_file_is_rewritten_after_sends_that_fail_partway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unsent_module, "SLACK", 10)
    monkeypatch.setattr(unsent_module, "_CHUNK", 10)
    held = Unsent(tmp_path)
    held.add([key(i) for i in range(100)])
    calls: list[int] = []

    def flapping(items: list[tuple[str, bytes | memoryview]]) -> int:  # takes one chunk a send, then goes away
        calls.append(len(items))
        if len(calls) % 2 == 0:
            raise StoreUnavailableError("away again")
        return len(items)

    for _ in range(6):
        with pytest.raises(StoreUnavailableError):
            held.send(lambda keys: [value(0)] * len(keys), flapping, now=True)
    (named,) = tmp_path.glob("unsent-*.keys")
    assert len(held) == 40 and sorted(named.read_text().split()) == sorted(key(i) for i in range(60, 100))


def test_two_readers_of_one_directory_skipping_different_files_read_each_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = Unsent(tmp_path), Unsent(tmp_path)
    one.add([key(1)])
    two.add([key(2)])
    asked: list[int] = []
    real = pins_module.read_at
    monkeypatch.setattr(pins_module, "read_at", lambda fd, size, offset=0: asked.append(size) or real(fd, size, offset))
    for _ in range(3):
        assert encode_key(key(2)) in one.pinned() and encode_key(key(1)) in two.pinned()
    assert sum(asked) == 66  # each file read once, whichever reader skipped it
    shutil.rmtree(tmp_path)
    assert encode_key(key(2)) not in pins_module.named_pins(tmp_path) and tmp_path not in pins_module._read


def test_sending_up_keys_the_copy_lacks_holds_none_of_them(tmp_path: Path) -> None:
    far = ReferenceStore(10**7)
    store = LayeredStore(PackedStore(tmp_path / "near", 10**7), far, Reports())
    store.near.put_many([(key(1), value(1))])
    assert store.send_up([key(i) for i in range(1, 50)]) == 1  # the one the copy holds: the others are computed later
    assert store.unsent.dropped == 0 and len(store.unsent) == 0 and sorted(far.keys()) == [key(1)]
    assert not list((tmp_path / "near").glob("unsent-*"))
    store.close()


def test_a_claimed_file_is_held_newest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"unsent-{DEAD_PID}-0a1b2c3d.keys").write_text("".join(key(i) + "\n" for i in range(20)))
    monkeypatch.setattr(unsent_module, "MAX_KEYS", 10)  # the oldest lines are those its process had sent
    claimed = Unsent(tmp_path)
    assert len(claimed) == 10 and claimed.dropped == 10
    assert sorted(claimed.pinned().__contains__(encode_key(key(i))) for i in range(10, 20)) == [True] * 10


@pytest.mark.slow
def test_a_forked_child_lets_go_of_its_parents_files(tmp_path: Path) -> None:
    held = Unsent(tmp_path)
    held.add([key(i) for i in range(5)])
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    wait, go = multiprocessing.get_context("fork").Pipe(duplex=False)

    def child() -> None:
        writer.send(len(held))  # the child looks at what it holds: none of its parent's
        wait.poll(60)  # and lives on, as a long-lived worker, after its parent ends

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    try:
        assert reader.poll(60) and reader.recv() == 0
        for fd in held._held.values():  # as the parent ends
            os.close(fd)
        held._held.clear()
        assert len(Unsent(tmp_path)) == 5  # free to claim: the child keeps no lock of its parent's
    finally:
        go.send(None)
        process.join(30)


def test_what_the_shared_store_did_not_take_waits_in_the_copy_for_a_later_process(tmp_path: Path) -> None:
    far = AwayStore(10**7)
    far.away = True
    first = LayeredStore(PackedStore(tmp_path / "near", 10**7), far, Reports())
    with pytest.raises(StoreUnavailableError):
        first.put_many([(key(i), value(i)) for i in range(6)])
    first.close()  # the server still away: the keys go to a file of the copy's
    (left,) = (tmp_path / "near").glob("unsent-*.keys")
    assert sorted(left.read_text().split()) == sorted(key(i) for i in range(6))
    assert len(LayeredStore(PackedStore(tmp_path / "other", 10**7), far, Reports()).unsent) == 0  # another copy
    assert len(Unsent(tmp_path / "near")) == 0  # locked by the process that saved it, which lives
    del first
    gc.collect()  # as its process ended: the file is free to claim
    far.away = False
    second = LayeredStore(PackedStore(tmp_path / "near", 10**7), far, Reports())
    assert [bytes(v or b"") for v in second.get_many([key(i) for i in range(6)])] == [value(i) for i in range(6)]
    assert len(far) == 0  # served by the copy: nothing was read from the server
    second.flush()  # a flush sends what waits
    assert sorted(far.keys()) == sorted(key(i) for i in range(6))
    assert not list((tmp_path / "near").glob("unsent-*"))
    second.close()


def test_a_file_of_unsent_keys_is_read_as_keys_only(tmp_path: Path) -> None:
    near = PackedStore(tmp_path / "near", 10**7)
    near.put_many([(key(1), value(1))])
    near.close()
    planted = "\n".join([key(1), "not a key", "import os; os.system('x')", key(2) + "x", "AB" * 16]) + "\n"
    (tmp_path / "near" / f"unsent-{DEAD_PID}-0a1b2c3d.keys").write_text(planted)
    far = AwayStore(10**7)
    store = LayeredStore(PackedStore(tmp_path / "near", 10**7), far, Reports())
    assert len(store.unsent) == 1
    store.flush()
    assert list(far.keys()) == [key(1)]
    store.close()


def test_a_planted_fifo_or_an_old_partial_file_of_unsent_keys_is_left_or_removed_not_read(tmp_path: Path) -> None:
    near = tmp_path / "near"
    near.mkdir()
    os.mkfifo(near / f"unsent-{DEAD_PID}-0a1b2c3d.keys")  # opened for reading, it would block until a writer came
    stale = near / f"unsent-{DEAD_PID}-1a1b2c3d.keys.tmp"
    stale.write_text(key(1) + "\n")  # a save whose process ended before its rename
    os.utime(stale, (time.time() - 120, time.time() - 120))
    racing = near / f"unsent-{os.getpid()}-3a1b2c3d.keys.tmp"
    racing.write_text(key(3) + "\n")  # created a moment ago, its process about to lock it
    fresh = near / f"unsent-{os.getpid()}-2a1b2c3d.keys.tmp"
    fresh.write_text(key(2) + "\n")  # one a live process is writing now: it holds a lock on it
    writing = os.open(fresh, os.O_RDONLY)
    fcntl.flock(writing, fcntl.LOCK_SH)
    opened: list[LayeredStore] = []
    thread = threading.Thread(
        target=lambda: opened.append(LayeredStore(PackedStore(near, 10**7), AwayStore(10**7), Reports())), daemon=True
    )
    thread.start()
    thread.join(timeout=30)
    assert opened and len(opened[0].unsent) == 0
    assert not stale.exists() and fresh.exists() and (near / f"unsent-{DEAD_PID}-0a1b2c3d.keys").exists()
    assert racing.exists()
    opened[0].close()
    os.close(writing)


def test_keys_left_by_an_ended_process_of_the_same_id_are_claimed(tmp_path: Path) -> None:
    # A job in a container is process 1 in every run; ids are reused: the file's lock says whose it is.
    (tmp_path / f"unsent-{os.getpid()}-0a1b2c3d.keys").write_text(key(7) + "\n")
    assert len(Unsent(tmp_path)) == 1


def test_a_claim_that_races_its_owners_next_save_takes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchcache.stores.unsent as unsent_module

    owner = Unsent(tmp_path)
    owner.add([key(1)])
    owner.save()
    real, raced = fcntl.flock, []

    def flock(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_EX | fcntl.LOCK_NB and not raced:  # the claimer opened the file; before its lock:
            raced.append(True)
            owner.add([key(2)])
            owner.save()  # the owner saves again, and lets go of the file the claimer opened
        real(fd, operation)

    monkeypatch.setattr(unsent_module.fcntl, "flock", flock)
    claimer = Unsent(tmp_path)
    monkeypatch.undo()
    assert raced and len(claimer) == 0  # not the owner's newer file under its old name
    (left,) = tmp_path.glob("unsent-*.keys")
    assert sorted(left.read_text().split()) == [key(1), key(2)] and len(owner) == 2


def test_keys_left_to_send_are_claimed_by_one_process_and_sent_once(tmp_path: Path) -> None:
    (tmp_path / f"unsent-{DEAD_PID}-0a1b2c3d.keys").write_text("".join(key(i) + "\n" for i in range(300)))
    first, second = Unsent(tmp_path), Unsent(tmp_path)  # two DataLoader workers opening one local copy
    assert (len(first), len(second)) == (300, 0)  # renamed to the first's name: not the second's to send
    written: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def write(items: list[tuple[str, Any]]) -> int:  # slow: the server takes its time
        inside.set()
        release.wait(30)
        written.extend(k for k, _ in items)
        return len(items)

    sender = threading.Thread(target=lambda: first.send(lambda keys: [b"x"] * len(keys), write))
    sender.start()
    assert inside.wait(30)
    assert first.send(lambda keys: [b"x"] * len(keys), write) == 0  # another thread sends: not twice
    release.set()
    sender.join(30)
    assert sorted(written) == sorted(key(i) for i in range(300)) and len(first) == 0 and first.dropped == 0
    first.save()
    assert not list(tmp_path.glob("unsent-*"))


@pytest.mark.slow
def test_a_forked_child_holds_none_of_its_parents_keys_to_send(tmp_path: Path) -> None:
    held = Unsent(tmp_path)
    held.add([key(i) for i in range(5)])
    parents = sorted(p.name for p in tmp_path.glob("unsent-*"))  # named as they came
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)

    def child() -> None:
        held.save()  # nothing of the parent's to save or send, nor to remove
        writer.send((len(held), sorted(p.name for p in tmp_path.glob("unsent-*"))))

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    assert reader.poll(60)
    assert reader.recv() == (0, parents) and len(parents) == 1
    process.join(30)
    assert len(held) == 5 and count_unsent(tmp_path.glob("unsent-*")) == 5


def test_writes_reach_both_and_the_shared_store_is_the_authority(
    layers: tuple[LayeredStore, CountingStore, Reports],
) -> None:
    store, far, _ = layers
    assert store.put_many([(key(i), value(i)) for i in range(10)]) == 10
    assert len(store) == len(far) == 10 and store.nbytes == far.nbytes and key(3) in store
    assert sorted(store.keys()) == sorted(far.keys())
    assert store.disk_bytes > 0  # the local copy's files
    far.asked.clear()
    assert bytes(store.get_many([key(3)])[0] or b"") == value(3) and far.asked == []
    assert store.delete_many([key(3), key(4)]) == 2
    assert store.get_many([key(3)]) == [None] and key(3) not in store
    store.clear()
    assert len(store) == 0 and store.get_many([key(5)]) == [None]


def test_an_entry_the_server_dropped_is_still_served_by_the_copy(
    layers: tuple[LayeredStore, CountingStore, Reports],
) -> None:
    store, far, _ = layers
    store.put_many([(key(1), value(1))])
    far.clear()  # evicted by the server, or cleared by another job: the output is still right
    assert bytes(store.get_many([key(1)])[0] or b"") == value(1)


def _fill_and_damage(store: LayeredStore, near: Path, every: int) -> None:
    """Store 4 entries of 4,000 bytes, then flip a byte of the local copy's segments every ``every`` bytes."""
    store.put_many([(key(i), value(i, 4000)) for i in range(4)])
    store.flush()
    for segment in near.glob("seg-*"):
        data = bytearray(segment.read_bytes())
        for i in range(200, len(data), every):
            data[i] ^= 0xFF
        segment.write_bytes(bytes(data))


def test_a_damaged_local_entry_is_read_from_the_shared_store_and_replaced(
    layers: tuple[LayeredStore, CountingStore, Reports], tmp_path: Path
) -> None:
    store, far, reports = layers
    _fill_and_damage(store, tmp_path / "near", every=997)
    got = store.get_many([key(i) for i in range(4)])
    assert [bytes(v) for v in got if v is not None] == [value(i, 4000) for i in range(4)]
    assert "corrupt" in reports.kinds()
    far.asked.clear()
    assert [bytes(v) for v in store.get_many([key(0)]) if v is not None] == [value(0, 4000)]
    assert far.asked == []  # the copy was written again


def test_a_failing_local_copy_is_reported_once_and_left_out() -> None:
    reports = Reports()
    far = CountingStore(10**7)
    store = LayeredStore(BrokenStore(10**7), far, reports)
    assert store.put_many([(key(i), value(i)) for i in range(3)]) == 3
    assert [bytes(v) for v in store.get_many([key(i) for i in range(3)]) if v is not None] == [
        value(i) for i in range(3)
    ]
    assert reports.kinds() == ["local"] and "disk gone" in reports.seen[0][1]
    assert not store.near_enabled
    report = store.verify()
    assert report.ok and report.entries == 3


def test_verify_checks_and_fixes_the_local_copy_too(
    layers: tuple[LayeredStore, CountingStore, Reports], tmp_path: Path
) -> None:
    store, _, _ = layers
    _fill_and_damage(store, tmp_path / "near", every=10**9)  # one flipped byte
    assert not store.verify().ok
    report = store.verify(fix=True)
    assert report.bad and all(bad in {key(i) for i in range(4)} for bad in report.bad)
    assert store.verify().ok


# -- options ------------------------------------------------------------------------------------


def test_local_cache_dir_is_only_for_a_redis_tier(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local_cache_dir"):
        torchcache(persistent=True, persistent_cache_dir=tmp_path, local_cache_dir=tmp_path / "copy")
    with pytest.raises(ConfigError, match=r"local_cache_dir.*off \(persistent=False\)"):
        torchcache(persistent_cache_dir="redis://127.0.0.1:1/0", local_cache_dir=tmp_path / "copy")

    class OffTheDisk(Counting):  # one instance of a class cached on a server with a copy: no disk tier at all
        torchcache_persistent = False

    off = cached(OffTheDisk, persistent=True, persistent_cache_dir="redis://127.0.0.1:1/0", local_cache_dir=tmp_path)()
    assert off.cache_instance.settings.local_cache_dir is None and not off.cache_instance.settings.persistent
    with pytest.raises(ConfigError, match="local_cache_dir must be a local directory"):
        torchcache(persistent=True, persistent_cache_dir="redis://127.0.0.1:1/0", local_cache_dir="redis://h:1/0")
    with pytest.raises(ConfigError, match="local_cache_dir must be a path"):
        torchcache(persistent=True, persistent_cache_dir="redis://127.0.0.1:1/0", local_cache_dir=3)
    with pytest.raises(ConfigError, match="local_cache_dir"):
        CachedDataset(list(range(3)), tmp_path, local_cache_dir=tmp_path / "copy")
    with pytest.raises(ConfigError, match="local_cache_dir must be a local directory"):
        CachedDataset(list(range(3)), "redis://127.0.0.1:1/0", local_cache_dir="redis://127.0.0.1:1/0")


# -- through @torchcache and CachedDataset, on a real server ------------------------------------


@pytest.fixture
def server() -> Iterator[Any]:
    from tests.redis_servers import own_server

    with own_server() as running:
        yield running


class _Wide(torch.utils.data.Dataset[torch.Tensor]):
    """Samples of 20 KB, counting how many are made."""

    def __init__(self) -> None:
        self.made = 0

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> torch.Tensor:
        self.made += 1
        return torch.full((5000,), float(i))


@pytest.mark.slow
def test_a_dataset_cache_whose_server_is_full_keeps_caching_in_its_local_copy(tmp_path: Path) -> None:
    from tests.redis_servers import own_server

    with own_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as full:
        data = _Wide()
        cache = CachedDataset(data, full.url, max_memory_size=0, local_cache_dir=tmp_path / "copy")
        made = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                for start in range(0, 200, 20):
                    batch = cache.__getitems__(list(range(start, start + 20)))
                    assert all(torch.equal(x, torch.full((5000,), float(i))) for i, x in enumerate(batch, start))
                made.append(data.made)
            cache.close()
        assert made[0] >= 200 and made[1] == made[0]  # epoch 2 read the copy: the server took part of epoch 1
        messages = [str(w.message) for w in caught]
        assert len(messages) <= 2 and not any("from now on" in m for m in messages), messages


_MODULE = """
import json, sys, warnings, torch
from tests.helpers import Counting, cached
model = cached(Counting, persistent=True, persistent_cache_dir=sys.argv[1], local_cache_dir=sys.argv[2],
               max_memory_cache_size=0)()
x = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = model(x)
    model.cache_instance.flush()
print(json.dumps({"items": model.items, "sum": float(y.sum()), "hits": model.cache_instance.stats().hits,
                  "warnings": [str(w.message) for w in caught]}))
"""


def _run(script: str, *args: str) -> dict[str, Any]:
    done = run_python(script, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _kill(server: Any) -> None:
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()


@pytest.mark.slow
def test_a_later_run_hits_the_local_copy_without_the_server(server: Any, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    first = _run(_MODULE, server.url, str(copy))
    assert first["items"] == 32 and first["warnings"] == []
    other_machine = _run(_MODULE, server.url, str(tmp_path / "other"))  # hits the server, fills its own copy
    assert other_machine["items"] == 0 and other_machine["hits"] == 32
    _kill(server)
    for directory in (copy, tmp_path / "other"):
        later = _run(_MODULE, server.url, str(directory))
        assert later["items"] == 0 and later["hits"] == 32 and later["sum"] == first["sum"]
        assert later["warnings"] == []  # nothing was asked of the server
    metas = [load_meta(path.parent)[0] for path in copy.glob("*/index.lmdb")]
    assert len(metas) == 1 and metas[0] is not None and metas[0]["copy_of"] == server.url


_EXIT_WARNINGS = """
import sys, torch
from tests.helpers import Counting, cached
model = cached(Counting, persistent=True, persistent_cache_dir=sys.argv[1], local_cache_dir=sys.argv[2],
               max_memory_cache_size=0)()
model(torch.randn(12, 4, generator=torch.Generator().manual_seed(3)))
print(model.items)
"""


_BROKEN_COPY = """
import sys, torch
from tests.helpers import Counting, cached
from torchcache.errors import StoreError
from torchcache.stores.packed.store import PackedStore

def put_many(self, items):
    raise StoreError("no space left on the local disk")

PackedStore.put_many = put_many  # the local copy cannot keep them either
model = cached(Counting, persistent=True, persistent_cache_dir=sys.argv[1], local_cache_dir=sys.argv[2],
               max_memory_cache_size=0)()
for _ in range(3):
    model(torch.randn(4, 4))
"""


@pytest.mark.slow
def test_entries_neither_the_server_nor_a_failed_copy_took_are_counted_at_exit(server: Any, tmp_path: Path) -> None:
    url = server.url
    server.stop()
    done = run_python(_BROKEN_COPY, url, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12 entries computed in this process could not be stored" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_entries_computed_while_the_server_was_away_reach_it_from_the_copy_in_a_later_process(
    server: Any, tmp_path: Path
) -> None:
    from torchcache.stores.redis.store import RedisStore

    url, port = server.url, server.port
    server.stop()
    away = run_python(_EXIT_WARNINGS, url, str(tmp_path))
    assert away.returncode == 0 and away.stdout.split()[-1] == "12", away.stderr[-3000:]
    assert "12 entries of the local copy could not be stored" in away.stderr, away.stderr[-3000:]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(["ls", str(tmp_path), "--json"]) == 0
        (listed,) = json.loads(out.getvalue())["caches"]
        assert (listed["unsent_entries"], listed["copy_of"]) == (12, url)  # what this machine alone holds
        assert main(["info", listed["key"], "--root", str(tmp_path)]) == 0
        assert "12 entries held here only" in out.getvalue()
        shutil.copytree(tmp_path, tmp_path.parent / "cleared")
        assert main(["clear", "--all", "--root", str(tmp_path.parent / "cleared"), "--yes"]) == 0
    assert "held 12 entries not yet sent to its server" in err.getvalue()  # said as they go
    server.start(port)
    back = run_python(_EXIT_WARNINGS, url, str(tmp_path))
    assert back.returncode == 0 and back.stdout.split()[-1] == "0", back.stderr[-3000:]  # all from the copy
    assert "could not be stored" not in back.stderr
    (namespace,) = RedisStore.namespaces(url)
    with RedisStore(url, namespace, 1 << 30) as store:
        assert len(store) == 12  # sent up at the exit flush of the process that found them waiting
    assert not list(tmp_path.rglob("unsent-*"))


def test_the_local_copy_comes_from_the_environment(
    server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHCACHE_DIR", server.url)
    monkeypatch.setenv("TORCHCACHE_LOCAL_DIR", str(tmp_path / "copy"))
    model = cached(Counting, persistent=True, max_memory_cache_size=0)()
    x = torch.randn(8, 4)
    first = model(x)
    model.cache_instance.flush()
    _kill(server)
    assert torch.equal(model(x), first) and model.items == 8  # the second call hit the copy
    assert len(list((tmp_path / "copy").glob("*/index.lmdb"))) == 1


def test_a_read_only_local_copy_warns_once_and_the_server_serves(server: Any, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes to read-only directories")
    copy = tmp_path / "copy"
    copy.mkdir()
    copy.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        model = cached(Counting, persistent=True, persistent_cache_dir=server.url, local_cache_dir=copy)()
        plain = Counting()
        x = torch.randn(8, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(model(x), plain(x))
        assert [w for w in caught if issubclass(w.category, CacheWarning)]
    finally:
        copy.chmod(stat.S_IRWXU)


def test_a_local_copy_that_cannot_be_made_leaves_the_server_alone(server: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = cached(Counting, persistent=True, persistent_cache_dir=server.url, local_cache_dir=blocker)(dim_out=3)
    plain = Counting(dim_out=3)
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(model(x), plain(x))
        model.cache_instance.flush()
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(messages) == 1 and "no local copy" in messages[0]
    disk = model.cache_instance.stats().disk
    assert disk is not None and disk.entries == 8  # on the server


@pytest.mark.slow
def test_a_dataset_cache_on_a_server_keeps_a_local_copy(server: Any, tmp_path: Path) -> None:
    copy = str(tmp_path / "copy")
    assert _run(RAMP_DATASET, server.url, copy) == {"calls": 24, "disk_hits": 0}
    _kill(server)
    assert _run(RAMP_DATASET, server.url, copy) == {"calls": 0, "disk_hits": 24}  # from the copy alone
    metas = [load_meta(path.parent)[0] for path in Path(copy).glob("*/index.lmdb")]
    assert len(metas) == 1 and metas[0] is not None
    assert metas[0]["kind"] == "dataset" and metas[0]["copy_of"] == server.url and metas[0]["length"] == 24


_WORKERS_DATASET = """
import sys, warnings, torch
from torch.utils.data import DataLoader
from torchcache import CachedDataset

class Ramp(torch.utils.data.Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, i):
        return torch.arange(6, dtype=torch.int16) * i, i

warnings.simplefilter("ignore")
data = CachedDataset(Ramp(), sys.argv[1], max_memory_size=0, local_cache_dir=sys.argv[2])
loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork")
print(sorted(int(y) for _, ys in loader for y in ys) == list(range(24)))
"""


@pytest.mark.slow
def test_samples_dataloader_workers_computed_while_the_server_was_away_reach_it_later(
    server: Any, tmp_path: Path
) -> None:
    from torchcache.stores.redis.store import RedisStore

    url, port = server.url, server.port
    server.stop()
    away = run_python(_WORKERS_DATASET, url, str(tmp_path))  # no close(): the workers end as DataLoader's do
    assert away.returncode == 0 and away.stdout.split()[-1] == "True", away.stderr[-3000:]
    assert list(tmp_path.rglob("unsent-*.keys"))  # what the server did not take, kept to send
    server.start(port)
    back = run_python(_WORKERS_DATASET, url, str(tmp_path))  # every sample from the copy: no write
    assert back.returncode == 0 and back.stdout.split()[-1] == "True", back.stderr[-3000:]
    (namespace,) = RedisStore.namespaces(url)
    with RedisStore(url, namespace, 1 << 30) as store:
        assert len(store) == 24  # sent as the workers ended
    assert not list(tmp_path.rglob("unsent-*"))


@pytest.mark.slow
def test_the_command_line_lists_and_verifies_a_local_copy(
    server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    _run(_MODULE, server.url, str(copy))
    assert main(["ls", str(copy)]) == 0
    listing = capsys.readouterr().out
    assert "Counting" in listing and "32" in listing
    assert main(["verify", str(copy)]) == 0


class _WholeReads(ReferenceStore):
    """A shared store whose reads fetch every entry, handing those not asked for as extras."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.reads, self._extras = 0, []

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        self.reads += 1
        self._extras = [(k, v) for k, v in self._data.items() if k not in keys]
        return super().get_many(keys)

    def take_extras(self) -> list[tuple[str, bytes | memoryview]]:
        extras, self._extras = self._extras, []
        return extras

    def placement(self, keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
        return [("the-one-segment", 100) if k in self._data else None for k in keys]


def test_entries_read_beyond_a_batch_wait_in_a_bounded_stash_while_the_local_copy_is_full() -> None:
    far = _WholeReads(10**6)
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(ReferenceStore(0), far, Reports(), stash_bytes=3 * len(value(0)))  # a copy with no room
    assert layered.get_many([key(0)]) == [value(0)] and far.reads == 1
    assert layered.stash.nbytes == 3 * len(value(0))  # the newest three of the nine others; the oldest went
    assert layered.get_many([key(9), key(8)]) == [value(9), value(8)] and far.reads == 1
    assert layered.served == [0, 3]  # the stash's hits were fetched from the shared store
    assert layered.get_many([key(9)]) == [value(9)] and far.reads == 2  # a stash hit is served once
    assert layered.get_many([key(1)]) == [value(1)] and far.reads == 3  # gone from the stash: read again
    assert layered.stash.nbytes <= layered.stash.max_bytes
    layered.delete_many([key(8)])  # in the stash again since the last read: deleted there too
    assert layered.get_many([key(8)]) == [None] and far.reads == 4
    layered.clear()
    assert layered.stash.nbytes == 0 and layered.get_many([key(7)]) == [None]


class _SlowCopy(ReferenceStore):
    """A local copy whose background writes wait for ``gate`` (a slow disk); ``fail`` makes them raise."""

    def __init__(self, max_bytes: int, fail: Exception | None = None) -> None:
        super().__init__(max_bytes)
        self.gate, self.writing, self.fail = threading.Event(), threading.Event(), fail
        self.log: list[str] = []

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        if threading.current_thread().name == "torchcache-local-copy":
            self.writing.set()
            assert self.gate.wait(30)
            if self.fail is not None:
                raise self.fail
            self.log.append("written")
        return super().put_many(items)


def test_entries_read_beyond_a_batch_are_served_from_ram_while_the_local_copy_writes_them() -> None:
    far, near = _WholeReads(10**6), _SlowCopy(10**6)
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(near, far, Reports())
    assert layered.get_many([key(0)]) == [value(0)] and far.reads == 1  # returns with the writer held up
    assert near.writing.wait(30) and key(5) not in near
    assert layered.get_many([key(5), key(6)]) == [value(5), value(6)] and far.reads == 1  # from RAM
    assert layered.served == [2, 1] and layered.placement([key(5)]) == [None]  # local: no request for it
    near.gate.set()
    layered.flush()  # waits for the writer
    assert all(key(i) in near for i in range(10)) and layered.pending.nbytes == 0
    assert layered.get_many([key(7)]) == [value(7)] and far.reads == 1


@pytest.mark.parametrize("fault", [StoreError("disk gone"), RuntimeError("a bug of the disk's driver")])
def test_a_background_write_that_fails_turns_the_local_copy_off_once_and_nothing_waits(fault: Exception) -> None:
    far, near, reports = _WholeReads(10**6), _SlowCopy(10**6, fail=fault), Reports()
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(near, far, reports)
    near.gate.set()
    assert layered.get_many([key(0)]) == [value(0)]
    layered.close()  # waits for the writer, which failed
    assert reports.kinds() == ["local"] and str(fault) in reports.seen[0][1] and not layered.near_enabled
    assert layered.get_many([key(3)]) == [value(3)] and far.reads == 2  # the shared store serves


def test_a_read_that_fetches_more_waits_while_too_much_waits_to_be_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layered_module, "PENDING_BYTES", 1)
    far, near = _WholeReads(10**6), _SlowCopy(10**6)
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(near, far, Reports())
    layered.get_many([key(0)])  # nine entries handed to the writer, which is held up
    waiting = threading.Event()

    class Watched(threading.Condition):
        def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
            if not predicate():
                waiting.set()
            return super().wait_for(predicate, timeout)

    layered.pending._cond = Watched(threading.Lock())
    reader = threading.Thread(target=lambda: (layered.get_many([key(99)]), near.log.append("added")))
    reader.start()
    assert waiting.wait(30) and near.log == []  # the second read waits for the writer
    near.gate.set()
    reader.join(30)
    assert near.log[0] == "written" and "added" in near.log  # added once the first writes were done
    layered.close()


@pytest.mark.slow
def test_a_forked_child_starts_with_nothing_waiting_to_be_written() -> None:
    far, near = _WholeReads(10**6), _SlowCopy(10**6)
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(near, far, Reports())
    layered.get_many([key(0)])
    assert near.writing.wait(30) and key(5) in layered.pending
    pid = os.fork()
    if pid == 0:  # the child: the parent's writer is not here, nor what it writes
        ok = key(5) not in layered.pending and layered.pending.nbytes == 0
        layered.pending.drain()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    near.gate.set()
    layered.close()
    assert os.waitstatus_to_exitcode(status) == 0 and key(5) in near


def test_without_a_thread_for_the_writer_the_read_writes_the_local_copy_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    far, near = _WholeReads(10**6), ReferenceStore(10**6)
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(near, far, Reports())
    monkeypatch.setattr(threading.Thread, "start", refused)
    assert layered.get_many([key(0)]) == [value(0)]
    assert all(key(i) in near for i in range(10)) and layered.pending.nbytes == 0
    layered.close()  # nothing to wait for


def test_a_child_process_writes_the_local_copy_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # A DataLoader or Pool worker is terminated soon after its last task: no writer may outlive it.
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    far, near = _WholeReads(10**6), _SlowCopy(10**6)
    far.put_many([(key(i), value(i)) for i in range(10)])
    layered = LayeredStore(near, far, Reports())
    assert layered.get_many([key(0)]) == [value(0)]
    assert all(key(i) in near for i in range(10)) and layered.pending.nbytes == 0 and not near.writing.is_set()
    layered.close()


def test_the_exit_warning_counts_what_waits_in_the_copy_apart_from_what_it_evicted(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from torchcache.faults import FaultLog
    from torchcache.module.exit import _tell_unstored

    store = LayeredStore(PackedStore(tmp_path / "near", 10**7), AwayStore(10**7), Reports())
    store.unsent.add([key(i) for i in range(3)])  # never in the copy: it had no room for them
    store.flush()  # the server is there: sent, or dropped
    cache = SimpleNamespace(faults=FaultLog("t"))
    disk = SimpleNamespace(store=store, where="s3://b/x", unstored=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tell_unstored(cache, disk)  # type: ignore[arg-type]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "3 entries could not be stored" in messages[0] and "not kept to send" in messages[0]
    store.close()
