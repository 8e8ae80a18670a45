from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import assert_all_entries_decode, entry_files
from torchcache import CacheStats, torchcache
from torchcache.module.precompute import precompute
from torchcache.stores.packed.index import INDEX_NAME
from torchcache.stores.packed.store import PackedStore


@torchcache(persistent=True)
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x) * scale


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


@torchcache()
class Switchable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.torchcache_enabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def twin(model: Encoder) -> Encoder:
    other = Encoder()
    other.load_state_dict(model.state_dict())
    return other


def assert_store_intact(root: Path) -> None:
    """Every store under ``root`` passes its checks (index, totals, record checksums) and holds whole frames."""
    indexes = list(root.rglob(INDEX_NAME))
    assert indexes
    for index in indexes:
        with PackedStore(index.parent, 10**9) as store:
            report = store.verify()
        assert report.ok, report
    assert_all_entries_decode(root)


def test_fills_a_persistent_cache_that_a_fresh_instance_hits(cache_root: Path) -> None:
    model = Encoder()
    batches = [torch.randn(8, 4) for _ in range(5)]
    stats = precompute(model, batches, progress=False)
    assert isinstance(stats, CacheStats)
    assert (stats.hits, stats.misses) == (0, 40)
    assert stats.disk is not None and stats.disk.entries == 40
    assert len(entry_files(cache_root)) == 40  # flushed: every entry is on disk when it returns

    fresh = twin(model)
    for batch in batches:
        torch.testing.assert_close(fresh(batch), model.linear(batch))
    after = fresh.cache_instance.stats()
    assert (after.hits, after.misses) == (40, 0)
    assert after.disk is not None and after.disk.hits == 40


@pytest.mark.parametrize("wrapped", [False, True])
def test_an_unpickled_instance_not_called_yet_is_filled_and_then_hit(cache_root: Path, wrapped: bool) -> None:
    model = torchcache(persistent=True)(Plain()) if wrapped else Encoder()
    batches = [torch.randn(8, 4) for _ in range(2)]
    loaded = pickle.loads(pickle.dumps(model))  # as torch.load or a spawned worker gets it: no cache yet
    if wrapped:  # a wrapped instance pickles as its plain class (docs: Several processes)
        with pytest.raises(TypeError, match="needs a cached module"):
            precompute(loaded, batches, progress=False)
        return
    assert loaded.cache_instance is None
    assert precompute(loaded, batches, progress=False).misses == 16
    assert precompute(pickle.loads(pickle.dumps(model)), batches, progress=False).hits == 16


def test_batches_of_tuples_dicts_and_a_dataloader(cache_root: Path) -> None:
    model = Encoder()
    x = torch.randn(12, 4)
    assert precompute(model, [(x[:6], 2.0), (x[6:], 2.0)], progress=False).misses == 12
    stats = precompute(model, [{"x": x[:4], "scale": 2.0}, {"x": x[4:]}, {"scale": 2.0, "x": x[4:]}], progress=False)
    assert (stats.hits, stats.misses) == (12, 20)  # scale=1.0 is another key
    stats = precompute(model, DataLoader(TensorDataset(x), batch_size=5), progress=False)
    assert (stats.hits, stats.misses) == (20, 24)  # the 8 items [4:] at scale 1.0 hit
    assert len(entry_files(cache_root)) == 24


def test_decorated_function_runs_without_grad() -> None:
    seen: list[bool] = []

    @torchcache(check_items=False)
    def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return x * 2

    x = torch.randn(6, 2, requires_grad=True)
    stats = precompute(double, [x[:3], x[3:]], progress=False)
    assert seen == [False, False]
    assert (stats.misses, stats.memory.entries) == (6, 6) and stats.disk is None
    with torch.no_grad():
        torch.testing.assert_close(double(x), x * 2)
    assert double.cache_instance.stats().hits == 6


def test_interrupt_keeps_every_finished_entry(cache_root: Path) -> None:
    model = Encoder()
    batches = [torch.randn(8, 4) for _ in range(4)]

    def interrupted() -> Iterator[torch.Tensor]:
        yield batches[0]
        yield batches[1]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        precompute(model, interrupted(), progress=False)
    assert len(entry_files(cache_root)) == 16
    assert not list(cache_root.rglob("*.tmp"))
    assert_store_intact(cache_root)

    fresh = twin(model)
    for batch in batches[:2]:
        fresh(batch)
    assert fresh.cache_instance.stats().misses == 0


