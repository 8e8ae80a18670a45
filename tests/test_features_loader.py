"""FeatureDataset.batch and .loader: whole batches read in one gather, equal to what default_collate makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from tests.helpers import assert_same
from tests.test_features import Fields, Images, Net, Scale, extract
from torchcache import CacheWarning, FeatureDataset, MissingFeatureError


def assert_same_batch(got: Any, want: Any) -> None:
    """Equal structure, types, dtypes, shapes and values (:func:`assert_same`); tensors contiguous."""
    assert_same(got, want)
    leaves = [got] if isinstance(got, torch.Tensor) else list(got.values() if isinstance(got, dict) else got)
    assert all(leaf.is_contiguous() for leaf in leaves if isinstance(leaf, torch.Tensor))


@pytest.mark.parametrize("kind", ["tuple", "dict", "tensor", "list"])
def test_a_batch_is_what_default_collate_makes_of_the_samples(cache_root: Path, kind: str) -> None:
    if kind == "dict":
        features = extract(Scale(), Fields(), input="x", batch_size=4)
    elif kind == "tuple":
        features = extract(Net(), Images(n=20))
    else:

        class Plain(Images):
            def __getitem__(self, i: int) -> Any:
                image, label = super().__getitem__(i)
                return image if kind == "tensor" else [label, image, np.float32(label / 3)]

        features = extract(Net(), Plain(n=20), input=0 if kind == "tensor" else 1)
    for indices in ([3, 1, 4, 1, 5], [0], [-1, 2, -3]):
        assert_same_batch(features.batch(indices), default_collate(features.__getitems__(indices)))


def test_the_loader_gives_every_sample_once_in_batches(cache_root: Path) -> None:
    features = extract(Net(), Images(n=50))
    batches = list(features.loader(16))
    assert [len(y) for _, y in batches] == [16, 16, 16, 2]
    assert_same_batch(batches[0], default_collate(features.__getitems__(range(16))))
    assert torch.cat([y for _, y in batches]).tolist() == [features[i][1] for i in range(50)]
    assert [len(y) for _, y in features.loader(16, drop_last=True)] == [16, 16, 16]


def test_a_shuffle_is_new_each_epoch_and_repeats_with_a_seeded_generator(cache_root: Path) -> None:
    features = extract(Net(), Images(n=50))

    def order(loader: DataLoader[Any]) -> list[int]:
        rows = torch.cat([x for x, _ in loader])
        return [int(torch.nonzero((rows == features[i][0]).all(1))[0]) for i in range(50)]

    loader = features.loader(8, shuffle=True, generator=torch.Generator().manual_seed(4))
    first, second = order(loader), order(loader)
    assert sorted(first) == list(range(50)) and first != second != list(range(50))
    again = features.loader(8, shuffle=True, generator=torch.Generator().manual_seed(4))
    assert order(again) == first


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_seeded_shuffle_gives_the_batches_a_plain_dataloader_gives(cache_root: Path, drop_last: bool) -> None:
    features = extract(Net(), Images(n=50))
    mine = features.loader(8, shuffle=True, drop_last=drop_last, generator=torch.Generator().manual_seed(7))
    plain = DataLoader(features, 8, shuffle=True, drop_last=drop_last, generator=torch.Generator().manual_seed(7))
    for _ in range(2):  # the second epoch draws on from the same generator in both
        got, want = list(mine), list(plain)
        assert len(got) == len(want) == len(mine) == len(plain)
        for batch, expected in zip(got, want, strict=True):
            assert_same_batch(batch, expected)


@pytest.mark.parametrize(("n", "drop_last"), [(50, False), (50, True), (48, False)])
def test_an_epoch_cut_short_after_its_last_batch_leaves_the_generator_as_a_plain_dataloader_does(
    cache_root: Path, n: int, drop_last: bool
) -> None:
    features = extract(Net(), Images(n=n))
    mine = features.loader(8, shuffle=True, drop_last=drop_last, generator=torch.Generator().manual_seed(2))
    plain = DataLoader(features, 8, shuffle=True, drop_last=drop_last, generator=torch.Generator().manual_seed(2))
    for loader in (mine, plain):
        batches = iter(loader)
        for _ in range(len(loader)):  # every batch, and nothing asked for after the last
            next(batches)
    assert_same_batch(next(iter(mine)), next(iter(plain)))


def test_an_unseeded_shuffle_draws_its_seed_from_the_global_rng(cache_root: Path) -> None:
    features = extract(Net(), Images(n=30))
    torch.manual_seed(3)
    got = torch.cat([x for x, _ in features.loader(8, shuffle=True)])
    torch.manual_seed(3)
    want = torch.cat([x for x, _ in DataLoader(features, 8, shuffle=True)])
    assert torch.equal(got, want) and not torch.equal(got, torch.cat([x for x, _ in features.loader(8)]))


@pytest.mark.slow
def test_workers_read_the_batches(cache_root: Path) -> None:
    features = extract(Net(), Images(n=40))
    alone = list(features.loader(8))
    with_workers = list(features.loader(8, num_workers=2))
    for got, want in zip(with_workers, alone, strict=True):
        assert_same_batch(got, want)


def test_a_collate_fn_gets_the_samples(cache_root: Path) -> None:
    features = extract(Net(), Images(n=10))
    batches = list(features.loader(4, collate_fn=list))
    assert [len(b) for b in batches] == [4, 4, 2] and isinstance(batches[0][0], tuple)


def test_features_that_vary_in_shape_go_through_default_collate_or_the_collate_fn(cache_root: Path) -> None:
    class Named(Images):
        def __getitem__(self, i: int) -> Any:
            return self.images[i], ["cat", "dog"][i % 2]

    features = extract(Net(), Named(n=10))
    assert features.info["layout"] == "variable"
    x, names = features.batch([0, 1, 2])
    assert tuple(x.shape) == (3, 5) and list(names) == ["cat", "dog", "cat"]
    assert [len(b) for b in features.loader(4, collate_fn=list)] == [4, 4, 2]


def test_a_damaged_row_in_a_batch_is_computed_again_or_an_error_without_the_backbone(cache_root: Path) -> None:
    features = extract(Net(), Images(n=20))
    want = features.batch([1, 2, 3])
    assert features.path is not None
    with open(features.path, "r+b") as raw:
        raw.seek(features.file.row_offset(2))
        raw.write(b"\xff" * 8)
    with pytest.warns(CacheWarning, match="damaged"):
        x, y = features.batch([1, 2, 3])
    assert torch.equal(y, want[1]) and torch.equal(x[[0, 2]], want[0][[0, 2]])
    assert torch.allclose(x[1], want[0][1], atol=1e-6)  # computed in another batch: equal up to rounding
    with open(features.path, "r+b") as raw:
        raw.seek(features.file.row_offset(3))
        raw.write(b"\xff" * 8)
    opened = FeatureDataset.open(features.path)
    with pytest.warns(CacheWarning), pytest.raises(MissingFeatureError, match="extract_features"):
        opened.batch([1, 2, 3])


def test_bad_arguments_are_refused_with_their_names(cache_root: Path) -> None:
    features = extract(Net(), Images(n=10))
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        features.loader(0)
    with pytest.raises(TypeError, match="sets sampler itself"):
        features.loader(4, sampler=[0, 1])
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator or None, got int"):
        features.loader(4, shuffle=True, generator=5)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="index 10 is out of range for 10 samples"):
        features.batch([10])
    with pytest.raises(TypeError, match="must be integers"):
        features.batch([True])
    for unordered in ({1: 2}, {2, 1}):  # a dict's keys, a set's order: no batch of positions
        with pytest.raises(TypeError, match="takes a list, a numpy array or a 1-D tensor of integers"):
            features.batch(unordered)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"one list of integers, got shape \(2, 2\)"):
        features.batch(np.array([[1, 2], [3, 4]]))
    with pytest.raises(TypeError, match=r"several go to features\.batch\(indices\), not in one of shape \(2,\)"):
        features[torch.tensor([1, 2])]


def test_a_seeded_loader_leaves_the_global_rng_as_it_was(cache_root: Path) -> None:
    features = extract(Net(), Images(n=20))
    state = torch.get_rng_state()
    assert sum(len(x) for x, _ in features.loader(8, shuffle=True, generator=torch.Generator().manual_seed(1))) == 20
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("index", [2.7, "3", np.float64(4.9), torch.tensor(4.6), torch.tensor(True), None])
def test_an_index_that_is_not_an_integer_is_refused_not_cut(cache_root: Path, index: Any) -> None:
    features = extract(Net(), Images(n=10))
    with pytest.raises(TypeError, match="must be integers"):
        features[index]
    with pytest.raises(TypeError, match="must be integers"):
        features.batch([1, index])
    assert torch.equal(features[np.int64(3)][0], features[torch.tensor(3)][0])


@pytest.mark.parametrize("indices", [3, slice(0, 2), "12"])
def test_a_batch_of_indices_that_is_not_a_sequence_is_refused_naming_the_argument(
    cache_root: Path, indices: Any
) -> None:
    features = extract(Net(), Images(n=10))
    with pytest.raises(TypeError, match=r"batch\(indices\) takes a list.*got " + type(indices).__name__):
        features.batch(indices)


def test_a_batch_of_indices_from_a_generator_is_read(cache_root: Path) -> None:
    features = extract(Net(), Images(n=10))
    assert torch.equal(features.batch(i for i in [1, 2])[0], features.batch([1, 2])[0])


def test_an_index_out_of_range_is_named_as_given_and_an_empty_batch_is_empty(cache_root: Path) -> None:
    features = extract(Net(), Images(n=10))
    with pytest.raises(IndexError, match="index -11 is out of range"):
        features[-11]
    with pytest.raises(IndexError, match=f"index {2**64 - 1} is out of range"):
        features.batch(np.array([2**64 - 1], np.uint64))  # not wrapped to -1, the last sample
    for far in (2**64, -(2**63) - 1):  # past int64
        with pytest.raises(IndexError, match=f"index {far} is out of range"):
            features[far]
    with pytest.raises(TypeError, match="must be integers"):
        features.batch(torch.arange(10) < 5)  # a mask
    assert features.__getitems__([]) == []
    with pytest.raises(ValueError, match="at least one index"):
        features.batch([])
