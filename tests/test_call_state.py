"""What a call reaches beyond its per-item inputs: wrapper signatures, defaults, state a forward writes, grad, modes."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchcache import CacheWarning, ConfigError, KeyingError, torchcache

X = torch.randn(3, 4)


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval().requires_grad_(False)


# -- signatures: a functools.wraps wrapper's own, not the function it wraps ----------------------------------
def _config_scale(forward: Any) -> Any:
    @functools.wraps(forward)
    def wrapper(self: Any, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return forward(self, x, 2.0 if scale is None else scale)  # None: the configured scale

    return wrapper


class WrappedForward(nn.Module):
    @_config_scale
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale


def test_a_wrappers_default_is_what_its_callers_get() -> None:
    model = torchcache()(WrappedForward())
    assert torch.equal(model(X), X * 2.0)
    assert torch.equal(model(X, 1.0), X)  # the inner default, passed: another key


def test_a_wrapped_functions_default_is_the_wrappers() -> None:
    @torchcache()
    @_config_scale_function
    def scaled(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale

    assert torch.equal(scaled(X), X * 2.0)
    assert torch.equal(scaled(X, scale=1.0), X)


def _config_scale_function(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("scale", 2.0)  # a pass-through wrapper that fills a default of its own
        return fn(*args, **kwargs)

    return wrapper


def _renamed(forward: Any) -> Any:
    @functools.wraps(forward)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if "factor" in kwargs:  # a deprecated name, passed on under the new one
            kwargs["scale"] = kwargs.pop("factor")
        return forward(self, *args, **kwargs)

    return wrapper


class RenamedKeyword(nn.Module):
    @_renamed
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale


def test_a_keyword_only_a_wrapper_takes_is_keyed_and_passed_on() -> None:
    model = torchcache()(RenamedKeyword())
    assert torch.equal(model(X, factor=3.0), X * 3.0)
    assert torch.equal(model(X, factor=4.0), X * 4.0)
    assert torch.equal(model(x=X, scale=3.0), X * 3.0)
    assert torch.equal(model(X), X)


def test_a_pass_through_wrapper_names_arguments_as_the_wrapped_forward_does() -> None:
    model = torchcache()(RenamedKeyword())
    model(x=X)
    model(X)  # positional or keyword: one key
    stats = model.cache_instance.stats()
    assert (stats.hits, stats.misses) == (3, 3)


# -- defaults and partials: one value for the whole batch --------------------------------------------------
class TensorDefault(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor = torch.ones(4)) -> torch.Tensor:  # noqa: B008
        return x + bias


def test_a_tensor_default_is_one_for_the_batch() -> None:
    model = torchcache()(TensorDefault())
    assert torch.equal(model(X), X + 1)
    assert torch.equal(model(X, torch.zeros(3, 4)), X)  # passed: per item


def test_a_tensor_bound_by_a_partial_is_one_for_the_batch() -> None:
    weight = torch.randn(4, 2)

    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    cached = torchcache()(functools.partial(project, w=weight))
    assert torch.equal(cached(X), X @ weight)
    assert torch.equal(cached(X), X @ weight)
    assert cached.cache_instance.stats().hits == 3


# -- state a forward writes: a hit would not write it --------------------------------------------------------
class RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


@pytest.mark.parametrize("persistent", [False, True])
def test_a_forward_that_writes_its_own_buffer_is_refused_naming_it(persistent: bool, tmp_path: Path) -> None:
    model = torchcache(persistent=persistent, persistent_cache_dir=tmp_path)(RunningMean().eval())
    with pytest.raises(KeyingError, match="wrote mean in place"):
        model(X)
    assert len(model.cache_instance.memory) == 0


def test_batch_norm_in_training_mode_runs_uncached_with_its_statistics_updated_once() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).requires_grad_(False)
    cached = torchcache(check_items=False)(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).requires_grad_(False))
    cached.load_state_dict(plain.state_dict())
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        for _ in range(2):
            assert torch.equal(cached(x), plain(x))
    assert torch.equal(cached[1].running_mean, plain[1].running_mean)
    assert any("training mode" in str(w.message) for w in caught)
    stats = cached.cache_instance.stats()
    assert (stats.hits, stats.memory.entries) == (0, 0)


class SharedAccumulator(nn.Module):
    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total += x.sum()
        return x * 2


def test_a_forward_that_writes_a_shared_argument_is_refused() -> None:
    model = torchcache(shared_args=("total",))(SharedAccumulator())
    with pytest.raises(KeyingError, match="wrote an input in place"):
        model(X, torch.zeros(()))


# -- gradients: a hit carries none ----------------------------------------------------------------------------
class Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.tensor(2.0, requires_grad=True)  # a plain attribute, not a parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.temperature


def test_a_tensor_attribute_that_requires_grad_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"require grad \(temperature\)"):
        torchcache()(Temperature())


def test_a_shared_argument_that_requires_grad_runs_uncached_with_its_gradient() -> None:
    prompt = torch.randn(4, requires_grad=True)
    model = torchcache(shared_args=("prompt",))(_Prompted())
    with pytest.warns(CacheWarning, match="requires grad"):
        (model(X, prompt).sum() + model(X, prompt).sum()).backward()
    assert prompt.grad is not None
    assert torch.allclose(prompt.grad, torch.full((4,), 6.0))
    assert model.cache_instance.stats().hits == 0


class _Prompted(nn.Module):
    def forward(self, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        return x + prompt


# -- modes and transforms ----------------------------------------------------------------------------------------
def test_a_first_call_under_inference_mode_leaves_later_calls_working() -> None:
    model, plain = torchcache()(_linear()), _linear()
    first, second = torch.randn(3, 4), torch.randn(5, 4)
    with torch.inference_mode():
        model(first)
    with torch.no_grad():
        assert torch.equal(model(second), plain(second))
        assert torch.equal(model(first), plain(first))


def test_a_call_under_vmap_runs_uncached() -> None:
    model, plain = torchcache()(_linear()), _linear()
    x = torch.randn(2, 3, 4)
    with pytest.warns(CacheWarning, match="vmap"):
        assert torch.equal(torch.func.vmap(model)(x), torch.func.vmap(plain)(x))


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) * 2


def test_a_hook_added_to_the_module_of_a_cached_method_is_seen() -> None:
    module = Embedder().eval().requires_grad_(False)
    embed = torchcache()(module.embed)
    before = embed(X)
    handle = module.register_forward_hook(lambda m, args, out: out + 1)
    assert torch.equal(embed(X), before + 2)
    handle.remove()
    assert torch.equal(embed(X), before)


def test_a_torchscript_module_is_refused_naming_the_way_out() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script's own
        scripted = torch.jit.script(_linear())
    with pytest.raises(ConfigError, match="persistent_module_hash"):
        torchcache()(scripted)

    class Calling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = scripted

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    with pytest.raises(KeyingError, match="TorchScript"):
        torchcache()(Calling())(X)
    named = torchcache(persistent_module_hash="scripted-v1")(Calling())
    assert torch.equal(named(X), scripted(X))
    assert torch.equal(named(X), scripted(X))


# -- tensors torch counts as contiguous whatever the stride of a dimension of size one ---------------------------
class OddStrides(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.arange(4.0).view(1, 4).T)  # (4, 1), strides (1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.offset.sum()).sum(1, keepdim=True).view(1, -1).T  # (B, 1), strides (1, B)


def test_items_outputs_and_buffers_of_one_element_with_any_stride_are_keyed_and_stored(tmp_path: Path) -> None:
    x = torch.arange(5.0).view(1, 5).T  # (5, 1), strides (1, 5)
    options = {"persistent": True, "persistent_cache_dir": tmp_path, "max_memory_cache_size": 0}
    model = torchcache(**options)(OddStrides())
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # a write that fails would warn
        want = OddStrides()(x)
        assert torch.equal(model(x), want)
        model.cache_instance.flush()
        again = torchcache(**options)(OddStrides())
        assert torch.equal(again(x), want)
    assert again.cache_instance.stats().disk.hits == 5


class Memo(nn.Module):
    """A table filled on first use, as rotary embeddings do: a memo, not state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(8), persistent=False)
        self.register_buffer("filled", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if int(self.filled) < n:
            self.table[:n] = torch.arange(n, dtype=torch.float32).sin()
            self.filled.fill_(n)
        return x * self.table[:n]


def test_a_table_a_forward_fills_on_first_use_is_refused_unless_named_in_key_ignore() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(KeyingError, match=r"table, filled in place.*key_ignore=\('table',\)"):
        torchcache()(Memo().eval())(x)  # a memo cannot be told from state that later outputs depend on
    model, plain = torchcache(key_ignore=("table", "filled"))(Memo().eval()), Memo().eval()
    for _ in range(3):
        assert torch.equal(model(x), plain(x))
    assert model.cache_instance.stats().hits == 6  # the key stays as the table fills


class Toggle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flags = [torch.ones(1)]  # state in a list: what a HeldValues watch sees

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.flags[0].mul_(-1)
        return x * self.flags[0]


def test_a_forward_that_writes_a_tensor_held_in_a_list_is_refused() -> None:
    model = torchcache(check_items=False)(Toggle().eval())
    with pytest.raises(KeyingError, match="holds in a list"):
        model(X)


def test_a_frozen_model_with_classic_weight_norm_is_cached() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's notice that weight_norm has a newer form
            return nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 4))).eval().requires_grad_(False)

    with torch.no_grad():
        want = build()(X)
    fresh = build()
    assert fresh[0].weight.requires_grad  # computed when weight_norm was applied, before any forward
    model = torchcache()(fresh)
    with torch.no_grad():
        assert torch.equal(model(X), want) and torch.equal(model(X), want)
    assert model.cache_instance.stats().hits == 3


