"""Items independent or refused: modules whose rows depend on the batch are never cached per item."""

from __future__ import annotations

import contextlib
import functools
import random
import types
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import Counting, assert_same
from tests.test_keying import ZOO
from torchcache import CacheWarning, KeyingError, torchcache
from torchcache.module import independence
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


@pytest.mark.parametrize("how", ["training mode", "dropout alone"])  # dropout alone: Monte Carlo dropout
def test_dropout_in_training_mode_runs_without_the_cache_with_one_warning(how: str) -> None:
    model = torchcache()(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).requires_grad_(False))
    if how == "dropout alone":
        model.eval()[1].train()  # the model in eval mode, its dropout on
    x = torch.randn(8, 4)
    with pytest.warns(CacheWarning, match="training mode") as caught:
        first = model(x)
    message = str(caught[0].message)
    assert "draw. Calls in training mode run without the cache" in message  # one sentence each, one remedy
    assert message.count("eval mode") == 1 and "deterministic function" not in message
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


def test_a_batch_of_one_item_repeated_is_checked_once_not_at_every_call() -> None:
    model, x = torchcache()(Counting(seed=5)), torch.randn(1, 4).repeat(3, 1)  # a warm-up batch of one item
    model(x)
    first = len(model.seen)  # computed, and computed again by the check
    for _ in range(3):
        model(x)
    assert len(model.seen) == first  # hits, not checked again
    model(torch.randn(3, 4))  # a batch of distinct items is still checked
    assert len(model.seen) > first + 1


class _RandomPastZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(x.shape[0], 1) * (x.sum(1, keepdim=True) > 0)  # random but for zeros


def test_a_batch_of_another_item_repeated_after_a_checked_one_is_checked() -> None:
    model = torchcache()(_RandomPastZero().eval())
    model(torch.zeros(1, 2).repeat(3, 1))  # a warm-up batch of zeros, checked
    with pytest.raises(DependentItemsError):
        model(torch.ones(1, 2).repeat(3, 1))


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


class _PoolsFromFour(nn.Module):
    """Centres its rows on the batch's mean, from batches of four on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True) if len(x) >= 4 else x


def test_a_batch_larger_than_any_checked_is_checked_again() -> None:
    model = torchcache()(_PoolsFromFour().eval())
    model(torch.randn(2, 4))  # passes: batches of two are per item
    with pytest.raises(DependentItemsError):
        model(torch.randn(4, 4))


def test_a_larger_batch_served_from_the_cache_is_checked_in_whole() -> None:
    model = torchcache()(_PoolsFromFour().eval())
    x = torch.randn(4, 4)
    model(x[:2])
    model(x[2:])  # every item computed in batches of two, where it pools nothing
    with pytest.raises(DependentItemsError):
        model(x)  # all hits; an uncached batch of four pools


def test_a_context_refused_at_a_later_check_removes_the_entries_stored_until_then(tmp_path: Any) -> None:
    model = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_PoolsFromFour().eval())
    model(torch.randn(2, 4))  # passes and is stored: batches of two are per item
    with pytest.raises(DependentItemsError):
        model(torch.randn(4, 4))  # the context checked again, in a larger batch: its rows may be wrong
    model.cache_instance.flush()
    assert len(model.cache_instance.memory) == 0
    assert model.cache_instance.stats().disk.entries == 0  # type: ignore[union-attr]


class _TrimsToTheLongest(nn.Module):
    """Mean-pools over the positions up to the longest item of the batch (zeros pad the rest)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        longest = int((x != 0).any(0).nonzero().max()) + 1
        return x[:, :longest].mean(1)


