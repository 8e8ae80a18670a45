"""WindowSampler: shuffled epochs that keep a window of a bucket's segments together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchcache import CachedDataset, ConfigError, WindowSampler
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


@pytest.mark.parametrize("window_bytes", [0, -1, "lots", "0.1B"])
def test_a_window_that_is_not_a_positive_size_is_refused_naming_the_argument(window_bytes: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="window_bytes"):
        WindowSampler(CachedDataset(Numbers(), tmp_path, max_memory_size=0), window_bytes=window_bytes)


def test_a_window_takes_a_size_as_the_other_sizes_do() -> None:
    assert WindowSampler(_Segments(), window_bytes="32MB").window_bytes == 32_000_000


@pytest.mark.parametrize(
    ("dataset", "options", "named"),
    [
        (torch.utils.data.TensorDataset(torch.zeros(4)), {}, "dataset"),
        (5, {}, "dataset"),
        (None, {"seed": "x"}, "seed"),
    ],
)
def test_what_is_not_a_cached_dataset_or_a_seed_is_refused_naming_it(dataset: Any, options: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named} must be"):
        WindowSampler(dataset if dataset is not None else _Segments(), **options)


class _Segments:
    """A stand-in for a CachedDataset in a bucket: 12 segments of 100 bytes, 30 samples each."""

    def __init__(self) -> None:
        self.cache = self
        self.shared: list[bool] = []

    def __len__(self) -> int:
        return 360

    def placement(self, keys: Any, shared: bool = False) -> list[tuple[str, int] | None]:
        self.shared.append(shared)
        return [(f"s{i % 12}", 100) for i in keys]


def test_the_ranks_of_a_job_take_disjoint_shares_of_whole_windows_from_the_bucket_alone() -> None:
    dataset = _Segments()
    samplers = [WindowSampler(dataset, window_bytes=100, num_replicas=3, rank=r) for r in range(3)]
    for _ in range(2):  # two epochs: a new order, still disjoint shares
        shares = [list(sampler) for sampler in samplers]
        assert sorted(i for share in shares for i in share) == list(range(360))
        segments = [{i % 12 for i in share} for share in shares]
        assert [len(s) for s in segments] == [4, 4, 4] and set.union(*segments) == set(range(12))
    assert dataset.shared == [True] * 6  # the bucket's placement, the same on every machine
    assert all(len(sampler) == 120 and sampler.seed == 0 for sampler in samplers)


@pytest.mark.parametrize(("drop_last", "share"), [(False, 14), (True, 13)])
def test_shares_are_equal_wrapping_around_or_dropping_the_last(tmp_path: Path, drop_last: bool, share: int) -> None:
    cached = CachedDataset(Numbers(), tmp_path, max_memory_size=0)  # 40 samples over 3 ranks
    shares = [list(WindowSampler(cached, num_replicas=3, rank=r, drop_last=drop_last)) for r in range(3)]
    assert [len(s) for s in shares] == [share] * 3
    taken = [i for s in shares for i in s]
    assert set(taken) <= set(range(40)) and len(set(taken)) == (40 if not drop_last else 39)
    cached.close()


@pytest.mark.parametrize(
    ("options", "named"),
    [({"num_replicas": 0}, "num_replicas"), ({"num_replicas": 2, "rank": 2}, "rank"), ({"rank": -1}, "rank")],
)
def test_a_share_that_does_not_exist_is_refused_naming_the_argument(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        WindowSampler(_Segments(), **options)
