"""Bounded memory: a cached call keeps no batch's outputs alive beyond what the memory tier holds.

Outputs must be freed by reference counting alone, the moment the caller drops them: a
reference cycle on the per-call path would keep every batch's tensors until the cyclic
garbage collector runs, so resident memory would grow far past ``max_memory_cache_size``.
These tests run with the cyclic collector off, so such a cycle shows as a leak.
"""

from __future__ import annotations

import gc
import os
import types
import weakref
from collections.abc import Iterator
from typing import cast

import pytest
import torch
from torch import nn

from torchcache import torchcache
from torchcache.module.engine import Cache
from torchcache.tiers.memory import ENTRY_BYTES
from torchcache.tree import flatten, leaf_paths, unflatten

BUDGET = 20_000_000
#: What a cached call may hold beyond the memory tier's budget: 10% of it, and 50 MB for the
#: allocator's free lists, torch's own caches and the interpreter.
OVERHEAD = BUDGET // 10 + 50_000_000
BATCHES = 150  # a leak of every batch would hold about 150 MB, three times what OVERHEAD allows


def _rss() -> int:
    """Resident bytes of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cache(module: nn.Module) -> Cache:
    return cast(Cache, module.cache_instance)


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector off (collected before, and turned back on after)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@torchcache(max_memory_cache_size=BUDGET, persistent=False)
class Widening(nn.Module):
    """A frozen module whose output width follows its input's first column (1 to 8 times 1,024 floats)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, None]]:
        times = 64 * (1 + int(x[0, 0]))
        wide = x.repeat(1, times) * self.scale
        return {"wide": wide, "pair": (x.sum(dim=1), None)}


def _batch(i: int) -> torch.Tensor:
    """64 new items of 16 floats; the first column picks the output width."""
    x = torch.randn(64, 16)
    x[:, 0] = i % 8
    return x


def test_outputs_are_freed_without_the_cyclic_collector(no_cyclic_gc: None) -> None:
    module = Widening()
    for i in range(8):  # the first calls set up what every call reuses (one of each width)
        module(_batch(i))
    before = _rss()
    outputs: list[weakref.ref[torch.Tensor]] = []
    inputs: list[torch.Tensor] = []
    for i in range(BATCHES):
        x = _batch(i)
        out = module(x)
        assert torch.equal(out["wide"][:, :16], x)
        outputs.append(weakref.ref(out["wide"]))
        outputs.append(weakref.ref(out["pair"][0]))
        if i % 50 == 0:
            inputs.append(x)
        del out
    grown = _rss() - before
    alive = sum(ref() is not None for ref in outputs)
    assert alive == 0, f"{alive} output tensors of {BATCHES} batches are still alive"
    assert _cache(module).memory.allocated_bytes <= BUDGET
    assert grown <= BUDGET + OVERHEAD, f"resident memory grew by {grown / 1e6:.1f} MB"
    for x in inputs:  # the cache still serves what it kept
        assert torch.equal(module(x)["wide"][:, :16], x)


@pytest.mark.slow
def test_the_budget_holds_in_resident_memory_for_outputs_of_four_bytes() -> None:
    budget = 100_000_000  # entries of 4-byte outputs: the index is nearly all an entry costs

    @torchcache(max_memory_cache_size=budget, check_items=False)
    def total(x: torch.Tensor) -> torch.Tensor:
        return x.sum(1, keepdim=True)

    generator = torch.Generator().manual_seed(0)
    total(torch.randn(4096, 2, generator=generator))
    gc.collect()
    before = _rss()
    for _ in range(2 * budget // ENTRY_BYTES // 4096):  # twice what fits: entries come and go
        total(torch.randn(4096, 2, generator=generator))
    gc.collect()
    grown = _rss() - before
    tier = total.cache_instance.memory
    assert tier.nbytes <= budget and len(tier) > budget // (2 * ENTRY_BYTES)
    assert grown <= budget * 1.05 + 10_000_000, (
        f"resident memory grew by {grown / 1e6:.1f} MB for {len(tier):,} entries"
    )


def test_hits_are_freed_without_the_cyclic_collector(no_cyclic_gc: None) -> None:
    module = Widening()
    x = _batch(3)
    module(x)
    refs = []
    for _ in range(20):
        out = module(x)
        refs.append(weakref.ref(out["wide"]))
        del out
    assert _cache(module).stats().hits == 20 * 64
    assert all(ref() is None for ref in refs)


def test_tree_walks_leave_no_cycles(no_cyclic_gc: None) -> None:
    output = {"a": torch.zeros(2, 3), "b": (torch.ones(2), None, [torch.ones(2, 1)])}
    spec, leaves = flatten(output)
    refs = [weakref.ref(t) for t in leaves]
    rebuilt = unflatten(spec, leaves)
    assert leaf_paths(spec) == ["output['a']", "output['b'][0]", "output['b'][2][0]"]
    del output, leaves, rebuilt
    assert all(ref() is None for ref in refs)
    assert _cyclic_garbage_of_tree_walks() == []


def _cyclic_garbage_of_tree_walks() -> list[object]:
    """What a collection finds that a tree walk could have made: its frames, functions, specs and containers.

    Only those count: threads of other tests in this process may make garbage of their own.
    """
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [o for o in gc.garbage if _made_by_a_walk(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def _made_by_a_walk(o: object) -> bool:
    if isinstance(o, types.FrameType):
        return "torchcache" in o.f_code.co_filename
    if isinstance(o, types.FunctionType):
        return (o.__module__ or "").startswith("torchcache")
    if isinstance(o, dict):
        return any(isinstance(v, torch.Tensor) for v in o.values())
    if isinstance(o, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in o) or (bool(o) and o[0] in ("T", "N", "tuple", "list", "dict"))
    return False
