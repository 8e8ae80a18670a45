"""CachedDataset and SampleCache: tiers, DataLoader workers (fork and spawn), budgets, faults, killed processes."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests import zygote
from tests.helpers import REPO, python_env, refuse_reading, run_python
from tests.store_helpers import charged
from torchcache import CachedDataset, CacheWarning, SampleCache
from torchcache.datasets.dataset import MissingSampleError
from torchcache.datasets.decode import decode_sample, frame_head
from torchcache.datasets.encode import SampleTypeError, encode_sample
from torchcache.datasets.keys import fingerprint_dataset, store_key
from torchcache.datasets.rows import ROWS_NAME
from torchcache.datasets.shm import LOCK_NAME, job_id
from torchcache.datasets.tiers import SampleTier, segment_bytes
from torchcache.errors import ConfigError, KeyingError
from torchcache.faults import FaultLog
from torchcache.stores.packed.format import HEADER
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES, PackedStore
from torchcache.stores.rows import Geometry, RowsFile

pytestmark = pytest.mark.usefixtures("reads_counted")  # the tests here count the dataset's reads


@pytest.fixture(autouse=True)
def shm_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own root of RAM tiers, in RAM where it can be.

    A root on the disk of the test's temporary directory would make the RAM tier's
    reserve (a quarter of its file system kept free) depend on how full that disk is.
    """
    ram = Path("/dev/shm")
    if ram.is_dir() and os.access(ram, os.W_OK | os.X_OK):
        root = Path(tempfile.mkdtemp(prefix="torchcache-test-", dir=ram))
    else:
        root = tmp_path / "shm"
        root.mkdir()
    monkeypatch.setenv("TORCHCACHE_SHM_DIR", str(root))
    for name in ("TORCHCACHE_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "calls.log"


class Numbers(Dataset[Any]):
    """Sample ``i`` is ``(a tensor filled with i % 251, i)``; every call appends ``i`` to a log file."""

    def __init__(self, n: int, log: Path, shape: tuple[int, ...] = (3, 4, 4)) -> None:
        # The log as a plain string: a Path would be keyed by its file's size and mtime, which calls change.
        self.n, self.log, self.shape = n, str(log), shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with open(self.log, "a") as file:  # O_APPEND: whole lines from every process
            file.write(f"{i}\n")
        return expected(i, self.shape), i


class Killing(Numbers):
    """Kills its own process (SIGKILL) the first time it computes sample ``kill_at``."""

    def __init__(self, n: int, log: Path, kill_at: int, flag: Path) -> None:
        super().__init__(n, log)
        self.kill_at, self.flag = kill_at, str(flag)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.kill_at and not os.path.exists(self.flag):
            Path(self.flag).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class FakeImage:
    """Stands in for a PIL image."""


FakeImage.__module__ = "PIL.Image"


class Labelled(Dataset[Any]):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        return torch.ones(2), {"label": FakeImage()}


def expected(i: int, shape: tuple[int, ...] = (3, 4, 4)) -> torch.Tensor:
    return torch.full(shape, i % 251, dtype=torch.uint8)


def calls(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def check_batch(images: torch.Tensor, labels: torch.Tensor) -> list[int]:
    for image, label in zip(images, labels.tolist()):
        assert torch.equal(image, expected(label, tuple(image.shape)))
    return list(labels.tolist())


def stored_samples(directory: Path, length: int) -> Iterator[tuple[int, Any]]:
    """Every entry of a tier's store and slots, decoded, by index (checks the store's own consistency)."""
    store = PackedStore(directory, 10**9)
    assert store.verify().ok
    for key in sorted(store.keys()):
        frame = store.get(key)
        assert frame is not None
        yield int(key, 16), decode_sample(frame)
    if not (directory / ROWS_NAME).exists():
        return
    rows = RowsFile.open(directory / ROWS_NAME)
    found, gathered, _, damaged = rows.read(np.arange(length))
    assert damaged == []
    at, size = rows.row_at, rows.row_size
    for j, index in enumerate(found.tolist()):
        yield index, decode_sample(bytes(gathered[j, at : at + size]))
    rows.close()


def fail(key: object) -> Any:
    raise AssertionError(f"computed {key!r}, which should be cached")


# -- DataLoader workers ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("context", "persistent"),
    [("fork", False), ("fork", True), ("spawn", True)],  # spawned workers made again each epoch add nothing new
    ids=["fork-new-workers", "fork-persistent", "spawn-persistent"],
)
def test_a_second_epoch_computes_nothing(log: Path, context: str, persistent: bool) -> None:
    n = 40
    data = CachedDataset(Numbers(n, log), max_memory_size="1MB")
    assert data[0][1] == 0  # the stores are open in this process when the workers start
    loader = DataLoader(
        data, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context=context, persistent_workers=persistent
    )
    for _ in range(2):
        seen = [label for images, labels in loader for label in check_batch(images, labels)]
        assert sorted(seen) == list(range(n))
        assert sorted(calls(log)) == list(range(n))  # the second epoch adds no call
    stats = data.stats()  # counted in the workers, summed here
    assert (stats.misses, stats.hits, stats.memory.hits, stats.memory.entries) == (n, n + 1, n + 1, n)
    del loader
    gc.collect()
    data.close()


@pytest.mark.slow
def test_the_memory_budget_holds_across_workers(log: Path) -> None:
    n, shape = 120, (3, 16, 16)
    budget = 40_000  # about 40 of the 120 samples
    data = CachedDataset(Numbers(n, log, shape), max_memory_size=budget)
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork")
    for _ in range(2):
        assert sorted(label for images, labels in loader for label in check_batch(images, labels)) == list(range(n))
    stats = data.stats()
    assert stats.memory.max_bytes == budget
    assert 0.25 * n < stats.memory.entries < n / 2
    assert stats.memory.bytes <= budget
    assert data.cache.memory_dir is not None
    cached = dict(stored_samples(data.cache.memory_dir, n))
    assert len(cached) == stats.memory.entries
    for i, sample in cached.items():
        assert torch.equal(sample[0], expected(i, shape)) and sample[1] == i
    data.close()


def test_half_the_room_serves_a_fixed_half_from_the_cache(log: Path) -> None:
    n, shape = 100, (3, 16, 16)
    room = len(encode_sample((expected(0, shape), 0))) + 15 + 16 + 96
    data = CachedDataset(Numbers(n, log, shape), max_memory_size=int(room * n / 2 / 0.99))
    loader = DataLoader(data, batch_size=10, shuffle=True)
    computed = []
    for _ in range(3):
        before = len(calls(log))
        for images, labels in loader:
            check_batch(images, labels)
        computed.append(sorted(calls(log)[before:]))
    assert computed[0] == list(range(n))
    assert 0.4 * n <= n - len(computed[1]) <= 0.6 * n
    assert computed[2] == computed[1]  # the same samples stay cached: nothing is rewritten
    stats = data.stats()
    assert stats.memory.entries == n - len(computed[1])
    assert stats.hits == 2 * stats.memory.entries
    data.close()


def test_the_transform_runs_after_the_cache_at_every_access(log: Path) -> None:
    def noisy(sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        return sample[0].float() + torch.rand(sample[0].shape), sample[1]

    data = CachedDataset(Numbers(8, log), transform=noisy)
    first, second = data[3], data[3]
    assert not torch.equal(first[0], second[0])
    for image, label in (first, second, *data.__getitems__([3, 3])):
        assert label == 3 and bool(((image - 3) >= 0).all() and ((image - 3) < 1).all())
    assert calls(log) == [3]
    cached = data.cache.get(3, fail)
    assert cached[0].dtype == torch.uint8 and torch.equal(cached[0], expected(3))
    data.close()


# -- the disk tier -----------------------------------------------------------------
@pytest.mark.slow
def test_a_disk_tier_removed_while_in_use_is_not_made_again_by_dataloader_workers(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(24, log), tmp_path / "cache", max_memory_size=0)
    directory = data.cache.directory
    assert directory is not None and (directory / "torchcache.json").is_file()
    shutil.rmtree(directory)  # `torchcache clear` while the job runs
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # each worker says its disk tier is gone
        assert sorted(label for images, labels in loader for label in check_batch(images, labels)) == list(range(24))
    assert not directory.exists()  # not a store without its metadata
    data.close()


_GONE_WITH_WORKERS = """
import shutil, sys, torch
from torch.utils.data import DataLoader
from torchcache import CachedDataset

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return torch.full((4,), i * i), i

if __name__ == "__main__":
    data = CachedDataset(Squares(), sys.argv[1], max_memory_size=0)
    shutil.rmtree(data.cache.directory)  # `torchcache clear` while the job runs
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context=sys.argv[2])
    print(sorted(int(i) for _, ids in loader for i in ids) == list(range(32)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_fault_every_dataloader_worker_meets_is_one_warning(tmp_path: Path, context: str) -> None:
    script = tmp_path / "gone.py"
    script.write_text(_GONE_WITH_WORKERS)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), context],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split()[-1] == "True", done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "CacheWarning" in line and "is gone" in line]
    assert len(warned) == 1, done.stderr[-3000:]


@pytest.mark.slow
def test_a_warmed_disk_cache_copied_elsewhere_serves_without_the_dataset(tmp_path: Path, log: Path) -> None:
    cache_dir = tmp_path / "cache"
    data = CachedDataset(Numbers(30, log), cache_dir, max_memory_size=0)
    stats = data.warmup(num_workers=0, progress=False)
    assert stats.misses == 30 and stats.disk is not None and stats.disk.entries == 30
    meta = data.cache.metadata()
    assert meta is not None
    assert (meta["kind"], meta["length"], meta["complete"]) == ("dataset", 30, True)
    assert meta["name"].endswith("Numbers") and meta["max_bytes"] == 50 * 10**9
    fingerprint = data.fingerprint
    data.close()
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(cache_dir, copy)
    shutil.rmtree(cache_dir)
    script = textwrap.dedent(
        """
        import sys, torch
        from torchcache import CachedDataset
        data = CachedDataset(None, sys.argv[1])
        assert len(data) == 30
        for i in range(30):
            image, label = data[i]
            assert label == i and torch.equal(image, torch.full((3, 4, 4), i, dtype=torch.uint8)), i
        stats = data.stats()
        print(stats.disk.hits, stats.misses)
        """
    )
    for where in (copy, copy / fingerprint):
        result = run_python(script, str(where))
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["30", "0"] and "Warning" not in result.stderr
    assert calls(log) == list(range(30))


def test_serving_without_the_dataset_skips_caches_of_a_sample_cache(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(3, log), tmp_path, max_memory_size=0)
    data[0]
    data.close()
    alone = SampleCache("crops", tmp_path, max_memory_size=0, max_disk_size="1MB")
    alone.get("a.jpg", lambda key: 1)
    alone.close()
    served = CachedDataset(None, tmp_path, max_memory_size=0)  # the one dataset cache, not "crops"
    assert served.fingerprint == data.fingerprint and len(served) == 3
    assert served[0][1] == 0
    served.close()


def test_serving_without_the_dataset_names_a_missing_sample(tmp_path: Path, log: Path) -> None:
    cache_dir = tmp_path / "cache"
    for nothing in (tmp_path / "missing", tmp_path):
        with pytest.raises(ConfigError, match="no dataset cache"):
            CachedDataset(None, nothing)
    data = CachedDataset(Numbers(10, log), cache_dir)
    data[2]
    data.close()
    served = CachedDataset(None, cache_dir)
    assert len(served) == 10 and served[2][1] == 2 and served[-8][1] == 2
    with pytest.raises(MissingSampleError, match="sample 5 is not in the cache"):
        served[5]
    served.close()
    other = CachedDataset(Numbers(11, log), cache_dir)
    other[0]
    other.close()
    with pytest.raises(ConfigError, match="2 dataset caches"):
        CachedDataset(None, cache_dir)


def test_serving_without_the_dataset_refuses_a_length_no_dataset_can_have(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(3, log), tmp_path, max_memory_size=0)
    data[0]
    data.close()
    meta_path = next(tmp_path.glob("*/torchcache.json"))
    meta = json.loads(meta_path.read_text())
    meta["length"] = 2**63  # past what len() can return
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="not a usable dataset cache"):
        CachedDataset(None, tmp_path)


class _OneLarge(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((300_000 if i == 0 else 100,), i % 7, dtype=torch.uint8)  # sample 0: past the budget


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_sample_too_large_for_the_budget_does_not_stop_the_caching_of_the_others(tmp_path: Path, where: str) -> None:
    if where == "disk":
        cached = CachedDataset(_OneLarge(), tmp_path, max_memory_size=0, max_disk_size="200KB")
    else:
        cached = CachedDataset(_OneLarge(), max_memory_size="200KB")
    for i in [0, *range(1, 50), *range(1, 50)]:
        assert torch.equal(cached[i], _OneLarge()[i])
    assert cached.stats().hits == 49  # every small sample the second time
    cached.close()


@pytest.mark.slow
def test_warmup_fills_in_parallel_and_resumes(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(50, log), tmp_path / "cache")
    data[3], data[7]
    meta = data.cache.metadata()
    assert meta is not None and "complete" not in meta
    data.warmup(num_workers=2, batch_size=8, progress=False)
    assert sorted(calls(log)) == list(range(50))  # 3 and 7 once
    data.warmup(num_workers=2, progress=False)
    assert len(calls(log)) == 50
    meta = data.cache.metadata()
    assert meta is not None and meta["complete"] is True
    assert [data[i][1] for i in range(50)] == list(range(50)) and len(calls(log)) == 50
    data.close()


def test_warmup_fills_the_ram_tier_and_the_disk_tier(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(20, log), tmp_path / "cache", max_memory_size="10MB")
    data[3]  # in both tiers already
    stats = data.warmup(num_workers=0, progress=False)
    assert stats.memory is not None and stats.disk is not None
    assert (stats.memory.entries, stats.disk.entries) == (20, 20) and sorted(calls(log)) == list(range(20))
    data.close()


def test_warmup_shows_progress_with_or_without_tqdm(
    tmp_path: Path, log: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = CachedDataset(Numbers(12, log), max_memory_size="1MB")
    data.warmup(num_workers=0, batch_size=5)
    assert "12/12" in capsys.readouterr().err  # tqdm's bar
    data.close()
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed
    data = CachedDataset(Numbers(13, log), max_memory_size="1MB")
    data.warmup(num_workers=0, batch_size=5)
    assert capsys.readouterr().err.strip().endswith("torchcache warmup: 13/13 samples")
    data.close()


# -- killed processes -------------------------------------------------------------
# The DataLoader learns of the killed worker either from its watchdog (RuntimeError) or
# from the tensor it was handing over (ConnectionResetError or EOFError, and an unclosed
# temporary file inside torch's fd sharing that Python reports as unraisable): each is
# the kill.
# Its SIGCHLD handler, which would raise the same RuntimeError again at any later
# bytecode (even inside pytest.raises while it matches the first error), is silenced.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning")
def test_a_worker_killed_mid_epoch_leaves_every_cached_sample_right(
    tmp_path: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils.data._utils import signal_handling

    monkeypatch.setattr(signal_handling, "_error_if_any_worker_fails", lambda: None)
    flag = tmp_path / "killed"
    data = CachedDataset(Killing(60, log, kill_at=30, flag=flag), tmp_path / "cache", max_memory_size="1MB")
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork")
    with pytest.raises((RuntimeError, ConnectionError, EOFError)):
        for images, labels in loader:
            check_batch(images, labels)
    assert flag.exists()
    del loader
    gc.collect()
    for directory in (data.cache.memory_dir, data.cache.directory):
        assert directory is not None
        found = dict(stored_samples(directory, 60))
        assert 0 < len(found) < 60
        for i, (image, label) in found.items():
            assert label == i and torch.equal(image, expected(i))
    before = len(calls(log))
    again = [label for images, labels in DataLoader(data, batch_size=4) for label in check_batch(images, labels)]
    assert again == list(range(60))
    assert len(calls(log)) - before == 60 - len(found)  # only what the disk tier lacked
    data.close()


JOB = textwrap.dedent(
    """
    import os, signal, sys, torch
    from torch.utils.data import Dataset
    from torchcache import CachedDataset

    class Ones(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            print("computed", i, flush=True)
            return torch.ones(2) * i

    data = CachedDataset(Ones(), max_memory_size="1MB", check_samples=False)  # its computed samples counted
    for i in range(4):
        assert torch.equal(data[i], torch.ones(2) * i)
    print("job", data.cache.job_dir, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "wait":
        sys.stdin.readline()
    """
)


def job_dir_of(output: str) -> Path:
    return Path(next(line for line in output.splitlines() if line.startswith("job ")).split(" ", 1)[1])


@pytest.mark.slow
def test_the_leftovers_of_a_killed_job_go_at_the_next_start(shm_root: Path, tmp_path: Path) -> None:
    killed = run_python(JOB, "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftover = job_dir_of(killed.stdout)
    assert (leftover / LOCK_NAME).exists() and len(list(leftover.iterdir())) == 2  # the lock and one dataset

    exited = run_python(JOB, "exit")
    assert exited.returncode == 0, exited.stderr
    assert not job_dir_of(exited.stdout).exists()  # removed at exit
    assert not leftover.exists()  # removed when that job started

    killed = run_python(JOB, "kill")
    leftover = job_dir_of(killed.stdout)
    env = python_env()
    live = zygote.start(["-c", JOB, "wait"], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert live.stdout is not None
        lines = [live.stdout.readline() for _ in range(5)]
        running = job_dir_of("".join(lines))
        cache = SampleCache("mine", max_memory_size="1MB")  # a start in this process sweeps too
        assert not leftover.exists() and running.exists()
        cache.close()
    finally:
        live.communicate("\n", timeout=60)
    assert live.returncode == 0
    assert not running.exists()  # removed when its job ended


@pytest.mark.slow
def test_processes_of_one_job_share_the_ram_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHCACHE_JOB_ID", "shared job/1")
    assert job_id().startswith("job-")
    env = python_env()
    first = zygote.start(["-c", JOB, "wait"], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert first.stdout is not None
        shared = job_dir_of("".join(first.stdout.readline() for _ in range(5)))
        second = run_python(JOB, "exit")
        assert second.returncode == 0, second.stderr
        assert "computed" not in second.stdout and job_dir_of(second.stdout) == shared
        assert shared.exists()  # the first process still uses it
    finally:
        first.communicate("\n", timeout=60)
    assert not shared.exists()
    monkeypatch.delenv("TORCHCACHE_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert job_id() == f"elastic-none-{os.getppid()}"


def test_closing_one_cache_frees_its_ram_tier_while_the_job_goes_on(log: Path) -> None:
    first = CachedDataset(Numbers(6, log), max_memory_size="1MB")
    second = CachedDataset(Numbers(7, log), max_memory_size="1MB")
    twin = CachedDataset(Numbers(7, log), max_memory_size="1MB")  # the same cache, one more user
    for data in (first, second, twin):
        data[1]
    assert first.cache.memory_dir is not None and second.cache.memory_dir is not None
    assert first.cache.memory_dir.parent == second.cache.memory_dir.parent  # one job
    assert first.cache.memory_dir.exists() and second.cache.memory_dir.exists()
    first.close()
    assert not first.cache.memory_dir.exists()  # its RAM is given back now
    second.close()
    assert second.cache.memory_dir.exists()  # the twin still uses it
    assert twin[1][1] == 1 and twin.stats().memory.hits == 2  # type: ignore[union-attr]
    twin.close()
    assert not second.cache.memory_dir.exists() and not second.cache.memory_dir.parent.exists()


# -- keys, indices, fingerprints ------------------------------------------------------
def test_indices_are_normalized_and_checked(log: Path) -> None:
    data = CachedDataset(Numbers(5, log), max_memory_size="1MB")
    assert data[-1][1] == 4 and data[np.int64(2)][1] == 2 and data[torch.tensor(1)][1] == 1
    for bad in (5, -6):
        with pytest.raises(IndexError, match="out of range"):
            data[bad]
    with pytest.raises(TypeError, match="integers"):
        data["1"]  # type: ignore[index]
    assert calls(log) == [4, 2, 1]
    data.close()


def test_fingerprints_follow_torchs_default_dtype(log: Path) -> None:
    data = Numbers(3, log)
    as_float32 = fingerprint_dataset(data)
    torch.set_default_dtype(torch.float64)  # torch.tensor([0.5]) in __getitem__ makes float64 samples now
    try:
        as_float64 = fingerprint_dataset(data)
    finally:
        torch.set_default_dtype(torch.float32)
    assert as_float64 != as_float32 and fingerprint_dataset(data) == as_float32


def test_fingerprints_follow_class_attributes_length_and_version(tmp_path: Path, log: Path) -> None:
    base = fingerprint_dataset(Numbers(5, log))
    assert fingerprint_dataset(Numbers(5, log)) == base
    others = [Numbers(6, log), Numbers(5, tmp_path / "other.log"), Numbers(5, log, (2, 2)), Killing(5, log, 1, log)]
    for other in others:
        assert fingerprint_dataset(other) != base
    assert fingerprint_dataset(Numbers(5, log), version=2) != base
    data = CachedDataset(Numbers(5, log), tmp_path / "cache", max_memory_size=0)
    data[0]
    again = CachedDataset(Numbers(5, log), tmp_path / "cache", max_memory_size=0)
    again[0]
    fresh = CachedDataset(Numbers(5, log), tmp_path / "cache", max_memory_size=0, version="v2")
    fresh[0]
    assert calls(log) == [0, 0]
    for each in (data, again, fresh):
        each.close()


class Mapped(Dataset[Any]):
    """Rows of an ``np.load(path, mmap_mode="r")`` array."""

    def __init__(self, rows: np.ndarray[Any, Any]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        return self.rows[i]


def test_fingerprints_of_a_memory_mapped_file_follow_the_file_then_what_it_maps_once_removed(tmp_path: Path) -> None:
    def mapped(name: str, values: Any) -> np.ndarray[Any, Any]:
        np.save(tmp_path / name, np.asarray(values, np.float32))
        return np.load(tmp_path / name, mmap_mode="r")  # type: ignore[no-any-return]

    one = mapped("one.npy", [[1, 2], [3, 4]])
    base = fingerprint_dataset(Mapped(one))
    assert fingerprint_dataset(Mapped(np.load(tmp_path / "one.npy", mmap_mode="r"))) == base  # by the file
    assert fingerprint_dataset(Mapped(one[1:])) != base  # another view of it
    rewritten = mapped("one.npy", [[1, 2], [3, 5]])
    assert fingerprint_dataset(Mapped(rewritten)) != base
    (tmp_path / "one.npy").unlink()  # removed while mapped: its content keys it, as an array's would
    other = mapped("other.npy", [[1, 2], [3, 6]])
    (tmp_path / "other.npy").unlink()
    keys = {fingerprint_dataset(Mapped(rows)) for rows in (rewritten, rewritten, other)}
    assert len(keys) == 2 and base not in keys


class FromFolder(Dataset[Any]):
    """Reads its samples from files in a folder it holds as a ``Path``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.load(self.root / "part" / f"{i}.npy"))


def test_a_folder_attribute_is_keyed_by_every_file_in_it_and_a_huge_one_asks_for_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "data"
    (folder / "part").mkdir(parents=True)
    for i in range(3):
        np.save(folder / "part" / f"{i}.npy", np.full(2, float(i)))
    data = CachedDataset(FromFolder(folder), tmp_path / "cache", max_memory_size=0)
    assert data[0].tolist() == [0.0, 0.0]
    data.close()
    np.save(folder / "part" / "0.npy", np.full(2, 7.0))  # rewritten in place: the folders' own times stay
    again = CachedDataset(FromFolder(folder), tmp_path / "cache", max_memory_size=0)
    assert again[0].tolist() == [7.0, 7.0]
    again.close()
    elsewhere = tmp_path / "elsewhere"  # a folder linked in is followed
    shutil.move(folder / "part", elsewhere)
    (folder / "part").symlink_to(elsewhere)
    (folder / "loop").symlink_to(folder)  # and a loop ends
    linked = CachedDataset(FromFolder(folder), tmp_path / "cache", max_memory_size=0)
    assert linked[2].tolist() == [2.0, 2.0]
    linked.close()
    np.save(elsewhere / "2.npy", np.full(2, 5.0))
    linked = CachedDataset(FromFolder(folder), tmp_path / "cache", max_memory_size=0)
    assert linked[2].tolist() == [5.0, 5.0]
    linked.close()
    for run in range(2):  # a cache kept inside the folder is not part of its key
        inside = CachedDataset(FromFolder(folder), folder / "cache", max_memory_size=0)
        assert inside[1].tolist() == [1.0, 1.0] and inside.stats().hits == run
        inside.close()
    monkeypatch.setattr("torchcache.canonical.objects.DIRECTORY_ENTRIES", 3)
    with pytest.raises(KeyingError, match=r"FromFolder\.root.*more than 3 files and folders.*version="):
        CachedDataset(FromFolder(folder), tmp_path / "cache")
    assert fingerprint_dataset(FromFolder(folder), version=1) != fingerprint_dataset(FromFolder(folder), version=2)


def test_a_folder_attribute_is_keyed_by_its_subfolders_too_an_empty_one_included(tmp_path: Path) -> None:
    folder = tmp_path / "classes"
    (folder / "cat").mkdir(parents=True)
    (folder / "cat" / "0.jpg").write_bytes(b"an image")
    before = fingerprint_dataset(FromFolder(folder))
    (folder / "bird").mkdir()  # a new class, no images yet: the labels a dataset makes of the folders change
    assert fingerprint_dataset(FromFolder(folder)) != before


def test_a_path_attribute_under_home_or_a_variable_is_keyed_by_the_file_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TC_DATA", str(tmp_path))
    labels = tmp_path / "labels.txt"
    labels.write_text("cat")
    for written in ("~/labels.txt", "$TC_DATA/labels.txt"):
        before = fingerprint_dataset(FromFolder(Path(written)))  # read as Path(...).expanduser() by the dataset
        labels.write_text("emu, a longer label")
        assert fingerprint_dataset(FromFolder(Path(written))) != before
        labels.write_text("cat")


def test_a_disk_tiers_metadata_that_cannot_be_read_is_left_as_it_is(
    tmp_path: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = CachedDataset(Numbers(4, log), tmp_path, max_memory_size=0)
    data[0]
    path = data.cache.directory / "torchcache.json"
    data.close()
    before = path.read_bytes()
    refuse_reading(monkeypatch, path)
    with pytest.warns(CacheWarning, match="Permission denied; left as it is"):
        again = CachedDataset(Numbers(4, log), tmp_path, max_memory_size=0)
        assert again[0][1] == 0 and again[3][1] == 3
    again.close()
    assert path.read_bytes() == before


def test_metadata_that_cannot_be_written_in_its_folder_alone_is_one_warning(
    tmp_path: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = CachedDataset(Numbers(4, log), tmp_path, max_memory_size=0)
    [data[i] for i in range(4)]
    (data.cache.directory / "torchcache.json").write_text("{bad")
    data.close()

    def refused(path: Path, meta: dict[str, Any]) -> None:  # a folder of mode 555 (root writes any)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("torchcache.datasets.opening.write_json_atomic", refused)
    with pytest.warns(CacheWarning, match="cannot write .*Permission denied") as caught:
        again = CachedDataset(Numbers(4, log), tmp_path, max_memory_size=0)
        assert [again[i][1] for i in range(4)] == [0, 1, 2, 3] and again.stats().hits == 4  # every read a hit
    again.close()
    assert len(caught) == 1


def test_a_list_or_a_tensor_is_a_dataset_keyed_by_its_values(tmp_path: Path) -> None:
    assert fingerprint_dataset([1, 2, 3]) == fingerprint_dataset([1, 2, 3])
    assert fingerprint_dataset([1, 2, 3]) != fingerprint_dataset([1, 2, 4])
    assert fingerprint_dataset(torch.arange(4)) != fingerprint_dataset(torch.arange(4) + 1)
    data = CachedDataset([10, 20, 30], tmp_path, max_memory_size=0)
    assert [data[i] for i in range(3)] == [10, 20, 30] and data.stats().misses == 3
    again = CachedDataset([10, 20, 30], tmp_path, max_memory_size=0)
    assert [again[i] for i in range(3)] == [10, 20, 30] and again.stats().hits == 3
    for each in (data, again):
        each.close()


def test_a_bad_sample_type_is_a_clear_error() -> None:
    data = CachedDataset(Labelled(), max_memory_size="1MB")
    with pytest.raises(SampleTypeError, match=r"sample\[1\]\['label'\]: cannot cache a value of type PIL\.Image\.Fake"):
        data[0]
    with pytest.raises(SampleTypeError, match="pil_to_tensor"):
        data.__getitems__([1, 2])
    with pytest.raises(TypeError, match="__len__"):
        CachedDataset(iter([1, 2]))
    data.close()


class BadAt(Numbers):
    """:class:`Numbers`, but sample ``bad`` holds a value that cannot be cached."""

    def __init__(self, n: int, log: Path, bad: int) -> None:
        super().__init__(n, log)
        self.bad = bad

    def __getitem__(self, i: int) -> Any:
        image, label = super().__getitem__(i)
        return (image, {"label": FakeImage()}) if i == self.bad else (image, label)


def test_a_full_tier_encodes_no_sample_but_still_refuses_bad_ones(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchcache.datasets.cache as sample_cache

    frame = encode_sample((expected(0), 0))
    head = frame_head(frame)
    assert head is not None
    geometry = Geometry.of(40, len(frame), head, {"kind": "samples"})
    stride, fixed = geometry.stride, geometry.rows_at
    data = CachedDataset(BadAt(40, log, bad=30), max_memory_size=fixed + 10 * stride)
    assert [label for _, label in data.__getitems__(list(range(20)))] == list(range(20))
    assert data.stats().memory.entries == 10  # the tier is full
    encoded: list[object] = []
    monkeypatch.setattr(sample_cache, "encode_sample", lambda sample: encoded.append(sample) or b"")
    samples = data.__getitems__(list(range(20, 30)))
    assert [label for _, label in samples] == list(range(20, 30))
    for i, (image, _) in zip(range(20, 30), samples):
        assert torch.equal(image, expected(i))
    assert encoded == []  # nothing is encoded for a tier that takes no more
    with pytest.raises(SampleTypeError, match=r"sample\[1\]\['label'\]: cannot cache a value of type PIL"):
        data[30]
    assert data.stats().memory.entries == 10 and calls(log) == list(range(31))
    data.close()


class Collating(Dataset[dict[str, Any]]):
    """A dataset whose ``__getitems__`` gives a collated batch (a dict), not a list of samples."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([i]), "i": i}

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        return {"x": torch.stack([torch.tensor([i]) for i in indices]), "i": list(indices)}


def test_a_getitems_that_collates_is_not_split_into_wrong_samples(tmp_path: Path) -> None:
    data = CachedDataset(Collating(), tmp_path / "cache", max_memory_size=0)
    with pytest.warns(CacheWarning, match=r"Collating\.__getitems__ gave a dict for 2 indices"):
        first = data.__getitems__([2, 3])  # two keys, as two indices: list() of the dict gave the keys
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        later = [data[2], data[5], *data.__getitems__([6, 7])]
    for sample, i in zip([*first, *later], [2, 3, 2, 5, 6, 7]):
        assert sample["i"] == i and torch.equal(sample["x"], torch.tensor([i]))
    data.close()


def test_a_dataset_pickles_without_its_open_files(log: Path) -> None:
    data = CachedDataset(Numbers(6, log), max_memory_size="1MB")
    data[1]
    copy = pickle.loads(pickle.dumps(data))
    assert copy[1][1] == 1 and copy.fingerprint == data.fingerprint
    assert calls(log) == [1]
    copy.close()
    data.close()


# -- SampleCache ----------------------------------------------------------------------
def test_sample_cache_keys_batches_and_stats(tmp_path: Path) -> None:
    cache = SampleCache("words", tmp_path / "cache", max_memory_size="1MB", max_disk_size="1MB", info={"name": "w"})
    asked: list[list[Any]] = []

    def lengths(keys: list[Any]) -> list[Any]:
        asked.append(keys)
        return [{"n": len(str(key))} for key in keys]

    assert cache.get_many(["a", 10, "ccc"], lengths) == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert cache.get_many(["ccc", "dddd", 10], lengths) == [{"n": 3}, {"n": 4}, {"n": 2}]
    assert asked == [["a", 10, "ccc"], ["dddd"]]
    assert "dddd" in cache and 10 in cache and "e" not in cache and 1.5 not in cache
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.memory.hits, stats.memory.entries) == (2, 4, 2, 4)
    assert stats.disk is not None and stats.disk.entries == 4
    meta = cache.metadata()
    assert meta is not None and meta["kind"] == "dataset" and meta["name"] == "w"
    assert store_key(10) == "000000000000000a" and len(store_key(-1)) == len(store_key("10")) == 32
    with pytest.raises(KeyingError):
        store_key(True)
    with pytest.raises(ValueError, match="returned 0 samples"):
        cache.get_many(["zz"], lambda keys: [])
    cache.close()
    reopened = SampleCache("words", tmp_path / "cache", max_memory_size="1MB", max_disk_size="1MB")
    assert reopened.get("ccc", fail) == {"n": 3}
    assert reopened.stats().disk.hits == 1  # type: ignore[union-attr]
    reopened.close()
    nothing = SampleCache("off", max_memory_size=0)
    assert nothing.get(1, lambda key: key) == 1 and 1 not in nothing
    assert nothing.stats().misses == 1 and nothing.stats().disk is None
    nothing.close()


def test_sample_caches_of_one_name_over_other_directories_keep_their_own_ram_tiers(tmp_path: Path) -> None:
    train = SampleCache("clips", tmp_path / "train", max_memory_size="1MB", max_disk_size="1MB")
    val = SampleCache("clips", tmp_path / "val", max_memory_size="1MB", max_disk_size="1MB")
    assert train.get("0001.npy", lambda key: "train") == "train"
    assert val.get("0001.npy", lambda key: "val") == "val"
    assert train.memory_dir != val.memory_dir
    (tmp_path / "x").mkdir()
    again = SampleCache("clips", tmp_path / "x" / ".." / "train", max_memory_size="1MB", max_disk_size="1MB")
    assert again.memory_dir == train.memory_dir and again.get("0001.npy", fail) == "train"  # one directory, spelled
    for cache in (train, val, again):
        cache.close()


def test_a_lower_disk_budget_on_a_later_run_holds_before_anything_is_written(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(200, log, (32, 32)), tmp_path, max_memory_size=0, max_disk_size="1MB")
    data.warmup(num_workers=0, progress=False)
    assert data.stats().disk.entries == 200  # type: ignore[union-attr]
    data.close()
    smaller = CachedDataset(Numbers(200, log, (32, 32)), tmp_path, max_memory_size=0, max_disk_size="100kB")
    stats = smaller.stats().disk
    assert stats is not None and 0 < stats.entries < 200 and stats.bytes <= 100_000
    assert smaller.cache.directory is not None and smaller.cache.metadata()["complete"] is False  # type: ignore[index]
    assert all(torch.equal(smaller[i][0], expected(i, (32, 32))) for i in range(200))
    smaller.close()


def test_serving_without_the_dataset_under_lower_budgets_removes_and_rewrites_nothing(
    tmp_path: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def files_under(root: Path) -> dict[str, bytes]:
        return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}

    data = CachedDataset(Numbers(200, log, (32, 32)), tmp_path, max_memory_size=0, max_disk_size="1MB")
    data.warmup(num_workers=0, progress=False)
    assert data.cache.directory is not None
    directory, meta = data.cache.directory, data.cache.metadata()
    data.close()
    other = CachedDataset(Numbers(50, log, (16, 16)), tmp_path / "other", max_memory_size=0)
    other.warmup(num_workers=0, progress=False)
    other.close()
    shutil.move(str(tmp_path / "other" / other.fingerprint), tmp_path / other.fingerprint)  # two caches, one root
    files = files_under(tmp_path)
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "100kB")  # the root's budget: below either cache
    served = CachedDataset(None, directory, max_memory_size=0, max_disk_size="100kB")  # the samples cannot be made
    assert all(torch.equal(served[i][0], expected(i, (32, 32))) for i in range(200))
    assert served.stats().disk.entries == 200  # type: ignore[union-attr]
    served.warmup(progress=False)  # has every sample: nothing to record either
    served.close()
    assert files_under(tmp_path) == files  # neither cache touched, nor either's torchcache.json
    monkeypatch.delenv("TORCHCACHE_MAX_SIZE")
    again = CachedDataset(None, directory, max_memory_size=0)  # nor did it record its budget for the next reader
    assert again.cache.metadata() == meta and meta is not None and meta["max_bytes"] == 10**6
    assert again.cache.max_disk_size == 10**6
    again.close()


@pytest.mark.parametrize("name", ["", 5, None])
def test_a_sample_cache_without_a_usable_name_is_refused_naming_it(name: Any) -> None:
    with pytest.raises(ConfigError, match=r"^name must be a non-empty string"):
        SampleCache(name)


def test_disk_hits_are_copied_up_to_ram(tmp_path: Path, log: Path) -> None:
    data = CachedDataset(Numbers(4, log), tmp_path / "cache", max_memory_size=0)
    data.warmup(num_workers=0, progress=False)
    data.close()
    data = CachedDataset(Numbers(4, log), tmp_path / "cache", max_memory_size="1MB")
    [data[i] for i in range(4)]
    [data[i] for i in range(4)]
    stats = data.stats()
    assert (stats.disk.hits, stats.memory.hits, stats.misses) == (4, 4, 0)  # type: ignore[union-attr]
    data.close()


def test_a_tier_keeps_what_its_store_holds_when_another_writer_filled_it(tmp_path: Path) -> None:
    budget = 10 * (HEADER.size + 8 + 100 + INDEX_ENTRY_BYTES)  # ten records (8-byte keys) and their index share
    store = PackedStore(tmp_path / "tier", budget, evict="none")
    tier = SampleTier("memory", store, budget, FaultLog("test"))
    store.put_many([(store_key(i), b"o" * 100) for i in range(100, 106)])  # the other process
    tier.put_many([(store_key(i), b"m" * 100) for i in range(8)])
    assert tier.full and charged(store) <= budget
    assert sorted(store.keys()) == sorted(store_key(i) for i in [*range(4), *range(100, 106)])
    tier.put_many([(store_key(50), b"m" * 100)])  # full: nothing more
    assert len(store) == 10
    store.close()


# -- faults ------------------------------------------------------------------------
def test_a_damaged_entry_is_a_warning_and_a_recompute() -> None:
    cache = SampleCache("damaged-entry", max_memory_size="1MB")
    computed: list[str] = []

    def compute(key: str) -> Any:
        computed.append(key)
        return torch.full((4,), len(key))

    cache.get("two", compute)
    assert cache.memory_dir is not None
    PackedStore(cache.memory_dir, "1MB").put_many([(store_key("two"), b"TCSM not a sample")])
    with pytest.warns(CacheWarning, match="damaged"):
        assert torch.equal(cache.get("two", compute), torch.full((4,), 3))
    assert torch.equal(cache.get("two", compute), torch.full((4,), 3))  # rewritten: a hit, no warning
    assert computed == ["two", "two"] and cache.stats().memory.hits == 1
    cache.close()


@pytest.mark.parametrize("where", ["frame", "checksum", "table"])
def test_a_damaged_slot_is_a_warning_and_a_recompute(log: Path, where: str) -> None:
    data = CachedDataset(Numbers(4, log), max_memory_size="1MB")
    data[2]
    assert data.cache.memory_dir is not None
    path = data.cache.memory_dir / ROWS_NAME
    rows = RowsFile.open(path)
    assert 2 in rows
    g, at = rows.geometry, rows.row_offset(2)
    assert at is not None
    data[3]
    raw = path.read_bytes()
    if where == "table":  # the table points at another sample's slot
        offset, new = g.slots_at + 8, raw[g.slots_at + 12 : g.slots_at + 16]
    else:
        offset = at + rows.row_size - 1 if where == "frame" else g.checks_at + 16 + 3
        new = bytes([raw[offset] ^ 0x10])
    rows.close()
    with open(path, "r+b") as file:  # in place: the cache maps the file
        file.seek(offset)
        file.write(new)
    with pytest.warns(CacheWarning, match="damaged"):
        image, label = data[2]
    assert label == 2 and torch.equal(image, expected(2))
    data[2]  # rewritten: a hit, no warning
    assert calls(log).count(2) == 2 and data.stats().memory.hits == 1
    data.close()


@pytest.mark.parametrize("part", ["store", "slots"])
def test_an_unexpected_error_of_a_tier_read_is_a_warning_and_a_recompute(
    log: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    data = CachedDataset(Numbers(4, log), max_memory_size="1MB")

    def get(index: int) -> Any:
        if part == "slots":
            return data[index]
        return data.cache.get(f"name {index}", lambda name: data.dataset[index])  # not an index: the store

    get(1)

    def broken(*args: Any) -> Any:
        raise ValueError("an unforeseen fault")

    if part == "store":
        monkeypatch.setattr(PackedStore, "get_many", broken)
    else:
        monkeypatch.setattr(RowsFile, "read", broken)
    with pytest.warns(CacheWarning, match="ValueError: an unforeseen fault") as record:
        samples = [get(1), get(1)]
    assert len([w for w in record if issubclass(w.category, CacheWarning)]) == 1
    assert all(label == 1 and torch.equal(image, expected(1)) for image, label in samples)
    assert calls(log) == [1, 1, 1]
    monkeypatch.undo()
    assert get(1)[1] == 1 and calls(log) == [1, 1, 1]  # a hit again
    data.close()


def test_a_disk_tier_that_cannot_be_opened_is_a_warning(tmp_path: Path, log: Path) -> None:
    blocked = tmp_path / "cache"
    blocked.mkdir()
    data_dir_name = fingerprint_dataset(Numbers(3, log))
    (blocked / data_dir_name).write_text("a file where the tier's directory should be")
    with pytest.warns(CacheWarning) as record:
        data = CachedDataset(Numbers(3, log), blocked, max_memory_size=0)
        assert [data[i][1] for i in (0, 1, 0)] == [0, 1, 0]
    assert any("cannot open the disk tier" in str(w.message) for w in record)
    assert calls(log) == [0, 1, 0]
    data.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_ram_root_of_another_user_is_refused(shm_root: Path, log: Path) -> None:
    root = shm_root / f"torchcache-{os.getuid()}"
    root.mkdir(parents=True)
    os.chown(root, 12345, -1)
    with pytest.warns(CacheWarning, match="not a directory of this user"):
        data = CachedDataset(Numbers(2, log))
    assert data.cache.memory_dir is None and data[1][1] == 1 and data.stats().memory.max_bytes == 0
    data.close()


def test_a_second_cache_with_a_larger_ram_budget_is_told_it_shares_the_smaller_tier(log: Path) -> None:
    frame = encode_sample(Numbers(64, log)[0])
    head = frame_head(frame)
    assert head is not None
    geometry = Geometry.of(64, len(frame), head, {"kind": "samples"})
    budget = geometry.rows_at + 20 * geometry.stride
    first = CachedDataset(Numbers(64, log), max_memory_size=budget)  # 20 rows
    [first[i] for i in range(64)]
    with pytest.warns(CacheWarning, match="was made for .* samples by an earlier cache of this dataset"):
        second = CachedDataset(Numbers(64, log), max_memory_size="10MB")
        [second[i] for i in range(64)]
    assert second.stats().memory.max_bytes <= budget  # it keeps the tier's budget, as the warning says
    assert first.stats().memory.bytes <= budget and second.stats().memory.bytes <= budget
    own = CachedDataset(Numbers(64, log), max_memory_size="10MB", version="own")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        [own[i] for i in range(64)]
        [own[i] for i in range(64)]
    assert own.stats().memory.hits == 64  # its own tier, of its own size, holds every sample
    for data in (first, second, own):
        data.close()


def test_the_users_ram_root_is_removed_with_its_last_job(shm_root: Path, log: Path) -> None:
    data = CachedDataset(Numbers(2, log), max_memory_size="1MB")
    assert data[1][1] == 1
    root = shm_root / f"torchcache-{os.getuid()}"
    assert root.is_dir() and stat.S_IMODE(root.stat().st_mode) == 0o700
    data.close()
    assert not root.exists()  # no empty directory stays behind in /dev/shm
    again = CachedDataset(Numbers(2, log), max_memory_size="1MB")
    assert again[0][1] == 0 and root.is_dir()
    again.close()


_CLOSED_WHILE_WORKERS_RUN = """
import sys
import torch
from torch.utils.data import DataLoader, Dataset
from torchcache import CachedDataset

class Filled(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((8,), float(i))

if __name__ == "__main__":
    data = CachedDataset(Filled(), max_memory_size="1MB")
    loader = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=sys.argv[1] != "per epoch")
    if sys.argv[1] == "closed first":
        data.close()  # the workers make the RAM tier again
    batches = iter(loader)
    assert next(batches).shape == (4, 8) and next(batches).shape == (4, 8)
    data.close()  # the workers still hold the RAM tier: the process exits with them alive
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["persistent", "per epoch", "closed first"])
def test_a_ram_tier_closed_while_its_workers_run_is_removed_at_exit(
    shm_root: Path, tmp_path: Path, workers: str
) -> None:
    result = run_python(_CLOSED_WHILE_WORKERS_RUN, workers, path=tmp_path / "closed.py")
    assert result.returncode == 0, result.stderr
    assert not any(shm_root.iterdir()), list(shm_root.rglob("*"))  # nothing of the job stays in /dev/shm


def test_a_dataset_cache_logs_its_summary_while_it_is_used(
    log: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, torchcache_logger: Any
) -> None:
    import torchcache.stats as stats

    torchcache_logger.propagate = True
    data = CachedDataset(Numbers(8, log), max_memory_size="1MB")
    data[0]
    assert "hit rate" not in caplog.text  # not before a minute has passed
    monkeypatch.setattr(stats, "SUMMARY_INTERVAL", 0.0)
    with caplog.at_level(logging.INFO, logger="torchcache"):
        data[0]
    line = next(r.getMessage() for r in caplog.records if "hit rate" in r.getMessage())
    assert line.startswith(f"dataset {data.cache.name}")  # the logger's name says torchcache
    assert "1 hit, 1 miss," in line and "memory 1 entry " in line
    data.close()


def test_each_tier_stores_in_segments_of_a_sixteenth_of_its_budget(tmp_path: Path) -> None:
    cache = SampleCache("seg", tmp_path / "disk", max_memory_size="64MB", max_disk_size="2GB")
    cache.get_many([0, 1], lambda keys: [torch.zeros(4) for _ in keys])
    sizes = {tier.name: tier.store.segment_bytes for tier in cache._open()}  # type: ignore[attr-defined]
    assert sizes == {"memory": 64 * 10**6 // 16, "disk": 2 * 10**9 // 16}
    assert segment_bytes(10**12) == 1 << 28  # the largest a segment gets
    cache.close()


def test_bad_arguments_of_a_dataset_cache_are_refused_naming_them(tmp_path: Path) -> None:
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(3))

        def __len__(self) -> int:
            return 3

    with pytest.raises(TypeError, match="map-style"):
        CachedDataset(Stream(), tmp_path)
    with pytest.raises(TypeError, match="transform must be a callable"):
        CachedDataset(Numbers(4, tmp_path / "log"), tmp_path, transform=5)  # type: ignore[arg-type]
    for bad in ("", 123):
        with pytest.raises(ConfigError, match="cache_dir"):
            CachedDataset(Numbers(4, tmp_path / "log"), bad)  # type: ignore[arg-type]
    cache = CachedDataset(Numbers(4, tmp_path / "log"), tmp_path, max_memory_size=0)
    with pytest.raises(TypeError, match="num_workers must be an int"):
        cache.warmup(num_workers="2")  # type: ignore[arg-type]
    cache.close()


class OneElementViews(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.arange(8.0).view(4, 2)
        return table[i : i + 1, 0], torch.arange(4.0)[::2][:1] + i  # one element, strides 2


def test_samples_of_one_element_with_any_stride_are_cached(tmp_path: Path) -> None:
    cache = CachedDataset(OneElementViews(), tmp_path, max_memory_size=0)
    for _ in range(2):
        for i in range(4):
            a, b = cache[i]
            want_a, want_b = OneElementViews()[i]
            assert torch.equal(a, want_a) and torch.equal(b, want_b)
    assert cache.stats().hits == 4
    cache.close()


def test_a_shm_directory_that_does_not_exist_is_not_made_and_the_ram_tier_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-shm"
    monkeypatch.setenv("TORCHCACHE_SHM_DIR", str(missing))
    with pytest.warns(CacheWarning, match="TORCHCACHE_SHM_DIR"):
        data = CachedDataset(Numbers(4, tmp_path / "log"), max_memory_size="1MB")
    samples = [data[i] for i in range(4)]
    assert all(torch.equal(x, expected(i, (3, 4, 4))) and label == i for i, (x, label) in enumerate(samples))
    assert data.stats().memory.entries == 0 and not missing.exists()
    data.close()