@pytest.mark.parametrize("spot", [16, 10**9])
def test_calls_that_compute_items_are_checked_again_now_and_then(spot: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(independence, "SPOT_ITEMS", spot)
    model = torchcache()(_TrimsToTheLongest().eval())
    for _ in range(4):  # items at full length: the first call is checked, and passes; 12 computed since
        model(torch.rand(4, 10) + 1)
    mixed = torch.rand(4, 10) + 1
    mixed[[0, 3], 5:] = 0  # the first and the last item short: pooled over 10 positions here, over 5 alone
    if spot > 16:  # never checked again: the short items' rows are cached as computed in this batch
        assert torch.equal(model(mixed), _TrimsToTheLongest()(mixed))
        return
    with pytest.raises(DependentItemsError):
        model(mixed)  # 16 computed since the check: checked again


def test_a_value_small_beside_the_rest_of_its_row_is_compared_as_itself() -> None:
    def scored(x: torch.Tensor) -> torch.Tensor:  # an embedding, and a score against the rest of the batch
        return torch.cat([x * 100, torch.softmax(x.sum(1, keepdim=True), 0)], 1)

    with pytest.raises(DependentItemsError):
        torchcache()(scored)(torch.randn(5, 8))


def test_calls_of_one_item_are_checked_again_once_per_spot_not_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(independence, "SPOT_ITEMS", 16)
    model = torchcache()(Counting().eval())
    model(torch.randn(2, 4))  # checked: each item alone
    before = model.items
    for _ in range(40):
        model(torch.randn(1, 4))
    assert model.items - before <= 40 + 40 // 16 + 1  # each item once, and an item again per spot check


def test_rows_stored_in_float16_are_compared_on_its_grid() -> None:
    torch.manual_seed(0)
    probabilities = nn.Sequential(nn.Linear(64, 32000), nn.Softmax(-1)).eval().requires_grad_(False)
    model = torchcache(cache_dtype=torch.float16)(probabilities)
    x = torch.randn(4, 64)
    model(x[:2])  # output values near 3e-5: float16's steps there are fixed, 6e-8
    assert model(x).shape == (4, 32000)  # a larger batch, checked again with two rows from the cache
    assert model.cache_instance.stats().hits == 2


def test_a_column_much_smaller_than_the_others_is_compared_on_its_own_scale() -> None:
    def mixed_scales(x: torch.Tensor) -> torch.Tensor:  # large features beside the batch's mean
        return torch.cat([x * 1e5, x.mean(0, keepdim=True).expand(len(x), -1)], 1)

    torch.manual_seed(0)
    model = torchcache()(mixed_scales)
    with pytest.raises(DependentItemsError):
        model(torch.randn(8, 4))


class _Standardized(nn.Module):
    """Frozen features centred with a dataset mean near their large offset: elements near zero, rounding of 100."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(1024, 256)
        nn.init.constant_(self.features.bias, 100.0)
        self.register_buffer("mean", torch.full((256,), 100.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x) - self.mean


@pytest.mark.parametrize("seed", range(6))
def test_elements_near_zero_in_a_column_of_larger_values_are_compared_on_the_columns_scale(seed: int) -> None:
    torch.manual_seed(seed)
    model = torchcache()(_frozen(_Standardized()))
    x = torch.randn(16, 1024)
    assert torch.equal(model(x), _Standardized.forward(model, x))  # checked, not refused: items are independent


def test_an_outlier_item_in_the_batch_does_not_hide_a_dependence_of_the_others() -> None:
    def nudged(x: torch.Tensor) -> torch.Tensor:  # 1e-4 of the batch mean: large beside the usual rows
        return x + 1e-4 * x.mean(0)

    torch.manual_seed(0)
    x = torch.randn(3, 16)
    x[0] *= 1e4  # one item ten thousand times the others
    with pytest.raises(DependentItemsError):
        torchcache()(nudged)(x)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_rows_cached_one_item_at_a_time_are_checked_as_a_whole_batch_at_the_first_all_hit_call(
    where: str, tmp_path: Any
) -> None:
    def pooled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # a mean over the batch beside per-item rows
        return x * 2, x.mean(0, keepdim=True)

    x = torch.arange(12.0).reshape(4, 3)
    first = torchcache(persistent=where == "disk", persistent_cache_dir=tmp_path)(pooled)
    first(x[:1])
    first(x[1:2])  # each stored as if it were per item: one row of one item
    reader = first
    if where == "disk":
        first.cache_instance.flush()
        independence.forget_checks()  # as in a new process
        reader = torchcache(persistent=True, persistent_cache_dir=tmp_path, max_memory_cache_size=0)(pooled)
    with pytest.raises(DependentItemsError, match=r"in a batch of 2, in 1 rows, not one per item"):
        reader(x[:2])  # all hits: computed whole, as an uncached call would be


class _Noisy(nn.Module):
    """Dropout, and a sample from a generator of its own: random in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.own = torch.Generator().manual_seed(3)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = random.random() + float(np.random.rand())  # the generators of Python and numpy too
        return self.drop(x) + torch.rand(x.shape, generator=self.own) + shift


def test_the_item_check_leaves_every_random_generator_as_it_found_it() -> None:
    cached, plain = torchcache()(_Noisy()), _Noisy()
    x = torch.randn(4, 6)
    for model in (cached, plain):  # the same draws, one module checked and the other not
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        with pytest.warns(CacheWarning, match="training mode") if model is cached else contextlib.nullcontext():
            out = model(x)
        after = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=model.own))
        if model is cached:
            cached_out, cached_after = out, after
    assert torch.equal(cached_out, out)  # an uncached call in training mode, as if no check had run
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(cached_after, after))


