"""The RAM tier of a dataset: its rows file, the packed store beside it, damage and faults, hostile files."""

from __future__ import annotations

import contextlib
import errno
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import fault_under, pwrite_fault
from torchcache import CachedDataset, CacheWarning
from torchcache._cgroup import memory_limit
from torchcache.datasets import tiers as sample_tiers
from torchcache.datasets.decode import decode_rows, decode_samples, frame_head
from torchcache.datasets.encode import encode_sample
from torchcache.datasets.keys import store_key
from torchcache.datasets.rows import ROWS_NAME, SampleRows
from torchcache.datasets.shm import default_memory_size
from torchcache.datasets.tiers import SampleTier
from torchcache.errors import StoreError
from torchcache.faults import FaultLog
from torchcache.stores.packed.store import PackedStore
from torchcache.stores.rows import RowsFile
from torchcache.stores.rows import file as rows_module


class Reports(list[tuple[str, str]]):
    def __call__(self, kind: str, message: str) -> None:
        self.append((kind, message))


def rows(directory: Path, length: int = 10, max_bytes: int = 10**6) -> SampleRows:
    return SampleRows(directory, length, max_bytes, lambda kind, message: None)


def read_all(file: RowsFile, indices: list[int]) -> dict[int, bytes]:
    found, gathered, _, _ = file.read(np.asarray(indices, np.int64))
    at, size = file.row_at, file.row_size
    return {indices[p]: bytes(gathered[j, at : at + size]) for j, p in enumerate(found.tolist())}


def test_a_full_file_system_turns_the_tier_writes_off_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PackedStore(tmp_path, 10**6)
    tier = SampleTier("memory", store, 10**6, FaultLog("full"), rows(tmp_path))

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rows_module, "pwrite_all", full)
    sample = encode_sample((torch.zeros(4), 1))
    with pytest.warns(CacheWarning, match="No space left"):
        tier.put_many([(store_key(1), sample)])
        tier.faults.emit()
    assert not tier.writable and len(tier) == 0
    tier.close()


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO", "no progress"])
def test_a_failing_slot_write_warns_and_the_tier_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    store = PackedStore(tmp_path, 10**6)
    tier = SampleTier("memory", store, 10**6, FaultLog("full"), rows(tmp_path))
    samples = {i: encode_sample((torch.full((4,), float(i)), i)) for i in range(4)}
    tier.put_many([(store_key(i), samples[i]) for i in range(2)])
    fault_under(monkeypatch, tmp_path, "pwrite", pwrite_fault(kind))
    with pytest.warns(CacheWarning):
        tier.put_many([(store_key(i), samples[i]) for i in range(2, 4)])
        tier.faults.emit()
    monkeypatch.undo()
    assert tier.slots is not None and tier.slots.file is not None and not tier.writable
    assert read_all(tier.slots.file, list(range(4))) == {i: bytes(samples[i]) for i in range(2)}  # nothing half-written
    tier.close()


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
        return SampleTier("memory", opener, 10**6, FaultLog("lazy"), rows(tmp_path))

    samples = {i: encode_sample((torch.full((4,), float(i)), i)) for i in range(10)}
    writer = tier(Opener(tmp_path))
    writer.put_many([(store_key(i), samples[i]) for i in range(6)] + [("ab" * 8 + "cd", b"other")])
    assert writer._opener is not None and writer._opener.calls == 1  # the budget counts the store
    reader_opener = Opener(tmp_path)
    reader = tier(reader_opener)  # as in another process
    slots = reader.slots_ready()
    assert slots is not None
    found, gathered, _, _ = slots.read(np.arange(10))
    assert found.tolist() == list(range(6)) and reader_opener.calls == 0
    built = decode_rows(gathered.reshape(-1).data, 6, slots.stride, slots.row_at, slots.row_size)
    assert built is not None and built[3][1] == 3
    reader.flush()
    assert reader_opener.calls == 0
    assert reader.get_many(["ab" * 8 + "cd"]) == [b"other"] and reader_opener.calls == 1
    assert len(reader) == 7 and reader_opener.calls == 1
    for each in (writer, reader):
        each.close()


