"""The oracle: a decorated module returns exactly what its plain twin returns; MRU hit rates."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import (
    ConvBackbone,
    Counting,
    MultiOut,
    assert_all_entries_decode,
    assert_same,
    cached,
    disk_bytes,
    entry_files,
    stored_entries,
)
from torchcache import torchcache
from torchcache.stores.packed.format import HEADER
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES
from torchcache.tiers.memory import ENTRY_BYTES

POOL = 24
#: What the packed store charges an entry's budget besides its frame: the record
#: header, the key (32 hex digits in 16 bytes) and the index's share.
ENTRY_OVERHEAD = HEADER.size + 16 + INDEX_ENTRY_BYTES

CONFIGS: dict[str, dict[str, Any]] = {
    "memory": {},
    "memory-small": {"max_memory_cache_size": "small"},
    "disk": {"persistent": True, "max_memory_cache_size": 0},
    "disk-small": {"persistent": True, "max_memory_cache_size": 0, "max_persistent_cache_size": "small"},
    "both-small": {"persistent": True, "max_memory_cache_size": "small", "max_persistent_cache_size": "small"},
}

MODULES: dict[str, tuple[type[torch.nn.Module], tuple[int, ...]]] = {
    "linear": (Counting, (4,)),
    "nested": (MultiOut, (4,)),
    "conv": (ConvBackbone, (3, 8, 8)),
}


def charged_bytes(root: Path) -> int:
    """What the entries under ``root`` cost the budget of their store (frames and overhead)."""
    return sum(len(frame) + ENTRY_OVERHEAD for frame in stored_entries(root).values())


def _item_bytes(output: Any) -> int:
    if isinstance(output, torch.Tensor):
        return output[0].numel() * output.element_size()
    values = output.values() if isinstance(output, dict) else output
    return sum(_item_bytes(v) for v in values)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("module", list(MODULES))
def test_outputs_equal_the_plain_module(config: str, module: str, cache_root: Path) -> None:
    base, item_shape = MODULES[module]
    plain = base()
    pool = torch.randn(POOL, *item_shape)
    item = _item_bytes(plain(pool[:1]))
    options = dict(CONFIGS[config])
    for name in ("max_memory_cache_size", "max_persistent_cache_size"):
        if options.get(name) == "small":  # room for about a third of the pool
            options[name] = (item + (ENTRY_BYTES if name == "max_memory_cache_size" else 400)) * POOL // 3
    model = cached(base, **options)()
    rng = random.Random(f"{config}-{module}")
    for step in range(30):
        size = rng.randint(1, 10)
        index = torch.tensor([rng.randrange(POOL) for _ in range(size)])
        assert_same(model(pool[index]), plain(pool[index]))
        if step % 2 and options.get("persistent"):
            model.cache_instance.flush()

    stats = model.cache_instance.stats()
    assert stats.hits > 0 and stats.misses > 0
    assert model.items == stats.misses  # only misses reach the module
    if stats.disk is not None:
        model.cache_instance.flush()
        assert stats.disk.hits > 0
        assert_all_entries_decode(cache_root)
        disk = model.cache_instance.stats().disk
        assert disk is not None and disk.bytes == disk_bytes(cache_root)
        assert charged_bytes(cache_root) <= stats.disk.max_bytes
    assert stats.memory.bytes <= stats.memory.max_bytes

    if stats.disk is not None:  # a fresh instance reads what the first one left
        stored = len(entry_files(cache_root))
        fresh = cached(base, **options)()
        assert_same(fresh(pool), plain(pool))
        assert fresh.cache_instance.stats().hits == stored > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(
        st.tuples(
            st.lists(st.integers(0, 11), min_size=1, max_size=8),
            st.sampled_from([None, 0, 1, 1.0, True, "1", (1, 2)]),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    ),
    budget_items=st.integers(0, 14),
)
def test_function_with_several_arguments_equals_the_plain_function(
    batches: list[tuple[list[int], Any, bool]], budget_items: int
) -> None:
    xs, ys = torch.randn(12, 3), torch.randn(12).double()

    def plain(x: torch.Tensor, y: torch.Tensor, option: Any = None, *, squared: bool = False) -> Any:
        tag = len(repr(option)) + 0.25 * len(type(option).__name__)  # differs for every option
        base = x * y[:, None] if not squared else (x * y[:, None]) ** 2
        return {"out": base + tag, "rest": [y * 2, (x > 0).sum(dim=1)]}

    fn = torchcache(max_memory_cache_size=budget_items * (3 * 8 + 8 + 8))(plain)
    for index, option, squared in batches:
        i = torch.tensor(index)
        assert_same(fn(xs[i], ys[i], option, squared=squared), plain(xs[i], ys[i], option, squared=squared))


# -- MRU: shuffled epochs over N items with room for C settle near hit rate C / N ----------
N_ITEMS, ROOM, BATCH, EPOCHS, MEASURED = 120, 30, 10, 8, 3


def _epochs(model: Any, plain: Any, pool: torch.Tensor, after_batch: Any) -> float:
    """Run shuffled epochs; return the hit rate over the last MEASURED epochs."""
    gen = torch.Generator().manual_seed(1)
    hits_before = 0
    for epoch in range(EPOCHS):
        if epoch == EPOCHS - MEASURED:
            hits_before = model.cache_instance.stats().hits
        order = torch.randperm(N_ITEMS, generator=gen)
        for start in range(0, N_ITEMS, BATCH):
            index = order[start : start + BATCH]
            assert_same(model(pool[index]), plain(pool[index]))
            after_batch()
    return (model.cache_instance.stats().hits - hits_before) / (MEASURED * N_ITEMS)


def test_memory_tier_mru_hit_rate() -> None:
    plain = Counting()
    pool = torch.randn(N_ITEMS, 4)
    item = _item_bytes(plain(pool[:1])) + ENTRY_BYTES  # its rows, and its index
    limit = ROOM * item
    model = cached(Counting, max_memory_cache_size=limit)()

    def check() -> None:
        memory = model.cache_instance.stats().memory
        assert memory.bytes <= limit
        assert memory.entries <= ROOM

    rate = _epochs(model, plain, pool, check)
    assert model.cache_instance.stats().memory.entries == ROOM
    assert rate == pytest.approx(ROOM / N_ITEMS, abs=0.1)


def test_disk_tier_mru_hit_rate(cache_root: Path, tmp_path: Path) -> None:
    plain = Counting()
    pool = torch.randn(N_ITEMS, 4)
    probe = cached(Counting, persistent=True, persistent_cache_dir=tmp_path / "probe")()
    probe(pool)
    probe.cache_instance.flush()
    costs = [len(frame) + ENTRY_OVERHEAD for frame in stored_entries(tmp_path / "probe").values()]
    assert len(costs) == N_ITEMS
    limit = ROOM * max(costs)
    model = cached(Counting, persistent=True, max_memory_cache_size=0, max_persistent_cache_size=limit)()

    def check() -> None:
        model.cache_instance.flush()
        assert charged_bytes(cache_root) <= limit

    rate = _epochs(model, plain, pool, check)
    room = len(entry_files(cache_root))
    # the store evicts whole segments (1/16 of so small a budget), so it may keep a few
    # entries fewer than fit
    assert ROOM * 3 // 4 <= room <= limit // min(costs)
    assert rate == pytest.approx(room / N_ITEMS, abs=0.1)
    assert model.cache_instance.stats().memory.hits == 0


@pytest.mark.parametrize("config", ["memory-small", "both-small"])
def test_threads_calling_one_cached_module_get_the_plain_outputs(config: str, cache_root: Path) -> None:
    import threading

    options = dict(CONFIGS[config])
    item = 16 * 4  # Counting returns 16 float32 per item
    for name in ("max_memory_cache_size", "max_persistent_cache_size"):
        if options.get(name) == "small":
            index = ENTRY_BYTES if name == "max_memory_cache_size" else 0
            options[name] = 10 * (item + index)  # far fewer than the pool: constant eviction
    model = cached(Counting, **options)()
    plain = Counting()
    pool = torch.randn(POOL, 4)
    expected = plain(pool)
    errors: list[str] = []
    requested: list[int] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            idx = rng.sample(range(POOL), rng.randint(1, 12))
            requested.append(len(idx))
            got = model(pool[idx])
            if not torch.equal(got, expected[idx]):
                errors.append(f"thread {seed}: wrong outputs for items {idx}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model.cache_instance.flush()
    assert errors == []
    stats = model.cache_instance.stats()
    assert stats.hits + stats.misses == sum(requested)
    assert stats.misses == model.items
    if options.get("persistent"):
        assert_all_entries_decode(cache_root)
