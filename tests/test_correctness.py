"""Keys that see everything that changes an output, and calls that behave as without the cache.

Each test here failed with torchcache 1.0: a wrong output served silently, or a call
that works without the cache and broke with it.
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchcache import CacheWarning, ConfigError, KeyingError, precompute, torchcache

from .helpers import Counting, assert_same, stored_entries


class Features(nn.Module):
    """A frozen model with a second method, as timm and CLIP models have."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(8, 4, generator=generator))
            self.linear.bias.copy_(torch.randn(8, generator=generator))
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


# -- bound methods and instances --------------------------------------------------------------
def test_a_bound_method_is_keyed_by_its_instance(tmp_path: Path) -> None:
    a, b = Features(seed=1), Features(seed=2)
    x = torch.randn(6, 4)
    cached_a = torchcache(persistent=True, persistent_cache_dir=tmp_path)(a.features)
    cached_b = torchcache(persistent=True, persistent_cache_dir=tmp_path)(b.features)
    assert_same(cached_a(x), a.features(x))
    cached_a.cache_instance.flush()
    assert cached_a.cache_instance.module_hash != cached_b.cache_instance.module_hash
    assert_same(cached_b(x), b.features(x))
    assert cached_b.cache_instance.stats().hits == 0


def test_a_cached_method_holds_its_model_and_pickles_as_the_model_and_the_methods_name(tmp_path: Path) -> None:
    cached = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Features(seed=3).features)  # no other owner
    gc.collect()
    x = torch.randn(5, 4)
    assert_same(cached(x), Features(seed=3).features(x))
    cached.cache_instance.flush()
    loaded = pickle.loads(pickle.dumps(cached))  # as a spawned DataLoader worker gets a dataset holding it
    assert loaded is not cached and loaded.cache_instance.module_hash == cached.cache_instance.module_hash
    assert_same(loaded(x), Features(seed=3).features(x))
    assert loaded.cache_instance.stats().disk.hits == 5  # type: ignore[union-attr]


def test_a_method_of_a_trainable_instance_is_refused() -> None:
    model = Features().requires_grad_(True)
    with pytest.raises(ConfigError, match="require grad"):
        torchcache()(model.features)


def test_wrapping_an_instance_leaves_its_class_and_other_instances_alone() -> None:
    frozen, trainable = Features(seed=1), Features(seed=2).requires_grad_(True)
    plain_keys = list(frozen.state_dict())
    plain_repr = repr(frozen)
    cached = torchcache()(frozen)
    assert cached is frozen
    assert isinstance(cached, Features) and type(cached).__name__ == "Features"
    assert Features.forward is not type(cached).forward
    assert list(cached.state_dict()) == plain_keys and repr(cached) == plain_repr
    assert "cache_instance" not in trainable.__dict__
    x = torch.randn(5, 4)
    loss = trainable(x).sum()
    loss.backward()  # the class still trains: no ConfigError, a gradient
    assert trainable.linear.weight.grad is not None
    assert_same(cached(x), cached(x))
    assert cached.cache_instance.stats().hits == 5
    assert torchcache()(cached).cache_instance is cached.cache_instance


def test_a_wrapped_instance_drops_into_a_sequential_and_follows_to_and_eval() -> None:
    backbone = torchcache()(Features())
    model = nn.Sequential(backbone, nn.Linear(8, 2))
    x = torch.randn(4, 4)
    first = model(x)
    model.eval()
    assert not backbone.training
    model.to(torch.float64)
    out = model(x.double())
    assert out.dtype == torch.float64
    assert torch.allclose(out.float(), first, atol=1e-5)
    plain = Features()
    plain.to(torch.float64)
    assert_same(backbone(x.double()), plain(x.double()))


def test_a_wrapped_instance_takes_its_key_again_after_load_state_dict() -> None:
    model = torchcache()(Features(seed=1))
    x = torch.randn(3, 4)
    model(x)
    other = Features(seed=2)
    model.load_state_dict(other.state_dict())
    assert_same(model(x), other(x))