def test_a_miss_leaves_the_store_closed_until_a_sample_goes_there(tmp_path: Path) -> None:
    def tier(opener: Opener) -> SampleTier:
        return SampleTier("memory", opener, 10**6, FaultLog("spill"), rows(tmp_path))

    writer_opener, reader_opener = Opener(tmp_path), Opener(tmp_path)
    writer, reader = tier(writer_opener), tier(reader_opener)  # as in two processes
    writer.put_many([(store_key(i), encode_sample((torch.full((4,), float(i)), i))) for i in range(4)])
    assert writer_opener.calls == 0  # every sample went to the slots
    ready = reader.slots_ready()
    assert ready is not None and ready.read(np.asarray([0, 9])).found.tolist() == [0]
    assert reader.get_many([store_key(9), "ab" * 9]) == [None, None] and "ab" * 9 not in reader
    assert reader_opener.calls == 0
    writer.put_many([("ab" * 9, b"not an index"), (store_key(5), encode_sample(torch.zeros(3)))])  # other sizes
    assert reader.get_many([store_key(5), "ab" * 9]) == [encode_sample(torch.zeros(3)), b"not an index"]
    assert "ab" * 9 in reader and reader_opener.calls == 1
    for each in (writer, reader):
        each.close()


def test_a_store_that_cannot_be_opened_leaves_the_slots_working(tmp_path: Path) -> None:
    opener = Opener(tmp_path, fail=True)
    tier = SampleTier("memory", opener, 10**6, FaultLog("lazy"), rows(tmp_path))
    with pytest.warns(CacheWarning, match="cannot open the memory tier's store .*Permission denied.*only its rows"):
        tier.put_many([(store_key(i), encode_sample((torch.zeros(4), i))) for i in range(4)] + [("ab" * 8, b"x")])
        tier.faults.emit()
    assert tier.writable and opener.calls == 1
    assert tier.slots is not None and tier.slots.file is not None
    assert tier.slots.file.read(np.asarray([0, 3, 5])).found.tolist() == [0, 1]
    assert tier.get_many(["ab" * 8]) == [None] and "ab" * 8 not in tier
    assert len(tier) == 4 and tier.nbytes == tier.slots.file.nbytes > 0
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
        patch.setattr(sample_tiers, "decode_samples", None)
        served = data.__getitems__([8, 0, 3, 5])
    assert data.stats().memory.hits == 4
    assert all(same(sample, every_kind(i)) for i, sample in zip([8, 0, 3, 5], served))
    served[1]["bf16"].add_(7)  # a transform that writes in place
    served[1]["f32"][:] = 99
    assert same(data.__getitems__([0, 3])[0], every_kind(0))  # the cache is as it was
    assert data.stats().memory.hits == 6
    data.close()


def test_a_slot_that_passes_its_checksum_but_is_not_a_sample_is_a_warning_and_a_recompute() -> None:
    data = CachedDataset([(torch.full((4,), float(i)), i) for i in range(6)], max_memory_size="1MB")
    data.__getitems__(list(range(6)))
    assert data.cache.memory_dir is not None
    planted = RowsFile.open(data.cache.memory_dir / ROWS_NAME)
    planted.unmark([3])
    planted.write(np.asarray([3]), np.full((1, planted.row_size), 0xFF, np.uint8))  # a valid row, not a frame
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


@pytest.mark.parametrize("hostile", ["garbage", "another length", "directory"])
def test_a_rows_file_not_of_this_dataset_is_left_alone_with_one_report(tmp_path: Path, hostile: str) -> None:
    path = tmp_path / ROWS_NAME
    if hostile == "garbage":
        path.write_bytes(b"TCROWS01" + bytes(5000))
    elif hostile == "another length":
        RowsFile.create(path, {"kind": "samples"}, 11, 64).close()
    else:
        path.mkdir()
    reports = Reports()
    slots = SampleRows(tmp_path, 10, 10**6, reports)
    assert slots.file is None and not slots.usable
    assert len(reports) == 1 and "is not used" in reports[0][1]
    tier = SampleTier("memory", PackedStore(tmp_path, 10**6), 10**6, FaultLog("hostile"), slots)
    tier.put_many([(store_key(i), encode_sample((torch.zeros(4), i))) for i in range(3)])
    assert slots.file is None and len(tier) == 3 and len(reports) == 1  # in the packed store, reported once
    assert tier.get_many([store_key(1)]) == [encode_sample((torch.zeros(4), 1))]
    tier.close()