class Masked(nn.Module):
    @torch.no_grad()
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * mask.sum()


def test_a_misspelled_shared_arg_of_a_wrapped_forward_is_refused() -> None:
    with pytest.raises(ConfigError, match="msk"):
        torchcache(shared_args=("msk",))(Masked())


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.linear(x)


def test_a_training_forward_that_writes_state_in_a_partial_batch_writes_it_once() -> None:
    model = torchcache(check_items=False)(Counted().requires_grad_(False))
    model.eval()
    model.calls.zero_()
    seen = X[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        with pytest.raises(KeyingError, match="calls"):
            model(seen)  # outside training mode: refused
    model.train()
    model.calls.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        model(seen)
        model(torch.cat([seen, X[2:]]))
    assert int(model.calls) == 2  # once a call, as without the cache


class _Centered(nn.Module):
    """State set from its first batch by assignment (data-dependent initialisation, as ActNorm does)."""

    def __init__(self, buffer: bool) -> None:
        super().__init__()
        self.buffer = buffer
        if buffer:
            self.register_buffer("mu", torch.zeros(3))
            self.register_buffer("ready", torch.tensor(False))
        else:
            self.mu: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.buffer and not self.ready:
            self.mu, self.ready = x.mean(0), torch.tensor(True)  # buffers replaced, not written in place
        elif not self.buffer and self.mu is None:
            self.mu = x.mean(0)
        return x - self.mu


@pytest.mark.parametrize("buffer", [False, True])
def test_rows_computed_while_forward_sets_its_state_are_not_stored_under_the_key_before(
    cache_root: Path, buffer: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    first = torchcache(persistent=True, max_memory_cache_size=0)(_Centered(buffer))
    assert torch.equal(first(a), _Centered(buffer)(a))
    assert first.cache_instance.stats().misses == 4  # computed, if not stored
    assert torch.equal(first(b), b - a.mean(0))  # its state is the first batch's, as without the cache
    first.cache_instance.flush()
    mixed = torch.cat([a[:2], b[:2]])  # another run, whose first batch shares items with the first run's
    assert torch.equal(
        torchcache(persistent=True, max_memory_cache_size=0)(_Centered(buffer))(mixed), mixed - mixed.mean(0)
    )


def test_a_write_that_verify_weights_finds_is_seen_at_the_call_it_is_due() -> None:
    linear = nn.Linear(3, 3).eval().requires_grad_(False)
    cached = torchcache(verify_weights=2)(linear)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    cached(x)
    cached(x)
    linear.weight.data.mul_(2)  # no version counter sees it: the check every 2 calls does
    cached(y)
    assert torch.equal(cached(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


class _Positions(nn.Module):
    """Rebuilds an equal tensor at every call (position ids, a mask): its key does not change."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8).requires_grad_(False)
        self.pos = torch.arange(8.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pos = torch.arange(8.0)
        return self.linear(x) + self.pos


def test_a_forward_that_rebuilds_an_equal_tensor_at_every_call_still_hits() -> None:
    cached, x = torchcache()(_Positions().eval()), torch.randn(4, 8)
    for _ in range(5):
        assert torch.equal(cached(x), cached.linear(x) + torch.arange(8.0))
    assert cached.cache_instance.stats().hits == 16  # each call after the first


class _Doubling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale * 2  # a tensor of the same kind, another value, at each call
        return x * self.scale


def test_a_tensor_rebound_to_another_value_as_the_forward_runs_keeps_its_rows_out() -> None:
    cached, x = torchcache()(_Doubling().eval()), torch.randn(4, 3)
    assert torch.equal(cached(x), x * 2) and torch.equal(cached(x), x * 4)  # as without the cache
    assert cached.cache_instance.stats().memory.entries == 0


def test_a_per_item_tensor_declared_shared_fails_on_a_partial_hit_saying_how_it_was_called() -> None:
    @torchcache(shared_args=("gains",), check_items=False)
    def scaled(x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        return x * gains  # gains has a row per item: it is not shared

    x, gains = torch.randn(4, 3), torch.randn(4, 3)
    scaled(x, gains)
    with pytest.raises(RuntimeError, match="must match") as info:
        scaled(torch.cat([x[:2], torch.randn(2, 3)]), gains)  # two hits, two items computed with all four gains
    (note,) = info.value.__notes__
    assert "on 2 of the batch's 4 items" in note and "shared_args=['gains']" in note


class _SeesAChangeWhileItRuns(nn.Module):
    """As if another thread saw a change to the weights while this forward ran."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache_instance.weights_changed()  # what another thread's call does when it sees a write
        return x * 2


def test_rows_computed_while_a_change_was_seen_are_returned_but_not_stored() -> None:
    model, x = torchcache()(_SeesAChangeWhileItRuns()), torch.randn(4, 3)
    assert torch.equal(model(x), x * 2)
    assert model.cache_instance.stats().memory.entries == 0  # computed as the state moved: not under the old key


class _SwitchedAsItRuns(nn.Module):
    """As if another thread called ``.train()`` while this forward ran in eval mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * (3 if self.training else 2)
        self.train()
        return out


def test_rows_computed_while_the_module_was_switched_to_the_other_mode_are_not_stored() -> None:
    model, x = torchcache()(_SwitchedAsItRuns().eval()), torch.randn(4, 3)
    assert torch.equal(model(x), x * 2)
    assert model.cache_instance.stats().memory.entries == 0  # not filed under eval: the mode moved as it ran


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _scaled(self: nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale


@pytest.mark.parametrize(
    ("kind", "forward"),
    [
        ("staticmethod", staticmethod(_doubled)),
        ("classmethod", classmethod(lambda cls, x: x * 2)),
        ("partialmethod", functools.partialmethod(_scaled, scale=2.0)),
    ],
)
def test_a_forward_that_is_not_a_method_is_refused_naming_the_way_out(kind: str, forward: Any) -> None:
    plain = type("Plain", (nn.Module,), {"forward": forward})
    assert torch.equal(plain()(torch.ones(2, 3)), torch.full((2, 3), 2.0))  # torch runs it
    with pytest.raises(ConfigError, match=rf"Plain.forward is a {kind}, .* 'def forward\(self, x\): \.\.\.'"):
        torchcache()(plain())
    with pytest.raises(ConfigError, match=rf"Plain.forward is a {kind}"):
        torchcache()(type("Plain", (nn.Module,), {"forward": forward}))
