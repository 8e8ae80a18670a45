"""The ``Store`` contract (one entry at a time), run against every such store, and the disk store's own behaviour.

``DiskStore`` keeps one file per entry, the layout of torchcache 1.0: the persistent
tier reads such directories in place and ``torchcache migrate`` packs them, so these
tests pin the files it reads. Batched stores (packed, Redis) have their contract in
``test_store_contract.py``.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import stat
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from torchcache.errors import CorruptEntryError, StoreError
from torchcache.policy import LruPolicy
from torchcache.stores import DiskStore, Store

StoreFactory = Callable[[int], Store]


def _key(i: int) -> str:
    """A key as the cache makes them: 32 lowercase hex digits."""
    return hashlib.md5(str(i).encode()).hexdigest()


A, B, C, D, E = (_key(i) for i in range(5))


def _disk_factory(tmp_path: Path) -> StoreFactory:
    counter = itertools.count()

    def make(max_bytes: int) -> Store:
        return DiskStore(tmp_path / f"disk-{next(counter)}", max_bytes=max_bytes)

    return make


# One parameter per ``Store``; another one joins the suite with one more entry.
_STORE_FACTORIES = [pytest.param(_disk_factory, id="disk")]


@pytest.fixture(params=_STORE_FACTORIES)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """A factory of empty stores of one kind: ``make_store(max_bytes)``."""
    factory: Callable[[Path], StoreFactory] = request.param
    return factory(tmp_path)


# -- the contract ---------------------------------------------------------------------------


def test_put_get_round_trip(make_store: StoreFactory) -> None:
    store = make_store(1000)
    assert store.get(A) is None
    assert store.put(A, b"alpha") is True
    assert store.put(B, b"\x00\xffbeta") is True
    assert store.get(A) == b"alpha"
    assert store.get(B) == b"\x00\xffbeta"
    assert store.get(C) is None


def test_empty_value(make_store: StoreFactory) -> None:
    store = make_store(10)
    assert store.put(A, b"")
    assert store.get(A) == b""
    assert A in store
    assert store.nbytes == 0


def test_put_replaces_a_value(make_store: StoreFactory) -> None:
    store = make_store(1000)
    store.put(A, b"first value")
    store.put(A, b"second")
    assert store.get(A) == b"second"
    assert len(store) == 1
    assert store.nbytes == len(b"second")


def test_delete(make_store: StoreFactory) -> None:
    store = make_store(1000)
    store.put(A, b"x" * 10)
    store.put(B, b"y" * 20)
    assert store.delete(A) is True
    assert store.delete(A) is False
    assert store.delete(C) is False
    assert store.get(A) is None
    assert A not in store
    assert store.get(B) == b"y" * 20
    assert store.nbytes == 20


def test_keys_len_nbytes_contains(make_store: StoreFactory) -> None:
    store = make_store(1000)
    assert list(store.keys()) == []
    assert len(store) == 0
    assert store.nbytes == 0
    values = {A: b"a" * 3, B: b"b" * 50, C: b"c" * 7}
    for key, value in values.items():
        store.put(key, value)
    assert sorted(store.keys()) == sorted(values)
    assert len(store) == 3
    assert store.nbytes == sum(map(len, values.values()))
    assert A in store and C in store
    assert D not in store
    assert 123 not in store


def test_clear(make_store: StoreFactory) -> None:
    store = make_store(1000)
    for i in range(10):
        store.put(_key(i), bytes([i]) * (i + 1))
    store.clear()
    assert len(store) == 0
    assert store.nbytes == 0
    assert list(store.keys()) == []
    assert all(store.get(_key(i)) is None for i in range(10))
    assert store.put(A, b"again")
    assert store.get(A) == b"again"


def test_value_larger_than_budget_is_refused(make_store: StoreFactory) -> None:
    store = make_store(100)
    store.put(A, b"a" * 40)
    assert store.put(B, b"b" * 101) is False
    assert store.get(B) is None
    assert B not in store
    assert list(store.keys()) == [A]
    assert store.get(A) == b"a" * 40
    assert store.nbytes == 40


def test_refused_value_keeps_the_old_value_of_its_key(make_store: StoreFactory) -> None:
    store = make_store(100)
    store.put(A, b"old")
    assert store.put(A, b"n" * 101) is False
    assert store.get(A) == b"old"


def test_value_of_exactly_the_budget_fits(make_store: StoreFactory) -> None:
    store = make_store(100)
    store.put(A, b"a" * 30)
    assert store.put(B, b"b" * 100) is True
    assert store.get(B) == b"b" * 100
    assert list(store.keys()) == [B]
    assert store.nbytes == 100


def test_zero_budget_stores_only_empty_values(make_store: StoreFactory) -> None:
    store = make_store(0)
    assert store.put(A, b"x") is False
    assert len(store) == 0
    assert store.put(B, b"") is True


def test_never_exceeds_budget(make_store: StoreFactory) -> None:
    store = make_store(1000)
    sizes = [(i * 37) % 300 + 1 for i in range(60)]
    for i, size in enumerate(sizes):
        assert store.put(_key(i), bytes([i % 256]) * size)
        assert store.nbytes <= 1000
        assert store.nbytes == sum(len(store.get(k) or b"") for k in list(store.keys()))
        assert store.get(_key(i)) == bytes([i % 256]) * size


def test_mru_eviction_order(make_store: StoreFactory) -> None:
    store = make_store(30)
    for key in (A, B, C):
        store.put(key, key[:10].encode())
    assert store.get(A) == A[:10].encode()  # A becomes the most recently used
    store.put(D, b"d" * 10)
    assert set(store.keys()) == {B, C, D}
    store.put(E, b"e" * 10)  # D was the most recent
    assert set(store.keys()) == {B, C, E}
    store.get(B)
    store.put(A, b"a" * 20)  # needs two slots: B, then E
    assert set(store.keys()) == {C, A}


def test_put_evicts_only_what_it_needs(make_store: StoreFactory) -> None:
    store = make_store(100)
    for i in range(10):
        store.put(_key(i), b"v" * 10)
    store.put(A, b"w" * 25)
    assert len(store) == 8
    assert store.nbytes == 95


class _StoreModel:
    """A dict with a byte budget and MRU eviction: what every store must behave like."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.data: dict[str, bytes] = {}  # least to most recently used

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.data.values()))

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            return False
        self.data.pop(key, None)
        while self.nbytes + len(value) > self.max_bytes:
            del self.data[next(reversed(self.data))]
        self.data[key] = value
        return True

    def get(self, key: str) -> bytes | None:
        if key not in self.data:
            return None
        value = self.data.pop(key)
        self.data[key] = value
        return value

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