def test_a_module_that_samples_in_eval_mode_is_told_to_take_the_randomness_out() -> None:
    cached = torchcache()(_Noisy().eval())  # dropout is off; its own generator still draws
    with pytest.raises(DependentItemsError, match="samples in eval mode too"):
        cached(torch.randn(4, 6))


def test_the_item_check_restores_generators_held_in_containers_and_captured_by_functions() -> None:
    class Drawing(nn.Module):  # draws on every forward, and returns what does not depend on the draws
        def __init__(self) -> None:
            super().__init__()
            self.gens = [torch.Generator().manual_seed(1)]
            self.legacy = np.random.RandomState(2)
            self.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.rand(1, generator=self.gens[0]), self.legacy.rand()
            return x * 2

    captured = np.random.default_rng(3)

    def doubled(x: torch.Tensor) -> torch.Tensor:
        captured.random()
        return x * 2

    model, plain, x = torchcache()(Drawing().eval()), Drawing().eval(), torch.randn(4, 3)
    model(x)  # the first call of a batch: checked item by item
    plain(x)
    assert torch.equal(torch.rand(2, generator=model.gens[0]), torch.rand(2, generator=plain.gens[0]))
    assert model.legacy.rand() == plain.legacy.rand()
    reference = np.random.default_rng(3)
    torchcache()(doubled)(x)
    reference.random()
    assert captured.random() == reference.random()  # one draw, as an uncached call makes


def _mirrored(x: torch.Tensor) -> torch.Tensor:
    return x - x.flip(0)


def _flipped(x: torch.Tensor) -> torch.Tensor:
    return x.flip(0)


def _centred_when_odd(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0) if len(x) % 2 else x


def _centred_when_even(x: torch.Tensor) -> torch.Tensor:
    return x if len(x) % 2 else x - x.mean(0)


@pytest.mark.parametrize(
    ("fn", "batch"),
    [
        (fn, batch)
        for fn in (_mirrored, _flipped, _centred_when_odd, _centred_when_even)
        for batch in range(2, 10)
        if fn is not _centred_when_even or batch % 2 == 0  # an odd batch pools nothing there: its rows are per item
    ],
)
def test_a_forward_that_pairs_items_with_their_mirrors_or_pools_one_parity_is_refused(fn: Any, batch: int) -> None:
    cached = torchcache()(fn)
    with pytest.raises(DependentItemsError, match="depend"):
        cached(torch.randn(batch, 4))


def test_a_forward_that_branches_on_grad_mode_is_refused_as_such_not_as_batch_dependent() -> None:
    @torchcache()
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * (2 if torch.is_grad_enabled() else 3)

    with pytest.raises(DependentItemsError, match=r"depend on whether gradients are on .* torch.no_grad\(\)") as info:
        scaled(torch.randn(4, 3))  # with gradients on, as in a training loop
    assert "other items" not in str(info.value)
    with torch.no_grad():  # computed without them, as the check does: not seen (documented)
        assert torch.equal(scaled(torch.ones(4, 3)), torch.full((4, 3), 3.0))


def test_a_whole_batch_checked_after_rows_cached_one_by_one_says_so() -> None:
    cached = torchcache()(lambda x: x - x.mean(0))
    x = torch.randn(3, 4)
    cached(x[:1])
    cached(x[1:2])  # rows of batches of one item: per item
    with pytest.raises(DependentItemsError, match="the whole batch was computed at once") as info:
        cached(x[:2])
    assert "in a batch of" not in str(info.value)
    assert "<lambda>: the stored rows of a batch differ from its rows computed now" in str(info.value)
    assert "Either the batch's stored rows are stale" in str(info.value)  # as likely as rows that depend on it


class DropPath(nn.Module):
    """timm's stochastic depth, by its name: the residual branch dropped per sample with ``drop_prob``."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0:
            return x
        keep = torch.rand(x.shape[0], 1) >= self.drop_prob
        return x * keep / (1 - self.drop_prob)


class _Attention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 1, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class Dinov2DropPath(nn.Module):
    """A library's stochastic depth, named with its model's prefix; its probability in ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape[0], 1) >= self.p) / (1 - self.p) if self.training else x


