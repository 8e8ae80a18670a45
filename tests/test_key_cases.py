"""Ways state reached ``forward`` that keys once missed: each returns its own outputs, or is refused."""

from __future__ import annotations

import builtins
import cmath
import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib.util
import inspect
import math
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import fake_extension, load_module
from torchcache import CacheWarning, KeyingError, torchcache
from torchcache.canonical import KeyEncoder
from torchcache.keys import numerics
from torchcache.module import rebinding


def _frozen(module: nn.Module) -> nn.Module:
    return module.eval().requires_grad_(False)


def _both(a: Any, b: Any, *inputs: Any, root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache ``a`` then ``b`` into one persistent root; return ``b``'s cached output and its plain output."""
    ca = torchcache(persistent=True, persistent_cache_dir=root)(a)
    ca(*inputs)
    ca.cache_instance.flush()
    expected = b(*inputs)
    cb = torchcache(persistent=True, persistent_cache_dir=root)(b)
    return cb(*inputs), expected


X = torch.arange(12.0).reshape(3, 4) - 5


# 1 -------------------------------------------------------------------------------------------------
class _Scale(nn.Module):
    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_a_module_with_slots_is_keyed_by_them(tmp_path: Path) -> None:
    got, expected = _both(_frozen(_Scale(2.0)), _frozen(_Scale(3.0)), X, root=tmp_path)
    assert torch.equal(got, expected)


# 2 -------------------------------------------------------------------------------------------------
def test_a_forward_hook_on_a_submodule_is_keyed(tmp_path: Path) -> None:
    plain = _frozen(nn.Sequential(nn.Identity(), nn.Tanh()))
    hooked = _frozen(nn.Sequential(nn.Identity(), nn.Tanh()))
    hooked[0].register_forward_hook(lambda module, args, out: out * 2)
    got, expected = _both(plain, hooked, X, root=tmp_path)
    assert torch.equal(got, expected) and not torch.equal(expected, plain(X))


def test_a_hook_registered_after_the_first_call_takes_the_key_again() -> None:
    net = torchcache()(_frozen(nn.Sequential(nn.Identity(), nn.Tanh())))
    before = net(X)
    handle = net[0].register_forward_hook(lambda module, args, out: out * 2)
    assert torch.equal(net(X), torch.tanh(X * 2))
    handle.remove()
    assert torch.equal(net(X), before)


@pytest.mark.parametrize("where", ["submodule", "global"])
def test_a_hook_put_in_place_of_another_in_its_dict_takes_the_key_again(where: str) -> None:
    net = torchcache()(_frozen(nn.Sequential(nn.Identity(), nn.Tanh())))
    register = net[0].register_forward_hook if where == "submodule" else nn.modules.module.register_module_forward_hook
    handle = register(lambda module, args, out: out * 2 if isinstance(module, nn.Identity) else out)
    try:
        assert torch.equal(net(X), torch.tanh(X * 2))
        hooks = net[0]._forward_hooks if where == "submodule" else nn.modules.module._global_forward_hooks
        hooks[handle.id] = lambda module, args, out: out * 3 if isinstance(module, nn.Identity) else out
        assert torch.equal(net(X), torch.tanh(X * 3))
    finally:
        handle.remove()


# 3 -------------------------------------------------------------------------------------------------
def _make(scale: float) -> type[nn.Module]:
    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * scale

    return Net


def test_classes_made_by_a_factory_are_keyed_by_their_closures(tmp_path: Path) -> None:
    got, expected = _both(_frozen(_make(2.0)()), _frozen(_make(3.0)()), X, root=tmp_path)
    assert torch.equal(got, expected)


# 4 -------------------------------------------------------------------------------------------------
_VARIANTS = """
import torch
from torch import nn

from tests.helpers import load_module
if VARIANT:
    class Net(nn.Module):
        def forward(self, x):
            return x * 2
else:
    class Net(nn.Module):
        def forward(self, x):
            return x * 3
"""


def test_two_classes_of_one_name_in_one_file_have_their_own_keys(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_variants")
    first = load_module(tmp_path / "defines_variants.py", "defines_variants", "VARIANT = True\n" + _VARIANTS).Net
    second = load_module(tmp_path / "defines_variants.py", "defines_variants", "VARIANT = False\n" + _VARIANTS).Net
    got, expected = _both(_frozen(first()), _frozen(second()), X, root=tmp_path / "cache")
    assert torch.equal(got, expected)


_BOUND_IN_MAIN = """
import torch
from torchcache import torchcache

model = None  # bound by main(), after the function below is decorated

@torchcache(persistent=True, persistent_cache_dir={root!r})
def embed(x):
    return model(x)
"""


def test_a_global_bound_after_decoration_and_before_the_first_call_is_keyed(tmp_path: Path, modules: list[str]) -> None:
    modules.append("binds_in_main")
    outputs = []
    for scale in (2.0, 3.0):  # two runs of one script, each with its own checkpoint
        script = load_module(tmp_path / "binds_in_main.py", "binds_in_main", _BOUND_IN_MAIN.format(root=str(tmp_path)))
        script.model = lambda x, scale=scale: x * scale
        outputs.append(script.embed(X))
        script.embed.cache_instance.flush()
    assert torch.equal(outputs[0], X * 2) and torch.equal(outputs[1], X * 3)


# 5 -------------------------------------------------------------------------------------------------
def test_a_file_edited_and_reloaded_gives_a_new_key(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))  # reload finds the module on the path
    modules.append("defines_edited")
    path = tmp_path / "defines_edited.py"
    source = "from torch import nn\nclass Net(nn.Module):\n    def forward(self, x):\n        return x * {}\n"
    module = load_module(path, "defines_edited", source.format(2))
    first = torchcache()(_frozen(module.Net()))
    before = first.cache_instance.module_hash
    path.write_text(source.format(3))
    importlib.invalidate_caches()
    module = importlib.reload(module)
    net = torchcache()(_frozen(module.Net()))
    assert net.cache_instance.module_hash != before
    assert torch.equal(net(X), X * 3)


# 6 -------------------------------------------------------------------------------------------------
_HELPER = "class Pre:\n    def apply(self, x):\n        return x * {}\n"


class _UsesHelper(nn.Module):
    def __init__(self, pre: Any) -> None:
        super().__init__()
        self.pre = pre

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre.apply(x)


def test_a_helper_object_is_keyed_by_its_class_code(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_helper")
    first = load_module(tmp_path / "defines_helper.py", "defines_helper", _HELPER.format(2)).Pre()
    second = load_module(tmp_path / "defines_helper.py", "defines_helper", _HELPER.format(3)).Pre()
    got, expected = _both(_frozen(_UsesHelper(first)), _frozen(_UsesHelper(second)), X, root=tmp_path / "cache")
    assert torch.equal(got, expected)


def test_a_dataset_transform_is_keyed_by_its_class_code(tmp_path: Path, modules: list[str]) -> None:
    from torchcache.datasets.keys import fingerprint_dataset

    modules.append("defines_transform")
    keys = []
    for factor in (2, 3):
        pre = load_module(tmp_path / "defines_transform.py", "defines_transform", _HELPER.format(factor)).Pre()
        keys.append(fingerprint_dataset(_TransformedData(pre)))
    assert keys[0] != keys[1]


class _TransformedData(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform.apply(X[i])


# 7 -------------------------------------------------------------------------------------------------
def test_weights_substituted_at_call_time_give_their_own_outputs() -> None:
    net = torchcache()(_frozen(nn.Linear(4, 2)))
    own = net(X)
    soup = {name: value * 2 for name, value in net.named_parameters()}
    got = torch.func.functional_call(net, soup, (X,))
    assert torch.allclose(got, nn.functional.linear(X, soup["weight"], soup["bias"]))
    assert not torch.allclose(got, own)
    assert torch.equal(net(X), own)


def test_weights_given_new_storage_through_data_are_seen() -> None:
    net = torchcache()(_frozen(nn.Linear(4, 2)))
    net(X)
    torch.nn.utils.vector_to_parameters(torch.arange(10.0), net.parameters())  # writes through .data
    assert torch.equal(net(X), nn.functional.linear(X, net.weight, net.bias))


# 8 -------------------------------------------------------------------------------------------------
_A = collections.namedtuple("_A", "image mask")
_B = collections.namedtuple("_B", "mask image")


def test_the_container_type_of_per_item_tensors_is_keyed() -> None:
    @torchcache()
    def first_field(pair: Any) -> torch.Tensor:
        return pair[0] * 2 + pair[1]

    image, mask = X, X.flip(1)
    assert torch.equal(first_field(_A(image, mask)), image * 2 + mask)
    assert torch.equal(first_field(_B(image, mask)), image * 2 + mask)  # B's first field holds `image`: keyed apart
    assert first_field.cache_instance.stats().hits == 0

    @torchcache()
    def kind(items: Any) -> torch.Tensor:
        return items[0] * (2 if isinstance(items, tuple) else 3)

    assert torch.equal(kind((X,)), X * 2) and torch.equal(kind([X]), X * 3)


# 9 -------------------------------------------------------------------------------------------------
class _Doubled(torch.Tensor):
    pass


def test_a_tensor_subclass_is_keyed_apart_from_a_plain_tensor() -> None:
    @torchcache()
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x.as_subclass(torch.Tensor) * (3 if type(x) is _Doubled else 2)

    assert torch.equal(scale(X), X * 2)
    assert torch.equal(scale(X.as_subclass(_Doubled)), X * 3)


_PAIR_SCALE = 2.0


class _Pair(NamedTuple):
    """An input container whose method reads a global."""

    a: torch.Tensor
    b: torch.Tensor

    def total(self) -> torch.Tensor:
        return (self.a + self.b) * _PAIR_SCALE


def test_a_global_or_method_of_an_input_type_rebound_after_a_call_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    @torchcache()
    def total(pair: _Pair) -> torch.Tensor:
        return pair.total()

    pair = _Pair(X, X.flip(1))
    assert torch.equal(total(pair), (X + X.flip(1)) * 2)
    monkeypatch.setattr(sys.modules[__name__], "_PAIR_SCALE", 3.0)
    assert torch.equal(total(pair), (X + X.flip(1)) * 3)  # the type's key is taken again
    monkeypatch.setattr(_Pair, "total", lambda self: self.a - self.b)
    assert torch.equal(total(pair), X - X.flip(1))
    assert total.cache_instance.stats().hits == 0


def test_an_input_type_is_checked_once_per_call_however_many_items_hold_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchcache.module import versions

    @torchcache()
    def totals(pairs: list[_Pair]) -> torch.Tensor:
        return torch.stack([pair.total() for pair in pairs]).sum(0)

    pairs = [_Pair(X, X * i) for i in range(8)]
    totals(pairs)
    checks, changed = [], versions.HeldValues.changed
    monkeypatch.setattr(versions.HeldValues, "changed", lambda self: checks.append(1) or changed(self))
    totals(pairs)
    assert len(checks) <= 2  # the module key's check and the type's, not one per pair


# 10 ------------------------------------------------------------------------------------------------
def test_shared_arguments_keep_where_their_tensors_sit() -> None:
    @torchcache(shared_args=("masks",))
    def masked(x: torch.Tensor, masks: tuple[Any, Any]) -> torch.Tensor:
        first, second = masks
        return x * (first if first is not None else 1) + (second if second is not None else 0)

    m = torch.full((4,), 2.0)
    assert torch.equal(masked(X, (m, None)), X * m)
    assert torch.equal(masked(X, (None, m)), X + m)


# 11 ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Config:
    scale: float


class _Configured(nn.Module):
    def __init__(self, cfg: _Config) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * getattr(self.cfg, "extra", self.cfg.scale)


def test_a_dataclass_is_keyed_by_attributes_set_outside_its_fields(tmp_path: Path) -> None:
    a, b = _Config(1.0), _Config(1.0)
    a.extra, b.extra = 2.0, 3.0  # type: ignore[attr-defined]
    got, expected = _both(_frozen(_Configured(a)), _frozen(_Configured(b)), X, root=tmp_path)
    assert torch.equal(got, expected)


# 12 ------------------------------------------------------------------------------------------------
def test_a_module_built_in_inference_mode_is_cached() -> None:
    with torch.inference_mode():
        net = _frozen(nn.Linear(4, 2))
    cached = torchcache()(net)
    first = cached(X)
    assert torch.equal(cached(X), first) and cached.cache_instance.stats().hits == 3


# 13 ------------------------------------------------------------------------------------------------
def _f(x: int) -> int:
    return x


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (bytearray(b"abc"), b"builtins.bytearray|abc"),
        (False, _f),
        ([False], [0]),
        ([None, "I"], [NotImplemented]),
        ((b"a", b""), (b"", b"a")),
        (memoryview(np.zeros(2, np.int32)), memoryview(np.zeros(2, np.float32))),
        (memoryview(np.zeros((2, 3), np.float32)), memoryview(np.zeros((3, 2), np.float32))),
        (memoryview(bytearray(8)), bytearray(8)),
    ],
    ids=[
        "bytearray-bytes",
        "false-function",
        "bool-int",
        "none-notimplemented",
        "bytes-split",
        "memoryview-format",
        "memoryview-shape",
        "memoryview-bytearray",
    ],
)
def test_values_of_different_kinds_never_encode_alike(a: Any, b: Any) -> None:
    encode = KeyEncoder("remedy").encode
    assert encode(a, "a") != encode(b, "b")


# 14 ------------------------------------------------------------------------------------------------
class _Clip(nn.Module):
    """Each image scored against every text of its batch, as CLIP's ``logits_per_image``."""

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        return images @ texts.T


def test_items_that_are_scored_against_each_other_are_refused_even_when_all_are_hits() -> None:
    model = torchcache(check_items=False)(_frozen(_Clip()))
    a, b, c, d = (torch.randn(2, 4) for _ in range(4))
    model(a, b)
    model(c, d)
    checked = torchcache()(_frozen(_Clip()))
    with pytest.raises(KeyingError, match=r"depends on the batch|depend on the other items"):
        checked(torch.cat([a[:1], c[1:]]), torch.cat([b[:1], d[1:]]))


# 15 ------------------------------------------------------------------------------------------------
def test_batch_norm_without_running_statistics_is_refused() -> None:
    model = torchcache()(_frozen(nn.BatchNorm1d(4, track_running_stats=False)))
    with pytest.raises(KeyingError, match="depend on the other items"):
        model(torch.randn(8, 4))


# found while keying submodules by their class ------------------------------------------------------
def test_submodules_without_attributes_are_keyed_by_their_class(tmp_path: Path) -> None:
    got, expected = _both(_frozen(nn.Sequential(nn.Tanh())), _frozen(nn.Sequential(nn.Sigmoid())), X, root=tmp_path)
    assert torch.equal(got, expected)


def test_a_submodule_switched_to_training_mode_alone_is_keyed() -> None:
    net = torchcache()(_frozen(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))))
    evaluated = net(X)
    net[1].train()
    with pytest.warns(CacheWarning, match="training mode"):  # dropout runs: calls run uncached, as in training
        net(X)
    net[1].eval()
    assert torch.equal(net(X), evaluated)


