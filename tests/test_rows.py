"""The rows file: round trips, slots and budgets, damage, hostile files, failing writes, processes, kills."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import multiprocessing
import os
import pickle
import signal
import struct
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from tests import zygote
from tests.helpers import REPO, fault_under, pwrite_fault
from torchcache.errors import CorruptEntryError, StoreError
from torchcache.stores.rows import Geometry, RowsFile
from torchcache.stores.rows import file as rows_module
from torchcache.stores.rows.format import digest

SIZE = 100
HEADER = {"kind": "test"}


def row(index: int, size: int = SIZE) -> np.ndarray[Any, Any]:
    """A row whose bytes name its index."""
    return np.asarray([(index * 7 + k) % 251 for k in range(size)], np.uint8)


def rows_of(indices: list[int], size: int = SIZE) -> np.ndarray[Any, Any]:
    return np.stack([row(i, size) for i in indices]) if indices else np.zeros((0, size), np.uint8)


def make(directory: Path, length: int = 50, capacity: int | None = None, head: int = 35) -> RowsFile:
    return RowsFile.create(directory / "rows.tcrows", HEADER, length, SIZE, head=head, capacity=capacity)


def read_all(file: RowsFile, indices: list[int]) -> dict[int, bytes]:
    found, gathered, _, _ = file.read(np.asarray(indices, np.int64))
    at, size = file.row_at, file.row_size
    return {indices[p]: bytes(gathered[j, at : at + size]) for j, p in enumerate(found.tolist())}


def poke(path: Path, offset: int, xor: int = 0x01) -> None:
    """Flip bits of one byte of a file, as damage on disk would."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ xor]), offset)
    finally:
        os.close(fd)


def test_rows_come_back_by_index_and_other_indices_miss(tmp_path: Path) -> None:
    file = make(tmp_path)
    assert file.write(np.arange(0, 50, 2), rows_of(list(range(0, 50, 2)))) == 0
    got = file.read(np.asarray([4, 5, 48, 4, 7]))
    assert got.found.tolist() == [0, 2, 3] and got.missing == [1, 4] and got.damaged == []
    assert read_all(file, [4, 5, 48]) == {4: bytes(row(4)), 48: bytes(row(48))}
    assert len(file) == 25 and 4 in file and 5 not in file and "4" not in file and 50 not in file
    assert (file.row_at + 35) % 16 == 0 and file.stride % 16 == 0  # the row's byte 35 is aligned
    assert file.missing().tolist() == list(range(1, 50, 2))
    file.close()


def test_a_second_opener_sees_the_rows_and_a_second_maker_opens_the_first_file(tmp_path: Path) -> None:
    first = make(tmp_path)
    second = RowsFile.open(tmp_path / "rows.tcrows")
    third = RowsFile.create(tmp_path / "rows.tcrows", HEADER, 50, SIZE + 16)  # the file that exists wins
    assert (second.row_size, third.row_size, third.header) == (SIZE, SIZE, HEADER)
    third.write(np.asarray([2]), rows_of([2]))
    assert read_all(first, [1, 2]) == read_all(second, [2]) == {2: bytes(row(2))}
    for file in (first, second, third):
        file.close()


@pytest.mark.parametrize("size", [SIZE, 96], ids=["padded lines", "rows as lines"])
def test_an_index_given_twice_is_written_once_and_rows_keep_their_order(tmp_path: Path, size: int) -> None:
    file = RowsFile.create(tmp_path / "rows.tcrows", HEADER, 50, size, head=0)
    assert (file.row_at, file.stride == size) == (0, size == 96)  # 96 bytes: a batch of rows is its lines
    assert file.write(np.asarray([9, 3, 9, 5]), rows_of([9, 3, 9, 5], size)) == 0
    assert read_all(file, [3, 5, 9]) == {i: bytes(row(i, size)) for i in (3, 5, 9)}
    assert file.nbytes == file.geometry.rows_at + 3 * file.stride  # three slots, not four
    assert file.write(np.asarray([5, 6]), rows_of([5, 6], size)) == 0  # 5 is written: only 6 is
    assert file.write(np.asarray([7, 8]), rows_of([7, 8], size)) == 0
    assert read_all(file, [5, 6, 7, 8]) == {i: bytes(row(i, size)) for i in (5, 6, 7, 8)}
    assert file.read(np.arange(50)).damaged == []
    written = np.asarray([3, 5, 6, 7, 8, 9])
    assert file.checks(written).tolist() == [digest(row(i, size), i) for i in written.tolist()]  # the format's
    file.close()