class LayerSkip(nn.Module):
    """Stochastic depth under a name of its own: known by its ``drop_prob``."""

    def __init__(self, drop_prob: float | torch.Tensor) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape[0], 1) >= self.drop_prob) if self.training else x


class GaussianDropout(nn.Module):
    """Multiplicative noise, by its name alone: its rate under a name torchcache does not read."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + self.rate * torch.randn_like(x)) if self.training else x


class StableDropout(nn.Module):
    """DeBERTa's dropout: not a torch class, its probability in ``drop_prob``."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, self.drop_prob, self.training)


class BartAttention(nn.Module):
    """Hugging Face's attention layers: the dropout probability a float attribute, applied as a function."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(x), p=self.dropout, training=self.training)


class DropBlock2d(nn.Module):
    """torchvision's drop block, by its name and ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand_like(x) >= self.p) if self.training else x


class NoDropout(nn.Module):
    """Named for dropout, with no probability: an identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class SpatialDropout(nn.Module):
    """A wrapper with no probability of its own: its child is checked."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.inner = nn.Dropout1d(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


class T5Attention(nn.Module):
    """A float probability under another name, given to a function: ``dropout_p`` as SDPA takes it."""

    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.dropout_p = dropout_p
        self.dropout = None  # a name for dropping that holds no probability
        self.attn_drop_enabled = True  # nor does a flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(x), p=self.dropout_p, training=self.training)


class GPT2Attention(nn.Module):
    """GPT-2's naming: ``attn_pdrop``."""

    def __init__(self, attn_pdrop: float) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.attn_pdrop = attn_pdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(x), self.attn_pdrop, self.training)


_DRAWING = [
    ("dropout rarely dropping", lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.001)), (8, 4)),
    ("dropout2d", lambda: nn.Sequential(nn.Conv2d(2, 2, 1), nn.Dropout2d(0.01)), (8, 2, 3, 3)),
    ("alpha dropout", lambda: nn.Sequential(nn.Linear(4, 4), nn.AlphaDropout(0.01)), (8, 4)),
    ("rrelu", lambda: nn.Sequential(nn.Linear(4, 4), nn.RReLU()), (8, 4)),
    ("attention dropout", lambda: _Attention(0.001), (8, 3, 4)),
    ("drop path", lambda: nn.Sequential(nn.Linear(4, 4), DropPath(0.001)), (8, 4)),
    ("prefixed drop path", lambda: nn.Sequential(nn.Linear(4, 4), Dinov2DropPath(0.001)), (8, 4)),
    ("stable dropout", lambda: nn.Sequential(nn.Linear(4, 4), StableDropout(0.001)), (8, 4)),
    ("layer skip", lambda: nn.Sequential(nn.Linear(4, 4), LayerSkip(0.001)), (8, 4)),
    ("gaussian dropout", lambda: nn.Sequential(nn.Linear(4, 4), GaussianDropout(0.0001)), (8, 4)),
    ("dropout as a float attribute", lambda: BartAttention(0.001), (8, 4)),
    ("drop block", lambda: nn.Sequential(nn.Linear(4, 4), DropBlock2d(0.001)), (8, 4)),
    ("drop probability in a tensor", lambda: nn.Sequential(nn.Linear(4, 4), LayerSkip(torch.tensor(0.001))), (8, 4)),
    ("dropout_p as a float attribute", lambda: T5Attention(0.001), (8, 4)),
    ("gpt-2's attn_pdrop", lambda: GPT2Attention(0.001), (8, 4)),
]


