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


def test_a_directory_at_one_entry_path_does_not_turn_off_disk_writes(cache_root: Path) -> None:
    x, y = torch.randn(N, 4), torch.randn(N, 4)
    writer = cached(Counting, persistent=True)()
    writer(x)
    writer.cache_instance.flush()
    files = entry_files(cache_root)
    for path in files:
        path.unlink()
    files[0].mkdir()  # a directory where one entry goes
    (files[0] / "child").write_bytes(b"")

    model = cached(Counting, persistent=True)()
    plain = Counting()
    with cache_warnings() as caught:
        assert_same(model(x), plain(x))
        model.cache_instance.flush()
        assert_same(model(y), plain(y))
        model.cache_instance.flush()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "Is a directory" in str(caught[0].message)
    written = [p for p in entry_files(cache_root) if p.is_file()]
    assert len(written) == 2 * N - 1  # every other entry of both batches was written
    assert_all_entries_decode_except(cache_root, files[0])
    fresh = cached(Counting, persistent=True)()
    assert_same(fresh(y), plain(y))
    assert fresh.items == 0


def assert_all_entries_decode_except(root: Path, skip: Path) -> None:
    from torchcache.codec import decode_frame

    for path in entry_files(root):
        if path != skip:
            decode_frame(path.read_bytes())


def test_a_corrupt_entry_that_cannot_be_removed_is_reported_as_such_and_skipped_in_the_process(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import torchcache.stores.disk as disk_module

    x = torch.randn(N, 4)
    writer = cached(Counting, persistent=True)()
    writer(x)
    writer.cache_instance.flush()
    files = entry_files(cache_root)
    flip(files[:1], cache_root / "unused")
    real_unlink = os.unlink

    def read_only(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(cache_root)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(disk_module.os, "unlink", read_only)
    plain = Counting()
    reader = cached(Counting, persistent=True, max_memory_cache_size=0, max_persistent_cache_size=1)()
    with cache_warnings() as caught:
        assert_same(reader(x), plain(x))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "cannot be removed" in message and "removed corrupt" not in message
    assert files[0].exists()
    assert reader.items == 1

    checked: list[int] = []
    import torchcache.persist as persist_module

    real_split = persist_module.split_frame
    monkeypatch.setattr(persist_module, "split_frame", lambda *a, **k: checked.append(1) or real_split(*a, **k))
    again = cached(Counting, persistent=True, max_memory_cache_size=0, max_persistent_cache_size=1)()
    with cache_warnings() as none:
        assert_same(again(x), plain(x))
    assert none == []  # known to this process: not read, not rejected, not reported again
    assert again.items == 1
    assert len(checked) == N - 1


def _layout_and_rows(n: int, seed: int) -> tuple[Any, list[torch.Tensor]]:
    from torchcache.tree import Layout, flatten

    out = {"a": torch.randn(n, 3, generator=torch.Generator().manual_seed(seed)), "b": torch.arange(n) + seed}
    spec, leaves = flatten(out)
    return Layout.of(spec, leaves, None), [leaf.contiguous() for leaf in leaves]


def _tier(directory: Path, reports: list[tuple[str, str]]) -> Any:
    from torchcache.persist import DiskTier

    return DiskTier(directory, 10**9, 5, {"torchcache_version": "test"}, lambda kind, msg: reports.append((kind, msg)))


@pytest.mark.parametrize("stored_first", [0, 40])
def test_queued_writes_are_read_back_before_the_writer_stores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored_first: int
) -> None:
    import threading

    reports: list[tuple[str, str]] = []
    tier = _tier(tmp_path / "module", reports)
    keys = [f"{i:032x}" for i in range(stored_first + 10)]
    layout, rows = _layout_and_rows(len(keys), seed=1)
    if stored_first:  # a batch of entries on disk and in the queue together (the parallel read path)
        tier.write(keys[:stored_first], layout, [r[:stored_first] for r in rows])
        tier.flush()
    release = threading.Event()
    real_put = tier.store.put

    def held_put(key: str, data: bytes) -> bool:
        assert release.wait(60)
        return real_put(key, data)

    monkeypatch.setattr(tier.store, "put", held_put)
    tier.write(keys[stored_first:], layout, [r[stored_first:] for r in rows])
    try:
        assert tier.pending > 0
        positions, got_layout, leaves = tier.read(keys)
        assert positions == list(range(len(keys)))
        assert got_layout == layout
        for got, want in zip(leaves, rows):
            assert torch.equal(got, want)
    finally:
        release.set()
        tier.flush()
    assert tier._pending == {}
    assert reports == []
    positions, _, leaves = tier.read(keys)
    assert positions == list(range(len(keys))) and all(torch.equal(g, w) for g, w in zip(leaves, rows))


def test_a_later_write_of_a_key_wins_and_failed_writes_leave_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import threading

    from torchcache.errors import StoreError

    reports: list[tuple[str, str]] = []
    tier = _tier(tmp_path / "module", reports)
    release = threading.Event()

    def failing_put(key: str, data: bytes) -> bool:
        assert release.wait(60)
        raise StoreError(f"cannot write cache entry {key}") from IsADirectoryError(errno.EISDIR, "Is a directory")

    monkeypatch.setattr(tier.store, "put", failing_put)
    keys = [f"{i:032x}" for i in range(4)]
    layout, first = _layout_and_rows(4, seed=1)
    _, second = _layout_and_rows(4, seed=2)
    tier.write(keys, layout, first)
    tier.write(keys[:2], layout, [r[:2] for r in second])
    try:
        _, _, leaves = tier.read(keys)
        assert torch.equal(leaves[0][:2], second[0][:2]) and torch.equal(leaves[0][2:], first[0][2:])
    finally:
        release.set()
        tier.flush()
    assert tier._pending == {}
    assert tier.read(keys) == ([], None, [])
    assert {kind for kind, _ in reports} == {"entry"}  # one bad path is not the end of the tier
    assert tier._writes_enabled


def test_metadata_is_written_through_a_new_unpredictable_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import torchcache.persist as persist_module
    from torchcache.meta import META_NAME, load_meta, write_json_atomic

    directory = tmp_path / "module"
    directory.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("not torchcache's")
    # links planted at the names a predictable scheme would use
    for name in (f".{META_NAME}.{os.getpid()}.{threading.get_ident()}.tmp", f".{META_NAME}.tmp"):
        os.symlink(victim, directory / name)
    renamed: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(persist_module.os, "replace", lambda a, b: renamed.append(str(a)) or real_replace(a, b))
    for _ in range(2):
        write_json_atomic(directory / META_NAME, {"torchcache_version": "test"})
    assert victim.read_text() == "not torchcache's"
    assert load_meta(directory) == ({"torchcache_version": "test"}, None)
    assert len(set(renamed)) == 2 and all(Path(name).name.startswith(f".{META_NAME}.") for name in renamed)


def test_a_failed_metadata_rename_leaves_no_temporary_file(tmp_path: Path) -> None:
    from torchcache.meta import META_NAME, write_json_atomic

    (tmp_path / META_NAME).mkdir()
    (tmp_path / META_NAME / "inside").write_text("x")
    with pytest.raises(OSError):
        write_json_atomic(tmp_path / META_NAME, {"torchcache_version": "test"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [META_NAME]
