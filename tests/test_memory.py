"""The memory tier: slabs of item outputs under a byte budget with MRU eviction."""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import traced_memory
from torchcache.tiers import memory
from torchcache.tiers.batch import run_start
from torchcache.tiers.memory import CAPACITY_OVERHEAD, ENTRY_BYTES, Slab
from torchcache.tree import Layout, flatten

#: The tier with its index left out of the budget: the slab arithmetic below counts rows only.
MemoryTier = functools.partial(memory.MemoryTier, entry_bytes=0)


def _layout(output: Any, cache_dtype: torch.dtype | None = None) -> tuple[Layout, list[torch.Tensor]]:
    spec, leaves = flatten(output)
    return Layout.of(spec, leaves, cache_dtype), leaves


def _keys(*names: int | str) -> list[bytes]:
    return [f"key-{n}".encode() for n in names]


def _batch(n: int, start: int = 0) -> torch.Tensor:
    """``n`` items of 4 float32 (16 bytes each), item ``i`` filled with ``start + i``."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 4).contiguous()


ROW = 16  # bytes of one item of _batch


def _stored(tier: MemoryTier, key: bytes) -> list[torch.Tensor] | None:
    """The stored leaves of one entry, or ``None``."""
    (hit,) = tier.find([key])
    if hit is None:
        return None
    slab, row = hit
    return [leaf[row] for leaf in slab.leaves]


def _put(tier: MemoryTier, keys: list[bytes], values: torch.Tensor) -> int:
    layout, leaves = _layout(values)
    return tier.put(keys, layout, leaves)


def test_put_and_find() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    keys = _keys(0, 1, 2)
    values = _batch(3, start=10)
    assert _put(tier, keys, values) == 3
    assert len(tier) == 3
    for key, value in zip(keys, values):
        assert key in tier
        stored = _stored(tier, key)
        assert stored is not None
        assert torch.equal(stored[0], value)
    assert tier.find(_keys(7)) == [None]
    found = tier.find([keys[2], b"missing", keys[0]])
    assert found[1] is None
    assert found[0] is not None and found[2] is not None
    assert found[0][0] is found[2][0]


def test_stored_values_are_copies() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    values = _batch(2)
    _put(tier, _keys(0, 1), values)
    values.fill_(99.0)
    stored = _stored(tier, _keys(1)[0])
    assert stored is not None
    assert torch.equal(stored[0], torch.ones(4))


def test_nested_outputs_and_cache_dtype() -> None:
    emb, ids, flags = torch.randn(3, 5), torch.arange(6).reshape(3, 2), torch.tensor([True, False, True])
    output = {"emb": emb, "ids": (ids, flags)}
    layout, leaves = _layout(output, cache_dtype=torch.float16)
    tier = MemoryTier(max_bytes=1000)
    assert tier.put(_keys(0, 1, 2), layout, leaves) == 3
    assert tier.nbytes == 3 * layout.nbytes == 3 * (5 * 2 + 2 * 8 + 1)
    stored = _stored(tier, _keys(1)[0])
    assert stored is not None
    assert stored[0].dtype == torch.float16
    assert torch.equal(stored[0], emb[1].half())
    assert torch.equal(stored[1], ids[1])
    assert torch.equal(stored[2], flags[1])


def test_discard() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    _put(tier, _keys(0, 1, 2), _batch(3))
    tier.discard(_keys(1)[0])
    tier.discard(b"never stored")
    assert _keys(1)[0] not in tier
    assert tier.find(_keys(1)) == [None]
    assert len(tier) == 2
    assert tier.nbytes == 2 * ROW
    stored = _stored(tier, _keys(2)[0])
    assert stored is not None and torch.equal(stored[0], torch.full((4,), 2.0))


def test_clear() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    _put(tier, _keys(0, 1, 2), _batch(3))
    tier.clear()
    assert len(tier) == 0
    assert tier.nbytes == 0
    assert tier.find(_keys(0, 1, 2)) == [None, None, None]
    assert _put(tier, _keys(5), _batch(1, start=5)) == 1
    stored = _stored(tier, _keys(5)[0])
    assert stored is not None and torch.equal(stored[0], torch.full((4,), 5.0))


def test_items_larger_than_the_budget_are_not_stored() -> None:
    tier = MemoryTier(max_bytes=ROW - 1)
    assert _put(tier, _keys(0, 1), _batch(2)) == 0
    assert len(tier) == 0
    assert tier.nbytes == 0


def test_items_larger_than_the_budget_do_not_evict_others() -> None:
    tier = MemoryTier(max_bytes=3 * ROW)
    _put(tier, _keys(0, 1), _batch(2))
    big, leaves = _layout(torch.zeros(1, 100))
    assert tier.put(_keys("big"), big, leaves) == 0
    assert len(tier) == 2


def test_zero_budget_stores_nothing() -> None:
    tier = MemoryTier(max_bytes=0)
    assert _put(tier, _keys(0), _batch(1)) == 0
    assert len(tier) == 0
    assert tier.nbytes == 0
    assert tier.find(_keys(0)) == [None]


def test_a_batch_larger_than_the_budget_stores_what_fits() -> None:
    tier = MemoryTier(max_bytes=5 * ROW)
    keys = _keys(*range(12))
    assert _put(tier, keys, _batch(12)) == 5
    assert tier.nbytes == 5 * ROW
    found = [k for k in keys if k in tier]
    assert len(found) == 5
    for key in found:
        stored = _stored(tier, key)
        assert stored is not None
        assert torch.equal(stored[0], torch.full((4,), float(keys.index(key))))


def test_exact_fit() -> None:
    tier = MemoryTier(max_bytes=3 * ROW)
    assert _put(tier, _keys(0, 1, 2), _batch(3)) == 3
    assert tier.nbytes == tier.max_bytes


def test_mru_eviction() -> None:
    tier = MemoryTier(max_bytes=3 * ROW)
    _put(tier, _keys("a", "b", "c"), _batch(3))
    tier.find(_keys("a"))  # a is now the most recently used
    assert _put(tier, _keys("d"), _batch(1, start=3)) == 1
    assert [k in tier for k in _keys("a", "b", "c", "d")] == [False, True, True, True]
    assert _put(tier, _keys("e"), _batch(1, start=4)) == 1  # d was the most recent
    assert [k in tier for k in _keys("b", "c", "d", "e")] == [True, True, False, True]
    tier.find(_keys("b", "c"))  # c is the most recent, then b
    assert _put(tier, _keys("f", "g"), _batch(2, start=5)) == 2
    assert [k in tier for k in _keys("b", "c", "e", "f", "g")] == [False, False, True, True, True]


def test_keys_already_present_are_skipped() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    _put(tier, _keys("a"), _batch(1, start=1))
    assert _put(tier, _keys("a", "b"), _batch(2, start=7)) == 1
    assert len(tier) == 2
    stored_a, stored_b = _stored(tier, _keys("a")[0]), _stored(tier, _keys("b")[0])
    assert stored_a is not None and torch.equal(stored_a[0], torch.full((4,), 1.0))
    assert stored_b is not None and torch.equal(stored_b[0], torch.full((4,), 8.0))
    assert tier.nbytes == 2 * ROW


def test_duplicate_keys_in_one_batch_are_stored_once() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    assert _put(tier, _keys("a", "b", "a", "b", "c"), _batch(5)) == 3
    assert tier.nbytes == 3 * ROW
    stored = _stored(tier, _keys("a")[0])
    assert stored is not None and torch.equal(stored[0], torch.zeros(4))


def test_slab_rows_are_reused_after_eviction() -> None:
    tier = MemoryTier(max_bytes=4 * ROW)
    keys = _keys(0, 1, 2, 3)
    _put(tier, keys, _batch(4))
    hits = tier.find(keys)
    assert all(h is not None for h in hits)
    slab: Slab = hits[0][0]  # type: ignore[index]
    rows = {h[1] for h in hits if h is not None}
    assert len(rows) == 4
    capacity = slab.capacity
    for i in range(4, 40):
        assert _put(tier, _keys(i), _batch(1, start=i)) == 1
        (hit,) = tier.find(_keys(i))
        assert hit is not None
        assert hit[0] is slab
        assert hit[1] in rows
        assert slab.capacity == capacity
        assert torch.equal(slab.leaves[0][hit[1]], torch.full((4,), float(i)))
    assert len(tier) == 4


def test_discarded_rows_are_reused() -> None:
    tier = MemoryTier(max_bytes=100 * ROW)
    _put(tier, _keys(*range(20)), _batch(20))
    hits = tier.find(_keys(*range(20)))
    slab: Slab = hits[0][0]  # type: ignore[index]
    used = {h[1] for h in hits if h is not None}
    capacity = slab.capacity
    for i in range(0, 20, 2):
        tier.discard(_keys(i)[0])
    _put(tier, _keys(*range(100, 110)), _batch(10))
    new = tier.find(_keys(*range(100, 110)))
    assert {h[1] for h in new if h is not None} <= used
    assert slab.capacity == capacity


def _first_leaf_ref(tier: MemoryTier, key: bytes) -> weakref.ref[torch.Tensor]:
    (hit,) = tier.find([key])
    assert hit is not None
    return weakref.ref(hit[0].leaves[0])


def test_a_slab_is_released_when_its_last_row_is_discarded() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    _put(tier, _keys(0, 1), _batch(2))
    ref = _first_leaf_ref(tier, _keys(0)[0])
    tier.discard(_keys(0)[0])
    gc.collect()
    assert ref() is not None  # one row is still live
    tier.discard(_keys(1)[0])
    gc.collect()
    assert ref() is None


def test_a_slab_is_released_when_its_last_row_is_evicted() -> None:
    tier = MemoryTier(max_bytes=4 * ROW)
    _put(tier, _keys(0, 1), _batch(2))
    ref = _first_leaf_ref(tier, _keys(0)[0])
    other, leaves = _layout(torch.zeros(4, 2, 2, dtype=torch.int32))  # 16 bytes, another layout
    assert tier.put(_keys("x", "y", "z", "w"), other, leaves) == 4
    assert _keys(0)[0] not in tier and _keys(1)[0] not in tier
    gc.collect()
    assert ref() is None
    assert tier.nbytes == 4 * other.nbytes


def test_a_released_slab_is_not_reused() -> None:
    tier = MemoryTier(max_bytes=10 * ROW)
    _put(tier, _keys(0), _batch(1))
    (old,) = tier.find(_keys(0))
    assert old is not None
    tier.discard(_keys(0)[0])
    _put(tier, _keys(1), _batch(1, start=1))
    (new,) = tier.find(_keys(1))
    assert new is not None
    assert new[0] is not old[0]


def test_layouts_get_separate_slabs_under_one_budget() -> None:
    tier = MemoryTier(max_bytes=6 * ROW)
    ints, int_leaves = _layout(torch.arange(8, dtype=torch.int64).reshape(2, 2, 2))  # 32 bytes
    _put(tier, _keys("f0", "f1", "f2"), _batch(3))
    assert tier.put(_keys("i0"), ints, [int_leaves[0][:1]]) == 1  # 48 + 32 bytes fit together
    (f_hit,) = tier.find(_keys("f0"))
    (i_hit,) = tier.find(_keys("i0"))
    assert f_hit is not None and i_hit is not None
    assert f_hit[0] is not i_hit[0]
    assert tier.nbytes == 3 * ROW + 32
    assert torch.equal(i_hit[0].leaves[0][i_hit[1]], int_leaves[0][0])
    # the next int row does not fit: the most recently used entry goes, whatever its layout
    tier.find(_keys("f0"))
    assert tier.put(_keys("i1"), ints, [int_leaves[0][1:]]) == 1
    assert tier.nbytes <= tier.max_bytes
    assert [k in tier for k in _keys("f0", "f1", "f2", "i0", "i1")] == [False, True, True, True, True]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 12),
    st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "find", "discard"]),
            st.lists(st.integers(0, 15), min_size=1, max_size=6),
            st.sampled_from([0, 1]),
        ),
        max_size=30,
    ),
)
def test_budget_and_contents_under_random_use(budget_rows: int, ops: list[tuple[str, list[int], int]]) -> None:
    layouts = [_layout(_batch(1)), _layout(torch.zeros(1, 3, dtype=torch.float64))]  # 16 and 24 bytes
    tier = MemoryTier(max_bytes=budget_rows * ROW)
    values: dict[bytes, tuple[int, float]] = {}
    for op, ids, which in ops:
        keys = [str(i).encode() for i in ids]
        if op == "put":
            layout, _ = layouts[which]
            fill = torch.tensor([float(i) for i in ids])
            leaf = fill.reshape(-1, *([1] * len(layout.leaves[0].shape))).expand(len(ids), *layout.leaves[0].shape)
            leaf = leaf.to(layout.leaves[0].out_dtype)
            new = [k for k in dict.fromkeys(keys) if k not in tier]
            stored = tier.put(keys, layout, [leaf])
            assert stored == min(len(new), tier.max_bytes // layout.nbytes)
            for key, i in zip(keys, ids):
                if key in new[:stored]:
                    values[key] = (which, float(i))
        elif op == "find":
            tier.find(keys)
        else:
            for key in keys:
                tier.discard(key)
        for key in list(values):
            if key not in tier:
                del values[key]
        assert tier.nbytes <= tier.max_bytes
        assert len(tier) == len(values)
        assert tier.nbytes == sum(layouts[w][0].nbytes for w, _ in values.values())
        for key, (which_, fill_) in values.items():
            stored_leaves = _stored(tier, key)
            assert stored_leaves is not None
            assert torch.all(stored_leaves[0] == fill_)
            assert stored_leaves[0].shape == layouts[which_][0].leaves[0].shape


@pytest.mark.parametrize("n", [1, 5, 13])
def test_nbytes_is_entries_times_layout_bytes(n: int) -> None:
    output = (torch.zeros(n, 3), torch.zeros(n, 1, dtype=torch.int8))  # 13 bytes, 16 with padding
    layout, leaves = _layout(output)
    assert layout.nbytes == 13
    tier = MemoryTier(max_bytes=1000)
    tier.put(_keys(*range(n)), layout, leaves)
    assert tier.nbytes == len(tier) * layout.nbytes == n * 13


def test_repr_mentions_budget_and_usage() -> None:
    tier = MemoryTier(max_bytes=12345)
    _put(tier, _keys(0), _batch(1))
    text = repr(tier)
    assert "12345" in text
    assert str(ROW) in text


# -- the slabs' footprint stays within the budget ---------------------------------------------
def _allocated(tier: MemoryTier) -> int:
    """Bytes the slabs' tensors allocate, measured on the tensors themselves."""
    return sum(leaf.numel() * leaf.element_size() for slab in tier.slabs() for leaf in slab.leaves)


