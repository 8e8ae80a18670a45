"""Several processes on one cache directory: concurrent writers, persistence, the disk limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.helpers import (
    REPO,
    Counting,
    assert_all_entries_decode,
    assert_same,
    cached,
    disk_bytes,
    entry_files,
    run_python,
)

PREAMBLE = """
import json, sys, time, torch
from pathlib import Path
from tests.helpers import Counting, cached

def inputs(n, seed):
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))

def report(model, **extra):
    s = model.cache_instance.stats()
    disk = s.disk
    print(json.dumps({"hits": s.hits, "misses": s.misses, "items": model.items,
                      "disk_hits": disk.hits, "disk_entries": disk.entries, "disk_bytes": disk.bytes, **extra}))
"""

WRITER = PREAMBLE + textwrap.dedent(
    """
    n, order_seed, barrier, me = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    x = inputs(n, 11)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(order_seed))
    model = cached(Counting, persistent=True, max_memory_cache_size=0)()
    (barrier / me).touch()
    deadline = time.monotonic() + 60
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.002)  # start writing together
    for start in range(0, n, 16):
        index = order[start : start + 16]
        assert torch.equal(model(x[index]), Counting()(x[index]))
    model.cache_instance.flush()
    report(model)
    """
)


def test_two_processes_writing_at_once_leave_valid_entries(cache_root: Path, tmp_path: Path) -> None:
    n = 240
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(n), str(seed), str(barrier), f"w{seed}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        stats = json.loads(out)
        assert stats["hits"] + stats["misses"] == n

    files = entry_files(cache_root)
    assert len(files) == n
    assert_all_entries_decode(cache_root)
    assert [p for p in cache_root.rglob("*") if p.is_file() and p.suffix not in (".tce", ".json")] == []

    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(11))
    reader = cached(Counting, persistent=True)()
    assert_same(reader(x), Counting()(x))
    stats = reader.cache_instance.stats()
    assert stats.misses == 0
    assert stats.disk is not None and stats.disk.hits == n
    assert reader.items == 0


READER = PREAMBLE + textwrap.dedent(
    """
    x = inputs(int(sys.argv[1]), 21)
    model = cached(Counting, persistent=True)()
    out = model(x)
    report(model, equal=torch.equal(out, Counting()(x)))
    """
)


def test_a_fresh_process_hits_what_another_process_stored(cache_root: Path) -> None:
    n = 50
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(21))
    model = cached(Counting, persistent=True)()
    model(x)
    model.cache_instance.flush()

    result = run_python(READER, str(n))
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["equal"] is True
    assert (stats["hits"], stats["misses"], stats["items"]) == (n, 0, 0)
    assert stats["disk_hits"] == n


SECOND_RUN = PREAMBLE + textwrap.dedent(
    """
    limit, n = int(sys.argv[1]), int(sys.argv[2])
    x = inputs(n, 32)
    model = cached(Counting, persistent=True, max_persistent_cache_size=limit)()
    out = model(x)
    model.cache_instance.flush()
    report(model, equal=torch.equal(out, Counting()(x)))
    """
)


def test_disk_limit_counts_what_an_earlier_run_left(cache_root: Path, tmp_path: Path) -> None:
    probe = cached(Counting, persistent=True, persistent_cache_dir=tmp_path / "probe")()
    probe(torch.randn(8, 4))
    probe.cache_instance.flush()
    size = max(p.stat().st_size for p in entry_files(tmp_path / "probe"))
    limit, n = 20 * size, 16  # each run alone fits; both together do not

    first = cached(Counting, persistent=True, max_persistent_cache_size=limit)()
    first(torch.randn(n, 4, generator=torch.Generator().manual_seed(31)))
    first.cache_instance.flush()
    first_files = set(entry_files(cache_root))
    assert len(first_files) == n
    assert disk_bytes(cache_root) <= limit

    result = run_python(SECOND_RUN, str(limit), str(n))
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["equal"] is True
    assert disk_bytes(cache_root) <= limit
    assert stats["disk_bytes"] == disk_bytes(cache_root)
    assert stats["disk_entries"] == len(entry_files(cache_root))
    # without counting the first run's entries both runs' 2 * n entries would be kept
    assert len(set(entry_files(cache_root)) - first_files) < n
    assert_all_entries_decode(cache_root)


FORKED = PREAMBLE + textwrap.dedent(
    """
    import os, signal, traceback
    x = inputs(200, 41)
    plain = Counting()
    model = cached(Counting, persistent=True, max_memory_cache_size=0)()
    model(x[:100])
    model.cache_instance.flush()
    assert torch.equal(model(x[:100]), plain(x[:100]))  # disk hits: the read pool has threads now
    model(x[150:])  # writes in flight while forking
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hang ends the child (status -14) instead of the test run
        try:
            equal = torch.equal(model(x[100:150]), plain(x[100:150]))  # new items: written by the child
            equal &= torch.equal(model(x[:100]), plain(x[:100]))  # disk hits through a new read pool
            model.cache_instance.flush()
            os._exit(0 if equal else 3)
        except BaseException:
            traceback.print_exc()
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    model.cache_instance.flush()
    print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
    """
)


def test_a_forked_child_reads_writes_and_flushes_without_hanging(cache_root: Path) -> None:
    result = run_python(FORKED)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"child": 0}, result.stderr
    assert len(entry_files(cache_root)) == 200
    assert_all_entries_decode(cache_root)


CHILDREN = PREAMBLE + textwrap.dedent(
    """
    import multiprocessing, multiprocessing.util, threading
    import torchcache.persist

    def work(seed, start):
        # Hold every write back until the child is exiting, so that only a flush at exit
        # can put the entries on disk (finalizers of higher priority run first).
        exiting = threading.Event()
        multiprocessing.util.Finalize(None, exiting.set, exitpriority=100)
        real_job = torchcache.persist.DiskTier._write_job

        def held_back(self, job):
            assert exiting.wait(60), "the child never started exiting"
            real_job(self, job)

        torchcache.persist.DiskTier._write_job = held_back
        model = cached(Counting, persistent=True)()
        model(inputs(40, seed)[start : start + 20])  # no flush(): the child's exit must write the entries

    if __name__ == "__main__":
        for seed, method in enumerate(("fork", "spawn")):
            context = multiprocessing.get_context(method)
            children = [context.Process(target=work, args=(seed, start)) for start in (0, 20)]
            for child in children:
                child.start()
            for child in children:
                child.join(120)
            print(method, [child.exitcode for child in children])
    """
)


def test_multiprocessing_children_flush_their_writes_at_exit(cache_root: Path, tmp_path: Path) -> None:
    result = run_python(CHILDREN, path=tmp_path / "children.py", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["fork [0, 0]", "spawn [0, 0]"], result.stderr
    assert len(entry_files(cache_root)) == 80  # 40 items of each start method
    assert_all_entries_decode(cache_root)


LOADER = PREAMBLE + textwrap.dedent(
    """
    from torch.utils.data import DataLoader, Dataset
    from torchcache import torchcache

    @torchcache(persistent=True)
    def embed(x):
        return x * 2 + 1

    class Samples(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return embed(inputs(32, 61)[i : i + 1])[0]  # cached in the worker, never flushed by hand

    if __name__ == "__main__":
        loader = DataLoader(Samples(), batch_size=8, num_workers=2, multiprocessing_context="fork")
        out = torch.cat(list(loader))
        print(json.dumps({"equal": torch.equal(out, inputs(32, 61) * 2 + 1)}))
    """
)


def test_dataloader_workers_write_their_entries(cache_root: Path, tmp_path: Path) -> None:
    result = run_python(LOADER, path=tmp_path / "loader.py", timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"equal": True}
    assert len(entry_files(cache_root)) == 32
    assert_all_entries_decode(cache_root)