_KEYS = [_key(i) for i in range(8)]


def test_store_matches_a_dict_model(make_store: StoreFactory) -> None:
    class StoreMachine(RuleBasedStateMachine):
        @initialize(max_bytes=st.sampled_from([0, 1, 40, 100, 250]))
        def create(self, max_bytes: int) -> None:
            self.store = make_store(max_bytes)
            self.model = _StoreModel(max_bytes)

        @rule(key=st.sampled_from(_KEYS), value=st.binary(max_size=120))
        def put(self, key: str, value: bytes) -> None:
            assert self.store.put(key, value) == self.model.put(key, value)

        @rule(key=st.sampled_from(_KEYS))
        def get(self, key: str) -> None:
            assert self.store.get(key) == self.model.get(key)

        @rule(key=st.sampled_from(_KEYS))
        def delete(self, key: str) -> None:
            assert self.store.delete(key) == self.model.delete(key)

        @rule()
        def clear(self) -> None:
            self.store.clear()
            self.model.data.clear()

        @invariant()
        def same_contents(self) -> None:
            if not hasattr(self, "store"):
                return
            assert sorted(self.store.keys()) == sorted(self.model.data)
            assert len(self.store) == len(self.model.data)
            assert self.store.nbytes == self.model.nbytes
            assert self.store.nbytes <= self.model.max_bytes
            for key in _KEYS:
                assert (key in self.store) == (key in self.model.data)

    run_state_machine_as_test(StoreMachine, settings=settings(max_examples=40, stateful_step_count=25, deadline=None))


# -- the disk store -------------------------------------------------------------------------


def _entry_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.tce"))


def test_entry_file_location(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    store.put(A, b"payload")
    path = tmp_path / A[:3] / f"{A}.tce"
    assert store.path(A) == path
    assert path.read_bytes() == b"payload"
    assert _entry_files(tmp_path) == [path]
    store.delete(A)
    assert not path.exists()


def test_eviction_removes_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=100)
    for i in range(20):
        store.put(_key(i), b"z" * 30)
    files = _entry_files(tmp_path)
    assert len(files) == 3
    assert sum(f.stat().st_size for f in files) <= 100
    assert {f.stem for f in files} == set(store.keys())


def test_no_temporary_files_after_writes(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    for i in range(20):
        store.put(_key(i), b"t" * 40)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".tce"] == []


