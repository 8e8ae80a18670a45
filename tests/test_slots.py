"""The slot store of RAM tiers: round trips, budget, damage, hostile files, processes, kills."""

from __future__ import annotations

import errno
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import REPO
from torchcache import CachedDataset, CacheWarning
from torchcache.datasets import cache as sample_cache
from torchcache.datasets.decode import decode_rows, decode_samples, frame_head
from torchcache.datasets.encode import encode_sample
from torchcache.datasets.keys import store_key
from torchcache.datasets.tiers import SampleTier
from torchcache.errors import StoreError
from torchcache.faults import FaultLog
from torchcache.stores import slots as slots_module
from torchcache.stores.packed.store import PackedStore
from torchcache.stores.slots import SLOTS_NAME, SlotStore, slot_layout

SIZE = 100


def frame(index: int, size: int = SIZE) -> bytes:
    """A frame whose bytes name its index (its head is 35 bytes, as a small sample's)."""
    return bytes((index * 7 + k) % 251 for k in range(size))


class Reports(list[tuple[str, str]]):
    def __call__(self, kind: str, message: str) -> None:
        self.append((kind, message))


def make(directory: Path, length: int = 50, max_bytes: int = 10**6) -> tuple[SlotStore, Reports]:
    reports = Reports()
    return SlotStore(directory, length, max_bytes, reports), reports


def read_all(store: SlotStore, indices: list[int]) -> dict[int, bytes]:
    found, buf = store.read(indices)
    at, stride, size = store.frame_at, store.stride, store.frame_size
    return {indices[p]: bytes(buf[j * stride + at : j * stride + at + size]) for j, p in enumerate(found)}


def test_frames_come_back_by_index_and_other_indices_miss(tmp_path: Path) -> None:
    store, reports = make(tmp_path)
    assert not store.ready and store.read([1, 2]) == ([], bytearray())
    assert store.create(SIZE, 35)
    assert store.put_many([(i, frame(i)) for i in range(0, 50, 2)], 10**6) == 0
    asked = [4, 5, -1, 50, 10**9, 48, 4]
    assert read_all(store, asked) == {4: frame(4), 48: frame(48)}
    assert len(store) == 25 and 4 in store and 5 not in store and "4" not in store
    assert (store.frame_at + 35) % 16 == 0 and store.stride % 16 == 0  # the sample's data is aligned
    assert reports == []
    store.close()


def test_a_second_store_opens_the_file_and_keeps_its_frame_size(tmp_path: Path) -> None:
    first, _ = make(tmp_path)
    second, _ = make(tmp_path)
    assert first.create(SIZE, 35) and second.attach() and second.frame_size == SIZE
    third, _ = make(tmp_path)
    assert third.create(SIZE + 16, 3) and third.frame_size == SIZE  # the file that exists wins
    third.put_many([(1, frame(1, SIZE + 16)), (2, frame(2))], 10**6)  # the other size is passed over
    assert read_all(first, [1, 2]) == {2: frame(2)}
    for store in (first, second, third):
        store.close()


def test_slots_stop_at_the_budget_and_the_file_stays_within_it(tmp_path: Path) -> None:
    _, stride, slots_at = slot_layout(SIZE, 35, 50)
    budget = slots_at + 10 * stride + stride // 2
    store, _ = make(tmp_path, max_bytes=budget)
    assert store.create(SIZE, 35) and store.capacity == 10
    assert store.put_many([(i, frame(i)) for i in range(6)], budget) == 0
    assert store.put_many([(i, frame(i)) for i in range(6)], budget) == 0  # already there: nothing taken
    assert store.put_many([(i, frame(i)) for i in range(6, 12)], budget) == 2
    assert len(store) == 10 and store.nbytes <= budget
    assert os.stat(tmp_path / SLOTS_NAME).st_size <= budget
    assert store.put_many([(30, frame(30))], slots_at + 5 * stride) == 1  # a smaller limit from the tier
    store.close()


def test_a_budget_without_room_for_the_table_makes_no_file(tmp_path: Path) -> None:
    store, reports = make(tmp_path, length=10**6, max_bytes=10**5)
    assert not store.create(SIZE, 35) and not (tmp_path / SLOTS_NAME).exists() and reports == []