@pytest.mark.parametrize(
    ("blocks", "bfree", "bavail", "kept"),
    [(100_000, 80_000, 20_000, True), (100_000, 80_000, 5_000, False), (0, 0, 0, True)],
    ids=["held-back-room", "held-back-full", "no-size"],
)
def test_the_free_quarter_of_a_ram_tier_counts_only_what_this_user_can_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: int, bfree: int, bavail: int, kept: bool
) -> None:
    # 100,000 blocks, of which the host holds back bfree - bavail: 20,000 free of 40,000 usable
    # leaves more than a quarter, 5,000 of 25,000 does not; neither is a quarter of all blocks.
    # A file system of no blocks has no size (ramfs, tmpfs with size=0): no reserve to keep.
    statvfs = os.statvfs

    def held_back(path: Any) -> os.statvfs_result:
        if not str(path).startswith(str(tmp_path)):
            return statvfs(path)
        return os.statvfs_result((4096, 4096, blocks, bfree, bavail, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", held_back)
    tier = SampleTier("memory", PackedStore(tmp_path, 10**6), 10**6, FaultLog("held back"), reserve_in=tmp_path)
    tier.put_many([(store_key(i), encode_sample((torch.zeros(4), i))) for i in range(3)])
    assert (len(tier), tier.full) == ((3, False) if kept else (0, True))
    tier.close()
    expected = min(32 * 10**9, (memory_limit() or 1 << 62) // 4)  # the RAM, or the container's limit
    if blocks:
        expected = min(expected, (blocks - bfree + bavail) * 4096 // 2)
    assert default_memory_size(tmp_path) == expected


class _Vectors(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randn(n, 1024, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


def test_ram_tiers_of_default_budgets_leave_a_quarter_of_their_file_system_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, total = tmp_path / "shm", 8 << 20  # an 8 MiB /dev/shm, as small as Docker's
    shm.mkdir()
    monkeypatch.setenv("TORCHCACHE_SHM_DIR", str(shm))
    statvfs = os.statvfs

    def used() -> int:
        return sum(p.stat().st_blocks * 512 for p in shm.rglob("*") if p.is_file())

    def small(path: Any) -> os.statvfs_result:
        if not str(path).startswith(str(shm)):
            return statvfs(path)
        free = max(0, total - used()) // 4096
        return os.statvfs_result((4096, 4096, total // 4096, free, free, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", small)
    train, val = CachedDataset(_Vectors(900, 1), version="train"), CachedDataset(_Vectors(900, 2), version="val")
    for data, source in ((train, _Vectors(900, 1)), (val, _Vectors(900, 2))):  # each budget: half of 8 MiB
        for start in range(0, 900, 50):
            batch = data.__getitems__(list(range(start, start + 50)))
            assert all(torch.equal(x, source[start + j][0]) for j, (x, _) in enumerate(batch))
    assert used() <= total * 3 // 4 + 50 * 4200  # a batch's samples may be the last to go in
    assert train.stats().memory.entries > 0 and val.stats().memory.entries > 0
    train.close()
    val.close()


def test_a_ram_tier_dropped_without_close_lets_go_of_its_directory() -> None:
    import gc

    from torchcache import CachedDataset

    def held(where: str) -> int:  # descriptors of files of the RAM tiers (lock files: a hold each)
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
                name = os.readlink(f"/proc/self/fd/{fd}")
                found += name.endswith("job.lock") if where == "locks" else name.startswith(where)
        return found

    class Tiny(torch.utils.data.Dataset[Any]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> Any:
            return torch.full((2,), float(i))

    def let_go_of_collected() -> None:  # as the next RAM tier opened or closed in the process does
        CachedDataset(Tiny(1), max_memory_size="1MB").close()

    data = CachedDataset(Tiny(3), max_memory_size="1MB")
    directory = data.cache.memory_dir
    assert directory is not None and torch.equal(data[1], torch.full((2,), 1.0))
    del data
    gc.collect()
    let_go_of_collected()
    assert not directory.exists()  # its last user let go: removed, as close() removes it
    root = str(directory.parent.parent)  # the RAM tiers of every job of this user
    before = held("locks"), held(root)
    for n in range(4, 44):  # datasets of other lengths: a RAM tier each
        CachedDataset(Tiny(n), max_memory_size="1MB")[0]
    gc.collect()
    let_go_of_collected()
    assert (held("locks"), held(root)) == before  # no hold, rows file or map kept per dataset dropped


def test_a_hold_collected_while_the_ram_tiers_lock_is_held_does_not_deadlock(tmp_path: Path) -> None:
    import threading

    from torchcache.datasets import shm

    job = tmp_path / "job"
    shm.hold(job)
    shm.hold(job / "cache")
    done = threading.Event()

    def collected_inside_a_hold() -> None:  # a collection pass run by an allocation inside hold()
        with shm._lock:
            shm._let_go(job, "cache", os.getpid())
        done.set()

    threading.Thread(target=collected_inside_a_hold, daemon=True).start()
    assert done.wait(30)
    assert (job / "cache").exists()  # let go of at the next hold or release, not inside the lock
    shm.hold(tmp_path / "other")  # the next hold lets go of it first
    assert not job.exists()
    shm.release(tmp_path / "other")