def test_a_second_store_sees_the_first_ones_entries(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, max_bytes=1000)
    first.put(A, b"a" * 100)
    first.put(B, b"b" * 200)
    second = DiskStore(tmp_path, max_bytes=1000)
    assert second.nbytes == 300
    assert sorted(second.keys()) == sorted([A, B])
    assert len(second) == 2
    assert A in second
    assert second.get(B) == b"b" * 200


def test_the_budget_spans_runs(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, max_bytes=500)
    for i in range(4):
        first.put(_key(i), b"f" * 100)
    second = DiskStore(tmp_path, max_bytes=500)
    second.put(E, b"s" * 250)
    assert second.nbytes <= 500
    assert sum(f.stat().st_size for f in _entry_files(tmp_path)) <= 500
    assert second.get(E) == b"s" * 250
    third = DiskStore(tmp_path, max_bytes=500)
    assert third.nbytes == sum(f.stat().st_size for f in _entry_files(tmp_path))


def test_earlier_entries_are_ordered_by_modification_time(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, max_bytes=1000)
    for key in (A, B, C):
        first.put(key, b"m" * 100)
    now = time.time()
    for age, key in [(300, B), (200, C), (100, A)]:  # A is the most recently used
        os.utime(first.path(key), (now - age, now - age))
    second = DiskStore(tmp_path, max_bytes=300)
    second.put(D, b"n" * 100)
    assert sorted(second.keys()) == sorted([B, C, D])
    assert not first.path(A).exists()


def test_first_put_of_a_new_store_counts_earlier_entries(tmp_path: Path) -> None:
    DiskStore(tmp_path, max_bytes=1000).put(A, b"x" * 80)
    second = DiskStore(tmp_path, max_bytes=100)
    second.put(B, b"y" * 80)
    assert second.nbytes == 80
    assert len(_entry_files(tmp_path)) == 1


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stale_temporary_files_are_removed_on_scan(tmp_path: Path) -> None:
    DiskStore(tmp_path, max_bytes=1000).put(A, b"entry")
    sub = tmp_path / A[:3]
    stale = sub / f".{A}.1234.deadbeef.tmp"
    fresh = sub / f".{B}.1234.cafecafe.tmp"
    almost = sub / f".{C}.1234.0badf00d.tmp"
    for path in (stale, fresh, almost):
        path.write_bytes(b"partial")
    _age(stale, 2 * 3600)
    _age(almost, 3000)
    store = DiskStore(tmp_path, max_bytes=1000)
    assert store.nbytes == len(b"entry")
    assert not stale.exists()
    assert fresh.exists()
    assert almost.exists()
    assert store.get(A) == b"entry"


def test_clear_keeps_non_entry_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=10_000)
    for i in range(5):
        store.put(_key(i), b"e" * 10)
    sub = tmp_path / _key(0)[:3]
    keep = [
        tmp_path / "meta.json",
        tmp_path / "README",
        tmp_path / f"{_key(9)}.tce",  # an entry name, but not inside a subdirectory
        sub / "notes.txt",
        sub / "ABCDEF.tce",  # not a lowercase hex key
        sub / "xyz.tce",
        sub / f"{_key(8)}.tce.bak",
        sub / f".{_key(7)}.99.fresh.tmp",
        tmp_path / "other" / "data.bin",
    ]
    for path in keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"keep me")
    # an entry left by another run is an entry, and is removed
    foreign = tmp_path / _key(6)[:3] / f"{_key(6)}.tce"
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_bytes(b"another run")
    store.clear()
    assert all(path.read_bytes() == b"keep me" for path in keep)
    assert not foreign.exists()
    assert [p for p in _entry_files(tmp_path) if p not in keep] == []
    assert len(store) == 0
    assert store.nbytes == 0