@pytest.mark.parametrize(("make", "shape"), [entry[1:] for entry in _DRAWING], ids=[entry[0] for entry in _DRAWING])
def test_a_submodule_that_draws_in_training_mode_runs_uncached_however_rarely_it_drops(make: Any, shape: Any) -> None:
    torch.manual_seed(0)
    model = torchcache()(make().requires_grad_(False).train())
    x = torch.randn(shape)
    with pytest.warns(CacheWarning, match=r"training mode: its outputs are not deterministic \(.*draws at random"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        model(x)
        model(x)
    assert model.cache_instance.stats().hits == 0 and len(model.cache_instance.memory) == 0
    model.eval()  # the same submodules draw nothing in eval mode
    model(x)
    assert torch.equal(model(x), model(x)) and model.cache_instance.stats().hits == 2 * len(x)


def test_dropout_of_probability_zero_or_switched_to_eval_mode_in_a_model_in_training_mode_is_cached() -> None:
    parts = [nn.Dropout(0.0), DropPath(0.0), StableDropout(0.0), NoDropout(), SpatialDropout(0.0), BartAttention(0.0)]
    parts.append(T5Attention(0.0))
    model = nn.Sequential(nn.Linear(4, 4), *parts, LayerSkip(torch.tensor(0.0)), nn.Dropout(0.5))
    model = torchcache()(model.requires_grad_(False).train())
    model[-1].eval()  # the model in training mode, this dropout not
    x = torch.randn(6, 4)
    expected = x
    for part in model:  # the submodules themselves are not cached
        expected = part(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        model(x)
        assert torch.equal(model(x), expected)
    assert model.cache_instance.stats().hits == 6


class _FeaturesAndHead(nn.Module):
    """timm's layout: dropout before the head alone, and a rate on the model, which ``forward_features`` never names."""

    def __init__(self) -> None:
        super().__init__()
        self.drop_rate = 0.1
        self.body = nn.Linear(4, 8)
        self.head_drop = nn.Dropout(self.drop_rate)
        self.head = nn.Linear(8, 2)
        self.tail = nn.Sequential(nn.Identity(), self.head_drop)  # the head's dropout, shared under a second name

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    def features_through_the_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def features_dropped_by_rate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.body(x), self.drop_rate, self.training)

    def features_by_name(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "head_" + "drop")(self.body(x))  # type: ignore[no-any-return]

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_drop(x)  # type: ignore[no-any-return]

    def features_through_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)  # type: ignore[no-any-return]

    def features_through_a_helper(self, x: torch.Tensor) -> torch.Tensor:
        return _dropped_by(self, x)

    @torch.no_grad()
    def features_decorated_plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    @torch.no_grad()
    def features_decorated(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_drop(self.body(x))  # type: ignore[no-any-return]

    def features_through_the_tail(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body(x))  # type: ignore[no-any-return]

    @property
    def dropper(self) -> nn.Module:
        return self.head_drop

    def features_through_a_property(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropper(self.body(x))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_drop(self.forward_features(x)))  # type: ignore[no-any-return]


def _dropped_by(model: _FeaturesAndHead, x: torch.Tensor) -> torch.Tensor:
    return model.head_drop(model.body(x))  # type: ignore[no-any-return]


_METHODS = ["forward_features", "features_through_the_head", "features_dropped_by_rate", "features_by_name"]


@pytest.mark.parametrize(
    "method",
    [
        *_METHODS,
        *("features_through_forward", "features_through_a_helper", "features_through_a_property"),
        *("features_decorated", "features_through_the_tail", "features_decorated_plain"),
    ],
)
def test_a_cached_method_is_run_uncached_in_training_mode_only_if_its_code_reaches_the_dropout(method: str) -> None:
    model = _FeaturesAndHead().requires_grad_(False).train()
    features = torchcache()(getattr(model, method))
    x = torch.randn(8, 4)
    if method in ("forward_features", "features_decorated_plain"):  # the head's dropout, the rate never named
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)
            features(x)
            assert torch.equal(features(x), model.body(x))
        assert features.cache_instance.stats().hits == 8  # type: ignore[attr-defined]
        return
    with pytest.warns(CacheWarning, match=r"training mode: its outputs are not deterministic \(.*draws at random"):
        features(x)
    features(x)
    assert features.cache_instance.stats().hits == 0  # type: ignore[attr-defined]


def test_a_cached_forward_runs_uncached_in_training_mode_whatever_it_names() -> None:
    whole = torchcache()(_FeaturesAndHead().requires_grad_(False).train())
    with pytest.warns(CacheWarning, match=r"training mode: its outputs are not deterministic \(.*draws at random"):
        whole(torch.randn(8, 4))
    assert whole.cache_instance.stats().hits == 0


class _Packed(nn.Module):
    """An LSTM over padded sequences packed with enforce_sorted=True: items must come longest first."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=True)
        return self.lstm(packed)[1][0][0]  # type: ignore[no-any-return]


def test_a_forward_that_takes_items_in_the_batchs_order_only_is_checked_in_that_order() -> None:
    model = torchcache()(_frozen(_Packed()))
    lengths = torch.tensor([7, 6, 5, 3, 2, 1])  # longest first, as pack_padded_sequence wants them
    x = torch.randn(6, 7, 4) * (torch.arange(7) < lengths[:, None])[..., None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        first = model(x, lengths)
        assert torch.equal(model(x, lengths), first) and model.cache_instance.stats().hits == 6
    assert torch.allclose(first, _Packed.forward(model, x, lengths))


class _OddAttributes(nn.Module):
    """Attributes named for dropping that are no probability, or that raise when read."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.drop_after = np.timedelta64(5, "s")
        self.drop_phase = torch.tensor(1j)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]