# -- the autocast state ---------------------------------------------------------------------------
def test_autocast_is_part_of_the_key() -> None:
    model = torchcache()(Features())
    plain = Features()
    x = torch.randn(8, 4)
    outside = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = model(x)
        expected_inside = plain(x)
    assert inside.dtype == torch.bfloat16
    assert_same(inside, expected_inside)
    assert_same(outside, plain(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same(model(x), expected_inside)
    assert_same(model(x), plain(x))
    stats = model.cache_instance.stats()
    assert (stats.misses, stats.hits) == (16, 16)


# -- shared arguments and outputs whose batch is elsewhere ---------------------------------------
def _attend(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mask @ x  # every row mixes all rows of x: a shared (T, T) mask


def test_a_shared_mask_whose_size_equals_the_batch_is_hashed_and_passed_whole() -> None:
    cached = torchcache(check_items=False, shared_args=["mask"])(_attend)
    mask = torch.eye(5)
    x = torch.randn(5, 3)
    assert_same(cached(x, mask), _attend(x, mask))
    order = torch.tensor([4, 2, 0, 1, 3])
    assert_same(cached(x[order], mask), _attend(x[order], mask))
    other = torch.tril(torch.ones(5, 5))
    assert_same(cached(x, other), _attend(x, other))


def _lstm_like(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Outputs shaped like an LSTM's: h_n and c_n are (num_layers, batch, hidden)."""
    h = torch.stack([x * 2, x * 3])  # num_layers = 2
    return x + 1, (h, h + 1)


def test_outputs_with_the_batch_in_another_dimension() -> None:
    cached = torchcache(batch_dims={"output[1][0]": 1, "output[1][1]": 1})(_lstm_like)
    x = torch.randn(2, 3)  # batch == num_layers: the dangerous case
    for got, want in zip(_flat(cached(x)), _flat(_lstm_like(x))):
        assert_same(got, want)
    swapped = x[[1, 0]]
    for got, want in zip(_flat(cached(swapped)), _flat(_lstm_like(swapped))):
        assert_same(got, want)
    assert cached.cache_instance.stats().hits == 2


def test_an_output_whose_first_dimension_equals_the_batch_by_chance_is_caught_and_dropped() -> None:
    cached = torchcache(check_items=False)(_lstm_like)
    cached(torch.randn(2, 3))  # stored per item, wrongly: h_n's first dimension is the layers
    assert len(cached.cache_instance.memory) == 2
    with pytest.raises(KeyingError, match="batch_dims") as info:
        cached(torch.randn(3, 3))
    assert "removed" in str(info.value)
    assert len(cached.cache_instance.memory) == 0


def test_an_output_not_batched_where_declared_is_named_with_the_shape_it_was_returned_in() -> None:
    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(-1)

    cached = torchcache(batch_dims={"output[0]": 1})(pair)  # output[0] is batch first after all
    with pytest.raises(KeyingError, match=r"returned output\[0\] \(batch_dims 1\) shaped \(3, 4\) for 3 items"):
        cached(torch.randn(3, 4))


def test_an_lstm_like_output_first_seen_at_a_batch_of_its_layers_points_to_batch_dims() -> None:
    cached = torchcache()(_lstm_like)  # h_n and c_n not declared; the first batch has as many items as layers
    with pytest.raises(KeyingError, match=r"depends on the batch.*named in batch_dims"):
        cached(torch.randn(2, 3))


def _flat(output: Any) -> list[torch.Tensor]:
    out, (h, c) = output
    return [out, h, c]


# -- training mode ------------------------------------------------------------------------------
class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x))


def test_keep_eval_keeps_the_module_in_eval_mode_under_a_parent_train() -> None:
    backbone = torchcache(keep_eval=True)(Dropping())
    head = nn.Linear(4, 1)
    model = nn.Sequential(backbone, head)
    model.train()
    assert head.training and not backbone.training and not backbone.drop.training
    x = torch.randn(16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = backbone(x)
    assert_same(out, backbone.linear(x))


def test_training_mode_with_dropout_warns_once() -> None:
    backbone = torchcache()(Dropping())
    backbone.train()
    x = torch.randn(4, 4)
    with pytest.warns(CacheWarning, match="training mode") as caught:
        backbone(x)
        backbone(torch.randn(4, 4))
    assert len([w for w in caught if "training mode" in str(w.message)]) == 1


# -- function keys ------------------------------------------------------------------------------
def test_two_lambdas_on_one_line_have_different_keys() -> None:
    add, mul = torchcache()(lambda x: x + 2), torchcache()(lambda x: x * 2)
    x = torch.randn(3, 2)
    assert_same(add(x), x + 2)
    assert_same(mul(x), x * 2)
    assert add.cache_instance.module_hash != mul.cache_instance.module_hash


def _make_scaler(factor: float) -> Any:
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    return scale


def test_closure_variables_are_keyed(tmp_path: Path) -> None:
    x = torch.randn(3, 2)
    double = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_make_scaler(2.0))
    assert_same(double(x), x * 2)
    double.cache_instance.flush()
    triple = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_make_scaler(3.0))
    assert_same(triple(x), x * 3)
    assert triple.cache_instance.stats().hits == 0


def test_a_tensor_attribute_set_in_init_is_keyed(tmp_path: Path) -> None:
    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.randn(4, 3)  # a random projection: neither a parameter nor a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.proj

    cls = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Projection)
    x = torch.randn(5, 4)
    torch.manual_seed(0)
    first = cls()
    assert_same(first(x), x @ first.proj)
    first.cache_instance.flush()
    torch.manual_seed(1)
    second = cls()
    assert second.cache_instance.module_hash != first.cache_instance.module_hash
    assert_same(second(x), x @ second.proj)
    assert second.cache_instance.stats().hits == 0


