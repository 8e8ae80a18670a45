"""The packed store's own properties: processes, crashes, damage, budgets, hostile files."""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import fault_under, run_python, traced_memory
from tests.store_helpers import Reports, charged, key, poison_index_leaves, value
from torchcache.errors import KeyingError, StoreError
from torchcache.stores.packed import evict as packed_evict
from torchcache.stores.packed import index as packed_index
from torchcache.stores.packed import segments as packed_segments
from torchcache.stores.packed import upkeep as packed_upkeep
from torchcache.stores.packed import verify as packed_verify
from torchcache.stores.packed.evict import INDEX_BASE_BYTES
from torchcache.stores.packed.format import HEADER, encode_key, encode_keys, parse_segment_name, segment_name
from torchcache.stores.packed.index import ENTRY, INDEX_NAME
from torchcache.stores.packed.mappable import unsound_pages
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES, PackedStore

FORK = multiprocessing.get_context("fork")
DEADLINE = 60.0


@pytest.fixture
def reports() -> Reports:
    return Reports()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def segments(root: Path) -> list[Path]:
    return sorted(root.glob("seg-*.tcs"))


def fill(store: PackedStore, ids: range, size: int = 1000) -> None:
    for start in range(ids.start, ids.stop, 100):
        store.put_many([(key(i), value(i, size)) for i in range(start, min(ids.stop, start + 100))])


def locate(store: PackedStore, i: int) -> tuple[int, int, int]:
    index = store._handle.ensure(write=False)
    assert index is not None
    with index.begin() as txn:
        raw = txn.get(bytes.fromhex(key(i)), db=index.entries)
    assert raw is not None
    seg, offset, length = ENTRY.unpack(raw)
    return seg, offset, length


