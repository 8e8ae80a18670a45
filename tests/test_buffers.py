"""Large output buffers are used again only once nothing refers to them."""

from __future__ import annotations

import gc
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import cached
from torchcache import _buffers
from torchcache._buffers import KEPT, MIN_BYTES, empty_rows


@pytest.fixture(autouse=True)
def _no_kept_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_buffers, "_kept", [])


def test_a_buffer_comes_back_only_once_every_view_of_it_is_gone() -> None:
    size = MIN_BYTES // 2
    rows = empty_rows(2, size)
    a = rows.ctypes.data
    tensor = torch.from_numpy(rows)[1, 8:].view(torch.float32)  # a tensor of a view of it
    del rows
    rows = empty_rows(2, size)
    b = rows.ctypes.data
    assert b != a  # the tensor holds the first
    del rows
    rows = empty_rows(2, size)
    assert rows.ctypes.data == b  # nothing holds the second
    storage = tensor.untyped_storage()
    del tensor, rows
    rows = empty_rows(2, size)
    assert rows.ctypes.data == b  # the storage alone holds the first
    del storage, rows
    assert empty_rows(2, size).ctypes.data == a


def test_at_most_kept_buffers_stay_and_small_ones_are_never_kept() -> None:
    held = [empty_rows(1, MIN_BYTES + i) for i in range(KEPT + 2)]  # each in use
    assert len(_buffers._kept) == KEPT
    del held
    gc.collect()
    assert all(b.nbytes >= MIN_BYTES for b in _buffers._kept) and len(_buffers._kept) == KEPT
    small = empty_rows(4, 16)
    assert small.shape == (4, 16) and small.dtype == np.uint8 and len(_buffers._kept) == KEPT
    again = empty_rows(1, MIN_BYTES + KEPT + 1)  # the size of the newest one kept: that one again
    assert again.base is _buffers._kept[-1]


def _take_one() -> None:
    assert empty_rows(1, MIN_BYTES).shape == (1, MIN_BYTES)


@pytest.mark.slow
def test_a_child_forked_while_the_lock_is_held_still_gets_buffers() -> None:
    with _buffers._lock:  # as another thread of this process may hold it at a fork
        child = multiprocessing.get_context("fork").Process(target=_take_one)
        child.start()
    child.join(60)
    assert child.exitcode == 0  # not None: the child did not wait on the lock it inherited


class Sparse(nn.Module):
    """About half of each output is zero: stored compressed, decoded into one buffer per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.randn(16384, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.repeat(1, 1024)) * self.scale


def test_disk_hits_held_by_the_caller_are_never_overwritten_by_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_buffers, "MIN_BYTES", 1024)  # every batch of rows through the kept buffers
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    wanted = [Sparse()(x) for x in batches]
    model = cached(Sparse, persistent=True, persistent_cache_dir=tmp_path, max_memory_cache_size=0)()
    for x in batches:
        model(x)
    model.cache_instance.flush()
    held = [model(x) for x in batches]  # each still referenced while the next ones are read
    assert model.cache_instance.stats().disk.hits == 32
    for got, want in zip(held, wanted):
        assert torch.equal(got, want)
    assert len(_buffers._kept) == KEPT  # the rows came from the kept buffers
    assert len({t.untyped_storage().data_ptr() for t in held}) == len(held)  # four batches alive: four buffers


class Flipped(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, [-1])  # any dtype, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.bool, torch.complex64])
def test_memory_hits_come_in_kept_buffers_and_those_held_are_never_overwritten(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(_buffers, "MIN_BYTES", 1024)  # every batch of hits through the kept buffers
    drawn = [torch.randn(8, 3, 64, generator=torch.Generator().manual_seed(i)) * 4 for i in range(4)]
    batches = [x > 0 if dtype is torch.bool else x.to(dtype) for x in drawn]
    model = cached(Flipped)()
    for x in batches:
        model(x)
    held = [model(x) for x in batches]  # all hits, each still referenced while the next ones are read
    assert model.cache_instance.stats().memory.hits == 32
    for got, x in zip(held, batches):
        assert torch.equal(got, torch.flip(x, [-1])) and got.dtype == dtype and got.is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in held}) == len(held)  # four alive: four buffers
    assert len(_buffers._kept) == KEPT and held[-1].untyped_storage().data_ptr() == _buffers._kept[-1].ctypes.data
    first = held[0].untyped_storage().data_ptr()
    del held
    again = model(batches[1])
    assert torch.equal(again, torch.flip(batches[1], [-1]))
    assert again.untyped_storage().data_ptr() != first  # the oldest buffer was let go, the kept ones are used
    assert again.untyped_storage().data_ptr() in {b.ctypes.data for b in _buffers._kept}


def _check_held(held: torch.Tensor, want: torch.Tensor, pipe: Any) -> None:
    pipe.recv()  # once the parent made its later calls
    pipe.send(bool(torch.equal(held, want)))


@pytest.mark.slow
def test_a_forked_child_keeps_its_copy_of_a_hit_while_the_parent_reads_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_buffers, "MIN_BYTES", 1024)
    batches = [torch.randn(8, 3, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = cached(Flipped)()
    for x in batches:
        model(x)
    held, want = model(batches[0]), torch.flip(batches[0], [-1])
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(target=_check_held, args=(held, want, theirs))
    child.start()
    del held  # the parent's buffer is free to it again: its next hits may use it
    for x in batches[1:] * 2:
        model(x)
    ours.send("go")
    assert ours.poll(60) and ours.recv() is True  # the child's pages are its own
    child.join(60)