def test_rows_written_again_out_of_slot_order_land_in_their_own_slots(tmp_path: Path) -> None:
    file = make(tmp_path)
    file.write(np.asarray([4, 7, 8]), rows_of([4, 7, 8]))  # slots 0, 1, 2
    file.unmark([4, 7, 8])  # as damaged rows are: written again into their own slots
    assert file.write(np.asarray([8, 4, 7, 9]), rows_of([8, 4, 7, 9])) == 0  # slots 2, 0, 1, then a new one
    got = file.read(np.asarray([4, 7, 8, 9]))
    assert got.damaged == [] and got.missing == []
    assert read_all(file, [4, 7, 8, 9]) == {i: bytes(row(i)) for i in (4, 7, 8, 9)}
    assert file.nbytes == file.geometry.rows_at + 4 * file.stride
    file.close()


def test_slots_stop_at_the_capacity_and_at_a_smaller_limit(tmp_path: Path) -> None:
    geometry = Geometry.of(50, SIZE, 35, HEADER)
    budget = geometry.rows_at + 10 * geometry.stride + geometry.stride // 2
    file = make(tmp_path, capacity=geometry.capacity(budget, 50))
    assert file.capacity == 10 and file.size <= budget
    assert file.write(np.arange(6), rows_of(list(range(6)))) == 0
    assert file.write(np.arange(6, 12), rows_of(list(range(6, 12)))) == 2
    assert len(file) == 10 and file.nbytes <= budget and os.stat(file.path).st_size <= budget  # type: ignore[arg-type]
    assert file.write(np.asarray([30]), rows_of([30]), geometry.rows_at + 5 * geometry.stride) == 1
    assert geometry.capacity(geometry.rows_at - 1, 50) == 0  # a budget without room for the tables
    file.close()


@pytest.mark.parametrize("full", [False, True], ids=["room-left", "every-slot-claimed"])
@pytest.mark.parametrize("damage", ["row", "check", "slot-swap", "slot-past-the-end"])
def test_damage_is_a_miss_never_a_wrong_row(tmp_path: Path, damage: str, full: bool) -> None:
    file = make(tmp_path, length=10 if full else 50)  # full: the row is written again into a slot no index names
    file.write(np.arange(10), rows_of(list(range(10))))
    at = file.row_offset(3)
    assert at is not None and file.path is not None
    g = file.geometry
    if damage == "row":
        poke(file.path, at + 17)
    elif damage == "check":
        poke(file.path, g.checks_at + 8 * 3 + 5)
    else:
        (slot,) = struct.unpack_from("<I", file.path.read_bytes(), g.slots_at + 4 * 4)
        value = slot if damage == "slot-swap" else file.capacity + 7
        with open(file.path, "r+b") as raw:
            raw.seek(g.slots_at + 4 * 3)
            raw.write(struct.pack("<I", value))
    got = file.read(np.arange(10))
    assert got.damaged == [3] and got.missing == [] and 3 not in got.found.tolist()
    assert file.damaged().tolist() == [3]
    assert read_all(file, list(range(10))) == {i: bytes(row(i)) for i in range(10) if i != 3}
    file.unmark([3])
    assert file.read(np.asarray([3])).missing == [0] and file.write(np.asarray([3]), rows_of([3])) == 0
    assert read_all(file, list(range(10))) == {i: bytes(row(i)) for i in range(10)}  # 4 as it was too
    assert file.damaged().tolist() == []
    file.close()


