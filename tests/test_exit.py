"""Processes that end cleanly: shared writer threads, exit hooks, failing disks that never hang."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_all_entries_decode, entry_files, run_python
from torchcache import flush_all, torchcache
from torchcache.tiers.writer import MAX_THREADS, THREAD_NAME

# -- many processes that re-create caches and exit as their writer threads idle out ------------
RECREATE = textwrap.dedent(
    """
    import faulthandler, gc, json, sys, threading, time
    import lmdb, torch
    import torchcache.tiers.writer as writer
    from torchcache import torchcache

    faulthandler.dump_traceback_later(60, exit=True)  # a hang ends the run, with every thread's stack
    # Writer threads idle out all through the run, and as it exits right after its flush.
    writer.IDLE_TIMEOUT = 0.05
    # The collector may run at any allocation. Here it runs whenever an index is being opened,
    # so that stores of the caches made before are collected (and close their own index) then.
    real_open = lmdb.open

    def open_after_collecting(*args, **kwargs):
        gc.collect()
        return real_open(*args, **kwargs)

    lmdb.open = open_after_collecting
    gc.freeze()  # what the imports made is never garbage: keep the collections short
    root, seed = sys.argv[1], int(sys.argv[2])
    generator = torch.Generator().manual_seed(seed)
    most_threads = 0
    start = time.monotonic()
    made = 0
    while made < 40 or time.monotonic() - start < 0.5:
        # a sweep, a re-run notebook cell, a reload: the cached function is made again,
        # here in one of 40 directories, so that there are many disk tiers and writers
        @torchcache(persistent=True, persistent_cache_dir=f"{root}/{made % 40}")
        def embed(x: torch.Tensor) -> torch.Tensor:
            return x * 2 + 1

        x = torch.randn(8, 1024, generator=generator)
        assert torch.equal(embed(x), x * 2 + 1)
        most_threads = max(most_threads, sum(t.name == "torchcache-writer" for t in threading.enumerate()))
        if made % 8 == 7:
            embed.cache_instance.flush()
        made += 1
    embed.cache_instance.flush()
    print(json.dumps({"made": made, "most_threads": most_threads}))
    """
)
_RUNS = 4
_AT_ONCE = 4


@pytest.mark.slow
def test_processes_that_recreate_caches_always_exit_cleanly(tmp_path: Path) -> None:
    def run(i: int) -> subprocess.CompletedProcess[str]:
        return run_python(RECREATE, str(tmp_path / f"run{i}"), str(i), timeout=300)

    with ThreadPoolExecutor(_AT_ONCE) as pool:
        results = list(pool.map(run, range(_RUNS)))
    statuses = [result.returncode for result in results]
    failed = [result.stderr[-2000:] for result in results if result.returncode != 0]
    assert statuses == [0] * _RUNS, failed
    for result in results:
        state = json.loads(result.stdout)
        assert state["made"] >= 40
        assert state["most_threads"] <= MAX_THREADS
        assert "terminate called" not in result.stderr
    # every write made it to disk, though most caches were never flushed by hand
    assert len(entry_files(tmp_path)) == 8 * sum(json.loads(result.stdout)["made"] for result in results)
    assert_all_entries_decode(tmp_path)


def test_fifty_caches_share_a_bounded_number_of_writer_threads(tmp_path: Path) -> None:
    most = 0
    for i in range(50):

        @torchcache(persistent=True, persistent_cache_dir=tmp_path / str(i))
        def triple(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        x = torch.randn(16, 256)
        assert torch.equal(triple(x), x * 3)
        most = max(most, sum(t.name == THREAD_NAME for t in threading.enumerate()))
    flush_all()
    assert 1 <= most <= MAX_THREADS
    assert len(entry_files(tmp_path / "49")) == 16


# -- at exit: writers flushed, threads stopped and joined, long waits explained ----------------
JOINED = textwrap.dedent(
    """
    import atexit, json, threading

    def threads_left():
        # registered before torchcache is imported: runs after torchcache's exit hooks
        names = [t.name for t in threading.enumerate() if t.name == "torchcache-writer"]
        print(json.dumps({"writer_threads_at_exit": len(names)}), flush=True)

    atexit.register(threads_left)

    import sys, torch
    import torchcache.tiers.writer as writer
    from torchcache import torchcache

    writer.IDLE_TIMEOUT = 600.0  # idle threads would still be there at exit

    @torchcache(persistent=True, persistent_cache_dir=sys.argv[1])
    def embed(x):
        return x + 1

    embed(torch.randn(32, 64))  # not flushed: the exit hook writes the entries
    print(json.dumps({"writer_threads_before_exit": sum(t.name == "torchcache-writer" for t in threading.enumerate())}))
    """
)


@pytest.mark.slow
def test_exit_writes_pending_entries_then_stops_and_joins_the_writer_threads(tmp_path: Path) -> None:
    result = run_python(JOINED, str(tmp_path))
    assert result.returncode == 0, result.stderr
    before, after = (json.loads(line) for line in result.stdout.splitlines())
    assert before["writer_threads_before_exit"] >= 1
    assert after == {"writer_threads_at_exit": 0}
    assert len(entry_files(tmp_path)) == 32


SLOW_EXIT = textwrap.dedent(
    """
    import logging, sys, threading, torch
    import torchcache.tiers.persistent as persistent
    from torchcache import torchcache

    reported = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "waiting for" in record.getMessage():
                reported.set()

    logging.getLogger("torchcache").addHandler(Seen(logging.WARNING))
    real_job = persistent.PersistentTier._write_job

    def slow_job(self, job):
        # a slow disk: the write ends only once the exit has said what it waits for
        if not reported.wait(60):
            print("never reported", file=sys.stderr)
        real_job(self, job)

    persistent.PersistentTier._write_job = slow_job

    @torchcache(persistent=True, persistent_cache_dir=sys.argv[1])
    def embed(x):
        return x * 2

    embed(torch.randn(64, 1024))  # 256 kB waiting to be written when the script ends
    """
)


@pytest.mark.slow
def test_a_slow_exit_says_what_it_waits_for(tmp_path: Path) -> None:
    result = run_python(SLOW_EXIT, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "never reported" not in result.stderr
    match = re.search(
        r"torchcache: waiting for (\d+) pending background write jobs? \((.*?), (\d+) bytes\)", result.stderr
    )
    assert match is not None, result.stderr
    assert int(match[1]) >= 1
    assert int(match[3]) >= 64 * 1024 * 4  # the outputs of the call, before compression
    assert len(entry_files(tmp_path)) == 64  # then it waited for them


# -- failing disk writes while clear() or a re-key waits for the writer ------------------------
FAILING_DISK = textwrap.dedent(
    """
    import errno, json, os, subprocess, sys, threading, time, types, warnings
    import torch
    import torchcache.stores.packed.segments as segments
    import torchcache.tiers.persistent as persistent
    from tests.helpers import Counting, cached

    root, failure, step_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])

    if failure == "patched":  # the segment files: appends find the disk full, new ones a read-only disk
        def no_space(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        failing_os = types.ModuleType("os")
        failing_os.__dict__.update(os.__dict__)
        failing_os.pwritev, failing_os.pwrite, failing_os.link = no_space, no_space, read_only
        segments.os = failing_os


    def make_unwritable(directory):
        if failure == "tmpfs":  # a full disk: 64 kB, where the pending write of a call takes 256 kB
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", directory], check=True)
        elif failure == "readonly":
            subprocess.run(["mount", "--bind", directory, directory], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", directory], check=True)


    def held_elsewhere(lock):
        if lock.acquire(blocking=False):
            lock.release()
            return False
        return True


    armed = {}  # directory -> the cache whose lock its writes wait for
    saw_lock_held = []
    real_job = persistent.PersistentTier._write_job


    def held_back_job(self, job):
        cache = armed.pop(self.where, None)
        if cache is not None:
            # the write runs (and fails) just when a caller holds the cache lock and waits for it
            deadline = time.monotonic() + step_timeout / 2
            while not held_elsewhere(cache._lock) and time.monotonic() < deadline:
                time.sleep(0.001)
            saw_lock_held.append(held_elsewhere(cache._lock))
        real_job(self, job)


    persistent.PersistentTier._write_job = held_back_job
    Model = cached(Counting, persistent=True, persistent_cache_dir=root)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))  # 256 kB of outputs per call


    def with_pending_write(seed):
        model = Model(16, 1024, seed=seed)
        armed[str(model.cache_instance.cache_dir)] = model.cache_instance
        assert torch.equal(model(x), Counting(16, 1024, seed=seed)(x))
        make_unwritable(str(model.cache_instance.cache_dir))
        return model


    def clear_then_call():
        model = with_pending_write(1)
        def action():
            model.cache_instance.clear()
            return torch.equal(model(x), Counting(16, 1024, seed=1)(x))
        return action


    def load_state_dict_then_call():
        model = with_pending_write(2)
        other = Counting(16, 1024, seed=3)
        def action():
            model.load_state_dict(other.state_dict())
            return torch.equal(model(x), other(x))
        return action


    def to_float64_then_call():
        model = with_pending_write(4)
        def action():
            model.to(torch.float64)
            out = model(x.double())
            return out.dtype == torch.float64 and torch.equal(out, Counting(16, 1024, seed=4).double()(x.double()))
        return action


    for name, prepare in [("clear", clear_then_call), ("load_state_dict", load_state_dict_then_call),
                          ("to", to_float64_then_call)]:
        saw_lock_held.clear()
        action = prepare()
        outcome = {}

        def run():
            try:
                outcome["equal"] = action()
            except BaseException as exc:
                outcome["error"] = repr(exc)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(step_timeout)
        outcome.update(
            step=name,
            finished=not thread.is_alive(),
            warnings=[(w.category.__name__, str(w.message)) for w in caught],
            saw_lock_held=saw_lock_held,
        )
        print(json.dumps(outcome), flush=True)
        if thread.is_alive():
            os._exit(0)  # the thread holds the cache lock for ever: skip the flush at exit
    """
)
_STEP_TIMEOUT = 60.0


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1] for line in mounts]
    return [point for point in points if point == str(path) or point.startswith(f"{path}/")]


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[None]:
    """Lets a test mount file systems under ``tmp_path``; unmounts them all afterwards."""
    yield
    for point in reversed(_mounts_under(tmp_path)):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def _mount_or_skip(*commands: list[str]) -> None:
    for command in commands:
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as exc:
            pytest.skip(f"cannot run {command[0]!r} ({exc}); the patched variant covers the failure")
        if result.returncode != 0:
            pytest.skip(
                f"{' '.join(command)} failed ({result.stderr.strip()}): mounting needs root with CAP_SYS_ADMIN; "
                "the patched variant covers the failure"
            )


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["patched", "tmpfs", "readonly"])
@pytest.mark.usefixtures("mount")
def test_failing_disk_writes_never_hang_clear_or_a_rekey(tmp_path: Path, failure: str) -> None:
    # Each module directory becomes a full 64 kB tmpfs, or a read-only bind mount, once its
    # writes are queued; first, see whether this process may mount at all.
    root, probe = tmp_path / "root", tmp_path / "probe"
    root.mkdir()
    probe.mkdir()
    if failure == "tmpfs":
        _mount_or_skip(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)])
    elif failure == "readonly":
        _mount_or_skip(["mount", "--bind", str(probe), str(probe)], ["mount", "-o", "remount,bind,ro", str(probe)])
    result = run_python(FAILING_DISK, str(root), failure, str(_STEP_TIMEOUT), timeout=4 * _STEP_TIMEOUT + 60)
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in result.stdout.splitlines()]
    for step in steps:
        assert step["finished"], (
            f"{step['step']}: the call did not return within {_STEP_TIMEOUT:.0f} s, a deadlock: the caller "
            "holds the cache lock while it waits for the writer, and the writer needs that lock to report "
            f"its failure\n{result.stderr[-3000:]}"
        )
        assert step.get("error") is None, step
        assert step["equal"] is True, step
        assert step["saw_lock_held"] == [True], step  # the write failed while the caller waited for it
        cache_warnings = [message for category, message in step["warnings"] if category == "CacheWarning"]
        # The held-back write failed and said so: as a failed write, or, on a full tmpfs where even
        # the index's lock file cannot be allocated, as a store that cannot be opened (and so not cleared).
        assert 1 <= len(cache_warnings) <= 2, step
        assert any("cannot write" in w or "the store is unavailable" in w for w in cache_warnings), step
        assert {category for category, _ in step["warnings"]} == {"CacheWarning"}, step
    assert [step["step"] for step in steps] == ["clear", "load_state_dict", "to"]
