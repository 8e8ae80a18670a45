"""Attributes rebound after the key was taken: of module instances and of classes of yours, seen at the next call."""

from __future__ import annotations

import warnings
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


def _count_keys(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time the module's key is taken again."""
    taken: list[int] = []
    real = model.cache_instance._take_key
    monkeypatch.setattr(model.cache_instance, "_take_key", lambda: taken.append(1) or real())
    return taken


def _expected(model: Scaled, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate=model.act.approximate) * model.scale * model.K


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "scale", 3.0),  # an instance attribute rebound
        lambda m: setattr(m, "K", 5.0),  # an instance attribute over a class value
        lambda m: setattr(m.act, "approximate", "tanh"),  # an attribute of a submodule of an installed class
        lambda m: setattr(type(m), "K", 7.0),  # a class value rebound
    ],
    ids=["instance", "over-class-value", "installed-submodule", "class-value"],
)
def test_an_attribute_rebound_after_the_first_call_is_seen(change, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Scaled, "K", 2.0)
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    model(x)
    change(model)
    assert torch.equal(model(x), _expected(model, x))


class Base(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Sub(Base):
    pass


def test_a_method_set_on_a_subclass_that_inherited_it_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache()(Sub()), torch.randn(4, 3)
    model(x)
    monkeypatch.setattr(Sub, "inner", lambda self, x: x - 1, raising=False)  # added to Sub, over Base's
    assert torch.equal(model(x), x - 1)


def test_a_rebound_attribute_is_keyed_in_later_processes(tmp_path: Path) -> None:
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
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # its own state, rebound at every run of forward
        if self.table is None or len(self.table) < x.shape[1]:
            self.table = torch.arange(float(x.shape[1]))  # a memo grown on demand
            self.grown = True  # a name added by forward
        return x + self.table[: x.shape[1]]


@pytest.mark.parametrize("check_items", [True, False])  # forward runs again to check items, or only once
def test_what_forward_rebinds_for_itself_does_not_take_the_key_again(check_items: bool) -> None:
    model = torchcache(check_items=check_items)(Counting())
    narrow, wide = torch.randn(4, 3), torch.randn(4, 5)
    batches = [narrow, wide, narrow, wide]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # no "rebound" warning either
        for x in batches:
            assert torch.equal(model(x), x + torch.arange(float(x.shape[1])))
            assert torch.equal(model(x), x + torch.arange(float(x.shape[1])))
    assert model.cache_instance.stats().hits == 6 * 4  # the narrow batch after the table grew: hits


def test_an_equal_value_set_again_keeps_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    model(x)
    taken = []
    monkeypatch.setattr(
        model.cache_instance, "_take_key", lambda real=model.cache_instance._take_key: taken.append(1) or real()
    )
    for _ in range(5):
        model.scale = float("1.0")  # a new float object, equal to the keyed one
        model.act.approximate = "".join(["no", "ne"])  # a new string, equal
        assert torch.equal(model(x), _expected(model, x))
    assert taken == []
    model.scale = -0.0  # not equal bit for bit: another key
    model(x)
    assert taken == [1]


def test_an_attribute_rebound_at_every_call_is_followed_and_said_once() -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    with pytest.warns(CacheWarning, match="attribute 'scale'.*key_ignore") as caught:
        for step in range(6):
            model.scale = float(step)
            assert torch.equal(model(x), _expected(model, x))
    assert len([w for w in caught if "rebound" in str(w.message)]) == 1


def test_an_ignored_attribute_is_not_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache(key_ignore=("scale",))(Scaled()), torch.randn(4, 3)
    model(x)
    taken = []
    monkeypatch.setattr(
        model.cache_instance, "_take_key", lambda real=model.cache_instance._take_key: taken.append(1) or real()
    )
    model.scale = 2.0
    model(x)
    assert taken == []