class _RaisingDropout(nn.Module):
    """A dropout-named module whose attributes come from a lookup that raises KeyError."""

    def __getattr__(self, name: str) -> Any:
        if name in ("p", "prob", "rate"):
            raise KeyError(name)
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_attributes_that_are_no_probability_are_left_and_one_that_raises_counts_as_drawing() -> None:
    plain = torchcache()(_OddAttributes().requires_grad_(False).train())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain(torch.randn(4, 4))
        plain(torch.randn(4, 4))
    raising = torchcache()(nn.Sequential(nn.Linear(4, 1), _RaisingDropout()).requires_grad_(False).train())
    with pytest.warns(CacheWarning, match=r"1 \(_RaisingDropout, p=unknown\) draws at random"):
        raising(torch.randn(4, 4))


class _Helpers(nn.Module):
    """Methods that reach the dropout through what the scan of names cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.drop = nn.Dropout(0.02)
        self.on_instance = types.MethodType(_dropped_by_helpers, self)

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x))  # type: ignore[no-any-return]

    partly = functools.partialmethod(dropped)

    @functools.cached_property
    def cached_drop(self) -> nn.Module:
        return self.drop

    def through_partialmethod(self, x: torch.Tensor) -> torch.Tensor:
        return self.partly(x)  # type: ignore[no-any-return]

    def through_the_instance(self, x: torch.Tensor) -> torch.Tensor:
        return self.on_instance(x)  # type: ignore[no-any-return]

    def through_a_cached_property(self, x: torch.Tensor) -> torch.Tensor:
        return self.cached_drop(self.linear(x))  # type: ignore[no-any-return]

    def through_a_hook(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]


def _dropped_by_helpers(model: _Helpers, x: torch.Tensor) -> torch.Tensor:
    return model.dropped(x)


@pytest.mark.parametrize(
    "method", ["through_partialmethod", "through_the_instance", "through_a_cached_property", "through_a_hook"]
)
def test_a_method_reaching_dropout_where_names_cannot_be_followed_counts_every_submodule(method: str) -> None:
    model = _Helpers().requires_grad_(False).train()
    if method == "through_a_hook":
        model.linear.register_forward_hook(lambda module, args, output: model.drop(output))
    cached = torchcache()(getattr(model, method))
    with pytest.warns(CacheWarning, match=r"drop \(Dropout, p=0.02\) draws at random"):
        cached(torch.randn(4, 4))


class _Scripted(nn.Module):
    """A TorchScript child holding dropout: its class is RecursiveScriptModule, its original name Dropout."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated in this torch
            self.inner = torch.jit.script(nn.Sequential(nn.Linear(4, 1), nn.Dropout(0.02)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


def test_dropout_inside_a_torchscript_child_is_known_by_its_original_name() -> None:
    model = torchcache(persistent_module_hash="scripted-v1")(_Scripted().requires_grad_(False).train())
    with pytest.warns(CacheWarning, match=r"inner.1 \(RecursiveScriptModule, p=0.02\) draws at random"):
        model(torch.randn(4, 4))


def test_a_context_cleared_by_another_threads_rekey_is_checked_again_not_a_key_error() -> None:
    from torchcache.faults import FaultLog
    from torchcache.module.independence import ItemCheck

    items = ItemCheck("model", True, FaultLog("model"))
    items.passed[b"context"] = (4, 0)
    items.reset()  # what a re-key on another thread does between a call's two reads
    assert items.again(b"context", 4, 0)


def test_an_output_of_as_many_rows_as_the_first_batch_by_chance_is_named_as_not_per_item() -> None:
    table = torch.randn(4, 2)

    def fixed(x: torch.Tensor) -> torch.Tensor:  # four rows whatever the batch
        return table + 0 * x.sum()

    with pytest.raises(
        DependentItemsError,
        match=r"gave \[2\] in a batch of 4 and \[2\] in a batch of 2, in 4 rows, not one per item",
    ):
        torchcache()(fixed)(torch.randn(4, 8))
