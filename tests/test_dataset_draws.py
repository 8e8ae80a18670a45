"""Datasets whose samples are random are refused, whatever a draw happened to give; seeded ones are cached."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from torchcache import CachedDataset
from torchcache.datasets.draws import random_reads, same_sample
from torchcache.datasets.encode import SampleTypeError
from torchcache.errors import KeyingError

Draw = Callable[[int], torch.Tensor]


class _Reads(Dataset[torch.Tensor]):
    """Ten samples made by ``draw``; the reads of each index counted."""

    def __init__(self, draw: Draw) -> None:
        self.draw = draw
        self.reads: dict[int, int] = {}

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads[index] = self.reads.get(index, 0) + 1
        return self.draw(index)


def _flip_torch(index: int) -> torch.Tensor:
    return torch.full((2,), float(index)) * (-1 if torch.rand(()) < 0.5 else 1)


def _flip_numpy(index: int) -> torch.Tensor:
    return torch.full((2,), float(index)) * (-1 if np.random.rand() < 0.5 else 1)


def _flip_python(index: int) -> torch.Tensor:
    return torch.full((2,), float(index)) * (-1 if random.random() < 0.5 else 1)


def _reseeded(index: int) -> torch.Tensor:
    torch.manual_seed(index)
    return torch.rand(3)


def _own_generator(index: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(index).random(3))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("draw", [_flip_torch, _flip_numpy, _flip_python])
def test_a_dataset_that_flips_with_a_global_generator_is_refused_whatever_the_draws_gave(
    draw: Draw, seed: int, tmp_path: Any
) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    data = CachedDataset(_Reads(draw), tmp_path, max_memory_size=0)
    with pytest.raises(KeyingError, match=r"_Reads\[3\] is random .* transform="):
        data[3]
    data.close()
    assert not any(tmp_path.rglob("*.tcs"))  # nothing of it was stored


def test_a_dataset_drawing_from_a_generator_of_its_own_is_refused_by_its_values(tmp_path: Any) -> None:
    generator = torch.Generator().manual_seed(0)
    data = CachedDataset(_Reads(lambda i: torch.rand(3, generator=generator) + i), tmp_path)
    with pytest.raises(KeyingError, match="gave another sample"):
        data[0]
    data.close()


@pytest.mark.parametrize("view", [torch.Tensor.conj, lambda t: t.conj().imag], ids=["conjugate", "negative"])
def test_a_random_sample_holding_a_conjugate_or_negative_view_is_refused(view: Any, tmp_path: Any) -> None:
    data = CachedDataset(_Reads(lambda i: [view(torch.tensor([1 + 2j])), torch.randn(3)]), tmp_path)
    with pytest.raises(KeyingError, match="is random"):
        data[0]
    data.close()
    t = torch.tensor([1 + 2j, 3j])
    assert same_sample(view(t), view(t.clone())) and not same_sample(view(t), view(t * 2))


@pytest.mark.parametrize("draw", [_reseeded, _own_generator])
def test_a_dataset_seeded_by_the_index_is_cached_and_leaves_the_generators_as_a_plain_read(
    draw: Draw, tmp_path: Any
) -> None:
    plain = _Reads(draw)
    data = CachedDataset(_Reads(draw), tmp_path)
    torch.manual_seed(7)
    first = [data[i] for i in (4, 5)]
    after_cached = torch.rand(4)
    torch.manual_seed(7)
    expected = [plain[i] for i in (4, 5)]
    assert torch.equal(after_cached, torch.rand(4))  # the check's reads left the generator where a plain read did
    assert all(same_sample(a, b) for a, b in zip(first, expected, strict=True))
    if draw is _reseeded:  # each read moves torch's generator: each sample is read twice more, from elsewhere
        assert data.dataset.reads == {4: 3, 5: 3}
    else:  # the first sample computed is read twice more, once per process
        assert data.dataset.reads == {4: 3, 5: 1}
    assert same_sample(data[4], expected[0]) and data.stats().hits == 1
    data.close()


def test_random_reads_restores_every_global_generator_and_names_the_cause() -> None:
    for draw in (_flip_torch, _flip_numpy, _flip_python):
        dataset = _Reads(draw)
        sample = dataset[1]
        states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
        assert random_reads(dataset.__getitem__, 1, sample) is not None
        assert torch.equal(states[0], torch.get_rng_state())
        assert np.array_equal(states[1], np.random.get_state()[1]) and states[2] == random.getstate()
    assert random_reads(_Reads(_own_generator).__getitem__, 1, _own_generator(1)) is None
    random.seed(3)  # the two reads agree (a sign times zero), but each moved random's stream on
    assert random_reads(_Reads(lambda i: torch.zeros(2) * random.random()).__getitem__, 1, torch.zeros(2)) == (
        "the same sample, but drew from a process-wide random generator"
    )


def test_check_samples_false_skips_the_reads_and_must_be_a_bool(tmp_path: Any) -> None:
    data = CachedDataset(_Reads(_flip_torch), tmp_path, check_samples=False)
    first = data[2]
    assert data.dataset.reads == {2: 1} and torch.equal(data[2], first)  # its first draw, served again
    data.close()
    with pytest.raises(TypeError, match="check_samples must be True or False, got 'yes'"):
        CachedDataset(_Reads(_flip_torch), tmp_path, check_samples="yes")  # type: ignore[arg-type]


class _Opaque:
    """Neither a tensor, an array nor a plain value: equal to no other instance."""


def test_a_sample_that_cannot_be_cached_is_refused_for_its_type_not_as_random(tmp_path: Any) -> None:
    data = CachedDataset(_Reads(lambda i: (torch.ones(2), _Opaque())), tmp_path)  # type: ignore[arg-type,return-value]
    with pytest.raises(SampleTypeError, match="_Opaque"):
        data[0]
    data.close()


class _Batched(Dataset[torch.Tensor]):
    """Samples given by ``__getitems__`` alone (``__getitem__`` is torch's, which raises)."""

    def __init__(self, draw: Draw) -> None:
        self.draw = draw

    def __len__(self) -> int:
        return 10

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.draw(i) for i in indices]