def test_a_directory_at_an_entry_path_is_a_miss_and_not_counted(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    store.path(A).mkdir(parents=True)
    store.put(B, b"b" * 10)
    assert store.get(A) is None
    assert A not in store
    assert list(store.keys()) == [B]
    assert store.nbytes == 10


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores file modes")
def test_reading_an_unreadable_file_raises_store_error(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    store.put(A, b"secret")
    store.path(A).chmod(0)
    try:
        with pytest.raises(StoreError):
            store.get(A)
    finally:
        store.path(A).chmod(0o644)


def test_failed_write_raises_store_error_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    store.path(A).mkdir(parents=True)
    (store.path(A) / "child").write_bytes(b"")
    with pytest.raises(StoreError):
        store.put(A, b"data")
    assert [p.name for p in store.path(A).parent.iterdir()] == [store.path(A).name]


def test_disk_store_with_lru_policy(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=30, policy=LruPolicy())
    for key in (A, B, C):
        store.put(key, b"l" * 10)
    store.get(A)
    store.put(D, b"l" * 10)
    assert sorted(store.keys()) == sorted([A, C, D])


def test_repr_shows_root_limit_and_usage(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1234)
    store.put(A, b"r" * 56)
    text = repr(store)
    assert str(tmp_path) in text
    assert "1234" in text
    assert "56" in text


def test_keys_iterator_is_a_snapshot(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    for i in range(5):
        store.put(_key(i), b"k")
    keys: Iterator[str] = store.keys()
    store.clear()
    assert sorted(keys) == sorted(_key(i) for i in range(5))


# -- planted files --------------------------------------------------------------------------


def _call_with_deadline(fn: Callable[[], object], seconds: float = 30.0) -> object:
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return in time."""
    result: list[object] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the call did not return within {seconds} s")
    if errors:
        raise errors[0]
    return result[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_at_an_entry_path_is_a_miss_without_blocking(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    store.path(A).parent.mkdir(parents=True)
    os.mkfifo(store.path(A))
    try:
        assert _call_with_deadline(lambda: store.get(A)) is None
        assert A not in store
        assert store.put(A, b"entry")  # the rename replaces the FIFO
        assert store.get(A) == b"entry"
    finally:
        if stat.S_ISFIFO(os.lstat(store.path(A)).st_mode):  # release a reader stuck on it
            os.close(os.open(store.path(A), os.O_RDWR | os.O_NONBLOCK))


def _framed(length: int) -> Callable[[bytes], int]:
    """A framing whose 8-byte prefix holds the whole length, little-endian."""

    def frame_length(prefix: bytes) -> int:
        if len(prefix) < 8:
            raise CorruptEntryError("truncated")
        return int.from_bytes(prefix[:8], "little")

    return frame_length


def test_a_file_whose_size_disagrees_with_its_prefix_is_refused_after_reading_the_prefix(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=10**12, frame_length=_framed(8), prefix_size=8)
    store.put(A, (20).to_bytes(8, "little") + b"x" * 12)
    assert store.get(A) == (20).to_bytes(8, "little") + b"x" * 12
    giant = store.path(B)
    giant.parent.mkdir(parents=True, exist_ok=True)
    with open(giant, "wb") as file:  # a sparse 1 GiB file that declares 20 bytes
        file.write((20).to_bytes(8, "little"))
        file.truncate(1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptEntryError, match="prefix declares 20"):
            store.get(B)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    (tmp_path / C[:3]).mkdir(exist_ok=True)
    with open(store.path(C), "wb") as file:  # too short for a prefix
        file.write(b"short")
        file.truncate(1 << 20)
    with open(store.path(C), "r+b") as file:
        file.write(b"\x00" * 8)
    with pytest.raises(CorruptEntryError, match="prefix declares 0"):
        store.get(C)
    store.put(D, b"tiny")  # small files are read whole, and checked by their reader
    assert store.get(D) == b"tiny"


def test_rejected_entries_are_removed(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_bytes=1000)
    store.put(A, b"bad")
    assert store.reject(A) is True
    assert not store.path(A).exists() and A not in list(store.keys())
    assert store.reject(A) is True  # already gone


def test_a_rejected_entry_that_cannot_be_removed_is_skipped_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchcache.stores.disk as disk_module

    store = DiskStore(tmp_path, max_bytes=1000)
    store.put(A, b"bad entry")
    store.put(B, b"good entry")
    real_unlink = os.unlink

    def read_only_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EROFS, "Read-only file system", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(disk_module.os, "unlink", read_only_unlink)
    assert store.reject(A) is False
    assert store.path(A).exists()
    reads: list[int] = []
    real_pread = os.pread
    monkeypatch.setattr(disk_module.os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    assert store.get(A) is None
    assert DiskStore(tmp_path, max_bytes=1000).get(A) is None  # another store of this process too
    assert reads == []
    assert store.get(B) == b"good entry"
    monkeypatch.setattr(disk_module.os, "unlink", real_unlink)
    store.put(A, b"rewritten")  # a new file at the path is read again
    assert store.get(A) == b"rewritten"


def test_eviction_goes_on_past_an_entry_it_cannot_remove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchcache.stores.disk as disk_module

    store = DiskStore(tmp_path, max_bytes=20)
    store.put(A, b"a" * 10)
    store.put(B, b"b" * 10)
    real_unlink = os.unlink

    def stuck_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path) == str(store.path(B)):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(disk_module.os, "unlink", stuck_unlink)
    assert store.put(C, b"c" * 10)  # MRU: B is the victim, cannot go; A goes next
    assert store.get(C) == b"c" * 10
