"""The packed store's batch fast path: found entries as arrays, checked with numpy, or a refusal.

``get_rows`` serves a batch whose found payloads share one length; anything it cannot
check as arrays makes it return ``None`` and report nothing, so that ``get_many`` reads
the batch and reports what it finds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.store_helpers import Reports, key, value
from torchcache.stores.packed.format import HEADER, segment_name
from torchcache.stores.packed.store import PackedStore

HEAD = 12


def head(_: memoryview) -> int:
    return HEAD


@pytest.fixture
def reports() -> Reports:
    return Reports()


@pytest.fixture
def store(tmp_path: Path, reports: Reports) -> PackedStore:
    made = PackedStore(tmp_path / "store", 10**8, report=reports)
    made.put_many([(key(i), value(i)) for i in range(200)])
    made.flush()
    return made


def _flip(store: PackedStore, i: int, at: int) -> None:
    seg, offset, _ = _locate(store, i)
    path = store.directory / segment_name(seg)
    with open(path, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _locate(store: PackedStore, i: int) -> tuple[int, int, int]:
    from torchcache.stores.packed.format import encode_key
    from torchcache.stores.packed.index import ENTRY

    index = store._handle.ensure(write=False)
    assert index is not None
    with index.begin() as txn:
        raw = txn.get(encode_key(key(i)))
    assert raw is not None
    return ENTRY.unpack(raw)


def test_found_entries_come_back_as_arrays_equal_to_get_many(store: PackedStore) -> None:
    ids = [5, 1000, 17, 199, 3, 1001, 42]  # 1000 and 1001 are misses
    got = store.get_rows([key(i) for i in ids], head)
    assert got is not None
    positions, heads, rows = got
    assert positions.tolist() == [0, 2, 3, 4, 6]
    expected = [value(ids[p]) for p in positions.tolist()]
    assert heads.shape == (5, HEAD) and rows.shape == (5, 1000 - HEAD)
    assert [bytes(h) + bytes(r) for h, r in zip(heads, rows)] == expected
    assert [bytes(v) for v in store.get_many([key(ids[p]) for p in positions.tolist()])] == expected  # type: ignore[arg-type]
    assert store.get_rows([key(1000)], head)[0].tolist() == []  # type: ignore[index]


def test_payloads_of_several_lengths_are_left_to_get_many(store: PackedStore) -> None:
    store.put_many([(key(500), value(500, 700))])
    assert store.get_rows([key(1), key(500)], head) is None
    assert [bytes(v) for v in store.get_many([key(1), key(500)])] == [value(1), value(500, 700)]  # type: ignore[arg-type]


@pytest.mark.parametrize("at", [0, 2, 3, 7, HEADER.size, HEADER.size + 16, HEADER.size + 16 + HEAD + 500])
def test_a_damaged_record_is_left_to_get_many_which_reports_it(store: PackedStore, reports: Reports, at: int) -> None:
    _flip(store, 42, at)  # magic, key length, payload length, checksum, key, payload
    assert store.get_rows([key(i) for i in (40, 41, 42, 43)], head) is None
    assert reports.seen == []
    got = store.get_many([key(i) for i in (40, 41, 42, 43)])
    assert got[2] is None and [bytes(v) for v in (got[0], got[1], got[3])] == [value(40), value(41), value(43)]  # type: ignore[arg-type]
    assert reports.kinds() == ["corrupt"]


def test_a_segment_cut_short_is_left_to_get_many(store: PackedStore) -> None:
    seg, offset, _ = _locate(store, 199)
    os.truncate(store.directory / segment_name(seg), offset + 100)
    assert store.get_rows([key(i) for i in (1, 199)], head) is None
    got = store.get_many([key(i) for i in (1, 199)])
    assert bytes(got[0]) == value(1) and got[1] is None  # type: ignore[arg-type]


def test_a_head_it_cannot_size_is_left_to_get_many(store: PackedStore) -> None:
    assert store.get_rows([key(1), key(2)], lambda payload: None) is None
    assert store.get_rows([key(1), key(2)], lambda payload: len(payload) + 1) is None


def test_keys_of_another_width_or_a_batch_with_nothing_found(store: PackedStore) -> None:
    assert store.get_rows([], head) is None
    positions, heads, rows = store.get_rows([key(2000), key(2001)], head)  # type: ignore[misc]
    assert positions.tolist() == [] and heads.size == 0 and rows.size == 0
    mixed = store.get_rows([key(1), "abcd"], head)
    assert mixed is None


def test_rows_span_several_segments(tmp_path: Path) -> None:
    store = PackedStore(tmp_path / "store", 10**8, segment_bytes=64 * 1024, report=Reports())
    store.put_many([(key(i), value(i)) for i in range(300)])
    store.flush()
    ids = np.random.default_rng(0).permutation(300)[:128].tolist()
    got = store.get_rows([key(i) for i in ids], head)
    assert got is not None
    positions, heads, rows = got
    assert positions.tolist() == list(range(128))
    assert [bytes(h) + bytes(r) for h, r in zip(heads, rows)] == [value(i) for i in ids]
