"""Items independent or refused: modules whose rows depend on the batch are never cached per item."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import Counting, assert_same
from tests.test_keying import ZOO
from torchcache import CacheWarning, KeyingError, torchcache
from torchcache.module.independence import DependentItemsError


def _frozen(module: nn.Module) -> nn.Module:
    return module.eval().requires_grad_(False)


class _AcrossTheBatch(nn.Module):
    """Attention over the items of the batch: each row mixes every other row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(x @ x.T, dim=1)
        return weights @ x


class _Logits(nn.Module):
    """CLIP's ``logits_per_image``: a row per image, a column per text of the batch."""

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        return images @ texts.T


@pytest.mark.parametrize(
    ("make", "inputs", "cause"),
    [
        (_AcrossTheBatch, (torch.randn(6, 4),), "depend on the other items"),
        (_Logits, (torch.randn(6, 4), torch.randn(6, 4)), "depends on the batch"),
        (lambda: nn.BatchNorm1d(4, track_running_stats=False), (torch.randn(6, 4),), "depend on the other items"),
    ],
    ids=["attention-across-the-batch", "clip-logits", "batch-norm-batch-statistics"],
)
def test_a_module_whose_rows_depend_on_the_batch_is_refused_with_the_cause_and_the_fix(
    make: Any, inputs: tuple[torch.Tensor, ...], cause: str
) -> None:
    model = torchcache()(_frozen(make()))
    with pytest.raises(DependentItemsError, match=cause) as info:
        model(*inputs)
    assert isinstance(info.value, KeyingError)
    assert "get_image_features" in str(info.value) and "check_items=False" in str(info.value)
    assert len(model.cache_instance.memory) == 0  # nothing it computed is kept


def test_a_refused_module_keeps_nothing_on_disk(cache_root: Any) -> None:
    model = torchcache(persistent=True)(_frozen(_AcrossTheBatch()))
    with pytest.raises(DependentItemsError):
        model(torch.randn(6, 4))
    model.cache_instance.flush()
    assert model.cache_instance.stats().disk.entries == 0  # type: ignore[union-attr]


def test_a_random_function_is_refused_as_not_deterministic() -> None:
    @torchcache()
    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)

    with pytest.raises(DependentItemsError, match="not deterministic") as info:
        noisy(torch.randn(4, 3))
    assert info.value.random


def test_dropout_in_training_mode_runs_without_the_cache_with_one_warning() -> None:
    model = torchcache()(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).requires_grad_(False))
    x = torch.randn(8, 4)
    with pytest.warns(CacheWarning, match="training mode"):
        first = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        second = model(x)
    assert not torch.equal(first, second)  # each call draws its own masks, as without the cache
    assert len(model.cache_instance.memory) == 0  # nothing computed in training mode was kept
    model.eval()
    assert torch.equal(model(x), model(x)) and model.cache_instance.stats().hits == 8


def test_the_check_leaves_batch_norm_statistics_as_a_plain_call_would() -> None:
    cached = torchcache()(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).requires_grad_(False))
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).requires_grad_(False)
    plain.load_state_dict(cached.state_dict())
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert_same(cached(x), plain(x))  # training mode: batch statistics, computed uncached
    assert torch.equal(cached[1].running_mean, plain[1].running_mean)
    cached.eval()
    plain.eval()
    assert_same(cached(x), plain(x))


def test_the_check_runs_once_per_module_key_and_process_for_one_or_two_items() -> None:
    first = torchcache()(Counting())
    first(torch.randn(5, 4))
    assert first.seen == [5, 2, 2]  # the last and the first item again, then two middle ones, in batches of their own
    second = torchcache()(Counting())  # the same key: already checked in this process
    second(torch.randn(5, 4))
    assert second.seen == [5]
    pair = torchcache()(Counting(seed=3))
    pair(torch.randn(2, 4))
    assert pair.seen == [2, 1, 1]  # each item alone


def test_check_items_false_turns_the_check_off() -> None:
    model = torchcache(check_items=False)(_frozen(_AcrossTheBatch()))
    x = torch.randn(6, 4)
    assert torch.equal(model(x), _AcrossTheBatch()(x))


def test_a_single_item_is_not_checked_until_a_batch_of_two() -> None:
    model = torchcache()(_frozen(_AcrossTheBatch()))
    model(torch.randn(1, 4))
    with pytest.raises(DependentItemsError):
        model(torch.randn(3, 4))


@pytest.mark.parametrize(("name", "cls", "kwargs", "shape"), ZOO, ids=[entry[0] for entry in ZOO])
def test_modules_of_the_torch_nn_zoo_are_not_refused(
    name: str, cls: type[nn.Module], kwargs: dict[str, Any], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = _frozen(cls(**kwargs))
    x = torch.randn(3, *shape[1:])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = module(x)
        if _mixes_the_first_dimension(name, kwargs):
            with pytest.raises(DependentItemsError):
                torchcache()(module)(x)
            return
        got = torchcache()(module)(x)
    assert torch.allclose(got, expected, atol=1e-6)


def _mixes_the_first_dimension(name: str, kwargs: dict[str, Any]) -> bool:
    """Modules whose first dimension is not the batch with these arguments (sequence first, or ``dim=0``)."""
    sequence_first = name.startswith("Transformer") and not kwargs.get("batch_first", False)
    return sequence_first or kwargs.get("dim") == 0
