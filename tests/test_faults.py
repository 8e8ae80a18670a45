"""Faults of the cache never break a forward call: bad entry files, unwritable roots, kills."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO, Counting, assert_all_entries_decode, assert_same, cached, entry_files, run_python
from torchcache import CacheWarning

N = 12


@contextmanager
def cache_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record every CacheWarning raised inside (other warnings are recorded and ignored)."""
    found: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    found.extend(w for w in caught if issubclass(w.category, CacheWarning))


class Evil:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def flip(paths: list[Path], marker: Path) -> None:
    for i, path in enumerate(paths):
        data = bytearray(path.read_bytes())
        # magic, reserved field, checksum, middle of the payload, last byte
        position = [0, 6, 30, len(data) // 2, len(data) - 1][i % 5]
        data[position] ^= 0x5A
        path.write_bytes(bytes(data))


def truncate(paths: list[Path], marker: Path) -> None:
    for i, path in enumerate(paths):
        data = path.read_bytes()
        path.write_bytes(data[: [0, 10, len(data) // 2, len(data) - 1][i % 4]])


def delete(paths: list[Path], marker: Path) -> None:
    for path in paths:
        path.unlink()


def pickled(paths: list[Path], marker: Path) -> None:
    for i, path in enumerate(paths):
        if i % 2:
            buffer = io.BytesIO()
            torch.save(Evil(marker), buffer)
            path.write_bytes(buffer.getvalue())
        else:
            path.write_bytes(pickle.dumps(Evil(marker)))


FAULTS: dict[str, Callable[[list[Path], Path], None]] = {
    "flip": flip,
    "truncate": truncate,
    "delete": delete,
    "pickle": pickled,
}


def test_the_pickle_payload_would_run(tmp_path: Path) -> None:
    """The payload is live: unpickling it does create the marker."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(Evil(marker))).close()
    assert marker.exists()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_bad_entry_files_are_misses_removed_and_warned_once(fault: str, cache_root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    x = torch.randn(N, 4)
    plain = Counting()
    writer = cached(Counting, persistent=True)()
    writer(x)
    writer.cache_instance.flush()
    files = entry_files(cache_root)
    assert len(files) == N

    # a reader with no room on disk writes nothing back, so what it removes stays removed
    reader = cached(Counting, persistent=True, max_memory_cache_size=0, max_persistent_cache_size=1)()
    FAULTS[fault](files[:4], marker)
    with cache_warnings() as caught:
        out = reader(x)
        reader.cache_instance.flush()
    assert_same(out, plain(x))
    assert reader.items == 4
    assert [p.exists() for p in files] == [False] * 4 + [True] * (N - 4)
    if fault == "delete":
        assert len(caught) <= 1
    else:
        assert len(caught) == 1, [str(w.message) for w in caught]
    assert_all_entries_decode(cache_root)

    # the same fault again: still correct and removed, no second warning
    FAULTS[fault](files[4:8], marker)
    with cache_warnings() as again:
        out = reader(x)
        reader.cache_instance.flush()
    assert_same(out, plain(x))
    assert reader.items == 4 + 8
    assert [p.exists() for p in files] == [False] * 8 + [True] * (N - 8)
    assert again == []
    assert not marker.exists()

    # an instance with room writes the recomputed items again
    rewriter = cached(Counting, persistent=True)()
    with cache_warnings() as none:
        assert_same(rewriter(x), plain(x))
        rewriter.cache_instance.flush()
    assert none == []
    assert rewriter.items == 8
    assert len(entry_files(cache_root)) == N
    assert_all_entries_decode(cache_root)
    fresh = cached(Counting, persistent=True)()
    assert_same(fresh(x), plain(x))
    assert fresh.items == 0


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_unwritable_root_falls_back_to_memory_with_one_warning(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a regular file, not a directory")
    options: dict[str, Any] = {"persistent": True}
    if how == "argument":
        options["persistent_cache_dir"] = blocker / "sub"
    else:
        monkeypatch.setenv("TORCHCACHE_DIR", str(blocker / "sub"))
    model = cached(Counting, **options)()
    plain = Counting()
    x = torch.randn(8, 4)
    with cache_warnings() as caught:
        first = model(x[:4])
        model.cache_instance.flush()
        second = model(x)
        third = model(x)
        model.cache_instance.flush()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert_same(first, plain(x[:4]))
    assert_same(second, plain(x))
    assert_same(third, plain(x))
    assert model.items == 8  # the memory tier still works
    stats = model.cache_instance.stats()
    assert stats.memory.entries == 8
    assert (stats.hits, stats.misses) == (12, 8)
    assert blocker.read_text() == "a regular file, not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_entry_subdirectories_that_cannot_be_created_fall_back_to_memory(cache_root: Path) -> None:
    model = cached(Counting, persistent=True)()
    module_dir = model.cache_instance.cache_dir
    module_dir.mkdir(parents=True)
    for i in range(16**3):  # every <3 hex> subdirectory name is taken by a file
        (module_dir / f"{i:03x}").write_bytes(b"")
    plain = Counting()
    x = torch.randn(8, 4)
    with cache_warnings() as caught:
        outs = [model(x[:4])]
        model.cache_instance.flush()
        outs += [model(x), model(x)]
        model.cache_instance.flush()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert_same(outs[0], plain(x[:4]))
    assert_same(outs[1], plain(x))
    assert_same(outs[2], plain(x))
    assert model.items == 8
    assert entry_files(cache_root) == []


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, torch
    from tests.helpers import Counting, cached

    real_write = os.write
    calls = 0

    def dying_write(fd, data):
        global calls
        calls += 1
        if calls == 6:  # die half-way through writing the 6th entry
            real_write(fd, bytes(data)[: len(data) // 2])
            os._exit(17)
        return real_write(fd, data)

    model = cached(Counting, persistent=True)()
    x = torch.randn(int(sys.argv[1]), 4, generator=torch.Generator().manual_seed(3))
    os.write = dying_write
    model(x)
    model.cache_instance.flush()
    os._exit(0)
    """
)


def test_process_killed_while_writing_leaves_no_partial_entry(cache_root: Path) -> None:
    result = run_python(KILLED_WRITER, str(N))
    assert result.returncode == 17, result.stderr
    files = entry_files(cache_root)
    assert 0 < len(files) < N
    assert_all_entries_decode(cache_root)

    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(3))
    rerun = cached(Counting, persistent=True)()
    with cache_warnings() as caught:
        out = rerun(x)
        rerun.cache_instance.flush()
    assert caught == []
    assert_same(out, Counting()(x))
    assert rerun.items == N - len(files)
    assert len(entry_files(cache_root)) == N
    assert_all_entries_decode(cache_root)


SIGKILLED_WRITER = textwrap.dedent(
    """
    import torch
    from tests.helpers import Counting, cached

    model = cached(Counting, persistent=True)()
    gen = torch.Generator().manual_seed(5)
    for step in range(100000):
        model(torch.randn(64, 4, generator=gen))
        if step == 0:
            model.cache_instance.flush()
            print("ready", flush=True)
    """
)


def test_process_sigkilled_while_writing_leaves_no_partial_entry(cache_root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGKILLED_WRITER], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()
    assert len(entry_files(cache_root)) >= 64
    assert_all_entries_decode(cache_root)

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(64, 4, generator=gen) for _ in range(3)]
    rerun = cached(Counting, persistent=True)()
    plain = Counting()
    for batch in batches:
        assert_same(rerun(batch), plain(batch))
    assert rerun.cache_instance.stats().hits >= 64
    rerun.cache_instance.flush()
    assert_all_entries_decode(cache_root)


def test_a_full_disk_warns_once_and_leaves_no_partial_entry(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import torchcache.stores.disk as disk_module

    real_write = os.write
    written: list[int] = []

    def write_until_full(fd: int, data: Any) -> int:
        if len(written) >= 3:  # three entries fit, then the disk is full in the middle of one
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(fd)
        return real_write(fd, data)

    monkeypatch.setattr(disk_module.os, "write", write_until_full)
    model = cached(Counting, persistent=True)()
    plain = Counting()
    x = torch.randn(10, 4)
    with cache_warnings() as caught:
        first = model(x)
        model.cache_instance.flush()
        second = model(x)
        model.cache_instance.flush()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "No space left" in str(caught[0].message)
    assert_same(first, plain(x))
    assert_same(second, plain(x))
    assert model.items == 10
    files = entry_files(cache_root)
    assert len(files) == 3
    assert_all_entries_decode(cache_root)
    assert not [p for p in cache_root.rglob("*.tmp")]
