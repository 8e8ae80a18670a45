"""The packed store's lock files: compact.lock and index.lock (torchcache.stores.packed.locks)."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from torchcache.errors import StoreError
from torchcache.stores.packed import locks, opening
from torchcache.stores.packed.index import open_index
from torchcache.stores.packed.locks import INDEX_LOCK_NAME, LOCK_NAME, exclusive, opening_index
from torchcache.stores.packed.store import PackedStore


def _refusing(refuse: Callable[[int], bool]) -> Callable[..., int]:
    """``os.open`` that fails with EACCES when ``refuse(flags)``, as for a file of another user."""
    real = os.open

    def fake(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if refuse(flags):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    return fake


def _taken_elsewhere(path: Path) -> bool:
    """Whether another open file description is refused an exclusive lock on ``path`` now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize("name", [LOCK_NAME, INDEX_LOCK_NAME])
def test_a_lock_file_this_process_may_not_write_is_locked_for_reading_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    path = tmp_path / name
    path.write_bytes(b"")
    inode = path.stat().st_ino
    monkeypatch.setattr(locks.os, "open", _refusing(lambda flags: bool(flags & os.O_RDWR)))
    with exclusive(str(tmp_path), wait=False, name=name) as taken:
        assert taken and _taken_elsewhere(path)
    assert path.stat().st_ino == inode  # the other user's file, not replaced
    assert not _taken_elsewhere(path)


def test_an_index_is_not_opened_while_it_is_being_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "WAIT_SECONDS", 0.05)
    with exclusive(str(tmp_path), wait=False, name=INDEX_LOCK_NAME) as replacing:
        assert replacing
        with opening_index(str(tmp_path)) as may_open:
            assert not may_open
        with pytest.raises(OSError) as raised:
            open_index(str(tmp_path), readonly=False)
        assert raised.value.errno == errno.EAGAIN
    with opening_index(str(tmp_path)) as may_open:
        assert may_open
        with opening_index(str(tmp_path)) as also:  # opening is shared
            assert also
        with exclusive(str(tmp_path), wait=False, name=INDEX_LOCK_NAME) as replacing:
            assert not replacing  # and keeps a replacement out
    index = open_index(str(tmp_path), readonly=False)
    index.close()


def test_opening_goes_on_where_no_lock_file_can_be_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks.os, "open", _refusing(lambda flags: True))  # as in a directory this user cannot write
    with opening_index(str(tmp_path)) as may_open:
        assert may_open
    with exclusive(str(tmp_path), wait=False) as taken:
        assert not taken
    assert not (tmp_path / INDEX_LOCK_NAME).exists()


def test_a_store_whose_index_stays_locked_waits_once_then_misses_until_it_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PackedStore(tmp_path, 1 << 20) as store:
        store.put_many([("aa" * 16, b"kept")])
    monkeypatch.setattr(locks, "WAIT_SECONDS", 0.05)
    waits: list[int] = []
    real_take = locks._take
    monkeypatch.setattr(locks, "_take", lambda fd, mode, wait: waits.append(wait) or real_take(fd, mode, wait))
    faults: list[str] = []
    with exclusive(str(tmp_path), wait=False, name=INDEX_LOCK_NAME) as replacing:  # held, as by a stopped process
        assert replacing
        store = PackedStore(tmp_path, 1 << 20, report=lambda kind, message: faults.append(message))
        for _ in range(5):  # each call a miss at once, not a wait of WAIT_SECONDS
            assert store.get_many(["aa" * 16]) == [None]
            with pytest.raises(StoreError):
                store.put_many([("bb" * 16, b"new")])
    assert waits.count(True) == 1 and len(faults) == 1 and "unavailable for 60 s" in faults[0]
    assert store.get_many(["aa" * 16]) == [None]  # released, but within the 60 s
    later = SimpleNamespace(monotonic=lambda: time.monotonic() + 61)  # as when they have passed
    monkeypatch.setattr(opening, "time", later)
    assert [bytes(v or b"") for v in store.get_many(["aa" * 16])] == [b"kept"]
    store.close()