def test_damaged_lists_every_written_row_that_fails_its_check(tmp_path: Path) -> None:
    file = make(tmp_path, length=9000)
    file.write(np.arange(0, 9000, 3), rows_of(list(range(0, 9000, 3))))
    for index in (3, 4500, 8997):
        at = file.row_offset(index)
        assert at is not None and file.path is not None
        poke(file.path, at)
    assert file.damaged().tolist() == [3, 4500, 8997]
    file.close()


def write_header(path: Path, bad_check: bool = False, **changes: Any) -> None:
    """Rewrite a valid rows file's header with some fields changed (and a valid checksum unless told)."""
    head = struct.Struct("<8sIIQQQQ")
    data = bytearray(path.read_bytes())
    names = ["magic", "version", "json_len", "length", "row_size", "row_at", "capacity"]
    fields = dict(zip(names, head.unpack_from(data)))
    text = bytes(data[head.size : head.size + fields["json_len"]])
    if "text" in changes:
        text = changes.pop("text")
        fields["json_len"] = len(text)
    fields.update(changes)
    packed = head.pack(*(fields[n] for n in names)) + text
    check = xxhash.xxh3_64_intdigest(packed) ^ (1 if bad_check else 0)
    path.write_bytes(packed + struct.pack("<Q", check) + bytes(data[len(packed) + 8 :]))