# -- batches ----------------------------------------------------------------------------
def test_a_batch_costs_one_transaction_and_few_system_calls(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PackedStore(root, 10**9)
    fill(store, range(10))  # the segment and the index exist
    calls: dict[str, int] = {"change": 0, "pwritev": 0, "pread": 0, "fstat": 0, "begin": 0}
    index = store._handle.ensure(write=False)
    assert index is not None

    def counting(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(index, "change", counting("change", index.change))
    monkeypatch.setattr(index, "begin", counting("begin", index.begin))
    for name in ("pwritev", "pread", "fstat"):
        fault_under(monkeypatch, root, name, counting(name, getattr(os, name)))
    assert store.put_many([(key(i), value(i, 3072)) for i in range(1000, 2024)]) == 1024
    assert calls["change"] == 1 and calls["pwritev"] <= 4  # 1,024 records: two or three iovec arrays, a short write
    calls.update(change=0, begin=0, pread=0, fstat=0)
    got = store.get_many([key(i) for i in range(1000, 2024)])
    assert all(bytes(v or b"") == value(i, 3072) for v, i in zip(got, range(1000, 2024)))
    # one segment: opened, its size checked, then every record read from its mapping; the index's length checked
    assert calls["change"] == 0 and calls["begin"] == 1 and calls["pread"] == 0 and calls["fstat"] <= 3


def test_the_length_check_follows_the_file_the_index_maps_not_its_path(root: Path) -> None:
    from torchcache.stores.packed.index import INDEX_NAME

    store = PackedStore(root, 10**9)
    fill(store, range(50))
    index = store._handle.ensure(write=False)
    assert index is not None
    mapped = root / INDEX_NAME
    os.replace(mapped, root / "kept")  # another program renames the file and puts a short one in its place
    mapped.write_bytes(b"\0" * 4096)
    with index.begin() as txn:  # the file mapped is still whole: no damage seen
        assert index.count(txn) == 50
    os.truncate(root / "kept", 4096)  # the file mapped is cut: damage, before any page is touched
    with pytest.raises(lmdb.CorruptedError, match="cut shorter"), index.begin():
        pass


# -- several processes ------------------------------------------------------------------
def _writer(path: str, ids: range, conn: Connection) -> None:
    store = PackedStore(path, 10**9)
    for start in range(ids.start, ids.stop, 50):
        store.put_many([(key(i), value(i)) for i in range(start, min(ids.stop, start + 50))])
        conn.send(min(ids.stop, start + 50))
    conn.send("done")
    conn.recv()  # stay alive (holding the segment) until told to go


@pytest.mark.slow
def test_a_running_reader_sees_what_other_processes_commit(root: Path, reports: Reports) -> None:
    reader = PackedStore(root, 10**9, report=reports)
    assert reader.get(key(0)) is None
    pipes, procs = [], []
    for n in range(2):
        parent, child = FORK.Pipe()
        proc = FORK.Process(target=_writer, args=(str(root), range(n * 1000, n * 1000 + 600), child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        done = [False, False]
        deadline = time.monotonic() + DEADLINE
        while not all(done):
            assert time.monotonic() < deadline, "writers did not finish"
            for n, conn in enumerate(pipes):
                if done[n] or not conn.poll(0.05):
                    continue
                message = conn.recv()
                if message == "done":
                    done[n] = True
                    continue
                committed = range(n * 1000, message)
                got = reader.get_many([key(i) for i in committed])  # whole entries, never torn
                assert all(v is not None and bytes(v) == value(i) for v, i in zip(got, committed))
        assert len(reader) == 1200 and reader.verify().ok
    finally:
        for conn in pipes:
            conn.send("go")
        for proc in procs:
            proc.join(DEADLINE)
    assert not reports.seen


@pytest.mark.slow
def test_two_processes_share_one_budget(root: Path) -> None:
    budget = 1_500_000
    procs = []
    for n in range(2):
        parent, child = FORK.Pipe()
        proc = FORK.Process(target=_budget_writer, args=(str(root), budget, n, child))
        proc.start()
        procs.append((proc, parent))
    for proc, conn in procs:
        assert conn.poll(DEADLINE)
        assert conn.recv() == "ok"
        proc.join(DEADLINE)
    store = PackedStore(root, budget)
    assert 0 < store.nbytes <= budget
    assert store.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES
    assert store.verify().ok


def _budget_writer(path: str, budget: int, n: int, conn: Connection) -> None:
    try:
        store = PackedStore(path, budget)
        for start in range(n * 10_000, n * 10_000 + 2000, 40):
            store.put_many([(key(i), value(i)) for i in range(start, start + 40)])
            assert store.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES + 2 * store.segment_bytes
        conn.send("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(repr(exc))


def test_a_dead_writers_segment_evicted_while_it_is_sealed_stays_gone(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sealing what a dead writer left must not bring back a row another process dropped meanwhile."""
    store = PackedStore(root, 10**8)
    fill(store, range(50))
    index = store._handle.ensure(write=True)
    assert index is not None and store._files.writer is not None
    dead = store._files.seal_writer()  # its lock goes, its row stays unsealed: a writer that died
    assert dead is not None
    opener = packed_segments.SegmentFiles(str(root), store.segment_bytes)
    take = opener.lock

    def evicted_meanwhile(seg: int) -> int | None:
        fd = take(seg)
        if seg == dead:  # another process evicts it once this look lets go of its lock, before the seal
            other = packed_segments.SegmentFiles(str(root), store.segment_bytes)
            change = index.change()
            with index.begin() as txn:
                kbs = [kb for kb, e in index.iter_entries(txn) if e is not None and e.seg == seg]
            change.remove_segment_entries(seg, kbs)
            change.drop_segment(seg)
            change.commit()
            other.remove(seg)
        return fd

    monkeypatch.setattr(opener, "lock", evicted_meanwhile)
    packed_upkeep.seal_orphans(index, opener)
    with index.begin() as txn:
        assert dead not in index.segment_table(txn)
    assert not os.path.exists(opener.path(dead))
    assert PackedStore(root, 10**8).verify().ok


def test_a_sweep_that_takes_a_new_segments_temporary_file(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's sweep may remove a new segment's file before it is locked: a new one is made."""
    store = PackedStore(root, 10**8)
    fill(store, range(10))
    store._files.seal_writer()  # the next write makes a new segment
    sweeper = packed_segments.SegmentFiles(str(root), store.segment_bytes)
    real_open = os.open
    swept: list[int] = []

    def open_then_sweep(path: str, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        fd = real_open(path, flags, mode, **kwargs)
        if os.path.basename(path).startswith(packed_segments.TMP_PREFIX) and not swept:
            swept.append(-1)
            swept.append(sweeper.sweep(lambda: {parse_segment_name(p.name) or 0 for p in segments(root)}))
        return fd

    monkeypatch.setattr(os, "open", open_then_sweep)
    fill(store, range(10, 20))
    monkeypatch.undo()
    assert swept == [-1, 1]  # the sweep took the first temporary file
    assert all(bytes(store.get(key(i)) or b"") == value(i) for i in range(20))
    assert not list(root.glob(f"{packed_segments.TMP_PREFIX}*"))
    assert store.verify().ok


def test_a_sweep_keeps_a_segment_indexed_after_its_first_look(root: Path) -> None:
    """A segment indexed (and let go of) by another writer after the sweep's first look is not an orphan."""
    store = PackedStore(root, 10**8)
    fill(store, range(10))
    index = store._handle.ensure(write=True)
    assert index is not None
    before = packed_upkeep.known_segments(index)
    store._files.seal_writer()
    fill(store, range(10, 20))  # a new segment, indexed after the look above
    store._files.seal_writer()  # and its writer's lock let go
    looks = iter([before])
    sweeper = packed_segments.SegmentFiles(str(root), store.segment_bytes)
    assert sweeper.sweep(lambda: next(looks, None) or packed_upkeep.known_segments(index)) == 0
    assert len(segments(root)) == 2
    assert all(bytes(store.get(key(i)) or b"") == value(i) for i in range(20))
    assert store.verify().ok


@pytest.mark.slow
def test_a_forked_child_uses_the_store_on_its_own(root: Path) -> None:
    reports: list[tuple[str, str]] = []
    store = PackedStore(root, 10**8, report=lambda kind, message: reports.append((kind, message)))
    fill(store, range(100))
    index = os.stat(root / INDEX_NAME).st_ino
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_child_uses, args=(store, child))
    proc.start()
    assert parent.poll(DEADLINE) and parent.recv() == "ok"
    proc.join(DEADLINE)
    assert bytes(store.get(key(150)) or b"") == value(150)  # the child's entries
    fill(store, range(200, 300))
    assert len(store) == 300 and store.verify().ok
    # the child opened the index as it was: neither taken for damaged nor rebuilt
    assert os.stat(root / INDEX_NAME).st_ino == index and reports == []


def _child_uses(store: PackedStore, conn: Connection) -> None:
    try:
        assert bytes(store.get(key(5)) or b"") == value(5)
        fill(store, range(100, 200))
        other = PackedStore(store.directory, 10**8, report=lambda kind, message: conn.send(f"{kind}: {message}"))
        assert bytes(other.get(key(150)) or b"") == value(150)
        other.close()
        store.close()
        conn.send("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(repr(exc))


# -- killed processes -------------------------------------------------------------------
def _endless_writer(path: str, budget: int, conn: Connection) -> None:
    store = PackedStore(path, budget)
    batch = 0
    while True:
        ids = range(batch * 20, batch * 20 + 20)
        store.put_many([(key(i), value(i, 700)) for i in ids])
        if batch % 3 == 0:
            store.delete_many([key(i) for i in range(batch * 20, batch * 20 + 20, 3)])
        conn.send(batch)
        batch += 1


@pytest.mark.slow
@pytest.mark.parametrize("budget", [10**8, 1_000_000])
def test_kill_9_loses_nothing_committed(root: Path, budget: int) -> None:
    for round_ in range(10):
        parent, child = FORK.Pipe()
        proc = FORK.Process(target=_endless_writer, args=(str(root / str(round_)), budget, child))
        proc.start()
        last = -1
        wanted = 3 + round_ * 2
        deadline = time.monotonic() + DEADLINE
        while last < wanted:
            assert time.monotonic() < deadline
            if parent.poll(0.05):
                last = parent.recv()
        os.kill(proc.pid, signal.SIGKILL)  # somewhere inside a later put_many
        proc.join(DEADLINE)
        while parent.poll():
            last = parent.recv()
        reports = Reports()
        store = PackedStore(root / str(round_), budget, report=reports)
        found = store.get_many([key(i) for i in range((last + 1) * 20)])
        assert all(v is None or bytes(v) == value(i, 700) for i, v in enumerate(found))
        if budget > 10**7:  # nothing was evicted: every committed entry that was not deleted is there
            kept = [i for i in range((last + 1) * 20) if not ((i // 20) % 3 == 0 and i % 20 % 3 == 0)]
            assert all(found[i] is not None for i in kept)
        assert store.verify().ok and not reports.seen
        fill(store, range(100_000, 100_050), 700)  # the next writer seals the dead one's segment
        index = store._handle.ensure(write=False)
        assert index is not None
        with index.begin() as txn:
            unsealed = [seg for seg, row in index.segment_table(txn).items() if not row.sealed]
        assert len(unsealed) <= 1  # only this process's own


# -- damaged records and index ----------------------------------------------------------
def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_bit_is_a_miss_reported_once(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**8, report=reports)
    fill(store, range(100))
    seg, offset, _ = locate(store, 42)
    _flip(root / segment_name(seg), offset + HEADER.size + 16 + 500)
    assert store.get(key(42)) is None
    assert store.get(key(42)) is None
    assert reports.kinds() == ["corrupt"] and key(42) in reports.seen[0][1]
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(store.get_many([key(i) for i in range(42)])))
    assert store.verify().bad == [key(42)]
    store.flush()  # the damaged entry leaves the index
    assert key(42) not in store and store.verify().ok


def test_a_torn_tail_and_a_truncated_segment(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**8, report=reports)
    fill(store, range(100))
    seg, offset, _ = locate(store, 99)
    path = root / segment_name(seg)
    os.truncate(path, offset + 100)  # the last record is cut in half
    assert store.get(key(99)) is None and reports.kinds() == ["corrupt"]
    assert store.verify().bad == [key(99)]
    store.verify(fix=True)
    assert store.verify().ok and len(store) == 99


def test_a_segment_cut_short_under_its_mapping_gives_misses(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**8, report=reports)
    fill(store, range(100))
    keys = [key(i) for i in range(100)]
    held = store.get_many(keys)  # the segment is mapped, and views of it are held
    seg, offset, _ = locate(store, 60)
    os.truncate(root / segment_name(seg), offset + 10)  # records 60 to 99 are gone
    got = store.get_many(keys)
    assert [i for i, v in enumerate(got) if v is None] == list(range(60, 100))
    assert all(bytes(got[i] or b"") == value(i) for i in range(60))
    assert set(reports.kinds()) == {"corrupt"}
    assert all(bytes(held[i] or b"") == value(i) for i in range(60))  # views of bytes still there stay right


def test_a_mapped_segment_that_grows_is_mapped_again(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = PackedStore(root, 10**8)
    reader = PackedStore(root, 10**8)
    fill(writer, range(50))
    held = reader.get_many([key(i) for i in range(50)])
    fill(writer, range(50, 300))  # the same segment grows past the reader's mapping
    assert len(segments(root)) == 1
    preads: list[int] = []
    real_pread = os.pread
    fault_under(monkeypatch, root, "pread", lambda *args: preads.append(1) or real_pread(*args))
    got = reader.get_many([key(i) for i in range(300)])
    assert preads == []  # read from a new mapping, not record by record
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(got))
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(held))


def test_a_segment_that_cannot_be_mapped_is_read_with_pread(
    root: Path, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PackedStore(root, 10**8, report=reports)
    fill(store, range(100))

    def refuse(*args: Any) -> None:
        raise OSError(errno.ENODEV, "this file system cannot map files")

    monkeypatch.setattr(packed_segments.mmap, "mmap", refuse)
    got = store.get_many([key(i) for i in range(100)])
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(got)) and reports.seen == []


def test_views_outlive_their_segment_and_the_store(root: Path) -> None:
    store = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(store, range(100))
    held = store.get_many([key(i) for i in range(100)])
    store.clear()  # every segment file is removed
    assert segments(root) == [] and store.get_many([key(0)]) == [None]
    store.close()
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(held))


def test_verify_fix_removes_bad_entries(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**8, report=reports)
    fill(store, range(50))
    for i in (3, 30):
        seg, offset, _ = locate(store, i)
        _flip(root / segment_name(seg), offset + HEADER.size + 16 + 10)
    report = store.verify(fix=True)
    assert sorted(report.bad) == sorted([key(3), key(30)]) and report.fixed
    assert len(store) == 48 and store.verify().ok and store.nbytes == 48 * 1000


def once_after_segment_table(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[], object], caller: str | None = None
) -> list[bool]:
    """Run ``action`` once, right after the store's rows are read (by ``caller``, if named); the list says it ran."""
    real, ran = packed_index.Index.segment_table, []

    def segment_table(self: Any, txn: Any) -> Any:
        table = real(self, txn)
        if not ran and (caller is None or sys._getframe(1).f_code.co_name == caller):
            ran.append(True)
            action()
        return table

    monkeypatch.setattr(packed_index.Index, "segment_table", segment_table)
    return ran


@pytest.mark.parametrize("fix", [False, True])
def test_verify_while_another_writer_adds_segments_keeps_its_entries_and_reports_nothing(
    root: Path, monkeypatch: pytest.MonkeyPatch, fix: bool
) -> None:
    checker = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(checker, range(100))
    writer = PackedStore(root, 10**8, segment_bytes=20_000)

    def write() -> None:  # another process writes while verify looks
        fill(writer, range(100, 200))
        writer.flush()

    wrote = once_after_segment_table(monkeypatch, write)
    report = checker.verify(fix=fix)
    assert wrote and report.ok and report.bad == [] and not report.fixed
    monkeypatch.undo()
    assert len(checker) == 200 and checker.verify().ok
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(checker.get_many([key(i) for i in range(200)])))


def test_verify_while_another_process_clears_the_store_reports_no_damage(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(checker, range(100))
    other = PackedStore(root, 10**8, segment_bytes=20_000)
    real, cleared = packed_segments.SegmentFiles.read, []

    def read(self: Any, *args: Any) -> Any:
        if not cleared:  # its entries and segments go between verify's look at the index and its reads
            cleared.append(True)
            other.clear()
        return real(self, *args)

    monkeypatch.setattr(packed_segments.SegmentFiles, "read", read)
    report = checker.verify(fix=True)
    assert cleared and report.ok and report.bad == [] and not report.fixed


def test_verify_while_another_process_writes_then_evicts_segments_reports_no_stray_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(checker, range(50))
    other = PackedStore(root, 10**8, segment_bytes=20_000)
    real_orphans, real_known, steps = packed_segments.SegmentFiles.orphans, packed_verify.known_segments, []

    def orphans(self: Any, known: set[int]) -> list[int]:
        if not steps:  # sealed segments made after verify read the rows: files it has no row for
            steps.append("written")
            fill(other, range(100, 200))
        return real_orphans(self, known)

    def known_segments(index: Any) -> set[int]:
        if steps == ["written"]:  # then evicted: rows dropped, files removed
            steps.append("evicted")
            other.clear()
        return real_known(index)

    monkeypatch.setattr(packed_segments.SegmentFiles, "orphans", orphans)
    monkeypatch.setattr(packed_verify, "known_segments", known_segments)
    report = checker.verify(fix=True)
    assert steps == ["written", "evicted"] and report.ok and not report.fixed, report.problems


def test_verify_while_another_process_evicts_a_segment_reports_no_missing_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(checker, range(100))
    other = PackedStore(root, 10**8, segment_bytes=20_000)
    evicted = once_after_segment_table(monkeypatch, other.clear, caller="_file_problems")  # rows read, files not yet
    report = checker.verify()
    assert evicted and report.ok, report.problems


@pytest.mark.parametrize("fix", [False, True])
def test_verify_while_another_process_writes_then_evicts_new_segments_reports_no_damage(
    root: Path, monkeypatch: pytest.MonkeyPatch, fix: bool
) -> None:
    checker = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(checker, range(100))
    checker.flush()
    before = set(checker._files.listed())
    other = PackedStore(root, 10**8, segment_bytes=20_000)

    def write() -> None:  # entries in segments that verify's first look at the rows did not see
        fill(other, range(100, 200))
        other.flush()

    wrote = once_after_segment_table(monkeypatch, write)
    real, evicted = packed_segments.SegmentFiles.read, []

    def read(self: Any, seg: int, *args: Any) -> Any:
        if seg not in before and not evicted:  # rows dropped, then files removed: before verify reads them
            evicted.append(True)
            other.clear()
        return real(self, seg, *args)

    monkeypatch.setattr(packed_segments.SegmentFiles, "read", read)
    report = checker.verify(fix=fix)
    assert wrote and evicted and report.ok and report.bad == [] and not report.fixed, (report.bad, report.problems)


def test_verify_while_a_writer_evicts_its_own_segment_reports_no_stray_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = PackedStore(root, 30_000, segment_bytes=100_000)  # one segment, the writer's own, over the budget
    checker = PackedStore(root, 30_000, segment_bytes=100_000)
    real, mine, reports = packed_segments.SegmentFiles.remove, [], []

    def remove(self: Any, seg: int) -> None:
        if self is writer._files and seg in mine and not reports:  # its row dropped, its file not yet removed
            reports.append(checker.verify())
        real(self, seg)

    monkeypatch.setattr(packed_segments.SegmentFiles, "remove", remove)
    for start in range(0, 100, 10):
        if writer._files.writer is not None:
            mine.append(writer._files.writer.seg)
        writer.put_many([(key(i), value(i)) for i in range(start, start + 10)])
        writer.flush()
    assert reports and reports[0].ok, reports[0].problems


@pytest.mark.parametrize("fix", [False, True])
def test_verify_while_another_process_compacts_the_index_then_clears_reads_the_new_index(
    root: Path, monkeypatch: pytest.MonkeyPatch, fix: bool
) -> None:
    checker = PackedStore(root, 10**8, segment_bytes=20_000)
    fill(checker, range(100))
    checker.flush()
    other = PackedStore(root, 10**8, segment_bytes=20_000)

    def compact_then_clear() -> None:  # the index file replaced, then changed where verify's old one cannot see
        index = other._handle.ensure(write=True)
        assert index is not None
        packed_upkeep.compact_index(index, str(root), lambda kind, message: None)
        assert index.replaced()
        other.clear()

    ran = once_after_segment_table(monkeypatch, compact_then_clear, caller="_bad_records")
    report = checker.verify(fix=fix)
    assert ran and report.ok and report.bad == [] and not report.fixed, (report.bad, report.problems)
    monkeypatch.undo()
    assert len(checker) == 0 and checker.verify().ok


def test_verify_fix_keeps_a_damaged_entry_written_again_since_it_was_checked(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = PackedStore(root, 10**8)
    fill(checker, range(50))
    seg, offset, _ = locate(checker, 3)
    _flip(root / segment_name(seg), offset + HEADER.size + 16 + 10)
    other = PackedStore(root, 10**8)
    real, rewrote = packed_index.Index.change, []

    def change(self: Any) -> Any:
        if not rewrote:  # between verify's checks and its repair, another process writes the entry again
            rewrote.append(True)
            other.delete_many([key(3)])
            other.put_many([(key(3), value(3))])
            other.flush()
        return real(self)

    monkeypatch.setattr(packed_index.Index, "change", change)
    report = checker.verify(fix=True)
    assert rewrote and report.bad == [key(3)] and report.fixed
    monkeypatch.undo()
    assert bytes(checker.get_many([key(3)])[0] or b"") == value(3) and checker.verify().ok


def test_a_garbage_index_is_rebuilt_from_the_segments(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**8)
    fill(store, range(300))
    store.close()
    (root / INDEX_NAME).write_bytes(os.urandom(50_000))
    reopened = PackedStore(root, 10**8, report=reports)
    assert "index" in reports.kinds()
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(reopened.get_many([key(i) for i in range(300)])))
    assert reopened.verify().ok


def test_an_index_that_lies_is_bounds_checked(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**12, report=reports)
    fill(store, range(10))
    seg, _, _ = locate(store, 1)
    index = store._handle.ensure(write=True)
    assert index is not None
    lies = {2: (seg, 0, 900), 3: (seg, 1 << 31, 1000), 4: (seg, 0, (1 << 32) - 1), 5: (seg + 77, 0, 1000)}
    with index.env.begin(write=True) as txn:
        for i, row in lies.items():
            txn.put(bytes.fromhex(key(i)), ENTRY.pack(*row), db=index.entries)
        txn.put(bytes.fromhex(key(6)), b"short", db=index.entries)
    os.truncate(root / segment_name(seg), 1 << 40)  # and a giant sparse segment
    with traced_memory() as traced:
        got = store.get_many([key(i) for i in range(10)])
        peak = traced()[1]
    assert peak < 10 << 20
    assert [i for i, v in enumerate(got) if v is None] == [2, 3, 4, 5, 6]
    assert all(bytes(got[i] or b"") == value(i) for i in (0, 1, 7, 8, 9))
    assert reports.kinds().count("corrupt") >= 4


# -- hostile files ------------------------------------------------------------------------
def test_an_index_whose_pages_point_outside_it_is_rebuilt_when_it_opens(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**7)
    fill(store, range(400), 100)
    store.close()
    poison_index_leaves(root / INDEX_NAME)  # reading them would kill the process (SIGBUS, SIGSEGV)
    reopened = PackedStore(root, 10**7, report=reports)
    got = reopened.get_many([key(i) for i in range(400)])
    assert all(v is not None and bytes(v) == value(i, 100) for i, v in enumerate(got))
    assert [kind for kind, message in reports.seen if "damaged" in message and "outside" in message] == ["index"]


def test_an_index_of_larger_pages_is_walked_at_its_own_page_size(root: Path) -> None:
    store = PackedStore(root, 10**7)
    fill(store, range(600), 100)
    store.close()
    path, page = root / INDEX_NAME, 16384  # what LMDB writes where the system's pages are 16 KiB
    small = path.read_bytes()
    large = bytearray(len(small) // 4096 * page)
    for i in range(len(small) // 4096):
        large[i * page : i * page + 4096] = small[i * 4096 : (i + 1) * 4096]
    newest = max((0, 1), key=lambda m: struct.unpack_from("<Q", large, m * page + 16 + 128)[0])
    large[0:4096] = large[newest * page : newest * page + 4096]  # the newest meta first
    for m in (0, 1):
        struct.pack_into("<I", large, m * page + 16 + 24, page)  # the page size, in the free tree's md_pad
    path.write_bytes(bytes(large))
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=3)
    with env.begin(db=env.open_db(b"entries", create=False)) as txn:
        assert env.stat()["psize"] == page and txn.stat()["entries"] == 600
    env.close()
    assert unsound_pages(str(path)) is None


def test_an_index_a_writer_grows_as_it_is_walked_is_not_called_damaged(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.stores.packed import mappable

    store = PackedStore(root, 10**8)
    fill(store, range(50), 100)
    path = str(root / INDEX_NAME)
    before = os.stat(path).st_size
    fill(store, range(50, 3000), 100)  # the file grows, then a newer header names the pages past its old end
    store.close()
    assert os.stat(path).st_size > before
    read, stat = os.pread, os.fstat
    headers: list[int] = []

    def pread(fd: int, n: int, offset: int) -> bytes:
        headers.append(offset)
        return read(fd, n, offset)

    def fstat(fd: int) -> os.stat_result:  # the size as it was before the writer's last commit, until a header is read
        real = stat(fd)
        return real if headers else os.stat_result((*real[:6], before, *real[7:]))

    monkeypatch.setattr(mappable.os, "pread", pread)
    monkeypatch.setattr(mappable.os, "fstat", fstat)
    assert mappable._unsound_once(path, None) is None  # one walk: its size is measured after the header


@pytest.mark.parametrize("txnid", [None, 7])
def test_a_problem_outside_a_transaction_counts_only_if_each_walk_finds_it(
    monkeypatch: pytest.MonkeyPatch, txnid: int | None
) -> None:
    from torchcache.stores.packed import mappable

    found = iter(["a tree points to page 9, outside its 8 pages", None, None])
    monkeypatch.setattr(mappable, "_unsound_once", lambda path, txnid: next(found))
    problem = unsound_pages("index.lmdb", txnid)  # with no transaction, a writer may reuse pages as they are walked
    assert problem == (None if txnid is None else "a tree points to page 9, outside its 8 pages")
    monkeypatch.setattr(mappable, "_unsound_once", lambda path, txnid: "a page has a node outside it")
    assert unsound_pages("index.lmdb", txnid) == "a page has a node outside it"


def test_the_command_lines_check_walks_a_snapshot_no_writer_can_reuse(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.stores.packed import mappable

    store = PackedStore(root, 10**8)
    fill(store, range(300), 100)
    path, walked = str(root / INDEX_NAME), []
    real = mappable.unsound_pages
    monkeypatch.setattr(mappable, "unsound_pages", lambda p, txnid=None: walked.append(txnid) or real(p, txnid))
    assert mappable.unsound_snapshot(path) is None  # open in this process: LMDB opens it once, walked outside
    store.close()
    assert mappable.unsound_snapshot(path) is None  # as torchcache ls or verify finds it: inside a read transaction
    assert len(walked) == 2 and walked[0] is None and isinstance(walked[1], int)
    lock = root / (INDEX_NAME + "-lock")
    elsewhere = root.parent / "elsewhere"
    elsewhere.write_bytes(b"a file of the user's")
    lock.unlink()
    lock.symlink_to(elsewhere)  # a lock file that is not one: not followed, nothing written through it
    assert mappable.unsound_snapshot(path) is None and walked[-1] is None
    lock.unlink()  # none: none is made by a check
    assert mappable.unsound_snapshot(path) is None and walked[-1] is None and not lock.exists()
    assert elsewhere.read_bytes() == b"a file of the user's"


def test_a_fifo_or_directory_where_a_segment_should_be(root: Path, reports: Reports) -> None:
    store = PackedStore(root, 10**8, report=reports)
    fill(store, range(20))
    seg, _, _ = locate(store, 0)
    path = root / segment_name(seg)
    store.close()
    path.unlink()
    os.mkfifo(path)
    fresh = PackedStore(root, 10**8, report=reports)
    assert fresh.get_many([key(i) for i in range(20)]).count(None) >= 1  # returns, does not block
    assert "segment" in reports.kinds()
    path.unlink()
    path.mkdir()
    other = PackedStore(root, 10**8, report=Reports())
    assert other.get(key(0)) is None
    fill(other, range(100, 120))
    assert bytes(other.get(key(110)) or b"") == value(110)
    other.verify(fix=True)
    assert path.is_dir()  # not ours to remove


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "directory", "sparse", "garbage", "lockfile-fifo"])
def test_hostile_files_at_the_index_path(root: Path, kind: str) -> None:
    root.mkdir()
    index = root / INDEX_NAME
    if kind == "fifo":
        os.mkfifo(index)
    elif kind == "directory":
        (index / "nested").mkdir(parents=True)
    elif kind == "sparse":
        with index.open("wb") as file:
            file.truncate(1 << 40)
    elif kind == "garbage":
        index.write_bytes(b"\xff" * 8192)
    else:
        os.mkfifo(root / (INDEX_NAME + "-lock"))
    code = (
        "import sys; from torchcache.stores.packed.store import PackedStore\n"
        "s = PackedStore(sys.argv[1], 10**7, report=lambda k, m: print(k))\n"
        "s.put_many([('abcd', b'x')]); assert bytes(s.get('abcd')) == b'x'; print('ok')\n"
    )
    result = run_python(code, str(root), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "ok"


# -- the budget and compaction ---------------------------------------------------------
def test_disk_stays_within_bounds_with_churn(root: Path) -> None:
    budget = 2_000_000
    store = PackedStore(root, budget)
    for step in range(4, 64):
        ids = range(step * 60, step * 60 + 60)
        store.put_many([(key(i), value(i, 3072)) for i in ids])
        store.delete_many([key(i) for i in range(step * 60 - 200, step * 60 - 170)])  # dead bytes
        store.put_many([(key(i), value(i + 1, 3072)) for i in range(step * 60 - 100, step * 60 - 80)])  # replaced
        assert store.nbytes <= budget
        assert store.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES
    assert store.verify().ok


def _churn(root: Path, budget: int, writer: int, batches: int, evict: str = "mru") -> None:
    store = PackedStore(root, budget, report=lambda kind, message: None, evict=evict)
    for step in range(batches):
        ids = range(writer * 10**6 + step * 20, writer * 10**6 + step * 20 + 20)
        store.put_many([(key(i), value(i, 500 + (i * 37) % 2500)) for i in ids])
        if step % 10 == 0:
            store.get_many([key(i) for i in ids])
    store.close()


def _bloat(index_path: Path, nbytes: int) -> None:
    """Leave the index file ``nbytes`` of free pages larger, as many readers and writers at once do."""
    env = lmdb.open(str(index_path), subdir=False, max_dbs=3, map_size=64 << 20)
    junk = env.open_db(b"junk")
    with env.begin(write=True) as txn:
        for i in range(nbytes // 4000):
            txn.put(i.to_bytes(4, "big"), b"x" * 3900, db=junk)
    with env.begin(write=True) as txn:
        txn.drop(junk, delete=True)
    env.close()


@pytest.mark.parametrize("evict", ["mru", "none"])
def test_a_full_store_compacts_a_bloated_index_even_when_it_refuses_a_write(root: Path, evict: str) -> None:
    budget = 1_500_000
    store = PackedStore(root, budget, evict=evict)
    store.put_many([(key(i), value(i, 500 + (i * 37) % 1500)) for i in range(1200)])  # full
    store.close()
    _bloat(root / INDEX_NAME, 2 * budget)
    reports = Reports()
    store = PackedStore(root, budget, evict=evict, report=reports)
    held = len(store)
    store.put_many([(key(10**8 + i), value(i, 1000)) for i in range(100)])  # refused by "none"
    assert reports.seen == []  # upkeep, not a fault: nothing to warn about
    assert charged(store) <= budget and store.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES
    assert len(store) >= held * 0.9 if evict == "mru" else len(store) == held  # a store that keeps, kept
    assert store.verify().ok


@pytest.mark.parametrize("evict", ["mru", "none"])
def test_a_small_budget_under_an_index_grown_past_it_compacts_it_and_keeps_entries(root: Path, evict: str) -> None:
    budget = 150_000  # under the slack a large budget gives free pages before compacting
    store = PackedStore(root, budget, evict=evict, report=lambda kind, message: None)
    store.put_many([(key(0), value(0))])
    store.close()
    _bloat(root / INDEX_NAME, 200_000)  # the index outgrew the budget (a larger one before, many writers)
    store = PackedStore(root, budget, evict=evict, report=lambda kind, message: None)
    for start in range(0, 50, 10):
        store.put_many([(key(100 + i), value(i, 1000)) for i in range(start, start + 10)])
    assert len(store) > 20  # entries kept, not a store full of index
    assert charged(store) <= budget and store.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES
    assert store.verify().ok


@pytest.mark.slow
@pytest.mark.parametrize("evict", ["mru", "none"])
def test_eight_writers_on_a_small_budget_keep_the_index_within_it_and_keep_entries(root: Path, evict: str) -> None:
    budget = 1_500_000
    first = PackedStore(root, budget, evict=evict)
    first.put_many([(key(0), value(0))])
    first.close()
    _bloat(root / INDEX_NAME, 2 * budget)  # the index outgrew the whole budget
    writers = [FORK.Process(target=_churn, args=(root, budget, w, 30, evict)) for w in range(8)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(DEADLINE)
    assert [process.exitcode for process in writers] == [0] * 8
    store = PackedStore(root, budget, report=lambda kind, message: None, evict=evict)
    store.put_many([(key(10**8 + i), value(i, 1000)) for i in range(100)])
    assert len(store) > 100  # entries kept, not a store full of index
    assert charged(store) <= budget
    assert store.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES
    keys = list(store.keys())
    got = store.get_many(keys)
    assert all(v is not None for v in got)  # the compacted index lost nothing, named no file removed since
    for k, v in zip(keys, got):
        i = int.from_bytes(bytes(v[:4]), "little")  # type: ignore[index]
        assert k in (key(i), key(10**8 + i)) and bytes(v) == value(i, len(v))  # type: ignore[arg-type]
    assert store.verify().ok


def test_a_bloated_index_is_compacted_with_every_entry_and_other_users_follow(root: Path) -> None:
    budget = 2_000_000
    store = PackedStore(root, budget, report=lambda kind, message: None)
    fill(store, range(200), 2000)
    store.close()
    _bloat(root / INDEX_NAME, 2 * budget)
    before = os.stat(root / INDEX_NAME)
    other = PackedStore(root, budget, report=lambda kind, message: None)
    assert len(other) == 200  # has the bloated index open
    store = PackedStore(root, budget, report=lambda kind, message: None)
    store.put_many([(key(500), value(500, 2000))])  # finds the index outgrew the budget and compacts it
    after = os.stat(root / INDEX_NAME)
    assert after.st_ino != before.st_ino and after.st_size < before.st_size // 4
    assert sorted(store.keys()) == sorted(key(i) for i in [*range(200), 500])
    other.put_many([(key(501), value(501, 2000))])  # opened the old file: writes to the new one
    assert sorted(other.keys()) == sorted(store.keys()) and len(store) == 202
    assert all(bytes(v) == value(i, 2000) for i, v in zip(range(200), other.get_many([key(i) for i in range(200)])))  # type: ignore[arg-type]
    assert store.verify().ok


def test_a_store_that_does_not_evict_keeps_what_it_holds_and_takes_what_fits(root: Path) -> None:
    budget = 100_000
    store = PackedStore(root, budget, evict="none")
    taken = [store.put_many([(key(i), value(i, 3000)) for i in range(at, at + 10)]) for at in range(0, 500, 10)]
    full = next(n for n, count in enumerate(taken) if count < 10)
    assert set(taken[:full]) == {10} and set(taken[full + 1 :]) == {0}
    held = [key(i) for i in range(sum(taken))]
    assert sorted(store.keys()) == sorted(held)  # the first ones written, kept
    assert 0 <= budget - charged(store) < 3000 + 15 + 8 + INDEX_ENTRY_BYTES  # the next one did not fit
    got = store.get_many(held)
    assert all(v is not None and bytes(v) == value(i, 3000) for i, v in enumerate(got))
    smaller = PackedStore(root, budget // 2, evict="none")  # a lower budget on a later run still holds
    smaller.trim()
    assert 0 < len(smaller) < len(held) and charged(smaller) <= budget // 2
    assert set(smaller.keys()) < set(held)


@pytest.mark.parametrize("how", ["put", "trim"])
def test_a_lower_limit_in_a_later_run_holds(root: Path, how: str) -> None:
    fill(PackedStore(root, 10**8), range(3000), 3072)
    smaller = PackedStore(root, 2_000_000)
    if how == "put":
        smaller.put_many([(key(10**6), value(1))])
    else:
        smaller.trim()
    assert 0 < smaller.nbytes <= 2_000_000
    assert smaller.disk_bytes <= 1.1 * 2_000_000 + INDEX_BASE_BYTES
    assert smaller.verify().ok


def test_compaction_gives_space_back_and_readers_follow(root: Path) -> None:
    budget = 3_000_000
    writer = PackedStore(root, budget)
    reader = PackedStore(root, budget)
    fill(writer, range(800), 3000)
    assert len(reader.get_many([key(i) for i in range(800)])) == 800  # caches descriptors
    writer.delete_many([key(i) for i in range(800) if i % 10])  # 90 % dead
    before = len(segments(root))
    fill(writer, range(1000, 1700), 3000)  # passes the budget: compaction
    assert len(segments(root)) < before + 8
    assert writer.disk_bytes <= 1.1 * budget + INDEX_BASE_BYTES
    survivors = [i for i in range(0, 800, 10)]
    got = reader.get_many([key(i) for i in survivors])
    assert all(v is None or bytes(v) == value(i, 3000) for v, i in zip(got, survivors))
    fresh = PackedStore(root, budget)
    got = fresh.get_many([key(i) for i in survivors])
    assert all(v is None or bytes(v) == value(i, 3000) for v, i in zip(got, survivors))
    assert fresh.verify().ok


@pytest.mark.parametrize("evict", ["mru", "lru"])
def test_eviction_keeps_pinned_entries_and_refuses_a_write_with_no_other_room(
    root: Path, evict: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 60_000
    store = PackedStore(root, budget, segment_bytes=10_000, evict=evict)
    pins: set[bytes] = set()
    store.pinned = lambda: pins
    for start in range(0, 150, 10):  # 150 kB through a 60 kB budget: segments go as the batches come
        store.put_many([(key(i), value(i)) for i in range(start, start + 10)])
        if start in (20, 70):  # entries the copy's server did not take: their only copy
            pins.update(encode_key(key(i)) for i in range(start, start + 10) if key(i) in store)
        assert charged(store) <= budget
    pinned = [i for i in range(150) if encode_key(key(i)) in pins]
    assert len(pinned) >= 15 and all(key(i) in store for i in pinned) and len(store) < 100
    assert [bytes(v or b"") for v in store.get_many([key(i) for i in pinned])] == [value(i) for i in pinned]

    pins.update(encode_keys(list(store.keys())))  # nothing left that may go: a write finds no room
    held = sorted(store.keys())
    scans: list[int] = []
    real_scan = packed_evict.scan_keys
    monkeypatch.setattr(packed_evict, "scan_keys", lambda fd, end: scans.append(end) or real_scan(fd, end))
    assert store.put_many([(key(i), value(i)) for i in range(500, 520)]) == 0
    assert sorted(store.keys()) == held and charged(store) <= budget
    first, scans[:] = len(scans), []
    assert store.put_many([(key(i), value(i)) for i in range(520, 540)]) == 0
    assert len(scans) <= 2 < first  # the batch's own two segments: those found kept are not read again
    assert store.put_many([(key(600), b"x" * 10)]) == 1  # what fits beside them is still stored
    pins.clear()  # sent: evicted again as the budget needs
    monkeypatch.setattr(packed_evict, "scan_keys", lambda fd, end: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(StoreError):
        store.put_many([(key(i), value(i)) for i in range(540, 560)])  # a segment that cannot be read
    monkeypatch.setattr(packed_evict, "scan_keys", real_scan)
    for seg in store._files.listed():  # no lock of a failed eviction outlives it
        lock = store._files.lock(seg)
        assert lock is not None or seg in store._files.own()
        os.close(lock) if lock is not None else None
    for start in range(700, 760, 10):
        store.put_many([(key(i), value(i)) for i in range(start, start + 10)])
    assert sum(key(i) in store for i in range(700, 760)) >= 10 and charged(store) <= budget
    assert not set(held) <= set(store.keys())
    store.close()


# -- failing disks ------------------------------------------------------------------------
@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "mnt"
    point.mkdir()
    yield point
    subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


def _mount(*commands: list[str]) -> None:
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            pytest.skip(f"mounting needs privileges: {result.stderr.strip()}")


@pytest.mark.slow
def test_a_full_disk_raises_and_leaves_nothing_half_written(mount_point: Path) -> None:
    _mount(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)])
    store = PackedStore(mount_point / "store", 10**9)
    stored: list[int] = []
    with pytest.raises(StoreError) as caught:
        for start in range(0, 10_000, 20):
            store.put_many([(key(i), value(i, 3000)) for i in range(start, start + 20)])
            stored.extend(range(start, start + 20))
    assert caught.value.errno == errno.ENOSPC or "No space" in str(caught.value)
    got = store.get_many([key(i) for i in range(len(stored) + 20)])
    assert all(bytes(got[i] or b"") == value(i, 3000) for i in stored)
    assert all(v is None for v in got[len(stored) :])
    assert store.verify().ok


def test_a_full_disk_simulated(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PackedStore(root, 10**9)
    fill(store, range(100))

    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    fault_under(monkeypatch, root, "pwritev", no_space)
    with pytest.raises(StoreError):
        store.put_many([(key(i), value(i)) for i in range(100, 200)])
    monkeypatch.undo()
    assert store.get(key(150)) is None and len(store) == 100 and store.verify().ok
    fill(store, range(100, 200))
    assert len(store) == 200 and store.verify().ok


def test_a_write_that_fails_in_a_new_segment_leaves_no_file_behind(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PackedStore(root, 10**9, segment_bytes=8192)
    fill(store, range(10))
    before = sorted(p.name for p in root.glob("seg-*"))

    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    fault_under(monkeypatch, root, "pwritev", no_space)
    with pytest.raises(StoreError):
        store.put_many([(key(i), value(i, 3000)) for i in range(100, 110)])  # new segments, none written
    monkeypatch.undo()
    assert sorted(p.name for p in root.glob("seg-*")) == before and store.verify().ok
    fill(store, range(100, 110))
    assert len(store) == 20


@pytest.mark.slow
def test_a_read_only_directory(tmp_path: Path, mount_point: Path) -> None:
    source = tmp_path / "source"
    fill(PackedStore(source / "store", 10**8), range(50))
    _mount(["mount", "--bind", str(source), str(mount_point)], ["mount", "-o", "remount,bind,ro", str(mount_point)])
    reports = Reports()
    store = PackedStore(mount_point / "store", 10**8, report=reports)
    got = store.get_many([key(i) for i in range(50)])
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(got)), (reports.seen, got.count(None))
    with pytest.raises(StoreError):
        store.put_many([(key(99), b"x")])
    assert store.get(key(99)) is None


def test_a_vanished_directory(root: Path) -> None:
    store = PackedStore(root, 10**8)
    fill(store, range(50))
    shutil.rmtree(root)
    assert store.get_many([key(i) for i in range(50)]) == [None] * 50
    with pytest.raises(StoreError):
        store.put_many([(key(1), b"x")])
    assert len(store) == 0 and store.nbytes == 0 and key(1) not in store
    store.close()


# -- open cost and overhead ---------------------------------------------------------------
@pytest.mark.slow
def test_opening_reads_no_segment_at_200k_entries(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PackedStore(root, 10**12)
    for start in range(0, 200_000, 2000):
        store.put_many([(key(i), b"v") for i in range(start, start + 2000)])
    store.close()
    opened: list[str] = []
    real_open = os.open

    def watch(path: str, *args: object, **kwargs: object) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", watch)
    again = PackedStore(root, 10**12)  # its opening time is measured in benchmarks/disk_tier.py
    assert again.get_many([key(i) for i in range(10**6, 10**6 + 1024)]) == [None] * 1024
    again.close()
    assert opened and not [path for path in opened if path.endswith(".tcs")]


@pytest.mark.slow
def test_overhead_at_200k_entries_of_3072_bytes(root: Path) -> None:
    store = PackedStore(root, 10**12)
    payload = os.urandom(3072)
    for start in range(0, 200_000, 1024):
        store.put_many([(key(i), payload) for i in range(start, min(200_000, start + 1024))])
    store.flush()
    assert store.disk_bytes <= 1.05 * 200_000 * 3072


_key_chars = st.sampled_from("0123456789abcdef")
_odd_chars = st.sampled_from("0123456789abcdefABCDEFg \n")
_keys = st.one_of(
    st.integers(1, 33).flatmap(lambda n: st.text(_key_chars, min_size=2 * n, max_size=2 * n)),
    st.text(st.one_of(_key_chars, _odd_chars), max_size=70),
)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.lists(_keys, max_size=6),
        st.integers(2, 32).flatmap(
            lambda w: st.lists(st.text(_key_chars, min_size=w, max_size=w), min_size=1, max_size=6)
        ),
    )
)
def test_keys_of_a_batch_encode_as_each_key_does(keys: list[str]) -> None:
    try:
        expected: list[bytes] | None = [encode_key(k) for k in keys]
    except KeyingError:
        expected = None
    if expected is None:
        with pytest.raises(KeyingError):
            encode_keys(keys)
    else:
        assert encode_keys(keys) == expected


def test_a_batch_over_several_segments_is_counted_in_each(root: Path) -> None:
    store = PackedStore(root, 10**8, segment_bytes=20_000)
    store.put_many([(key(i), value(i, 1000 + i)) for i in range(60)])  # one call, several segments
    store.put_many([(key(i), value(i, 500)) for i in range(5)])  # replaces five, in the open segment
    index = store._handle.ensure(write=False)
    assert index is not None
    with index.begin() as txn:
        table = index.segment_table(txn)
        places = [(ENTRY.unpack(raw), kb) for kb, raw in txn.cursor(db=index.entries)]
    assert len(table) > 2
    want: dict[int, list[int]] = {seg: [0, 0] for seg in table}
    for (seg, _, length), kb in places:
        want[seg][0] += HEADER.size + len(kb) + length
        want[seg][1] += 1
    assert {seg: [row.live, row.records] for seg, row in table.items()} == want
    assert store.nbytes == sum(1000 + i for i in range(5, 60)) + 5 * 500 and store.verify().ok


# -- opening under limits -----------------------------------------------------------------
_UNDER_LIMIT = """
import os, resource, sys
from torchcache.stores.packed.store import PackedStore

root, limit = sys.argv[1], sys.argv[2]
if limit == "tight":  # a little above what this process maps now: too little for any index map
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (8 << 20),) * 2)
else:
    resource.setrlimit(resource.RLIMIT_AS, (int(limit),) * 2)
seen = []
store = PackedStore(root, "1GB", report=lambda kind, message: seen.append(kind))
got = store.get_many([format(i, "08x") for i in range(100)])
print(sum(v is not None and bytes(v) == bytes([i]) * 1000 for i, v in enumerate(got)))
try:
    print(store.put_many([(format(i, "08x"), bytes([i]) * 1000) for i in range(100, 110)]))
except OSError as exc:
    print("unwritable", type(exc).__name__)
print(",".join(seen))
"""


def _fill_for_child(root: Path) -> tuple[int, int]:
    store = PackedStore(root, "1GB")
    store.put_many([(format(i, "08x"), bytes([i]) * 1000) for i in range(100)])
    store.close()
    st = os.stat(root / INDEX_NAME)
    return st.st_ino, st.st_size


@pytest.mark.slow
def test_an_index_opens_and_serves_hits_under_an_address_space_limit(root: Path) -> None:
    _fill_for_child(root)
    done = run_python(_UNDER_LIMIT, str(root), str(8_000_000 * 1024))  # ulimit -v 8000000
    assert done.returncode == 0, done.stderr
    hits, stored, reported = done.stdout.splitlines()
    assert (hits, stored, reported) == ("100", "10", "")
    assert len(PackedStore(root, "1GB")) == 110


@pytest.mark.slow
def test_no_address_space_for_the_index_leaves_it_as_it_is(root: Path) -> None:
    identity = _fill_for_child(root)
    done = run_python(_UNDER_LIMIT, str(root), "tight")
    assert done.returncode == 0, done.stderr
    hits, stored, reported = done.stdout.splitlines()
    assert (hits, stored, reported) == ("0", "unwritable StoreError", "index")  # unavailable, warned once
    st = os.stat(root / INDEX_NAME)
    assert (st.st_ino, st.st_size) == identity  # neither removed nor rebuilt
    got = PackedStore(root, "1GB").get_many([format(i, "08x") for i in range(100)])
    assert all(v is not None and bytes(v) == bytes([i]) * 1000 for i, v in enumerate(got))


@pytest.mark.parametrize(
    "error",
    [
        lmdb.MemoryError("mdb_env_open", "Cannot allocate memory"),
        lmdb.LockError("mdb_env_open", "Resource temporarily unavailable"),
        lmdb.DiskError("mdb_env_open", "No space left on device"),
        lmdb.ReadersFullError("mdb_env_open", "readers full"),
        OSError(errno.ENOMEM, "Cannot allocate memory"),
        OSError(errno.EAGAIN, "Resource temporarily unavailable"),
    ],
    ids=lambda e: type(e).__name__ + (f"-{errno.errorcode[e.errno]}" if isinstance(e, OSError) else ""),
)
def test_an_error_opening_the_index_is_not_damage(
    root: Path, reports: Reports, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    filler = PackedStore(root, 10**8)
    fill(filler, range(50))
    filler.close()
    before = os.stat(root / INDEX_NAME)

    def refuse(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(packed_index.lmdb, "open", refuse)
    store = PackedStore(root, 10**8, report=reports)
    assert store.get_many([key(i) for i in range(50)]) == [None] * 50
    with pytest.raises(StoreError):
        store.put_many([(key(99), b"x")])
    assert len(store) == 0 and key(1) not in store
    assert reports.kinds() == ["index"] and "unavailable" in reports.seen[0][1]  # once, for every use
    after = os.stat(root / INDEX_NAME)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    monkeypatch.undo()  # the next use opens it
    got = store.get_many([key(i) for i in range(50)])
    assert all(bytes(v or b"") == value(i) for i, v in enumerate(got))
    assert reports.kinds() == ["index"]


def test_a_map_found_full_grows_and_the_write_goes_through(root: Path) -> None:
    store = PackedStore(root, 10**7)
    store._handle.map_size = 1 << 18  # a map far too small for what follows
    store.close()
    fill(store, range(2000), size=10)  # small entries: the index outgrows its map several times
    index = store._handle.ensure(write=False)
    assert index is not None and index.map_size > 1 << 18
    got = store.get_many([key(i) for i in range(2000)])
    assert all(bytes(v or b"") == value(i, 10) for i, v in enumerate(got))
    other = PackedStore(root, 10**7)  # another store of this directory maps it at its size
    assert len(other) == 2000


# -- planted bookkeeping ------------------------------------------------------------------
def _plant(root: Path, **values: int) -> None:
    env = lmdb.open(str(root / INDEX_NAME), subdir=False, max_dbs=3, lock=False)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        for name, number in values.items():
            txn.put(name.encode(), number.to_bytes(8, "little"), db=meta)
    env.close()


PLANTED_META: dict[str, dict[str, int]] = {
    "payload too large": {"payload": 10**12},
    "records too small": {"records": 3},
    "files wrong": {"files": 1 << 62},
    "all zero": {"payload": 0, "records": 0, "files": 0},
    "all at the top": {"payload": (1 << 64) - 1, "records": (1 << 64) - 1, "files": (1 << 64) - 1},
    "counters out of range": {"clock": (1 << 64) - 1, "gen": (1 << 64) - 1, "next_seg": 1},
}


@pytest.mark.parametrize("plant", list(PLANTED_META))
def test_planted_index_totals_are_recomputed_from_the_entries(root: Path, plant: str) -> None:
    store = PackedStore(root, 200_000, segment_bytes=20_000)
    fill(store, range(100))
    want = store.usage()
    store.close()
    _plant(root, **PLANTED_META[plant])
    reopened = PackedStore(root, 200_000, segment_bytes=20_000)
    assert reopened.usage() == want and reopened.nbytes == want["payload"]
    assert "in 100 entries" in repr(reopened)
    fill(reopened, range(100, 400))  # writes go on, eviction keeps the budget
    usage = reopened.usage()
    assert usage["records"] + usage["entries"] * 96 <= 200_000 and usage["entries"] > 50
    assert reopened.verify().ok
    got = reopened.get_many([key(i) for i in range(400)])
    assert all(v is None or bytes(v) == value(i) for i, v in enumerate(got))


@pytest.mark.parametrize("end", [(1 << 64) - 1, (1 << 63) + 1010], ids=["all ones", "high bit"])
def test_a_planted_segment_row_is_left_out_and_writes_go_on(root: Path, end: int) -> None:
    store = PackedStore(root, 200_000, segment_bytes=20_000)
    fill(store, range(30))
    store.close()
    env = lmdb.open(str(root / INDEX_NAME), subdir=False, max_dbs=3, lock=False)
    with env.begin(write=True) as txn:
        rows = env.open_db(b"segments", txn=txn)
        for seg, row in list(txn.cursor(db=rows)):
            sealed, _, live, count, stamp = struct.unpack("<BQQQQ", row)
            txn.put(seg, struct.pack("<BQQQQ", sealed, end, live, count, stamp), db=rows)
    env.close()
    reopened = PackedStore(root, 200_000, segment_bytes=20_000)
    got = reopened.get_many([key(i) for i in range(30)])
    assert all(v is None or bytes(v) == value(i) for i, v in enumerate(got))
    fill(reopened, range(30, 60))  # no struct.error: a row no segment could have is not believed
    assert reopened.verify(fix=True).entries >= 30 and reopened.verify().ok


def test_verify_reports_and_fixes_planted_totals(root: Path) -> None:
    store = PackedStore(root, 10**8)
    fill(store, range(50))
    store.close()
    _plant(root, payload=7, records=10**9, files=5)
    index = packed_index.open_index(str(root), readonly=True)
    with index.begin() as txn:
        assert index.stored_totals(txn)[b"records"] == 10**9  # as planted, and checked on every read:
        assert index.totals(txn)[b"records"] < 10**8
    index.close()
    reopened = PackedStore(root, 10**8)
    report = reopened.verify()
    assert len(report.problems) == 3 and not report.ok
    assert reopened.verify(fix=True).fixed and reopened.verify().ok


def test_a_read_only_store_writes_nothing_and_a_writer_beside_it_writes_once_it_is_closed(root: Path) -> None:
    writer = PackedStore(root, 10**8)
    fill(writer, range(10))
    (orphan,) = [p for p in segments(root)]
    stray = orphan.with_name(orphan.name.replace("0001", "0009"))
    stray.write_bytes(orphan.read_bytes())  # a segment the index does not know
    reader = PackedStore(root, 10**8, readonly=True)  # shares the writer's environment in this process
    assert len(reader) == 10 and stray.exists()  # nothing sealed or removed by a reader
    writer.close()
    reader.close()
    reader = PackedStore(root, 10**8, readonly=True)
    writer = PackedStore(root, 10**8)  # finds the reader's read-only environment
    with pytest.raises(StoreError, match="read-only"):
        fill(writer, range(10, 20))
    reader.close()
    fill(writer, range(10, 20))  # opened again, for writing
    assert len(writer) == 20
    writer.close()