@pytest.mark.parametrize("damage", ["frame", "checksum", "table-swap", "table-past-the-end"])
def test_damage_is_a_miss_never_a_wrong_frame(tmp_path: Path, damage: str) -> None:
    store, reports = make(tmp_path)
    store.create(SIZE, 35)
    store.put_many([(i, frame(i)) for i in range(10)], 10**6)
    table, slots = store._table, store._slots
    assert table is not None and slots is not None
    if damage == "frame":
        slots[int(table[3]) - 1, store.frame_at + 17] ^= 1
    elif damage == "checksum":
        slots[int(table[3]) - 1, 0] ^= 0x80
    elif damage == "table-swap":
        table[3] = table[4]
    else:
        table[3] = store.capacity + 1
    assert read_all(store, list(range(10))) == {i: frame(i) for i in range(10) if i != 3}
    assert (len(reports) == 1 and "damaged" in reports[0][1]) == (damage != "table-past-the-end")
    assert 3 not in store or damage == "table-past-the-end"
    assert store.put_many([(3, frame(3))], 10**6) == 0 or damage == "table-past-the-end"
    store.close()


def write_header(path: Path, **changes: Any) -> None:
    """Rewrite a valid slot file's header with some fields changed (and a valid checksum unless told)."""
    import struct

    import xxhash

    head = struct.Struct("<8sIIIIQQQQ")
    data = bytearray(path.read_bytes())
    names = ["magic", "version", "frame_size", "frame_at", "stride", "length", "capacity", "table_at", "slots_at"]
    fields = dict(zip(names, head.unpack_from(data)))
    fields.update({k: v for k, v in changes.items() if k in fields})
    packed = head.pack(*(fields[n] for n in names))
    data[: head.size] = packed
    check = xxhash.xxh3_64_intdigest(packed) ^ (1 if changes.get("bad_check") else 0)
    data[head.size : head.size + 8] = struct.pack("<Q", check)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "hostile",
    ["magic", "version", "checksum", "length", "capacity", "frame_at", "truncated", "symlink", "fifo", "directory"],
)
def test_a_hostile_file_is_left_alone_with_a_report(tmp_path: Path, hostile: str) -> None:
    made, _ = make(tmp_path)
    made.create(SIZE, 35)
    made.put_many([(1, frame(1))], 10**6)
    made.close()
    path = tmp_path / SLOTS_NAME
    changes: dict[str, Any] = {
        "magic": {"magic": b"NOTSLOTS"},
        "version": {"version": 2},
        "checksum": {"bad_check": True},
        "length": {"length": 51},
        "capacity": {"capacity": 10**9},
        "frame_at": {"frame_at": 3},
    }.get(hostile, {})
    if changes:
        write_header(path, **changes)
    elif hostile == "truncated":
        os.truncate(path, os.stat(path).st_size // 2)
    else:
        path.rename(tmp_path / "elsewhere")
        if hostile == "symlink":
            path.symlink_to(tmp_path / "elsewhere")
        elif hostile == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
    store, reports = make(tmp_path)
    assert not store.ready and not store.usable
    assert len(reports) == 1 and "not used" in reports[0][1]
    assert store.read([1]) == ([], bytearray()) and store.put_many([(2, frame(2))], 10**6) == 0
    assert not store.create(SIZE, 35)


def test_a_file_cut_short_after_it_was_opened_is_an_error_not_a_crash(tmp_path: Path) -> None:
    store, _ = make(tmp_path)
    store.create(SIZE, 35)
    store.put_many([(1, frame(1))], 10**6)
    os.truncate(tmp_path / SLOTS_NAME, 8192)
    with pytest.raises(StoreError, match="cut short"):
        store.read([1])
    store.close()


def test_a_writer_that_dies_between_claim_and_publish_leaves_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = make(tmp_path)
    store.create(SIZE, 35)
    store.put_many([(1, frame(1))], 10**6)

    def died(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slots_module, "pwrite_all", died)
    with pytest.raises(OSError):
        store.put_many([(2, frame(2)), (3, frame(3))], 10**6)
    monkeypatch.undo()
    assert read_all(store, [1, 2, 3]) == {1: frame(1)}
    assert store.put_many([(2, frame(2))], 10**6) == 0  # slots are not reused: the next one is taken
    assert read_all(store, [1, 2, 3]) == {1: frame(1), 2: frame(2)}
    store.close()


def _writer(directory: str, worker: int, rounds: int, queue: Any) -> None:
    store = SlotStore(directory, 400, 10**7, lambda kind, message: queue.put(message))
    rng = np.random.default_rng(worker)
    wrong = 0
    for _ in range(rounds):
        picked = rng.choice(400, 16, replace=False).tolist()
        if not store.ready:
            store.create(SIZE, 35)
        store.put_many([(i, frame(i)) for i in picked], 10**7)
        wrong += sum(data != frame(i) for i, data in read_all(store, picked).items())
    queue.put(wrong)
    store.close()


def test_four_processes_writing_and_reading_overlapping_indices(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_writer, args=(str(tmp_path), w, 40, queue)) for w in range(4)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(60)
    assert results == [0, 0, 0, 0]  # no report (a string) and no wrong frame
    store, reports = make(tmp_path, length=400, max_bytes=10**7)
    assert store.attach()
    everything = read_all(store, list(range(400)))
    assert len(everything) > 300 and all(data == frame(i) for i, data in everything.items())
    assert store.nbytes <= 10**7 and reports == []
    store.close()


KILLED_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from tests.test_slots import frame
    from torchcache.stores.slots import SlotStore
    store = SlotStore({directory!r}, 2000, 10**8, lambda kind, message: None)
    store.create(100, 35)
    i = 0
    while True:
        store.put_many([(j % 2000, frame(j % 2000)) for j in range(i, i + 7)], 10**8)
        i += 7
        print(i, flush=True)
    """
)


def test_writers_killed_at_random_moments_leave_every_entry_right_or_a_miss(tmp_path: Path) -> None:
    script = KILLED_WRITER.format(repo=str(REPO), directory=str(tmp_path))
    rng = np.random.default_rng(5)
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        for _ in range(int(rng.integers(1, 40))):
            child.stdout.readline()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        store, reports = make(tmp_path, length=2000, max_bytes=10**8)
        found = read_all(store, list(range(2000)))
        assert found and all(data == frame(i) for i, data in found.items()) and reports == []
        store.close()


# -- the tier and the cache --------------------------------------------------------------------
def test_a_full_file_system_turns_the_tier_writes_off_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PackedStore(tmp_path / "store", 10**6)
    tier = SampleTier("memory", store, 10**6, FaultLog("full"), SlotStore(tmp_path, 10, 10**6, lambda k, m: None))

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slots_module, "pwrite_all", full)
    sample = encode_sample((torch.zeros(4), 1))
    with pytest.warns(CacheWarning, match="No space left"):
        tier.put_many([(store_key(1), sample)])
        tier.faults.emit()
    assert not tier.writable and len(tier) == 0
    tier.close()


def _pwrite_fault(kind: str) -> Any:
    real = os.pwrite
    calls: list[int] = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(1)
        if len(calls) > 1000:  # a loop waiting for progress would never end: stop it here
            raise RuntimeError("pwrite was called 1000 times and wrote nothing")
        if kind == "no progress":
            return 0
        if kind == "short, then ENOSPC" and len(calls) == 1:
            return real(fd, bytes(data)[: len(data) // 2], offset)
        code = errno.EIO if kind == "EIO" else errno.ENOSPC
        raise OSError(code, os.strerror(code))

    pwrite.calls = calls  # type: ignore[attr-defined]
    return pwrite


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO", "short, then ENOSPC", "no progress"])
def test_a_failing_slot_write_is_an_error_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    store, _ = make(tmp_path)
    assert store.create(SIZE, 35)
    assert store.put_many([(i, frame(i)) for i in range(5)], 10**6) == 0
    fault = _pwrite_fault(kind)
    monkeypatch.setattr(slots_module.os, "pwrite", fault)
    with pytest.raises(OSError) as caught:
        store.put_many([(i, frame(i)) for i in range(5, 10)], 10**6)
    assert caught.value.errno in (errno.ENOSPC, errno.EIO) and len(fault.calls) < 10
    monkeypatch.undo()
    assert read_all(store, list(range(10))) == {i: frame(i) for i in range(5)}  # none of the failed batch
    assert len(store) == 5
    store.close()


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO", "no progress"])
def test_a_failing_slot_write_warns_and_the_tier_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    store = PackedStore(tmp_path / "store", 10**6)
    tier = SampleTier("memory", store, 10**6, FaultLog("full"), SlotStore(tmp_path, 10, 10**6, lambda k, m: None))
    samples = {i: encode_sample((torch.full((4,), float(i)), i)) for i in range(4)}
    tier.put_many([(store_key(i), samples[i]) for i in range(2)])
    monkeypatch.setattr(slots_module.os, "pwrite", _pwrite_fault(kind))
    with pytest.warns(CacheWarning):
        tier.put_many([(store_key(i), samples[i]) for i in range(2, 4)])
        tier.faults.emit()
    monkeypatch.undo()
    assert tier.slots is not None and not tier.writable
    assert read_all(tier.slots, list(range(4))) == {i: bytes(samples[i]) for i in range(2)}  # nothing half-written
    tier.close()


def test_a_slot_file_whose_table_has_no_pages_gets_them_or_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maker, _ = make(tmp_path)
    assert maker.create(SIZE, 35)
    maker.close()
    path = tmp_path / SLOTS_NAME
    data = path.read_bytes()
    path.unlink()
    with path.open("wb") as file:  # the same file, sparse: its table has no pages
        file.write(data[:4096])
        file.truncate(len(data))
    assert os.stat(path).st_blocks * 512 < maker.slots_at
    monkeypatch.setattr(slots_module.os, "posix_fallocate", _pwrite_fault("ENOSPC"))
    store, reports = make(tmp_path)
    assert not store.ready and not store.usable and "pages" in reports[0][1]  # never written through the map
    monkeypatch.undo()
    store, reports = make(tmp_path)
    assert store.ready and reports == [] and os.stat(path).st_blocks * 512 >= store.slots_at
    assert store.put_many([(1, frame(1))], 10**6) == 0 and read_all(store, [1]) == {1: frame(1)}
    store.close()


class Opener:
    """Opens a tier's packed store when called, and counts the calls; ``fail`` raises instead."""

    def __init__(self, directory: Path, fail: bool = False) -> None:
        self.directory, self.fail, self.calls = directory, fail, 0

    def __call__(self) -> PackedStore:
        self.calls += 1
        if self.fail:
            raise StoreError(f"cannot create the store directory {self.directory}: Permission denied")
        return PackedStore(self.directory, 10**6)


def test_a_tier_opens_its_store_only_for_what_is_not_in_its_slots(tmp_path: Path) -> None:
    def tier(opener: Opener) -> SampleTier:
        return SampleTier("memory", opener, 10**6, FaultLog("lazy"), SlotStore(tmp_path, 10, 10**6, lambda k, m: None))

    samples = {i: encode_sample((torch.full((4,), float(i)), i)) for i in range(10)}
    writer = tier(Opener(tmp_path / "store"))
    writer.put_many([(store_key(i), samples[i]) for i in range(6)] + [("ab" * 8 + "cd", b"other")])
    assert writer._opener is not None and writer._opener.calls == 1  # the budget counts the store
    reader_opener = Opener(tmp_path / "store")
    reader = tier(reader_opener)  # as in another process
    slots = reader.slots_ready()
    assert slots is not None
    found, buf = reader.read_slots(list(range(10)))
    assert found == list(range(6)) and reader_opener.calls == 0
    assert decode_rows(buf, 6, slots.stride, slots.frame_at, slots.frame_size)[3][1] == 3
    reader.flush()
    assert reader_opener.calls == 0
    assert reader.get_many(["ab" * 8 + "cd"]) == [b"other"] and reader_opener.calls == 1
    assert len(reader) == 7 and reader_opener.calls == 1
    for each in (writer, reader):
        each.close()


def test_a_miss_leaves_the_store_closed_until_a_sample_goes_there(tmp_path: Path) -> None:
    def tier(opener: Opener) -> SampleTier:
        return SampleTier("memory", opener, 10**6, FaultLog("spill"), SlotStore(tmp_path, 10, 10**6, lambda k, m: None))

    writer_opener, reader_opener = Opener(tmp_path / "store"), Opener(tmp_path / "store")
    writer, reader = tier(writer_opener), tier(reader_opener)  # as in two processes
    writer.put_many([(store_key(i), encode_sample((torch.full((4,), float(i)), i))) for i in range(4)])
    assert writer_opener.calls == 0  # every sample went to the slots
    assert reader.slots_ready() is not None and reader.read_slots([0, 9])[0] == [0]
    assert reader.get_many([store_key(9), "ab" * 9]) == [None, None] and "ab" * 9 not in reader
    assert reader_opener.calls == 0
    writer.put_many([("ab" * 9, b"not an index"), (store_key(5), encode_sample(torch.zeros(3)))])  # other sizes
    assert reader.get_many([store_key(5), "ab" * 9]) == [encode_sample(torch.zeros(3)), b"not an index"]
    assert "ab" * 9 in reader and reader_opener.calls == 1
    for each in (writer, reader):
        each.close()


def test_a_store_that_cannot_be_opened_leaves_the_slots_working(tmp_path: Path) -> None:
    opener = Opener(tmp_path / "store", fail=True)
    tier = SampleTier("memory", opener, 10**6, FaultLog("lazy"), SlotStore(tmp_path, 10, 10**6, lambda k, m: None))
    with pytest.warns(CacheWarning, match="cannot open the memory tier's store .*Permission denied.*only its slots"):
        tier.put_many([(store_key(i), encode_sample((torch.zeros(4), i))) for i in range(4)] + [("ab" * 8, b"x")])
        tier.faults.emit()
    assert tier.writable and opener.calls == 1
    assert tier.read_slots([0, 3, 5])[0] == [0, 1]
    assert tier.get_many(["ab" * 8]) == [None] and "ab" * 8 not in tier
    assert len(tier) == 4 and tier.nbytes > 0 and tier.used() == tier.nbytes
    tier.drop("ab" * 8)
    assert opener.calls == 1  # not tried again
    tier.close()


def test_samples_of_other_sizes_go_to_the_packed_store(tmp_path: Path) -> None:
    class Varied(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> Any:
            return torch.full((1 + i % 3, 4), float(i)), i

    data = CachedDataset(Varied(), max_memory_size="1MB")
    first = [data[i] for i in range(12)]
    again = [data[i] for i in range(12)]
    for i, (x, label) in enumerate(again):
        assert label == i and torch.equal(x, first[i][0]) and x.shape == (1 + i % 3, 4)
    stats = data.stats()
    assert stats.hits == 12 and stats.memory.entries == 12
    assert data.cache.memory_dir is not None
    assert len(PackedStore(data.cache.memory_dir, "1MB")) == 8  # two of the three shapes
    data.close()


def test_decode_rows_builds_alike_frames_and_declines_others() -> None:
    samples = [(torch.arange(6, dtype=torch.int16).reshape(2, 3) + i, i, f"s{i}") for i in range(5)]
    frames = [encode_sample(s) for s in samples]
    size, head = len(frames[0]), frame_head(frames[0])
    assert head is not None
    at = 16 + (-head % 16)
    stride = -(-(at + size) // 16) * 16
    buf = bytearray(stride * len(frames))
    for j, f in enumerate(frames):
        buf[j * stride + at : j * stride + at + size] = f
    built = decode_rows(buf, len(frames), stride, at, size)
    assert built is not None
    for (x, i, s), (y, j, t) in zip(samples, built):
        assert torch.equal(x, y) and i == j and s == t
    assert decode_rows(buf, len(frames), stride, at + 1, size) is None  # not a frame there
    other = encode_sample((torch.zeros(3, 2, dtype=torch.int16), 0, "s0"))  # same size, another header
    buf[stride + at : stride + at + size] = other
    assert decode_rows(buf, len(frames), stride, at, size) is None
    assert decode_samples([bytes(buf[j * stride + at : j * stride + at + size]) for j in range(2)])[1][0].shape == (
        3,
        2,
    )


def test_samples_of_one_size_and_several_structures_share_the_slots() -> None:
    class Shapes(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> Any:
            return torch.full((2, 6) if i % 2 else (3, 4), float(i)), i  # one frame size, two headers

    data = CachedDataset(Shapes(), max_memory_size="1MB")
    first = data.__getitems__(list(range(10)))
    again = data.__getitems__(list(range(10)))  # from the slots, built one by one
    assert data.stats().memory.hits == 10
    assert data.cache.memory_dir is not None and len(PackedStore(data.cache.memory_dir, "1MB")) == 0
    for i, ((x, a), (y, b)) in enumerate(zip(first, again)):
        assert a == b == i and torch.equal(x, y) and y.shape == ((2, 6) if i % 2 else (3, 4))
    data.close()


def every_kind(i: int) -> dict[str, Any]:
    """A sample with a leaf of every kind, its frame of one size whatever ``i``."""
    return {
        "bf16": torch.full((2, 3), i + 0.5, dtype=torch.bfloat16),  # a dtype numpy lacks
        "f32": np.full((3,), -i, np.float32),
        "half": np.float16(i / 4),
        "text": f"\u00e9\udcff{chr(65 + i % 26)}",  # a lone surrogate too
        "raw": bytes([i % 256]) * 3,
        "number": float("nan") if i % 2 else i + 0.25,
        "c": complex(i, -i),
        "rest": (None, True, [i, 2.5]),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_every_kind_of_value_comes_back_from_the_slots_as_a_copy_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    class Kinds(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, i: int) -> Any:
            return every_kind(i)

    data = CachedDataset(Kinds(), max_memory_size="1MB")
    data.__getitems__(list(range(9)))
    with monkeypatch.context() as patch:  # one read of the slots, built as views of it, not one by one
        patch.setattr(sample_cache, "decode_samples", None)
        served = data.__getitems__([8, 0, 3, 5])
    assert data.stats().memory.hits == 4
    assert all(same(sample, every_kind(i)) for i, sample in zip([8, 0, 3, 5], served))
    served[1]["bf16"].add_(7)  # a transform that writes in place
    served[1]["f32"][:] = 99
    assert same(data.__getitems__([0, 3])[0], every_kind(0))  # the cache is as it was
    assert data.stats().memory.hits == 6
    data.close()


def test_a_file_system_without_fallocate_gets_its_pages_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(*args: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    store, reports = make(tmp_path, length=3000)
    assert store.create(SIZE, 35) and reports == []
    assert os.stat(tmp_path / SLOTS_NAME).st_blocks * 512 >= store.slots_at  # header and table written
    store.put_many([(2999, frame(2999))], 10**6)
    assert read_all(store, [2999]) == {2999: frame(2999)}
    store.close()


def test_a_slot_that_passes_its_checksum_but_is_not_a_sample_is_a_warning_and_a_recompute() -> None:
    data = CachedDataset([(torch.full((4,), float(i)), i) for i in range(6)], max_memory_size="1MB")
    data.__getitems__(list(range(6)))
    assert data.cache.memory_dir is not None
    planted = SlotStore(data.cache.memory_dir, 6, 10**6, report=lambda kind, message: None)
    assert planted.attach()
    planted.drop(3)
    planted.put_many([(3, b"\xff" * planted.frame_size)], 10**6)  # a valid slot holding no sample frame
    planted.close()
    with pytest.warns(CacheWarning, match="damaged"):
        samples = data.__getitems__(list(range(6)))
    assert [label for _, label in samples] == list(range(6)) and torch.equal(samples[3][0], torch.full((4,), 3.0))
    assert data.stats().memory.hits == 5
    assert data[3][1] == 3 and data.stats().memory.hits == 6  # written again, a hit
    data.close()


def test_int_keys_outside_the_dataset_skip_the_slots_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    from torchcache import SampleCache

    cache = SampleCache("outside", max_memory_size="1MB", info={"length": 4})
    keys = [2, 2**63 + 5, -3, 4]
    first = cache.get_many(keys, lambda missing: [torch.full((2,), float(k % 97)) for k in missing])
    again = cache.get_many(keys, lambda missing: pytest.fail(f"computed {missing}"))
    assert [float(x[0]) for x in first] == [float(x[0]) for x in again] == [float(k % 97) for k in keys]
    assert not [w for w in recwarn if issubclass(w.category, CacheWarning)]
    assert cache.memory_dir is not None and len(PackedStore(cache.memory_dir, "1MB")) == 3  # only 2 is in a slot
    cache.close()
