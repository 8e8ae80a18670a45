"""WindowSampler: shuffled epochs that keep a window of a bucket's segments together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchcache import CachedDataset, WindowSampler
from torchcache.datasets.sampler import window_order


class Numbers(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _placement(segments: int, per: int, loose: int, size: int = 100) -> list[tuple[str, int] | None]:
    placed: list[tuple[str, int] | None] = [(f"s{i % segments}", size) for i in range(segments * per)]
    return placed + [None] * loose


@pytest.mark.parametrize("seed", range(5))
def test_each_index_comes_once_and_a_window_is_contiguous_and_within_its_bytes(seed: int) -> None:
    placement = _placement(segments=12, per=30, loose=90)
    order = window_order(placement, 300, np.random.default_rng(seed))
    assert sorted(order) == list(range(len(placement)))
    runs: list[set[str]] = [set()]  # the segments of each window, in the order met
    seen: set[str] = set()
    for i in order:
        place = placement[i]
        if place is None:
            continue
        if place[0] not in runs[-1]:
            if len(runs[-1]) == 3:  # 300 bytes: three segments of 100
                runs.append(set())
            assert place[0] not in seen, f"segment {place[0]} comes back after its window"
            runs[-1].add(place[0])
            seen.add(place[0])
    assert len(runs) == 4 and all(len(run) == 3 for run in runs)


def test_indices_held_locally_are_spread_over_every_window() -> None:
    placement = _placement(segments=4, per=100, loose=400)
    order = window_order(placement, 100, np.random.default_rng(0))
    quarters = [order[k * 200 : (k + 1) * 200] for k in range(4)]
    loose = [sum(1 for i in quarter if placement[i] is None) for quarter in quarters]
    assert all(60 <= count <= 140 for count in loose), loose  # about 100 in each window, not all at the end


def test_a_segment_larger_than_the_window_is_a_window_of_its_own() -> None:
    placement = _placement(segments=3, per=5, loose=0, size=1000)
    order = window_order(placement, 10, np.random.default_rng(0))
    segments = [placement[i][0] for i in order]  # type: ignore[index]
    assert [segments[k] for k in range(0, 15, 5)] == [segments[k + 4] for k in range(0, 15, 5)]


def test_without_placement_the_order_is_a_plain_shuffle() -> None:
    order = window_order([None] * 1000, 10, np.random.default_rng(0))
    assert sorted(order) == list(range(1000)) and order != list(range(1000))


def test_epochs_differ_and_replay_by_seed_and_epoch(tmp_path: Path) -> None:
    cached = CachedDataset(Numbers(), tmp_path, max_memory_size=0)
    first = WindowSampler(cached, seed=3)
    epochs = [list(first) for _ in range(3)]
    assert all(sorted(epoch) == list(range(40)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = WindowSampler(cached, seed=3)
    assert [list(again) for _ in range(3)] == epochs
    again.set_epoch(1)
    assert list(again) == epochs[1] and again.epoch == 2
    assert list(WindowSampler(cached, seed=4)) != epochs[0]
    cached.close()


def test_without_a_seed_torch_manual_seed_fixes_the_orders(tmp_path: Path) -> None:
    cached = CachedDataset(Numbers(), tmp_path, max_memory_size=0)
    torch.manual_seed(7)
    first = list(WindowSampler(cached))
    torch.manual_seed(7)
    assert list(WindowSampler(cached)) == first
    cached.close()


def test_a_data_loader_with_the_sampler_serves_every_sample(tmp_path: Path) -> None:
    cached = CachedDataset(Numbers(), tmp_path, max_memory_size=0)
    loader = torch.utils.data.DataLoader(cached, batch_size=8, sampler=WindowSampler(cached, seed=0))
    for _ in range(2):
        assert sorted(torch.cat(list(loader)).tolist()) == list(range(40))
    cached.close()


@pytest.mark.parametrize("window_bytes", [0, -1, 1.5, "64MB"])
def test_a_window_that_is_not_a_positive_int_is_refused_naming_the_argument(window_bytes: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="window_bytes"):
        WindowSampler(CachedDataset(Numbers(), tmp_path, max_memory_size=0), window_bytes=window_bytes)