# also seen ----------------------------------------------------------------------------------------
def test_hits_come_back_in_the_memory_format_a_real_call_returns() -> None:
    conv = _frozen(nn.Conv2d(3, 4, 3)).to(memory_format=torch.channels_last)
    net = torchcache()(conv)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    miss, hit = net(x), net(x)
    assert miss.is_contiguous(memory_format=torch.channels_last) and not miss.is_contiguous()
    assert hit.is_contiguous(memory_format=torch.channels_last) and torch.equal(hit, miss)


def test_inputs_in_a_channels_last_layout_are_keyed_apart_from_contiguous_ones() -> None:
    conv = _frozen(nn.Conv2d(3, 4, 3))
    net, x = torchcache()(copy.deepcopy(conv)), torch.randn(2, 3, 8, 8)
    net(x)
    last = x.to(memory_format=torch.channels_last)
    miss, hit = net(last), net(last)
    assert net.cache_instance.stats().hits == 2 and torch.equal(miss, conv(last)) and torch.equal(hit, miss)
    assert miss.stride() == hit.stride() == conv(last).stride() and net(x).stride() == conv(x).stride()


@pytest.mark.parametrize("dims", [4, 5])
def test_the_misses_of_a_channels_last_batch_are_computed_channels_last(dims: int) -> None:
    layout = torch.channels_last if dims == 4 else torch.channels_last_3d
    conv = _frozen(nn.Conv2d(3, 4, 3) if dims == 4 else nn.Conv3d(3, 4, 3))
    seen: list[bool] = []
    conv.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous(memory_format=layout)))
    net = torchcache()(copy.deepcopy(conv))
    x = torch.randn(4, 3, *[6] * (dims - 2)).to(memory_format=layout)
    net(x[:2])
    mixed, hit = net(x), net(x)  # two items computed, then none
    assert net.cache_instance.stats().hits == 2 + 4 and all(seen) and len(seen) >= 2  # the copy's hook (and checks)
    assert torch.equal(mixed, conv(x)) and torch.equal(hit, mixed)
    assert mixed.stride() == hit.stride() == conv(x).stride()


class _FormatByBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # as kernel heuristics may: the layout follows the batch
        y = x * 2 + 1
        return y.contiguous(memory_format=torch.channels_last) if len(x) >= 4 else y.contiguous()


def test_hits_and_misses_computed_in_other_memory_formats_merge_without_recomputing() -> None:
    net, x = torchcache()(_FormatByBatch()), torch.randn(8, 3, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        for rows in (slice(0, 4), slice(2, 5), slice(0, 6)):
            assert torch.equal(net(x[rows]), x[rows] * 2 + 1)
    assert net.cache_instance.stats().hits == 2 + 4  # item 4, kept in the other format, is computed again


class _Mapping(collections.abc.Mapping):  # type: ignore[type-arg]
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


class DynamicCache:
    """What a generation cache of past keys and values looks like to the cache: not per item."""


def test_outputs_that_cannot_be_cached_say_the_way_out() -> None:
    @torchcache()
    def encodes(x: torch.Tensor) -> Any:
        return _Mapping({"input_ids": x})

    with pytest.raises(KeyingError, match=r"return dict\(output\)"):
        encodes(X)

    @torchcache()
    def generates(x: torch.Tensor) -> Any:
        return {"logits": x, "past_key_values": DynamicCache()}

    with pytest.raises(KeyingError, match="use_cache=False"):
        generates(X)


# a package installed with `pip install .` keeps its version while its code changes ----------------
def _install_fake(site: Path, factor: int, direct: str, script: str = "") -> None:
    package = site / "builtlocally"
    package.mkdir(parents=True, exist_ok=True)
    source = f"def scale(x):\n    return x * {factor}\n"
    (package / "__init__.py").write_text(source)
    info = site / "builtlocally-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: builtlocally\nVersion: 0.1.0\n")
    digest = __import__("hashlib").sha256(source.encode()).hexdigest()
    record = f"builtlocally/__init__.py,sha256={digest},{len(source)}\n"
    if script:  # pip writes a console script with the environment's interpreter in it, outside the package
        record += f"../../../bin/builtlocally,sha256={script},99\n"
    (info / "RECORD").write_text(record)
    (info / "direct_url.json").write_text(direct)