@pytest.mark.parametrize("draw", [_own_generator, _flip_python])
def test_a_dataset_with_getitems_alone_is_read_again_through_it(draw: Draw, tmp_path: Any) -> None:
    data = CachedDataset(_Batched(draw), tmp_path)
    if draw is _flip_python:
        with pytest.raises(KeyingError, match="is random"):
            data.__getitems__([2, 3])
    else:
        assert same_sample(data.__getitems__([2, 3]), [draw(2), draw(3)])
    data.close()


@pytest.mark.parametrize("flip", [_flip_torch, _flip_numpy, _flip_python])
def test_samples_that_draw_after_the_first_are_refused_when_their_batch_moved_a_generator(
    flip: Draw, tmp_path: Any
) -> None:
    def clean_then_flipped(index: int) -> torch.Tensor:
        return torch.full((2,), float(index)) if index < 5 else flip(index)

    data = CachedDataset(_Reads(clean_then_flipped), tmp_path)  # the first half plain, the second augmented
    assert same_sample(data.__getitems__([0, 1]), [clean_then_flipped(0), clean_then_flipped(1)])
    data.__getitems__([2, 3])
    with pytest.raises(KeyingError, match=r"_Reads\[5\] is random"):
        data.__getitems__([4, 5, 6])
    reads = data.dataset.reads  # 4 read again (it draws nothing), then 5, found random at its first or second read
    assert {i: reads[i] for i in (0, 1, 2, 3, 4, 6)} == {0: 3, 1: 1, 2: 1, 3: 1, 4: 2, 6: 1} and reads[5] in (2, 3)
    data.close()


def _seeded_then_streaming(index: int) -> torch.Tensor:
    if index < 5:
        torch.manual_seed(index)
    return torch.full((2,), float(index)) + torch.rand(2)


def test_a_dataset_seeded_by_the_index_then_drawing_from_the_stream_is_refused_where_it_draws(tmp_path: Any) -> None:
    data = CachedDataset(_Reads(_seeded_then_streaming), tmp_path)
    for batch in ([0, 1], [2, 3]):
        assert same_sample(data.__getitems__(batch), [_seeded_then_streaming(i) for i in batch])
    with pytest.raises(KeyingError, match=r"_Reads\[5\] is random .* generators stood elsewhere"):
        data.__getitems__([4, 5])
    data.close()


class _Flaky(_Reads):
    """Sample 0 read a second time raises, as a file gone for a moment would."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 0 and self.reads.get(index) == 1:
            self.reads[index] = 2
            raise OSError("the file is away")
        return super().__getitem__(index)


def test_a_read_again_that_fails_leaves_the_sample_as_computed_and_the_next_batch_is_checked(tmp_path: Any) -> None:
    data = CachedDataset(_Flaky(_own_generator), tmp_path)
    assert same_sample(data[0], _own_generator(0))  # the check's read failed: no verdict
    assert same_sample(data[1], _own_generator(1)) and data.dataset.reads[1] == 3  # checked at the next one
    data.close()


def test_the_check_reads_numpys_generator_whatever_its_bit_generator(tmp_path: Any) -> None:
    before = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(1))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            data = CachedDataset(_Reads(_own_generator), tmp_path)
            assert same_sample(data[2], _own_generator(2))
            data.close()
            flipping = CachedDataset(_Reads(_flip_numpy), tmp_path)
            with pytest.raises(KeyingError, match="is random"):
                flipping[2]
            flipping.close()
    finally:
        np.random.set_bit_generator(before)


def _numpy_reseeded(index: int) -> torch.Tensor:
    np.random.seed(index)
    return torch.from_numpy(np.random.rand(3))


def test_the_check_seeds_the_cpus_generator_alone_not_cudas(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def seeds_every_device(seed: int) -> None:
        raise AssertionError("torch.manual_seed seeds CUDA's generators too (or queues it until CUDA starts)")

    data = CachedDataset(_Reads(_numpy_reseeded), tmp_path)
    monkeypatch.setattr(torch, "manual_seed", seeds_every_device)
    assert same_sample(data.__getitems__([1, 2]), [_numpy_reseeded(1), _numpy_reseeded(2)])  # moved numpy's
    assert data.dataset.reads == {1: 3, 2: 3}
    data.close()