def test_interrupt_inside_a_batch_stores_nothing_of_it(cache_root: Path) -> None:
    calls = 0

    @torchcache(check_items=False, persistent=True, key_ignore=("calls",))  # a counter outputs do not read
    def flaky(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return x + 1

    with pytest.raises(KeyboardInterrupt):
        precompute(flaky, [torch.randn(5, 2) for _ in range(4)], progress=False)
    assert len(entry_files(cache_root)) == 10
    assert_store_intact(cache_root)


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (Plain(), r"a cached module .*; wrap it \(model = torchcache\(persistent=True\)\(model\)\) or decorate"),
        (Wrapper(), r"its submodule 'backbone' is cached: precompute\(model.backbone, batches\)"),
        (Encoder, r"needs a module instance, got the class Encoder; pass an instance"),
        (Switchable(), r"caching turned off \(torchcache_enabled=False\)"),
        (lambda x: x, r"decorated with @torchcache\(\), got <function"),
    ],
)
def test_wrong_target_says_how_to_fix_it(target: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        precompute(target, [torch.randn(2, 4)], progress=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("batches", [torch.randn(8, 4), {"x": torch.randn(8, 4)}, b"ab", 3])
def test_one_batch_is_not_an_iterable_of_batches(batches: Any) -> None:
    with pytest.raises(TypeError, match=r"takes an iterable of batches, got \w+; pass a list of batches"):
        precompute(Encoder(), batches, progress=False)


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    model = Encoder()
    batch = torch.randn(10, 4)
    precompute(model, [batch, batch, batch, batch], progress=True)
    text = tty.getvalue()
    assert "precompute: 100%" in text and "40/40" in text and "item/s" in text
    assert "hit rate 75%" in text

    tty.seek(0)
    tty.truncate()
    precompute(model, DataLoader(TensorDataset(torch.randn(9, 4)), batch_size=4), progress=True)
    assert "9/9" in tty.getvalue()

    tty.seek(0)
    tty.truncate()
    assert precompute(model, [batch], progress=False).hits == 40
    assert tty.getvalue() == ""


def test_no_bar_off_a_terminal_or_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    precompute(Encoder(), [torch.randn(3, 4)], progress=True)
    assert plain.getvalue() == ""
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails as if tqdm were missing
    stats = precompute(Encoder(), [torch.randn(3, 4)], progress=True)
    assert stats.misses == 3 and tty.getvalue() == ""


def test_precompute_is_exported_as_a_function() -> None:
    import torchcache

    assert torchcache.precompute is precompute
    assert "precompute" in torchcache.__all__


class WithMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3).requires_grad_(False)

    @torchcache()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    @torchcache()
    def scaled(this, x: torch.Tensor) -> torch.Tensor:  # its first parameter has another name than self
        return this.proj(x) * 2


def test_a_method_decorated_in_its_class_is_precomputed_on_its_instance() -> None:
    net, x = WithMethod(), torch.randn(8, 4)
    assert precompute(net.embed, [x[:4], x[4:]], progress=False).misses == 8
    assert torch.equal(net.embed(x), net.proj(x)) and net.embed.cache_instance.stats().hits == 8
    assert precompute(net.scaled, [x], progress=False).misses == 8


def test_a_batch_that_does_not_fit_the_call_is_named_before_it_runs() -> None:
    encoder, x = Encoder(), torch.randn(4, 4)
    with pytest.raises(
        TypeError, match=r"but batch 1 is a tuple of 3 \(Tensor, float, int\), which does not fit"
    ) as info:
        precompute(encoder, [(x,), (x, 2.0, 3)], progress=False)
    assert "(x for x, _ in loader) for (inputs, labels) batches" in str(info.value)
    assert encoder.cache_instance.stats().misses == 4  # the batch before it ran, and is kept


def test_progress_is_a_bool() -> None:
    with pytest.raises(TypeError, match=r"precompute\(progress=\.\.\.\) must be True or False, got 'no'"):
        precompute(Encoder(), [torch.randn(2, 4)], progress="no")  # type: ignore[arg-type]


def test_a_mapping_batch_with_keys_that_are_not_names_is_named_too() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"but batch 1 is a mapping with keys \[1, 'x'\]"):
        precompute(Encoder(), [x, {1: x, "x": x}], progress=False)