@pytest.mark.parametrize(
    ("direct", "follows_files"),
    [
        ('{"url": "file:///src/builtlocally", "dir_info": {}}', True),
        ('{"url": "file:///src/dist/builtlocally-0.1.0-py3-none-any.whl", "archive_info": {}}', True),
        ('{"url": "https://files.example/builtlocally-0.1.0.tar.gz", "archive_info": {}}', False),
        ("{}", False),
    ],
    ids=["built-from-a-directory", "from-a-local-wheel", "from-a-url", "from-an-index"],
)
def test_a_package_built_from_a_directory_is_keyed_by_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str, follows_files: bool
) -> None:
    from torchcache.canonical import origins

    site = tmp_path / "site-packages"
    monkeypatch.syspath_prepend(str(site))
    keys = []
    for factor in (2, 3):
        _install_fake(site, factor, direct)
        monkeypatch.setattr(origins, "_versions", {})  # a new process
        monkeypatch.delitem(sys.modules, "builtlocally", raising=False)
        importlib.invalidate_caches()
        module = importlib.import_module("builtlocally")
        keys.append(KeyEncoder("remedy").encode(module.scale, "scale"))
    monkeypatch.delitem(sys.modules, "builtlocally", raising=False)
    assert (keys[0] != keys[1]) == follows_files


def test_a_local_wheel_installed_in_two_environments_keeps_one_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.canonical import origins

    direct = '{"url": "file:///src/dist/builtlocally-0.1.0-py3-none-any.whl", "archive_info": {}}'
    keys = []
    for env in ("a", "b"):  # its console script differs (each names its own interpreter); its package does not
        site = tmp_path / env / "site-packages"
        monkeypatch.syspath_prepend(str(site))
        _install_fake(site, 2, direct, script=env * 64)
        monkeypatch.setattr(origins, "_versions", {})
        monkeypatch.delitem(sys.modules, "builtlocally", raising=False)
        importlib.invalidate_caches()
        keys.append(KeyEncoder("remedy").encode(importlib.import_module("builtlocally").scale, "scale"))
        monkeypatch.delitem(sys.modules, "builtlocally", raising=False)
        sys.path.remove(str(site))
    assert keys[0] == keys[1]