def test_var_positional_and_var_keyword_arguments_never_collide() -> None:
    @torchcache()
    def f(x: torch.Tensor, *args: int, **kwargs: int) -> torch.Tensor:
        return x * (1 + sum(args)) + 10 * sum(kwargs.values())

    x = torch.randn(3, 2)
    assert_same(f(x, 5), x * 6)
    assert_same(f(x, **{"args[0]": 5}), x + 50)
    assert_same(f(x, **{"*args[0]": 5}), x + 50)
    assert f.cache_instance.stats().hits == 0  # three different calls


def test_functools_partial_is_keyed_by_its_bound_arguments() -> None:
    def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    double = torchcache()(functools.partial(scale, factor=2.0))
    triple = torchcache()(functools.partial(scale, factor=3.0))
    x = torch.randn(3, 2)
    assert_same(double(x), x * 2)
    assert_same(triple(x), x * 3)
    assert double.cache_instance.module_hash != triple.cache_instance.module_hash


# -- calls as the caller made them ---------------------------------------------------------------
def _adds_keywords(forward: Any) -> Any:
    """Like Hugging Face's forward decorators: keyword-only extras, filled in by the wrapper."""

    @functools.wraps(forward)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("use_cache", False)
        return forward(self, *args, **kwargs)

    return wrapper


def test_the_forward_is_called_with_the_callers_own_argument_layout() -> None:
    @torchcache()
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2).requires_grad_(False)

        @_adds_keywords
        def forward(self, x: torch.Tensor, scale: float = 1.0, use_cache: bool | None = None) -> torch.Tensor:
            assert use_cache is False
            return self.linear(x) * scale

    model = Wrapped()
    x = torch.randn(6, 4)
    assert_same(model(x), model.linear(x))
    assert_same(model(x, scale=2.0), model.linear(x) * 2)
    assert_same(model(x[:4]), model.linear(x[:4]))  # a partial hit, computed with only the missing rows
    assert model.cache_instance.stats().hits == 4