def _assert_within_budget(tier: MemoryTier) -> None:
    allocated = _allocated(tier)
    assert allocated == tier.allocated_bytes
    held = allocated + len(tier) * tier.entry_bytes  # the slabs, and the index
    assert held <= tier.max_bytes * (1 + CAPACITY_OVERHEAD), (held, tier.max_bytes)


def _shaped(n: int, width: int, start: int) -> torch.Tensor:
    """``n`` items of ``width`` float32, item ``i`` filled with ``start + i``."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, width).contiguous()


def test_slabs_of_many_shapes_stay_within_the_budget() -> None:
    # progressive resizing: many batches of each shape in turn; one batch of every old
    # shape stays and is never touched again
    widths = [4, 8, 12, 16, 24, 32, 48]
    tier = MemoryTier(max_bytes=4096)
    expected: dict[bytes, tuple[int, float]] = {}
    start = 0
    for width in widths:
        for _ in range(12):
            keys = _keys(*range(start, start + 8))
            assert _put(tier, keys, _shaped(8, width, start)) == 8
            expected.update({key: (width, float(start + i)) for i, key in enumerate(keys)})
            start += 8
            _assert_within_budget(tier)
            assert tier.nbytes <= tier.max_bytes
            for key in [k for k in expected if k not in tier]:
                del expected[key]
            for key, (w, fill) in expected.items():
                stored = _stored(tier, key)
                assert stored is not None
                assert torch.equal(stored[0], torch.full((w,), fill))
    assert len({slab.layout for slab in tier.slabs()}) > 1  # old shapes kept their last batches


def test_a_slab_holding_few_live_rows_is_compacted_when_another_needs_the_room() -> None:
    tier = MemoryTier(max_bytes=64 * ROW)
    _put(tier, _keys(*range(64)), _batch(64))  # one slab takes the whole budget
    for i in range(4, 64):
        tier.discard(_keys(i)[0])
    (old,) = tier.find(_keys(0))
    assert old is not None and old[0].capacity == 64
    wide, leaves = _layout(torch.ones(48, 4, dtype=torch.int32))  # 16-byte rows of another layout
    assert tier.put(_keys(*range(100, 148)), wide, leaves) == 48
    _assert_within_budget(tier)
    (moved,) = tier.find(_keys(0))
    assert moved is not None and moved[0] is old[0]
    assert old[0].capacity == 4  # the four live rows, moved together
    for i in range(4):
        stored = _stored(tier, _keys(i)[0])
        assert stored is not None and torch.equal(stored[0], torch.full((4,), float(i)))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(st.tuples(st.integers(0, 4), st.integers(1, 12), st.booleans()), max_size=40),
    st.sampled_from([0, 24]),
)
def test_slab_capacity_stays_within_the_budget_under_random_use(
    budget_rows: int, ops: list[tuple[int, int, bool]], entry_bytes: int
) -> None:
    widths = [1, 2, 3, 5, 8]  # float32 items of 4 to 32 bytes
    tier = memory.MemoryTier(max_bytes=budget_rows * ROW * (1 + entry_bytes // 8), entry_bytes=entry_bytes)
    expected: dict[bytes, tuple[int, float]] = {}
    counter = 0
    for which, n, discard in ops:
        if discard and expected:
            key = next(iter(expected))
            tier.discard(key)
        else:
            keys = _keys(*range(counter, counter + n))
            stored = _put(tier, keys, _shaped(n, widths[which], counter))
            assert stored == min(n, tier.max_bytes // (4 * widths[which] + entry_bytes))
            expected.update({keys[i]: (widths[which], float(counter + i)) for i in range(n)})
            counter += n
        _assert_within_budget(tier)
        for key in [k for k in expected if k not in tier]:
            del expected[key]
        assert len(tier) == len(expected)
        for key, (width, fill) in expected.items():
            stored_leaves = _stored(tier, key)
            assert stored_leaves is not None
            assert torch.equal(stored_leaves[0], torch.full((width,), fill))


def test_the_index_of_tiny_entries_is_charged_to_the_budget() -> None:
    tier = memory.MemoryTier(1_000_000)  # 4-byte outputs: the index is most of what an entry costs
    x = torch.arange(20_000, dtype=torch.float32).reshape(-1, 1)
    spec, leaves = flatten(x)
    layout = Layout.of(spec, leaves, None)
    with traced_memory() as traced_now:
        for start in range(0, len(x), 1000):  # five times what fits: entries come and go
            tier.put([start.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(1000)], layout, [x[:1000]])
        traced = traced_now()[0]  # the index, keys included (the slabs are torch's)
    assert len(tier) == 1_000_000 // (4 + ENTRY_BYTES) and tier.nbytes <= tier.max_bytes
    assert traced + tier.allocated_bytes <= tier.max_bytes


def test_the_index_of_new_entries_takes_its_room_from_rows_left_unused() -> None:
    tier = memory.MemoryTier(20_000)
    wide, tiny = torch.zeros(5, 250), torch.zeros(5, 1)
    for i, leaf in enumerate((wide, tiny, wide)):  # the last evicts wide rows and reuses their room in the slab
        tier.put(_keys(*range(10 * i, 10 * i + 5)), Layout.of("T", [leaf], None), [leaf])
        assert tier.allocated_bytes + len(tier) * ENTRY_BYTES <= tier.max_bytes


@pytest.mark.parametrize("freed", [[], [3, 1], [5, 6, 7], [7, 0, 4]])
def test_a_batch_lands_in_its_rows_whether_they_are_one_run_or_scattered(freed: list[int]) -> None:
    tier = MemoryTier(max_bytes=100 * ROW)
    _put(tier, _keys(*range(8)), _batch(8))
    for i in freed:
        tier.discard(_keys(i)[0])
    new = list(range(100, 100 + len(freed) + 3))  # the freed rows first, then new ones at the end
    assert _put(tier, _keys(*new), _batch(len(new), start=100)) == len(new)
    for i in [*new, *(i for i in range(8) if i not in freed)]:
        stored = _stored(tier, _keys(i)[0])
        assert stored is not None and torch.equal(stored[0], torch.full((4,), float(i)))


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], None), ([4], 4), ([4, 5, 6], 4), ([4, 6, 7], None), ([6, 5, 4], None), ([4, 4, 5], None), ([0, 2, 2], None)],
)
def test_run_start(values: list[int], expected: int | None) -> None:
    assert run_start(values) == expected