def test_a_list_of_strings_as_long_as_the_batch_is_pointed_out_once() -> None:
    @torchcache()
    def encode(batch: dict[str, Any]) -> torch.Tensor:
        return batch["input_ids"] * 2

    ids = torch.arange(6).reshape(3, 2)
    with pytest.warns(CacheWarning, match=r"batch\['text'\]\" is a list of as many strings as the batch"):
        encode({"input_ids": ids, "text": ["a", "b", "c"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        encode({"input_ids": ids, "text": ["c", "b", "a"]})  # once per cache
        assert encode.cache_instance.stats().hits == 0  # the list is keyed whole: another order, other keys


def _joined(feats: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(feats.values()), dim=1)  # depends on the order of the dict


def _joined_keywords(**feats: torch.Tensor) -> torch.Tensor:
    return torch.cat(list(feats.values()), dim=1)


def test_a_dict_of_tensors_and_keyword_arguments_are_keyed_in_their_order() -> None:
    a, b = torch.randn(3, 2), torch.randn(3, 5)
    joined = torchcache()(_joined)
    joined({"rgb": a, "depth": b})
    assert torch.equal(joined({"depth": b, "rgb": a}), torch.cat([b, a], dim=1))
    keywords = torchcache()(_joined_keywords)
    keywords(rgb=a, depth=b)
    assert torch.equal(keywords(depth=b, rgb=a), torch.cat([b, a], dim=1))


class _Batch(dict):  # type: ignore[type-arg]
    scale = 1.0


def _scaled_batch(batch: _Batch) -> torch.Tensor:
    return batch["x"] * batch.scale


def _with_default(batch: collections.defaultdict[str, Any]) -> torch.Tensor:
    return batch["x"] + (batch["bias"] if batch["bias"] is not None else 0)


def test_a_mapping_class_keeps_its_attributes_in_the_key_and_in_smaller_batches() -> None:
    x = torch.randn(4, 3)
    cached = torchcache()(_scaled_batch)
    first = _Batch(x=x)
    first.scale = 1.0
    assert torch.equal(cached(first), x)  # the item check rebuilt smaller batches with the attribute
    second = _Batch(x=x)
    second.scale = 10.0
    assert torch.equal(cached(second), x * 10.0)
    partial = _Batch(x=torch.cat([x[:2], torch.randn(2, 3)]))
    partial.scale = 10.0
    assert torch.equal(cached(partial), partial["x"] * 10.0)  # misses computed on a rebuilt _Batch
    defaults = torchcache()(_with_default)
    made = collections.defaultdict(lambda: None, x=x)
    assert torch.equal(defaults(made), x)
    partly = collections.defaultdict(lambda: None, x=torch.cat([x[:2], torch.randn(2, 3)]))
    assert torch.equal(defaults(partly), partly["x"])
    assert defaults.cache_instance.stats().hits == 2


class _Options:
    def __init__(self, gain: float) -> None:
        self.name, self.gain = "run", gain

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}  # what gets logged: not everything forward reads


class _Gained(nn.Module):
    def __init__(self, options: _Options) -> None:
        super().__init__()
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.options.gain


def test_an_object_with_a_to_dict_is_keyed_by_what_it_leaves_out_too(tmp_path: Path) -> None:
    got, expected = _both(_Gained(_Options(1.0)), _Gained(_Options(5.0)), X, root=tmp_path)
    assert torch.equal(got, expected)


class _Summarised:
    """A ``to_dict()`` meant for logging: it gives the weights' shape, not their values."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def to_dict(self) -> dict[str, Any]:
        return {"weights": f"tensor{tuple(self.weights.shape)}"}


class _Shifted(nn.Module):
    def __init__(self, op: _Summarised) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.op.weights.sum()


def test_an_object_whose_to_dict_describes_an_attribute_otherwise_is_keyed_by_the_attribute(tmp_path: Path) -> None:
    a, b = _Shifted(_Summarised(torch.zeros(3))), _Shifted(_Summarised(torch.ones(3)))
    got, expected = _both(a, b, X, root=tmp_path)
    assert torch.equal(got, expected)


_ENCODER = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).requires_grad_(False).eval()


def _through_global_encoder(x: torch.Tensor) -> torch.Tensor:
    return _ENCODER(x)


class _HoldsUnregistered(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "encoder", encoder)  # not a submodule: keyed as a value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


@pytest.mark.parametrize("holder", ["function", "module"])
def test_the_training_flag_of_a_module_held_as_a_value_is_keyed_and_watched(holder: str) -> None:
    encoder = _ENCODER if holder == "function" else nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    encoder.requires_grad_(False)  # held as a value: one that is trained is refused
    cached = torchcache()(_through_global_encoder if holder == "function" else _HoldsUnregistered(encoder).eval())
    cached(X)
    try:
        encoder.train()  # dropout on: the eval-mode entries must not be served
        with pytest.raises(KeyingError, match="not deterministic"):
            cached(X)
    finally:
        encoder.eval()
    assert torch.equal(cached(X), encoder(X))


@pytest.mark.parametrize("holder", ["function", "module"])
@pytest.mark.parametrize("change", ["parameter", "submodule"])
def test_a_module_held_as_a_value_whose_parameter_or_submodule_is_replaced_is_seen(holder: str, change: str) -> None:
    encoder = _ENCODER if holder == "function" else nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    encoder.requires_grad_(False)  # held as a value: one that is trained is refused
    cached = torchcache()(_through_global_encoder if holder == "function" else _HoldsUnregistered(encoder).eval())
    weight, dropout = encoder[0].weight, encoder[1]
    cached(X)
    try:
        if change == "parameter":
            encoder[0].weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        else:
            encoder[1] = nn.Tanh()
        assert torch.equal(cached(X), encoder(X))
    finally:
        encoder[0].weight, encoder[1] = weight, dropout
    assert torch.equal(cached(X), encoder(X))


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = torch.ones(4)  # a plain attribute: neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


def test_a_tensor_attribute_rebound_after_the_first_call_is_seen() -> None:
    cached = torchcache()(_Masked())
    assert torch.equal(cached(X), X)
    cached.mask = torch.zeros(4)
    assert torch.equal(cached(X), X * 0)
    cached.mask = torch.ones(4)
    assert torch.equal(cached(X), X)


class _Rescaled(nn.Module):
    factor = 1.0  # a class value

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * self.scale * type(self).factor


@pytest.mark.parametrize("where", ["instance", "submodule", "class"])
def test_a_plain_attribute_rebound_after_the_first_call_is_seen(where: str) -> None:
    class Rescaled(_Rescaled):  # a class of its own: its value is rebound below
        factor = 1.0

    cached = torchcache()(Rescaled())
    assert torch.equal(cached(X), nn.functional.gelu(X))
    if where == "instance":
        cached.scale = 3.0
    elif where == "submodule":
        cached.act.approximate = "tanh"
    else:
        Rescaled.factor = 3.0
    assert torch.equal(cached(X), _Rescaled.forward(cached, X))


class _SlottedScale(nn.Module):
    __slots__ = ("k",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class _Held(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.helpers = [nn.ReLU()]  # a module held in a list: keyed as a value
        self.scale = _SlottedScale()
        self.scale.k = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.helpers[0](self.act(x)))


@pytest.mark.parametrize("change", ["submodule class", "held module class", "slot"])
def test_a_class_swapped_or_a_slot_rebound_after_the_first_call_is_seen(change: str) -> None:
    cached = torchcache()(_Held())
    cached(X)
    cached(X)  # nothing changed: a hit, and nothing seen as changed
    held = cached.cache_instance._held
    assert held is not None and not held.changed()
    if change == "submodule class":
        cached.act.__class__ = nn.SiLU
    elif change == "held module class":
        cached.helpers[0].__class__ = nn.Tanh
    else:
        cached.scale.k = 5.0
    assert torch.equal(cached(X), _Held.forward(cached, X))
    assert cached.cache_instance.stats().hits == len(X)


def test_a_deleted_module_whose_attributes_are_watched_is_freed_without_the_cyclic_collector() -> None:
    model = torchcache()(_Rescaled())
    model.weight = nn.Parameter(torch.ones(4), requires_grad=False)
    model.table = torch.zeros(3)  # a tensor attribute, watched with the plain ones
    model(X)
    gone = weakref.ref(model.weight)
    gc.collect()
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


class _Counting(_Rescaled):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # state forward rebinds: a new key at each call, unless key_ignore names it
        return super().forward(x)


def test_a_counter_forward_rebinds_is_a_new_key_each_time_said_once_unless_it_is_ignored() -> None:
    counting = torchcache(check_items=False)(_Counting())
    with pytest.warns(CacheWarning, match="attribute 'calls'.*rebound 3 times.*key_ignore"):
        for _ in range(4):
            assert torch.equal(counting(X), nn.functional.gelu(X))
    assert counting.cache_instance.stats().hits == 0
    ignoring = torchcache(check_items=False, key_ignore=("calls",))(_Counting())
    for _ in range(4):
        assert torch.equal(ignoring(X), nn.functional.gelu(X))
    assert ignoring.cache_instance.stats().hits == 3 * len(X)


def test_weight_norms_own_rebinding_at_every_call_is_no_change_and_its_weights_are_still_watched() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated, still used
        normed = _frozen(nn.utils.weight_norm(nn.Linear(4, 4)))
    cached = torchcache()(normed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # no "rebound 3 times"
        for _ in range(4):
            cached(X)
    assert cached.cache_instance.stats().hits == 3 * len(X)
    with torch.no_grad():
        normed.weight_g.mul_(2)
    direction = normed.weight_v / normed.weight_v.norm(dim=1, keepdim=True)
    torch.testing.assert_close(cached(X), nn.functional.linear(X, normed.weight_g * direction, normed.bias))


class _Memo(nn.Module):
    seen: ClassVar[dict[int, int]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).seen = {**type(self).seen, len(type(self).seen): 1}  # a class-level memo, rebound
        return x * 2


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Memo()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_class_value_forward_rebinds_is_left_out_by_its_name() -> None:
    _Memo.seen = {}
    cached = torchcache(key_ignore=("seen",), check_items=False)(_Outer())  # a class is shared: by name
    for _ in range(4):
        assert torch.equal(cached(X), X * 2)
    assert cached.cache_instance.stats().hits == 3 * len(X)


def test_a_value_rebound_to_an_equal_one_keeps_the_entries() -> None:
    cached = torchcache()(_Rescaled())
    cached(X)
    cached.scale = float("1.0")  # another object, the same value
    cached.act.approximate = "".join(["no", "ne"])
    cached(X)
    assert cached.cache_instance.stats().hits == len(X)
    cached.scale = 1  # equal, but an int: another key
    cached(X)
    assert cached.cache_instance.stats().hits == len(X)


def test_a_complex_attribute_rebound_to_its_other_signed_zero_is_a_change() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = complex(-4, 0.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * cmath.sqrt(self.c).imag  # 2j, or -2j for -4-0j

    cached = torchcache(check_items=False)(Root())
    assert torch.equal(cached(X), X * 2)
    cached.c = complex(-4, -0.0)
    assert torch.equal(cached(X), X * -2)


def test_an_attribute_of_the_module_rebound_at_every_call_is_said_once() -> None:
    cached = torchcache()(_Rescaled())
    with pytest.warns(CacheWarning, match="attribute 'scale'.*rebound 3 times.*key_ignore") as caught:
        for step in range(6):
            cached.scale = float(step)
            assert torch.equal(cached(X), nn.functional.gelu(X) * step)
    assert len([w for w in caught if "rebound" in str(w.message)]) == 1


class _PerBatch(dict):  # type: ignore[type-arg]
    """A library's batch: its fields as attributes too (as a ModelOutput), and private per-batch data."""


class _Slotted(collections.abc.MutableMapping):  # type: ignore[type-arg]
    __slots__ = ("_items",)

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _first(batch: Any) -> torch.Tensor:
    return batch["x"] * 2


def test_a_mappings_tensor_and_private_attributes_do_not_make_a_key_per_batch() -> None:
    cached = torchcache()(_first)
    x = torch.randn(4, 3)
    for rows in (x, torch.cat([x[:2], torch.randn(2, 3)])):
        batch = _PerBatch(x=rows)
        batch.x, batch._encodings = rows, [object()]  # the items again, and per-batch data
        assert torch.equal(cached(batch), rows * 2)
    assert cached.cache_instance.stats().hits == 2  # the same items in another batch


def test_a_mapping_that_holds_its_items_in_an_attribute_is_never_written_by_the_cache() -> None:
    cached = torchcache()(_first)
    x = torch.randn(4, 3)
    batch = _Slotted({"x": x})
    cached(batch)  # the item check makes smaller batches of it
    partial = _Slotted({"x": torch.cat([x[:2], torch.randn(2, 3)])})
    mine = partial["x"]
    assert torch.equal(cached(partial), mine * 2)
    assert batch["x"] is x and partial["x"] is mine


class _Scaled(_Slotted):
    __slots__ = ("__dict__",)

    def __init__(self, items: dict[str, Any], scale: float = 1.0) -> None:
        super().__init__(items)
        self.scale = scale  # public configuration: keyed, and carried into smaller batches


def _scaled_first(batch: Any) -> torch.Tensor:
    return batch["x"] * batch.scale


def test_a_mappings_public_attributes_are_keyed_and_carried_into_smaller_batches() -> None:
    cached = torchcache()(_scaled_first)
    x = torch.randn(4, 3)
    assert torch.equal(cached(_Scaled({"x": x}, 2.0)), x * 2.0)  # the item check's batches keep scale=2
    partial = torch.cat([x[:2], torch.randn(2, 3)])
    assert torch.equal(cached(_Scaled({"x": partial}, 2.0)), partial * 2.0)
    assert torch.equal(cached(_Scaled({"x": x}, 3.0)), x * 3.0)
    shared = _PerBatch(x=x)
    shared.weight = torch.ones(3)  # a tensor beside the items, not one of them: refused, not ignored
    with pytest.raises(KeyingError, match="attributes"):
        cached(shared)


def _resized(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    x.resize_(())
    return y


def test_an_input_reshaped_in_place_is_refused_with_the_cause() -> None:
    with pytest.raises(KeyingError, match="wrote an input in place"):
        torchcache()(_resized)(torch.randn(4, 3))


def _squeezed(x: torch.Tensor) -> torch.Tensor:
    return (x @ torch.ones(3, 1)).squeeze()  # () for one item


def test_a_head_that_squeezes_is_cached_in_batches_of_four() -> None:
    cached = torchcache()(_squeezed)
    x = torch.randn(4, 3)
    assert torch.equal(cached(x), _squeezed(x)) and torch.equal(cached(x), _squeezed(x))


def _dropped_in_place(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.hardtanh_(x, -100.0, 100.0) * 2  # a write in place that changes no value


def test_a_write_in_place_that_changes_no_value_is_not_refused() -> None:
    x = torch.randn(4, 3)
    assert torch.equal(torchcache()(_dropped_in_place)(x.clone()), x * 2)


# state reached in other ways ----------------------------------------------------------------------
_MEMOIZED = """
import functools
@functools.lru_cache(maxsize=None)
def factor():
    return {}
def scaled(x):
    return x * factor()
"""


def test_a_memoized_helper_is_keyed_by_the_function_it_wraps(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_memoized")
    first = load_module(tmp_path / "defines_memoized.py", "defines_memoized", _MEMOIZED.format(2.0)).scaled
    second = load_module(tmp_path / "defines_memoized.py", "defines_memoized", _MEMOIZED.format(3.0)).scaled
    got, expected = _both(first, second, X, root=tmp_path / "cache")
    assert torch.equal(got, expected)


def _positions(x: torch.Tensor) -> torch.Tensor:
    return x + ((torch.arange(1, x.shape[1] + 1) / 7.0).exp() * 1.1).tan().to(x.dtype)  # in the default dtype


def test_the_default_dtype_is_keyed(tmp_path: Path) -> None:
    cached = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_positions)
    single = cached(X * 0.1)
    cached.cache_instance.flush()
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        again = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_positions)
        assert torch.equal(again(X * 0.1), _positions(X * 0.1))
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(single, _positions(X * 0.1))


def _matmul(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.ones(x.shape[1], 3)


def test_the_float32_precision_of_each_backend_is_keyed_and_never_breaks_a_call(tmp_path: Path) -> None:
    cached = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_matmul)
    cached(X)
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # the per-backend API: the legacy getter raises
        assert torch.equal(cached(X), _matmul(X))
        assert cached.cache_instance.stats().misses == 2 * len(X)  # another key: computed again
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = "none"
    cached(X)
    assert cached.cache_instance.stats().misses == 2 * len(X)


def test_numerics_set_explicitly_to_their_defaults_add_nothing_to_keys() -> None:
    from torchcache.keys import numerics

    try:
        torch.set_float32_matmul_precision("high")
        assert numerics(["cpu"])  # another precision: keyed
        torch.set_float32_matmul_precision("highest")  # back, and "ieee" where it was "none": as the default
        torch.backends.cudnn.allow_tf32 = True
        torch.set_flush_denormal(False)
        assert numerics(["cpu"]) == []
    finally:
        torch.set_float32_matmul_precision("highest")


def test_flushing_subnormals_to_zero_is_keyed() -> None:
    tiny = torch.full((2, 3), 1e-39)  # subnormal float32: 0 on a thread that flushes them
    cached = torchcache()(_matmul)
    try:
        torch.set_flush_denormal(True)
        assert not cached(tiny).any()
    finally:
        torch.set_flush_denormal(False)
    exact = cached(tiny)
    assert torch.equal(exact, _matmul(tiny)) and exact.all()


def test_deterministic_algorithms_and_reduced_precision_reductions_are_keyed() -> None:
    def which(x: torch.Tensor) -> torch.Tensor:  # a forward whose kernels these settings choose
        return x * (2.0 if torch.are_deterministic_algorithms_enabled() else 1.0)

    cached, x = torchcache()(which), torch.ones(2, 3)
    assert torch.equal(cached(x), x)
    matmul = torch.backends.cuda.matmul
    try:
        torch.use_deterministic_algorithms(True)
        assert torch.equal(cached(x), x * 2)
        torch.use_deterministic_algorithms(False)
        matmul.allow_fp16_reduced_precision_reduction = False
        assert numerics(())[0].startswith(b"reduced_precision_reduction:") and torch.equal(cached(x), x)
    finally:
        torch.use_deterministic_algorithms(False)
        matmul.allow_fp16_reduced_precision_reduction = True
    assert cached.cache_instance.stats().hits == 0


@contextlib.contextmanager
def _switched(name: str) -> Iterator[None]:
    was = getattr(torch._C, f"_get_{name}")()
    getattr(torch._C, f"_set_{name}")(not was)
    try:
        yield
    finally:
        getattr(torch._C, f"_set_{name}")(was)


@pytest.mark.parametrize(
    "name",
    ["mkldnn_enabled", "nnpack_enabled", "cudnn_enabled", "cudnn_deterministic", "cublas_allow_fp16_accumulation"],
)
def test_backend_switches_that_choose_other_kernels_are_keyed(name: str) -> None:
    conv = _frozen(nn.Conv2d(3, 8, 3))
    cached, x = torchcache()(_frozen(nn.Conv2d(3, 8, 3))), torch.randn(4, 3, 16, 16)
    cached.load_state_dict(conv.state_dict())
    cached(x)
    with _switched(name):
        assert numerics(()) == [f"{name}:{getattr(torch._C, f'_get_{name}')()}".encode()]
        assert torch.equal(cached(x), conv(x))
    assert cached.cache_instance.stats().hits == 0


def test_opt_einsum_turned_off_or_given_another_strategy_is_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from torchcache import keys

    for installed, enabled, strategy, line in [
        (True, True, "auto", None),  # installed, at its defaults
        (True, True, "optimal", b"opt_einsum:True:optimal"),
        (True, False, "auto", b"opt_einsum:False:auto"),
        (False, False, None, None),  # not installed: nothing to set
    ]:
        monkeypatch.setattr(keys, "_OPT_EINSUM", types.SimpleNamespace(enabled=enabled, strategy=strategy))
        monkeypatch.setattr(keys, "_OPT_EINSUM_INSTALLED", installed)
        assert numerics(()) == ([line] if line else [])


def test_weights_converted_to_channels_last_after_the_first_call_get_their_own_entries() -> None:
    conv = _frozen(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)))
    cached, x = torchcache()(copy.deepcopy(conv)), torch.randn(4, 3, 16, 16)
    cached(x)
    cached.to(memory_format=torch.channels_last)
    conv.to(memory_format=torch.channels_last)
    got = cached(x)
    assert torch.equal(got, conv(x)) and got.is_contiguous(memory_format=torch.channels_last)
    assert cached.cache_instance.stats().hits == 0


def test_code_under_the_interpreters_prefix_but_outside_its_libraries_is_the_users() -> None:
    from torchcache.canonical.origins import is_installed_file

    assert not is_installed_file(str(Path(sys.base_prefix) / "src" / "app" / "train.py"))  # /usr/src/app
    assert is_installed_file(torch.__file__) and is_installed_file(warnings.__file__)


def _centered(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=0)  # each row depends on the batch


def test_a_batch_of_one_item_repeated_does_not_pass_the_item_check() -> None:
    centered = torchcache()(_centered)
    warm = centered(torch.zeros(4, 4))  # a warm-up batch: its items are alike, so it tells nothing
    assert torch.equal(warm, torch.zeros(4, 4))
    with pytest.raises(KeyingError, match="depend on the other items"):
        centered(torch.cat([torch.randn(3, 4), torch.zeros(1, 4)]))  # one of its rows cached


def test_the_item_check_runs_per_call_context_and_sees_sorted_batches_and_single_items() -> None:
    def pool(ids: torch.Tensor, lengths: torch.Tensor, center: bool = False) -> torch.Tensor:
        longest = int(lengths.max())  # the padding trimmed to the batch's longest item
        rows = ids[:, :longest].float().mean(dim=1, keepdim=True)
        return rows - rows.mean(dim=0) if center else rows

    lengths = torch.tensor([2, 3, 5, 8])  # sorted: the last and the first together keep the longest
    ids = (torch.arange(8).expand(4, 8) < lengths[:, None]) * 7
    with pytest.raises(KeyingError, match="depend on the other items"):
        torchcache()(pool)(ids, lengths)
    plain = torchcache()(lambda x, center=False: x - x.mean(dim=0) if center else x * 2)
    plain(torch.randn(4, 3))
    with pytest.raises(KeyingError, match="depend on the other items"):  # another context: checked again
        plain(torch.randn(4, 3), center=True)
    noisy = torchcache()(lambda x: x + torch.randn_like(x))
    with pytest.raises(KeyingError, match="not deterministic"):  # one item at a time: computed twice
        noisy(torch.randn(1, 3))


def _normalized_in_place(x: torch.Tensor) -> torch.Tensor:
    x.sub_(x.mean(dim=1, keepdim=True))  # the caller's tensor changes: a hit would not change it
    return x * 2


def test_a_forward_that_writes_its_input_in_place_is_refused() -> None:
    with pytest.raises(KeyingError, match="wrote an input in place"):
        torchcache()(_normalized_in_place)(torch.randn(4, 3))


def test_a_check_whose_smaller_batch_fails_refuses_the_module() -> None:
    model = torchcache()(_frozen(nn.BatchNorm1d(4, track_running_stats=False)).train())
    with pytest.warns(CacheWarning, match="in training mode"):  # one item alone: batch norm raises
        out = model(torch.randn(2, 4))
    assert out.shape == (2, 4)
    evaluated = torchcache()(_frozen(nn.BatchNorm1d(4, track_running_stats=False)))
    with pytest.raises(KeyingError, match="raised ValueError"):
        evaluated(torch.randn(2, 4))


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.teacher = [nn.Linear(4, 4).requires_grad_(False)]  # not registered: keyed by content
        self.table = {"w": torch.ones(4)}
        self.scale = np.ones(4, dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.teacher[0](x) * self.table["w"] * torch.from_numpy(self.scale)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.layers.__delitem__(slice(2, None)),
        lambda m: m.layers.pop(0),
        lambda m: m.teacher[0].weight.mul_(2),
        lambda m: m.table["w"].mul_(2),
        lambda m: np.multiply(m.scale, 2, out=m.scale),
    ],
    ids=["del", "pop", "module-in-a-list", "tensor-in-a-dict", "numpy-array"],
)
def test_state_changed_in_place_outside_the_registries_takes_the_key_again(change: Any) -> None:
    model = torchcache()(_frozen(_Layers()))
    model(X)
    change(model)
    assert torch.equal(model(X), _Layers.forward(model, X))