def test_a_dict_of_per_item_tensors_is_keyed_and_sliced() -> None:
    seen: list[int] = []

    @torchcache(check_items=False)
    def encode(batch: dict[str, torch.Tensor], pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append(batch["ids"].shape[0])
        return batch["ids"].float() * batch["mask"] + pair[0] - pair[1]

    ids, mask = torch.randint(0, 9, (6, 3)), torch.rand(6, 3)
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    expected = ids.float() * mask + a - b
    assert_same(encode({"ids": ids, "mask": mask}, (a, b)), expected)
    ids2 = torch.cat([ids[[5, 0]], torch.randint(0, 9, (1, 3))])
    mask2, a2, b2 = torch.cat([mask[[5, 0]], mask[:1]]), torch.cat([a[[5, 0]], a[:1]]), torch.cat([b[[5, 0]], b[:1]])
    assert_same(encode({"ids": ids2, "mask": mask2}, (a2, b2)), ids2.float() * mask2 + a2 - b2)
    assert seen == [6, 1]  # the second call computed only its new item


def test_a_call_without_tensors_raises_a_value_error_as_in_0_6() -> None:
    @torchcache()
    def f(x: float) -> torch.Tensor:
        return torch.tensor([x])

    with pytest.raises(ValueError, match="tensor"):
        f(1.0)


def test_any_persistent_module_hash_string_is_accepted_and_kept_apart(tmp_path: Path) -> None:
    names = ["resnet50 v2", "resnet50/v2", "resnet50_v2", "ü", "..", "a" * 300]
    dirs = set()
    for name in names:
        model = torchcache(persistent=True, persistent_cache_dir=tmp_path, persistent_module_hash=name)(Counting())
        model(torch.randn(2, 4))
        model.cache_instance.flush()
        directory = model.cache_instance.cache_dir
        assert directory is not None and directory.parent == tmp_path and directory.is_dir()
        dirs.add(directory.name)
    assert len(dirs) == len(names)


def test_warnings_about_0_6_options_point_at_the_callers_line() -> None:
    with pytest.warns(FutureWarning, match="zstd_compression") as caught:
        torchcache(zstd_compression=True)
    assert caught[0].filename == __file__

    @torchcache()
    class Legacy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.torchcache_zstd_compression_level = 3

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.warns(FutureWarning, match="torchcache_zstd_compression_level") as caught:
        Legacy()
    assert caught[0].filename == __file__


# -- copies ---------------------------------------------------------------------------------------
def test_deepcopy_of_a_model_that_holds_a_cached_module() -> None:
    backbone = torchcache()(Counting())
    model = nn.Sequential(backbone, nn.Linear(16, 1))
    x = torch.randn(4, 4)
    model(x)
    teacher = copy.deepcopy(model)
    copied = teacher[0]
    assert copied.cache_instance is not backbone.cache_instance
    assert copied.cache_instance._owner() is copied
    assert_same(teacher(x), model(x))
    state = {k: v + 1 for k, v in copied.state_dict().items()}
    copied.load_state_dict(state)
    plain = Counting()
    plain.load_state_dict(state)
    assert_same(copied(x), plain(x))
    assert_same(backbone(x), Counting()(x))


def test_deepcopy_of_a_wrapped_instance_is_cached_and_bound_to_the_copy() -> None:
    model = torchcache()(Features(seed=1))
    twin = copy.deepcopy(model)
    assert type(twin) is type(model)
    assert twin.cache_instance is not model.cache_instance and twin.cache_instance._owner() is twin
    x = torch.randn(3, 4)
    assert_same(twin(x), model(x))


@torchcache()
class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_shallow_copy_of_a_decorated_module_gets_a_cache_of_its_own() -> None:
    model = _Scaled()
    x = torch.randn(3, 4)
    assert_same(model(x), x)
    twin = copy.copy(model)  # copies __dict__, cache_instance included
    twin.scale = 7.0
    assert_same(twin(x), x * 7.0)
    assert twin.cache_instance is not model.cache_instance and twin.cache_instance._owner() is twin
    assert_same(model(x), x)


def test_a_shallow_copy_of_a_wrapped_instance_is_a_plain_module() -> None:
    model = torchcache()(Features(seed=1))
    twin = copy.copy(model)
    assert "cache_instance" not in vars(twin)
    x = torch.randn(3, 4)
    assert_same(twin(x), model(x))


# -- precompute -------------------------------------------------------------------------------------
def test_precompute_names_a_batch_that_does_not_fit_the_call() -> None:
    model = torchcache()(Counting())
    loader = [[torch.arange(4), torch.randn(4, 4)]]
    with pytest.raises(TypeError, match=r"\(x for _, x in loader\) for \(index, inputs\) batches"):
        precompute(model, loader, progress=False)


def test_a_sparse_output_is_refused_clearly() -> None:
    @torchcache()
    def sparse(x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse()

    with pytest.raises(KeyingError, match="to_dense"):
        sparse(torch.eye(3))


# -- variable shapes -----------------------------------------------------------------------------------
def test_a_low_hit_rate_with_changing_input_shapes_is_pointed_out() -> None:
    @torchcache()
    def embed(ids: torch.Tensor) -> torch.Tensor:
        return ids.float().sum(dim=1, keepdim=True)

    generator = torch.Generator().manual_seed(0)
    with pytest.warns(CacheWarning, match="Variable-length") as caught:
        for step in range(80):
            length = 4 + step % 12  # padded to the longest item of each batch
            embed(torch.randint(0, 9, (4, length), generator=generator))
    assert len([w for w in caught if "Variable-length" in str(w.message)]) == 1


def test_a_second_instance_of_one_key_sees_entries_still_pending_in_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from torchcache.tiers.persistent import PersistentTier

    release = threading.Event()
    real_job = PersistentTier._write_job

    def held_back(self: Any, job: Any) -> None:
        release.wait(30)
        real_job(self, job)

    monkeypatch.setattr(PersistentTier, "_write_job", held_back)
    first = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Features(seed=3))
    second = torchcache(persistent=True, persistent_cache_dir=tmp_path, max_memory_cache_size=0)(Features(seed=3))
    x = torch.randn(6, 4)
    try:
        first(x)
        assert first.cache_instance.module_hash == second.cache_instance.module_hash
        assert stored_entries(tmp_path) == {}  # the writes really are held back
        assert_same(second(x), Features(seed=3)(x))
        assert second.cache_instance.stats().hits == 6  # served from the first one's pending writes
    finally:
        release.set()
        first.cache_instance.flush()
    assert len(stored_entries(tmp_path)) == 6


def test_names_in_shared_args_and_batch_dims_must_exist() -> None:
    with pytest.raises(ConfigError, match="masc"):
        torchcache(shared_args=["masc"])(_attend)
    with pytest.raises(ConfigError, match="'y'"):
        torchcache(batch_dims={"y": 1})(_attend)
    typo = torchcache(batch_dims={"output[1][2]": 1})(_lstm_like)
    with pytest.raises(ConfigError, match=r"output\[1\]\[2\]"):
        typo(torch.randn(2, 3))


def test_module_hash_follows_loaded_weights_before_the_next_call() -> None:
    model = torchcache()(Features(seed=1))
    model(torch.randn(2, 4))
    old = model.cache_instance.module_hash
    model.load_state_dict(Features(seed=2).state_dict())
    assert model.cache_instance.module_hash != old


def test_an_output_on_the_meta_device_is_refused_and_leaves_other_calls_their_device() -> None:
    @torchcache()
    def moved(x: torch.Tensor, device: str) -> torch.Tensor:
        return (x * 2).to(device)

    x = torch.randn(3, 2)
    assert moved(x, "cpu").device.type == "cpu"
    with pytest.raises(KeyingError, match="meta device"):
        moved(x, "meta")
    hit = moved(x, "cpu")
    assert hit.device.type == "cpu" and torch.equal(hit, x * 2)


def test_hits_are_merged_onto_the_device_of_each_leaf() -> None:
    from torchcache.tiers.batch import cast_returned, merge_parts
    from torchcache.tree import Layout, flatten

    spec, leaves = flatten((torch.zeros(4, 2), torch.zeros(4, 3)))
    layout = Layout.of(spec, leaves, None)
    devices = (torch.device("cpu"), torch.device("meta"))  # a call that returns (features, aux.to(other))
    parts = [([0, 2], [torch.ones(2, 2), torch.ones(2, 3)]), ([1, 3], [torch.zeros(2, 2), torch.zeros(2, 3)])]
    merged = merge_parts(parts, 4, layout, devices)
    assert [t.device.type for t in merged] == ["cpu", "meta"] and torch.equal(
        merged[0][:, 0], torch.tensor([1.0, 0, 1, 0])
    )
    assert [t.device.type for t in cast_returned(leaves, layout, devices)] == ["cpu", "meta"]
    assert [t.device.type for t in cast_returned(leaves, layout, (torch.device("meta"),))] == ["meta", "meta"]


@pytest.mark.parametrize(
    "split", [[[0, 1, 2], [3, 4, 5]], [[3, 4, 5], [0, 1, 2]], [[0, 2, 4], [1, 3, 5]], [[1, 2], [0, 3, 4, 5]]]
)
def test_parts_are_merged_in_input_order_whether_their_positions_are_runs_or_not(split: list[list[int]]) -> None:
    from torchcache.tiers.batch import merge_parts
    from torchcache.tree import Layout, flatten

    expected = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)
    spec, leaves = flatten((expected, expected.double()))
    layout = Layout.of(spec, leaves, None)
    parts = [(positions, [expected[positions], expected[positions].double()]) for positions in split]
    merged = merge_parts(parts, 6, layout, (torch.device("cpu"),))
    assert torch.equal(merged[0], expected) and torch.equal(merged[1], expected.double())