@pytest.mark.parametrize(
    "hostile",
    ["magic", "version", "checksum", "capacity", "row_at", "row_size", "json", "list", "spaces", "truncated"],
)
def test_a_hostile_header_is_refused_before_anything_is_mapped(tmp_path: Path, hostile: str) -> None:
    made = make(tmp_path)
    made.write(np.asarray([1]), rows_of([1]))
    made.close()
    path = tmp_path / "rows.tcrows"
    changes: dict[str, Any] = {
        "magic": {"magic": b"NOTROWS!"},
        "version": {"version": 2},
        "checksum": {"bad_check": True},
        "capacity": {"capacity": 51},
        "row_at": {"row_at": 16},
        "row_size": {"row_size": 1 << 31},
        "json": {"text": b'{"kind":'},
        "list": {"text": b"[1]"},
        "spaces": {"text": b'{"kind": "test"}'},
    }.get(hostile, {})
    if changes:
        write_header(path, **changes)
    else:
        os.truncate(path, os.stat(path).st_size // 2)
    with pytest.raises(CorruptEntryError):
        RowsFile.open(path)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_what_is_not_a_regular_file_is_not_opened(tmp_path: Path, kind: str) -> None:
    make(tmp_path).close()
    path = tmp_path / "rows.tcrows"
    path.rename(tmp_path / "elsewhere")
    if kind == "symlink":
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises((CorruptEntryError, OSError)):
        RowsFile.open(path)


def test_a_file_cut_short_after_it_was_opened_is_an_error_not_a_crash(tmp_path: Path) -> None:
    file = make(tmp_path)
    file.write(np.asarray([1]), rows_of([1]))
    os.truncate(tmp_path / "rows.tcrows", 8192)
    with pytest.raises(StoreError, match="cut short"):
        file.read(np.asarray([1]))
    with pytest.raises(StoreError, match="cut short"):
        file.write(np.asarray([2]), rows_of([2]))
    file.close()


def test_rows_kept_in_memory_and_a_closed_file(tmp_path: Path) -> None:
    memory = RowsFile.in_memory(HEADER, 10, SIZE)
    memory.write(np.asarray([7]), rows_of([7]))
    assert read_all(memory, [7, 8]) == {7: bytes(row(7))} and memory.path is None
    with pytest.raises(TypeError, match="cannot be sent to another process"):
        memory.__getstate__()
    memory.close()
    with pytest.raises(StoreError, match="closed"):
        memory.read(np.asarray([7]))


def descriptors(path: Path) -> int:
    """How many of this process's descriptors (its own and its maps') hold the file at ``path``."""
    want, held = os.stat(path), 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the one listdir used, closed by now
            got = os.stat(f"/proc/self/fd/{fd}")  # the file it holds, by whichever name it was made
            held += (got.st_dev, got.st_ino) == (want.st_dev, want.st_ino)
    return held


def test_a_file_dropped_without_close_lets_its_descriptors_go_and_an_unpickled_one_owns_its_own(
    tmp_path: Path,
) -> None:
    file = make(tmp_path)
    path = tmp_path / "rows.tcrows"
    file.write(np.asarray([1]), rows_of([1]))
    copy = pickle.loads(pickle.dumps(file))  # reopened where it is unpickled (a DataLoader worker)
    gc.collect()  # the file it was opened as is gone: the copy's descriptor is not closed with it
    copy.write(np.asarray([2]), rows_of([2]))
    held = descriptors(path)
    del file
    gc.collect()
    assert 0 < descriptors(path) < held
    assert read_all(copy, [1, 2]) == {1: bytes(row(1)), 2: bytes(row(2))}
    del copy
    gc.collect()
    assert descriptors(path) == 0


def test_a_write_that_fails_after_its_slots_were_given_leaves_misses_and_the_slots_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = make(tmp_path)
    file.write(np.asarray([1]), rows_of([1]))
    real, calls = rows_module.pwrite_all, []

    def dies_at_the_rows(fd: int, data: memoryview, offset: int) -> None:
        calls.append(offset)
        if offset >= file.geometry.rows_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(rows_module, "pwrite_all", dies_at_the_rows)
    with pytest.raises(OSError):
        file.write(np.asarray([2, 3]), rows_of([2, 3]))
    monkeypatch.undo()
    assert read_all(file, [1, 2, 3]) == {1: bytes(row(1))}
    slots = file.nbytes
    assert file.write(np.asarray([2, 3]), rows_of([2, 3])) == 0 and file.nbytes == slots  # their own slots
    assert read_all(file, [1, 2, 3]) == {i: bytes(row(i)) for i in (1, 2, 3)}
    file.close()


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO", "short, then ENOSPC", "no progress"])
def test_a_failing_write_is_an_error_and_marks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    file = make(tmp_path)
    assert file.write(np.arange(5), rows_of(list(range(5)))) == 0
    fault = pwrite_fault(kind)
    fault_under(monkeypatch, tmp_path, "pwrite", fault)
    with pytest.raises(OSError) as caught:
        file.write(np.arange(5, 10), rows_of(list(range(5, 10))))
    assert caught.value.errno in (errno.ENOSPC, errno.EIO) and len(fault.calls) < 10
    monkeypatch.undo()
    assert read_all(file, list(range(10))) == {i: bytes(row(i)) for i in range(5)}  # none of the failed batch
    assert len(file) == 5
    file.close()


def test_a_file_system_without_fallocate_still_makes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*args: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    fault_under(monkeypatch, tmp_path, "posix_fallocate", unsupported)
    file = make(tmp_path, length=3000)
    file.write(np.asarray([2999]), rows_of([2999]))
    assert read_all(file, [2999]) == {2999: bytes(row(2999))}
    file.close()


def test_a_file_made_for_a_budget_allocates_its_tables_not_its_rows(tmp_path: Path) -> None:
    file = RowsFile.create(tmp_path / "rows.tcrows", HEADER, 100_000, 4096, allocate_rows=False)
    blocks = os.stat(tmp_path / "rows.tcrows").st_blocks * 512
    assert file.geometry.rows_at <= blocks < file.geometry.rows_at + 64 * 4096  # the rows take room as written
    file.close()


def test_the_holes_of_a_sparse_file_are_not_read_to_count_or_list_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A planted file that claims 2**28 rows in a table of holes (2 GiB of checks on 3 blocks):
    # counting and listing its rows costs what it holds, not what it claims.
    from torchcache.stores import files

    monkeypatch.setattr(files, "allocate", lambda fd, size: None)
    length, picked = 1 << 28, [5, 1 << 27, (1 << 28) - 1]
    file = RowsFile.create(tmp_path / "rows.tcrows", HEADER, length, SIZE, capacity=4)
    if os.stat(tmp_path / "rows.tcrows").st_blocks * 512 > 1 << 20:
        file.close()
        pytest.skip("the temporary directory's file system keeps no holes")
    file.write(np.asarray(picked), rows_of(picked))
    scanned: list[int] = []  # checks read by numpy's scans

    def spy(scan: Any) -> Any:
        return lambda a, *args, **kwargs: (scanned.append(np.size(a)), scan(a, *args, **kwargs))[1]

    monkeypatch.setattr(np, "count_nonzero", spy(np.count_nonzero))
    monkeypatch.setattr(np, "flatnonzero", spy(np.flatnonzero))
    assert file.count() == 3 and file.written().tolist() == picked and file.damaged().tolist() == []
    assert 0 < sum(scanned) < 1 << 20  # the blocks written, not 2**28 checks
    file.close()


def _writer(directory: str, worker: int, rounds: int, queue: Any) -> None:
    file = RowsFile.create(Path(directory) / "rows.tcrows", HEADER, 400, SIZE, capacity=300)
    rng = np.random.default_rng(worker)
    wrong = 0
    for _ in range(rounds):
        picked = rng.choice(400, 16, replace=False).tolist()
        file.write(np.asarray(picked), rows_of(picked))
        wrong += sum(data != bytes(row(i)) for i, data in read_all(file, picked).items())
    queue.put(wrong)
    file.close()


@pytest.mark.slow
def test_four_processes_writing_and_reading_overlapping_indices(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_writer, args=(str(tmp_path), w, 40, queue)) for w in range(4)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(60)
    assert results == [0, 0, 0, 0]
    file = RowsFile.open(tmp_path / "rows.tcrows")
    everything = read_all(file, list(range(400)))
    assert len(everything) == 300 and all(data == bytes(row(i)) for i, data in everything.items())
    assert file.nbytes == file.size and file.damaged().tolist() == []  # every slot given once, none lost
    file.close()


KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, {repo!r})
    from tests.test_rows import HEADER, rows_of
    from torchcache.stores.rows import RowsFile
    file = RowsFile.create(Path({directory!r}) / "rows.tcrows", HEADER, 2000, 100)
    i = 0
    while True:
        picked = [j % 2000 for j in range(i, i + 7)]
        file.write(np.asarray(picked), rows_of(picked))
        i += 7
        print(i, flush=True)
    """
)


@pytest.mark.slow
def test_writers_killed_at_random_moments_leave_every_row_right_or_a_miss(tmp_path: Path) -> None:
    script = KILLED_WRITER.format(repo=str(REPO), directory=str(tmp_path))
    rng = np.random.default_rng(5)
    for _ in range(3):
        child = zygote.start(["-c", script], env=dict(os.environ), cwd=os.getcwd(), stdout=subprocess.PIPE)
        assert child.stdout is not None
        for _ in range(int(rng.integers(1, 40))):
            child.stdout.readline()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        file = RowsFile.open(tmp_path / "rows.tcrows")
        found = read_all(file, list(range(2000)))
        assert found and all(data == bytes(row(i)) for i, data in found.items())
        assert file.damaged().tolist() == []
        file.close()


def test_the_header_is_canonical_json_and_no_file_can_run_code(tmp_path: Path) -> None:
    file = RowsFile.create(tmp_path / "rows.tcrows", {"b": 1, "a": [1, 2]}, 4, 8)
    file.close()
    data = (tmp_path / "rows.tcrows").read_bytes()
    assert b'{"a":[1,2],"b":1}' in data[:200]
    opened = RowsFile.open(tmp_path / "rows.tcrows")
    assert opened.header == {"a": [1, 2], "b": 1} and json.dumps(opened.header)
    opened.close()