_TABLE = torch.ones(4)


def _reads_a_table(x: torch.Tensor) -> torch.Tensor:
    return x * _TABLE


def test_a_global_tensor_written_in_place_takes_a_functions_key_again() -> None:
    cached = torchcache()(_reads_a_table)
    cached(X)
    try:
        _TABLE.mul_(2)
        assert torch.equal(cached(X), X * 2)
    finally:
        _TABLE.fill_(1)


def _by_name(x: torch.Tensor) -> torch.Tensor:
    return x * globals()["_TABLE"]


def _reads_its_own_globals(x: torch.Tensor) -> torch.Tensor:
    return x * _reads_its_own_globals.__globals__["_TABLE"]


def _reads_a_frames_globals(x: torch.Tensor) -> torch.Tensor:
    return x * sys._getframe(0).f_globals["_TABLE"]


def _reads_a_frames_locals(x: torch.Tensor) -> torch.Tensor:
    scale = _TABLE  # noqa: F841 - read through the frame
    return x * inspect.currentframe().f_locals["scale"]  # type: ignore[union-attr]


def _reads_the_callers_locals(x: torch.Tensor) -> torch.Tensor:
    return x * sys._getframe(1).f_locals.get("scale", 1.0)


def _reads_a_module_found_at_run_time(x: torch.Tensor) -> torch.Tensor:
    return x * inspect.getmodule(_reads_a_module_found_at_run_time)._TABLE  # type: ignore[union-attr]


def _reads_the_builtins_namespace(x: torch.Tensor) -> torch.Tensor:
    return x * builtins.__dict__["abs"](-2)