def test_an_output_that_requires_grad_with_no_input_that_does_is_refused_not_cached_without_grad() -> None:
    @torchcache()
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * torch.full((4,), 2.0, requires_grad=True)  # trainable, made where no key looks

    x = torch.randn(3, 4)
    with pytest.raises(ConfigError, match=r"returned an output that requires grad though no input does"):
        scaled(x)
    assert len(scaled.cache_instance.memory) == 0  # nothing kept that a hit would return without grad
    with torch.no_grad():  # no graph: the outputs are plain values, cached
        assert torch.equal(scaled(x), x * 2) and torch.equal(scaled(x), x * 2)
    assert scaled.cache_instance.stats().hits == 3
    with pytest.raises(ConfigError, match=r"requires grad though no input does"):
        scaled(x)  # in grad mode again: refused as a hit too, not served without its gradient
    with pytest.warns(CacheWarning, match="an input requires grad"):
        assert scaled(x.clone().requires_grad_()).requires_grad  # such calls bypass the cache, as always


def test_a_context_refused_for_outputs_that_require_grad_is_asked_again_after_clear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @torchcache()
    def scaled(x: torch.Tensor) -> torch.Tensor:  # reads what no key sees (docs: What the key cannot see)
        return x * torch.full((4,), 2.0, requires_grad=os.environ.get("TC_TEST_TRAIN") == "1")

    x = torch.randn(3, 4)
    monkeypatch.setenv("TC_TEST_TRAIN", "1")
    with pytest.raises(ConfigError, match=r"requires grad though no input does"):
        scaled(x)
    monkeypatch.setenv("TC_TEST_TRAIN", "0")  # frozen, then the cache cleared, as the message says
    scaled.cache_instance.clear()
    assert torch.equal(scaled(x), x * 2) and not scaled(x).requires_grad


_TRAINED_HEAD = nn.Linear(4, 3)  # trainable, read by the function below
_TRAINED_SCALE = torch.ones(4, requires_grad=True)


def test_tensors_that_require_grad_read_through_globals_are_refused_not_cached_without_grad() -> None:
    @torchcache()
    def head(x: torch.Tensor) -> torch.Tensor:
        return _TRAINED_HEAD(x)

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * _TRAINED_SCALE

    x = torch.randn(2, 4)
    with pytest.raises(ConfigError, match=r"reads 2 tensors that require grad through its globals"):
        head(x)
    with pytest.raises(ConfigError, match=r"reads 1 tensor that require grad"):
        torchcache()(Scaled())(x)
    _TRAINED_HEAD.requires_grad_(False)
    try:
        assert torch.equal(head(x), _TRAINED_HEAD(x))  # frozen: cached
    finally:
        _TRAINED_HEAD.requires_grad_(True)
