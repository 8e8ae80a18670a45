"""Settings among a module's attributes, and members of your classes, rebound after the key was taken."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from torchcache import CacheWarning, torchcache


class Scaled(nn.Module):
    K = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * self.scale * self.K


def _expected(model: Scaled, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate=model.act.approximate) * model.scale * model.K


def _count_keys(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time the module's key is taken again."""
    taken: list[int] = []
    real = model.cache_instance._take_key
    monkeypatch.setattr(model.cache_instance, "_take_key", lambda: taken.append(1) or real())
    return taken


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "scale", 3.0),
        lambda m: setattr(m.act, "approximate", "tanh"),  # a submodule of an installed class
        lambda m: setattr(Scaled, "K", 7.0),  # a class value of yours
    ],
    ids=["instance", "installed-submodule", "class-value"],
)
def test_a_setting_rebound_after_the_first_call_is_seen(
    change: Callable[[Scaled], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Scaled, "K", 2.0)
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    model(x)
    change(model)
    assert torch.equal(model(x), _expected(model, x))


def test_a_rebound_setting_is_keyed_in_later_processes(tmp_path: Path) -> None:
    x = torch.randn(4, 3)
    writer = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Scaled())
    writer(x)
    writer.scale = 3.0
    assert torch.equal(writer(x), _expected(writer, x))
    writer.cache_instance.flush()
    reader = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Scaled())
    assert torch.equal(reader(x), _expected(reader, x))  # scale 1.0: not the entries stored with 3.0


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # its own state, rebound at every run of forward
        return x * 2


def _seen(module: nn.Module, args: object, output: torch.Tensor) -> None:
    module.seen += 1  # a hook of the cached module itself: it runs on hits too
    module.last_output = output


def test_what_forward_and_the_modules_own_hooks_keep_on_it_does_not_take_the_key_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Counting()
    model.register_forward_hook(_seen)
    model, x = torchcache()(model), torch.randn(4, 3)
    model(x)
    taken = _count_keys(model, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        for _ in range(4):
            assert torch.equal(model(x), x * 2)
    assert taken == [] and model.seen == 5
    assert model.cache_instance.stats().hits == 4 * 4


def test_an_equal_setting_set_again_keeps_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    model(x)
    taken = _count_keys(model, monkeypatch)
    for _ in range(5):
        model.scale = float("1.0")  # a new float object, equal to the keyed one
        model.act.approximate = "".join(["no", "ne"])  # a new string, equal
        assert torch.equal(model(x), _expected(model, x))
    assert taken == []
    model.scale = -0.0  # not equal bit for bit: another key
    model(x)
    assert taken == [1]


class Loud(str):
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing")

    __hash__ = str.__hash__


def test_a_setting_whose_class_compares_oddly_is_taken_again_without_calling_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    model.act.approximate = Loud("none")
    model(x)
    taken = _count_keys(model, monkeypatch)
    model.act.approximate = Loud("none")
    assert torch.equal(model(x), _expected(model, x))
    assert taken == [1]


def test_a_setting_rebound_at_every_call_is_followed_and_said_once() -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    with pytest.warns(CacheWarning, match="attribute 'scale'.*key_ignore") as caught:
        for step in range(6):
            model.scale = float(step)
            assert torch.equal(model(x), _expected(model, x))
    assert len([w for w in caught if "rebound" in str(w.message)]) == 1


def test_an_ignored_setting_is_not_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache(key_ignore=("scale",))(Scaled()), torch.randn(4, 3)
    model(x)
    taken = _count_keys(model, monkeypatch)
    model.scale = 2.0
    model(x)
    assert taken == []


def test_a_deleted_model_is_freed_without_a_collection() -> None:
    model = torchcache()(Scaled())
    model.mask = torch.ones(3)  # a plain tensor attribute is watched too
    model(torch.randn(4, 3))
    weight = weakref.ref(model.act)
    gc.disable()
    try:
        del model
        assert weight() is None
    finally:
        gc.enable()