def _reads_globals_through_a_lambda(x: torch.Tensor) -> torch.Tensor:
    return x * (lambda: 0).__globals__["_TABLE"]


def _imports_by_name(x: torch.Tensor) -> torch.Tensor:
    return importlib.import_module("math").pi * x


def _module_by_name(x: torch.Tensor) -> torch.Tensor:
    return sys.modules["math"].pi * x


def _module_by_name_imported(x: torch.Tensor) -> torch.Tensor:
    from sys import modules

    return modules["math"].pi * x


def _imports_by_name_imported(x: torch.Tensor) -> torch.Tensor:
    from importlib import import_module

    return import_module("math").pi * x


def _imports_by_name_imported_whole(x: torch.Tensor) -> torch.Tensor:
    import importlib  # a local name: its attributes are not globals

    return importlib.import_module("math").pi * x


def _module_by_name_imported_whole(x: torch.Tensor) -> torch.Tensor:
    import sys

    return sys.modules["math"].pi * x


def _imports_by_name_through_a_submodule(x: torch.Tensor) -> torch.Tensor:
    import importlib.util  # binds importlib

    return importlib.import_module("math").pi * x


def _imports_by_name_through_getattr(x: torch.Tensor) -> torch.Tensor:
    import importlib

    return getattr(importlib, "import_module")("math").pi * x  # noqa: B009 - the case under test


@pytest.mark.parametrize(
    ("fn", "named"),
    [
        (_by_name, "globals"),
        (_imports_by_name, "importlib"),
        (_module_by_name, "sys.modules"),
        (_module_by_name_imported, "sys.modules"),
        (_imports_by_name_imported, "importlib"),
        (_imports_by_name_imported_whole, "importlib"),
        (_module_by_name_imported_whole, "sys.modules"),
        (_imports_by_name_through_a_submodule, "importlib"),
        (_imports_by_name_through_getattr, "importlib"),
        (_reads_its_own_globals, "__globals__"),
        (_reads_a_frames_globals, "f_globals"),
        (_reads_a_frames_locals, "reads frames"),
        (_reads_the_callers_locals, "reads frames"),
        (_reads_a_module_found_at_run_time, "the module of an object"),
        (_reads_the_builtins_namespace, "builtins' namespace"),
        (_reads_globals_through_a_lambda, "__globals__"),
    ],
)
def test_code_that_names_what_it_reads_at_run_time_is_refused(fn: Any, named: str) -> None:
    with pytest.raises(KeyingError, match=f"{named}.*known only when it runs"):
        torchcache()(fn)(X)


def _abs_of_minus_two(x: torch.Tensor) -> torch.Tensor:
    return x * abs(-2)


@pytest.mark.parametrize(
    ("put", "gives"),
    [
        (lambda value: 5, 5),
        (functools.wraps(abs)(lambda value: 5), 5),  # with abs's name and module
        (round, -2),  # a builtin of another name
        (math.floor, -2),  # a function of C from another module
    ],
)
def test_a_builtin_put_in_pythons_place_is_keyed_and_watched(
    put: Any, gives: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rebinding, "_rebound", collections.Counter())  # other tests rebound abs too
    cached = torchcache()(_abs_of_minus_two)
    assert torch.equal(cached(X), X * 2)
    plain = cached.cache_instance.module_hash
    monkeypatch.setattr(builtins, "abs", put)
    assert torch.equal(cached(X), X * gives)  # rebound after the first call: the key is taken again
    fresh = torchcache()(_abs_of_minus_two)
    assert torch.equal(fresh(X), X * gives)
    assert fresh.cache_instance.module_hash not in (plain, None)  # put there before the key: keyed by its code


def _prints_and_doubles(x: torch.Tensor) -> torch.Tensor:
    if x.isnan().any():
        print("nan in", x.shape)
    return x * 2


def test_print_wrapped_per_process_keeps_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = []
    for is_main in (True, False):  # setup_for_distributed of many training scripts: prints on one rank only
        shown = builtins.print
        monkeypatch.setattr(builtins, "print", lambda *args, main=is_main, show=shown: show(*args) if main else None)
        cached = torchcache()(_prints_and_doubles)
        assert torch.equal(cached(X), X * 2)
        keys.append(cached.cache_instance.module_hash)
        monkeypatch.undo()
    assert keys[0] == keys[1] is not None


class _Record:
    def __init__(self) -> None:
        self.f_locals = 2.0  # an attribute that happens to share a frame's name


_RECORD = _Record()


def _reads_an_attribute_named_like_a_frames(x: torch.Tensor) -> torch.Tensor:
    return x * _RECORD.f_locals


def test_an_attribute_named_like_a_frames_namespace_is_keyed() -> None:
    assert torch.equal(torchcache()(_reads_an_attribute_named_like_a_frames)(X), X * 2)


_READS_DICT = "import holds_scale\n\ndef scaled(x):\n    return x * holds_scale.__dict__['T']\n"


def test_a_user_modules_dict_is_keyed_as_the_module(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    modules += ["holds_scale", "reads_dict"]
    held = load_module(tmp_path / "holds_scale.py", "holds_scale", "T = 2.0\n")
    cached = torchcache()(load_module(tmp_path / "reads_dict.py", "reads_dict", _READS_DICT).scaled)
    assert torch.equal(cached(X), X * 2)
    held.T = 3.0
    assert torch.equal(cached(X), X * 3)


@torchcache()
class _Doubles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)

    def times(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.times(x)


class _Triples(_Doubles):
    def times(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


_HEAD = nn.Linear(4, 4).requires_grad_(False)


class _UsesAGlobalHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.extra = [nn.Identity()]  # a module held in a plain list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra[0](_HEAD(x))


@pytest.mark.parametrize("where", ["global", "list"])
def test_a_hook_added_to_a_module_held_as_a_value_takes_the_key_again(where: str) -> None:
    model = torchcache()(_UsesAGlobalHead())
    twin = _UsesAGlobalHead()
    assert torch.equal(model(X), twin(X))
    held = _HEAD if where == "global" else model.extra[0]
    handle = held.register_forward_pre_hook(lambda module, args: (args[0] * 3,))
    try:
        twin.extra = model.extra
        assert torch.equal(model(X), twin(X))
        held._forward_pre_hooks[handle.id] = lambda module, args: (args[0] * 5,)  # one put in its place
        assert torch.equal(model(X), twin(X))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(10):  # then nothing changes: the key is not taken again (a warning would say so)
                assert torch.equal(model(X), twin(X))
        assert not [w for w in seen if "taken again" in str(w.message)]
    finally:
        handle.remove()
    assert torch.equal(model(X), _UsesAGlobalHead()(X))  # removed: seen too


_TRUNK = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).requires_grad_(False)


def _through_the_trunk(x: torch.Tensor) -> torch.Tensor:
    return _TRUNK(x)


def test_a_submodule_deleted_from_a_module_held_as_a_value_takes_the_key_again() -> None:
    cached = torchcache()(_through_the_trunk)
    assert torch.equal(cached(X), _TRUNK(X))
    relu = _TRUNK[1]
    del _TRUNK[1]  # no registration hook sees a deletion
    try:
        assert torch.equal(cached(X), _TRUNK(X))
    finally:
        _TRUNK.append(relu)


class _HookedAtEachStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)

    def scale(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * 2,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_key_taken_again_alike_at_every_call_is_pointed_out_once() -> None:
    model = torchcache()(_HookedAtEachStep())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(12):  # a new bound method registered each step: the key is taken again each time
            handle = model.linear.register_forward_pre_hook(model.scale)
            assert torch.equal(
                model(X),
                nn.functional.linear(X * 2, model.linear.weight, model.linear.bias),
            )
            handle.remove()
    alike = [w for w in seen if "taken again 8 times in a row" in str(w.message)]
    assert len(alike) == 1 and issubclass(alike[0].category, CacheWarning)


class _Offset(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _offset_by_100(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + 100


@pytest.mark.parametrize("how", ["instance", "class of a package"])
def test_a_classs_forward_replaced_after_wrapping_is_the_one_that_runs(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rebinding, "_rebound", collections.Counter())  # other tests replace it too
    cls: type[nn.Module] = _Offset if how == "instance" else nn.Identity
    before = cls.forward
    model = torchcache()(cls()) if how == "instance" else torchcache()(cls)()
    assert torch.equal(model(X), before(model, X))
    monkeypatch.setattr(cls, "forward", _offset_by_100)
    assert torch.equal(model(X), X + 100)
    fresh = torchcache()(cls()) if how == "instance" else torchcache()(cls)()
    assert torch.equal(fresh(X), X + 100)


class _PlusOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@torchcache()
class _InheritsForward(_PlusOne):
    pass


class _DoublesInner(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def test_a_decorated_class_that_inherits_forward_runs_its_bases_forward_as_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rebinding, "_rebound", collections.Counter())  # other tests replace it too
    model = _InheritsForward()
    assert torch.equal(model(X), X + 1)
    monkeypatch.setattr(_PlusOne, "forward", _offset_by_100)
    assert torch.equal(model(X), X + 100)


class _PlusFifty(_PlusOne):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 50


class _AfterInheritsForward(_InheritsForward, _PlusFifty):  # its order: _InheritsForward, _PlusFifty, _PlusOne
    pass


def test_the_forward_past_a_decorated_class_follows_the_instances_class_order() -> None:
    assert torch.equal(_AfterInheritsForward()(X), X + 50)


class _TimesTwo(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@torchcache()
class _InheritsScaled(_TimesTwo):
    pass


class _UnderInheritsScaled(_InheritsScaled):
    pass


def test_an_undecorated_subclass_splits_arguments_by_the_forward_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebinding, "_rebound", collections.Counter())  # other tests replace it too
    model = _UnderInheritsScaled()
    assert torch.equal(model(X), X * 2)

    def shifted(self: nn.Module, x: torch.Tensor, shift: float = 0.0, scale: float = 2.0) -> torch.Tensor:
        return x * scale + shift

    monkeypatch.setattr(_TimesTwo, "forward", shifted)
    assert torch.equal(model(X, 5.0), X * 2 + 5) and torch.equal(model(X, scale=3.0), X * 3)


@torchcache()
class _Base(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@torchcache()
class _CallsItsBase(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_a_decorated_class_calling_a_decorated_bases_forward_caches_its_own_outputs() -> None:
    model = _CallsItsBase()
    for _ in range(3):  # the base's rows were stored under the same key as the outer call's, and won
        assert torch.equal(model(X), (X + 1) * 2)
    assert model.cache_instance.stats().hits == 2 * len(X)


class _ScaledPlusFifty(_PlusOne):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale + 50


class _OwnForwardCallsPastADecoratedClass(_InheritsForward, _ScaledPlusFifty):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, scale=2.0)  # the decorated class's wrapper, then _ScaledPlusFifty's forward


def test_a_subclasss_own_forward_calling_a_decorated_class_splits_by_the_forward_past_it() -> None:
    model = _OwnForwardCallsPastADecoratedClass()
    for _ in range(2):
        assert torch.equal(model(X), X * 2 + 50)


class _PerSequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.layout != torch.strided:  # cannot be keyed per item: runs plain, its dense form through the cache
            return self(x.to_dense())
        return self.linear(x)


def test_calls_of_a_module_inside_its_own_uncached_call_are_still_cached() -> None:
    model = torchcache()(_PerSequence())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # a sparse tensor cannot be keyed per item
        for _ in range(2):
            assert torch.equal(model(X.to_sparse()), model.linear(X))
    assert model.cache_instance.stats().hits == len(X)


def test_moving_a_model_at_every_step_does_not_warn_of_keys_taken_again() -> None:
    model = torchcache()(nn.Linear(4, 4).requires_grad_(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(12):  # asked for (.to, load_state_dict): the key is taken again, as it should be
            model.to("cpu")
            model(X)


def test_fx_traces_the_forward_a_wrapped_module_runs_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebinding, "_rebound", collections.Counter())  # other tests replace it too
    outer = _DoublesInner(torchcache()(_PlusOne()))
    assert torch.equal(outer(X), (X + 1) * 2)
    monkeypatch.setattr(_PlusOne, "forward", _offset_by_100)
    assert torch.equal(torch.fx.symbolic_trace(outer)(X), (X + 100) * 2)


def test_a_copy_of_a_wrapped_graph_module_keeps_its_own_forward_when_the_original_is_recompiled() -> None:
    original = torchcache()(torch.fx.symbolic_trace(_PlusOne()))
    original(X)
    copied = copy.deepcopy(original)
    graph = original.graph
    placeholder = next(node for node in graph.nodes if node.op == "placeholder")
    with graph.inserting_after(placeholder):
        scale = graph.placeholder("scale")
    output = next(node for node in graph.nodes if node.op == "output")
    with graph.inserting_before(output):
        output.args = (graph.call_function(torch.mul, (output.args[0], scale)),)
    original.recompile()
    assert torch.equal(copied(X), X + 1) and torch.equal(copied(x=X), X + 1)
    assert torch.equal(original(X, 3.0), (X + 1) * 3)


def test_the_modules_own_class_swapped_after_a_call_takes_the_key_again() -> None:
    model = _Doubles()
    assert torch.equal(model(X), X * 2)
    model.__class__ = _Triples
    assert torch.equal(model(X), X * 3)


_OPTIONS = {"modules": 2.0, "import_module": 3.0}


class _NamesModulesElsewhere(nn.Module):
    """Imports sys and importlib whole, and names "modules" and "import_module" without reading them from those."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import importlib
        import sys

        scale = _OPTIONS["modules"] * _OPTIONS["import_module"] if sys.version_info >= (3, 8) else 1.0
        count = len(list(self.modules())) + len(importlib.__name__)
        return self.linear(x) * scale + count


def test_a_whole_import_of_sys_or_importlib_is_refused_only_where_their_attribute_is_read() -> None:
    model = torchcache()(_frozen(_NamesModulesElsewhere()))
    assert torch.equal(model(X), _NamesModulesElsewhere.forward(model, X)) and model.cache_instance.stats().misses


def test_a_method_patched_into_an_installed_class_is_keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = _frozen(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    got, expected = None, None
    first = torchcache(persistent=True, persistent_cache_dir=tmp_path)(net)
    first(X)
    first.cache_instance.flush()
    monkeypatch.setattr(nn.ReLU, "forward", lambda self, x: x.clamp(min=1.0))
    second = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_frozen(nn.Sequential(net[0], nn.ReLU())))
    got, expected = second(X), net[0](X).clamp(min=1.0)
    assert torch.equal(got, expected)


def _gelu_of_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x)


def _sigmoid_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def test_a_users_function_put_into_an_installed_module_is_keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_gelu_of_torch)
    first(X)
    first.cache_instance.flush()
    monkeypatch.setattr(torch.nn.functional, "gelu", _sigmoid_gelu)  # as kernel-patching libraries do
    second = torchcache(persistent=True, persistent_cache_dir=tmp_path)(_gelu_of_torch)
    assert torch.equal(second(X), _sigmoid_gelu(X))


def test_a_function_of_a_users_own_compiled_extension_is_keyed_by_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import math

    built = fake_extension(tmp_path, "tc_myops", monkeypatch)
    monkeypatch.setattr(math.hypot, "__module__", "tc_myops")  # a C function of that module
    before = KeyEncoder("remedy").encode(math.hypot, "gain")
    built.write_bytes(b"\x7fELF version 2, rebuilt")
    assert KeyEncoder("remedy").encode(math.hypot, "gain") != before


def test_a_method_another_package_only_adds_to_an_installed_class_keeps_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    before = KeyEncoder("remedy").encode(nn.Linear, "cls")
    installed = str(Path(torch.__file__).with_name("smart.py"))  # a function of another installed package's file
    smart_apply = eval(compile("lambda self, fn: fn(self)", installed, "eval"))
    monkeypatch.setattr(nn.Module, "smart_apply", smart_apply, raising=False)  # as transformers does
    assert KeyEncoder("remedy").encode(nn.Linear, "cls") == before
    monkeypatch.setattr(nn.Module, "log", lambda self, text: print(text), raising=False)  # a script's helper too
    assert KeyEncoder("remedy").encode(nn.Linear, "cls") == before
    monkeypatch.setattr(nn.Linear, "extra_repr", lambda self: "patched")  # overrides nn.Module's: keyed
    assert KeyEncoder("remedy").encode(nn.Linear, "cls") != before


class AttrDict(dict):  # type: ignore[type-arg]
    __getattr__ = dict.__getitem__  # a missing attribute raises KeyError, not AttributeError


def test_a_dict_whose_attributes_are_its_items_is_keyed_by_its_items() -> None:
    first, again, other = AttrDict(k=2.0), AttrDict(k=2.0), AttrDict(k=3.0)
    encode = KeyEncoder("remedy").encode
    assert encode(first, "cfg") == encode(again, "cfg") != encode(other, "cfg")


class Keyed:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __torchcache_key__(self) -> float:
        return self.scale


class Delegating:  # a view that hands attribute lookups to the object it wraps, and holds a lock of its own
    def __init__(self, inner: Keyed) -> None:
        self._inner, self._lock = inner, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_an_object_that_delegates_its_attributes_is_keyed_by_the_key_it_delegates_to() -> None:
    encode = KeyEncoder("remedy").encode
    first, again, other = Delegating(Keyed(2.0)), Delegating(Keyed(2.0)), Delegating(Keyed(3.0))
    assert encode(first, "cfg") == encode(again, "cfg") != encode(other, "cfg")


class BrokenKey:
    @property
    def __torchcache_key__(self) -> Any:
        raise RuntimeError("the key's source is gone")


def test_a_key_method_that_fails_is_an_error_not_a_key_of_the_state() -> None:
    with pytest.raises(RuntimeError, match="source is gone"):
        KeyEncoder("remedy").encode(BrokenKey(), "cfg")


def test_a_compiled_pattern_and_a_struct_are_keyed_as_pickle_would_describe_them() -> None:
    import re
    import struct

    encode = KeyEncoder("remedy").encode
    patterns = [re.compile(r"\w+"), re.compile(r"\w*"), re.compile(r"\w+", re.IGNORECASE)]
    assert len({encode(p, "pattern") for p in patterns}) == 3 and encode(re.compile(r"\w+"), "p") == encode(
        patterns[0], "p"
    )
    assert encode(struct.Struct("<I"), "packer") != encode(struct.Struct("<Q"), "packer")
    assert encode(struct.Struct("<I"), "packer") == encode(struct.Struct("<I"), "packer")


def _keys_of_two_versions(tmp_path: Path, modules: list[str], files: dict[str, str], build: Any) -> list[str]:
    """The module keys of ``build(loaded)`` for the files' sources with ``{}`` as 2, then as 3 (loaded in order)."""
    keys = []
    for version in (2, 3):
        loaded = {
            name: load_module(tmp_path / f"{name}.py", name, source.format(version)) for name, source in files.items()
        }
        model = torchcache()(_frozen(build(loaded)))
        keys.append(model.cache_instance.module_hash)
    modules.extend(files)
    return keys


_NET = "from torch import nn\n{imports}\nclass Net(nn.Module):\n    def forward(self, x):\n        return {body}\n"


@pytest.mark.parametrize(
    ("files", "read"),
    [
        (  # a name a module makes as it is read (PEP 562), from a helper edited since
            {
                "lazy_impl": "def act(x):\n    return x * {}\n",
                "lazy_pkg": "def __getattr__(name):\n    import lazy_impl\n    return getattr(lazy_impl, name)\n",
            },
            ("import lazy_pkg", "lazy_pkg.act(x)"),
        ),
        (  # a module of the user's read whole, and a function it imported from another
            {"kernels": "def act(x):\n    return x + {}\n", "reexports": "from kernels import act\n"},
            ("import reexports", "getattr(reexports, 'act')(x)"),
        ),
        (  # methods of a class whose __module__ names the standard library
            {"new_class": "import types\ndef act(s, x):\n    return x - {}\nK = types.new_class('K')\nK.act = act\n"},
            ("from new_class import K", "K().act(x)"),
        ),
        (  # a value in a class make_dataclass made (its __module__ is "types" on Python 3.11)
            {"made_dc": "import dataclasses\nCfg = dataclasses.make_dataclass('Cfg', [], namespace={{'k': {}.0}})\n"},
            ("from made_dc import Cfg", "x * Cfg().k"),
        ),
        (  # a property of the user's metaclass
            {"meta": "class Meta(type):\n    @property\n    def factor(cls):\n        return {}.0\n"},
            ("from meta import Meta", "x * type(self).factor"),
        ),
    ],
    ids=["module_getattr", "reexported", "new_class", "make_dataclass", "metaclass"],
)
def test_code_reached_past_a_modules_names_is_keyed_by_its_code(
    tmp_path: Path, modules: list[str], files: dict[str, str], read: tuple[str, str]
) -> None:
    imports, body = read
    net = _NET.format(imports=imports, body=body).replace("{", "{{").replace("}", "}}")
    if "Meta" in imports:
        net = net.replace("class Net(nn.Module):", "class Net(nn.Module, metaclass=Meta):")
    keys = _keys_of_two_versions(
        tmp_path, modules, {**files, "uses_helper": net}, lambda loaded: loaded["uses_helper"].Net()
    )
    assert keys[0] != keys[1]


def test_a_method_of_the_users_code_replaced_on_a_class_the_standard_library_made_is_seen(
    tmp_path: Path, modules: list[str]
) -> None:
    modules.extend(["made_class", "uses_made"])
    made = load_module(tmp_path / "made_class.py", "made_class", "import types\nK = types.new_class('K')\n")
    made.K.act = lambda self, x: x * 2
    uses = load_module(
        tmp_path / "uses_made.py", "uses_made", _NET.format(imports="from made_class import K", body="K().act(x)")
    )
    model = torchcache()(_frozen(uses.Net()))
    assert torch.equal(model(X), X * 2)
    made.K.act = lambda self, x: x * 3
    assert torch.equal(model(X), X * 3)


def test_a_name_a_module_makes_follows_the_globals_its_getattr_reads(tmp_path: Path, modules: list[str]) -> None:
    modules.extend(["backends", "uses_backends"])
    source = "SCALES = {'a': 2.0, 'b': 3.0}\nBACKEND = 'a'\ndef __getattr__(name):\n    return SCALES[BACKEND]\n"
    backends = load_module(tmp_path / "backends.py", "backends", source)
    uses = load_module(
        tmp_path / "uses_backends.py",
        "uses_backends",
        _NET.format(imports="import backends", body="x * backends.scale"),
    )
    model = torchcache()(_frozen(uses.Net()))
    assert torch.equal(model(X), X * 2.0)
    backends.BACKEND = "b"  # read by its __getattr__: seen
    assert torch.equal(model(X), X * 3.0)


def test_a_metaclass_is_keyed_only_where_it_is_the_users() -> None:
    class Meta(type):
        pass

    class Described(metaclass=Meta):
        pass

    encode = KeyEncoder("remedy").encode
    assert b"metaclass" in encode(Described, "cls")
    assert b"metaclass" not in encode(torch.ScriptObject, "cls")  # pybind11's, from no module loaded: not the user's


_LAZY_PACKAGE = "import importlib\ndef __getattr__(name):\n    return importlib.import_module('.' + name, __name__)\n"


@pytest.mark.parametrize("imported_first", [False, True])
def test_a_submodule_a_package_imports_as_it_is_read_is_keyed_as_a_submodule(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch, imported_first: bool
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "lazy_package").mkdir()
    (tmp_path / "lazy_package" / "__init__.py").write_text(_LAZY_PACKAGE)
    (tmp_path / "lazy_package" / "ops.py").write_text("def act(x):\n    return x * 2\n")
    modules.extend(["lazy_package", "lazy_package.ops", "uses_lazy_package"])
    importlib.invalidate_caches()
    package = importlib.import_module("lazy_package")
    if imported_first:
        importlib.import_module("lazy_package.ops")
    else:
        vars(package).pop("ops", None)
    source = _NET.format(imports="import lazy_package", body="lazy_package.ops.act(x)")
    uses = load_module(tmp_path / "uses_lazy_package.py", "uses_lazy_package", source)
    model = torchcache()(_frozen(uses.Net()))
    assert torch.equal(model(X), X * 2)  # keyed by the submodule's code, in either order; its __getattr__ is not read
    assert b"__getattr__" not in KeyEncoder("remedy").encode(uses.Net, "cls")


def test_a_name_defined_where_a_modules_getattr_made_it_is_seen(tmp_path: Path, modules: list[str]) -> None:
    modules.extend(["makes_names", "uses_made_names"])
    made = load_module(tmp_path / "makes_names.py", "makes_names", "def __getattr__(name):\n    return 2.0\n")
    source = _NET.format(imports="import makes_names", body="x * makes_names.scale")
    uses = load_module(tmp_path / "uses_made_names.py", "uses_made_names", source)
    model = torchcache()(_frozen(uses.Net()))
    assert torch.equal(model(X), X * 2.0)
    made.scale = 10.0  # now a name of the module, in front of its __getattr__
    assert torch.equal(model(X), X * 10.0)


def test_a_class_of_the_users_named_after_an_installed_module_is_keyed_by_its_code() -> None:
    class Disguised(nn.Module):
        __module__ = "torch.nn"  # for a shorter repr

        def scale(self) -> float:
            return 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale()

    before = KeyEncoder("remedy").encode(Disguised, "cls")
    Disguised.scale = lambda self: 3.0  # type: ignore[method-assign]
    assert KeyEncoder("remedy").encode(Disguised, "cls") != before
    assert KeyEncoder("remedy").encode(nn.Linear, "cls") == KeyEncoder("remedy").encode(nn.Linear, "cls")


_HELPER_SCALE = 2.0


def _scaled_helper(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * _HELPER_SCALE


class _CallsHelper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled_helper(x)  # type: ignore[operator]


class _CallsHelperByName(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "scaled_helper")(x)  # type: ignore[no-any-return]  # noqa: B009 - read by its name


class _CallsHelperOffTheClass(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Module.scaled_helper(self, x)  # type: ignore[no-any-return,operator]


class _Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.exp()) * 2  # log read off torch and off a tensor, not off a module


def test_a_helper_of_the_users_put_on_nn_module_is_keyed_where_forward_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = torchcache()(_Plain())
    before = plain.cache_instance.module_hash
    monkeypatch.setattr(nn.Module, "scaled_helper", _scaled_helper, raising=False)
    monkeypatch.setattr(nn.Module, "log", lambda self, text: print(text, file=sys.stderr), raising=False)
    assert torchcache()(_Plain()).cache_instance.module_hash == before  # neither read: keys stay
    models = [torchcache()(calls()) for calls in (_CallsHelper, _CallsHelperByName, _CallsHelperOffTheClass)]
    for model in models:
        unread = model.cache_instance.module_hash  # the key the first call takes, read before it
        assert torch.equal(model(X), X * 2.0) and model.cache_instance.module_hash == unread
    monkeypatch.setattr(f"{__name__}._HELPER_SCALE", 3.0)  # a global the helper reads: seen by each
    with pytest.warns(CacheWarning, match="'_HELPER_SCALE' .* rebound 3 times"):
        assert all(torch.equal(model(X), X * 3.0) for model in models)
    ignoring = torchcache(key_ignore=("scaled_helper",))(_CallsHelper())
    key = ignoring.cache_instance.module_hash
    monkeypatch.setattr(f"{__name__}._HELPER_SCALE", 4.0)
    assert ignoring.cache_instance.module_hash == key  # named in key_ignore: left out


def test_what_code_reads_by_name_and_which_classes_are_made_elsewhere() -> None:
    from torchcache.canonical.origins import made_elsewhere
    from torchcache.canonical.reads import reads_of

    def keyed_by_strings(self: Any, x: Any) -> Any:
        return {"log": x}["log"] + getattr(self, "helper")(x)  # noqa: B009

    def dict_keys_only(x: Any) -> Any:
        return {"log": x}["log"] + x.exp()

    assert reads_of(keyed_by_strings.__code__)[1] >= {"log", "helper"}
    assert "log" not in reads_of(dict_keys_only.__code__)[1] and "exp" in reads_of(dict_keys_only.__code__)[1]
    made = types.new_class("Made")
    made.act = lambda self, x: x
    assert made_elsewhere(made)  # __module__ "types", which does not hold it
    assert not any(made_elsewhere(t) for t in (type(None), type(lambda: 0), type(threading.Lock()), nn.Linear))
