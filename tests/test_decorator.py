"""The decorator's interface: options, overrides, errors, stats, keys and returned values."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import platformdirs
import pytest
import torch
from torch import nn

from tests.helpers import (
    ConvBackbone,
    Counting,
    MultiOut,
    assert_all_entries_decode,
    assert_same,
    cached,
    disk_bytes,
    entry_files,
    stored_entries,
)
from torchcache import CacheStats, CacheWarning, ConfigError, TierStats, torchcache
from torchcache.codec import decode_frame
from torchcache.stores.packed.store import PackedStore


@contextmanager
def torchcache_log() -> Iterator[list[logging.LogRecord]]:
    """Records of the "torchcache" logger, however it is configured."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("torchcache")
    handler, level = Collect(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def pair(base: type[nn.Module] = Counting, *args: Any, **options: Any) -> tuple[Any, Any]:
    """A decorated module and its plain twin with the same weights."""
    return cached(base, **options)(*args), base(*args)


# -- hits, misses, partial hits ---------------------------------------------------------
def test_hit_returns_the_values_of_a_real_call_without_running_forward() -> None:
    model, plain = pair()
    x = torch.randn(8, 4)
    first = model(x)
    second = model(x)
    assert_same(first, plain(x))
    assert_same(second, plain(x))
    assert model.seen == [8]
    stats = model.cache_instance.stats()
    assert (stats.hits, stats.misses) == (8, 8)


def test_partial_hit_runs_only_the_missing_items_and_keeps_input_order() -> None:
    model, plain = pair()
    x = torch.randn(10, 4)
    model(x[:4])
    order = torch.tensor([7, 1, 5, 0, 9, 3, 2])
    out = model(x[order])
    assert model.seen == [4, 3]  # only 7, 5 and 9 are new
    assert_same(out, plain(x[order]))
    stats = model.cache_instance.stats()
    assert (stats.hits, stats.misses) == (4, 7)


def test_conv_backbone_on_images() -> None:
    model, plain = pair(ConvBackbone)
    x = torch.randn(6, 3, 8, 8)
    model(x[:3])
    assert_same(model(x), plain(x))
    assert_same(model(x.flip(0)), plain(x.flip(0)))
    assert model.items == 6


def test_nested_outputs_keep_structure_dtypes_and_shapes_on_hits() -> None:
    model, plain = pair(MultiOut)
    x = torch.randn(5, 4)
    model(x[:2])
    assert_same(model(x), plain(x))
    assert_same(model(x), plain(x))
    assert model.items == 5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_output_dtype_is_preserved_on_hits(dtype: torch.dtype) -> None:
    @torchcache()
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 3).to(dtype)

    x = torch.randn(6, 5)
    f(x[:3])
    assert_same(f(x), (x * 3).to(dtype))
    assert_same(f(x), (x * 3).to(dtype))


def test_one_dimensional_inputs_and_outputs() -> None:
    calls: list[int] = []

    @torchcache(check_items=False)
    def square(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * x

    x = torch.randn(7)
    assert_same(square(x[:3]), x[:3] * x[:3])
    assert_same(square(x), x * x)
    assert_same(square(x), x * x)
    assert calls == [3, 4]


def test_several_tensor_arguments_positional_and_keyword() -> None:
    calls: list[int] = []

    @torchcache(check_items=False)
    def combine(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(a.shape[0])
        out = a.sum(dim=1, keepdim=True) * b
        return out if c is None else out + c[:, None]

    a, b, c = torch.randn(6, 3), torch.randn(6, 2), torch.randn(6)
    want = a.sum(dim=1, keepdim=True) * b + c[:, None]
    assert_same(combine(a, b, c), want)
    assert_same(combine(a, b=b, c=c), want)
    assert_same(combine(c=c, b=b, a=a), want)
    assert calls == [6]
    # the same a with another b is another item
    b2 = b.clone()
    b2[2] += 1
    want2 = a.sum(dim=1, keepdim=True) * b2 + c[:, None]
    assert_same(combine(a, b2, c), want2)
    assert calls == [6, 1]
    # leaving out c is another key too
    assert_same(combine(a, b), a.sum(dim=1, keepdim=True) * b)
    assert calls == [6, 1, 6]


def test_var_positional_and_var_keyword_tensors() -> None:
    calls: list[int] = []

    @torchcache(check_items=False)
    def total(*xs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        calls.append(xs[0].shape[0])
        out = sum(xs, torch.zeros_like(xs[0]))
        for key in sorted(named):
            out = out * 2 + named[key]
        return out

    x, y, z = torch.randn(3, 4, 2).unbind(0)
    assert_same(total(x, y, w=z), (x + y) * 2 + z)
    assert_same(total(x, y, w=z), (x + y) * 2 + z)
    assert_same(total(x, y, v=z), (x + y) * 2 + z)
    assert_same(total(x, w=y), x * 2 + y)
    assert calls == [4, 4, 4]


# -- stats, clear, flush, directories ----------------------------------------------------
def test_stats_fields_memory_only() -> None:
    model, _ = pair(max_memory_cache_size="1MB")
    cache = model.cache_instance
    empty = cache.stats()
    assert isinstance(empty, CacheStats)
    assert (empty.hits, empty.misses, empty.hit_rate) == (0, 0, 0.0)
    assert empty.disk is None
    assert isinstance(empty.memory, TierStats)
    assert (empty.memory.entries, empty.memory.bytes, empty.memory.hits) == (0, 0, 0)
    assert empty.memory.max_bytes == 10**6

    x = torch.randn(8, 4)
    model(x[:4])
    four = cache.stats().memory
    model(x)
    stats = cache.stats()
    assert dataclasses.is_dataclass(stats)
    assert (stats.hits, stats.misses) == (4, 8)
    assert stats.hit_rate == pytest.approx(4 / 12)
    assert stats.memory.entries == 8
    assert four.entries == 4
    assert four.bytes > 0
    assert stats.memory.bytes == 2 * four.bytes
    assert stats.memory.hits == 4
    assert stats.disk is None


def test_stats_disk_tier(cache_root: Path) -> None:
    model, _ = pair(persistent=True, max_persistent_cache_size="5MB")
    x = torch.randn(6, 4)
    model(x)
    model.cache_instance.flush()
    disk = model.cache_instance.stats().disk
    assert disk is not None
    assert disk.entries == 6 == len(entry_files(cache_root))
    assert disk.bytes == disk_bytes(cache_root)
    assert disk.max_bytes == 5 * 10**6
    assert disk.hits == 0

    fresh = cached(Counting, persistent=True)()
    assert_same(fresh(x), Counting()(x))
    stats = fresh.cache_instance.stats()
    assert fresh.items == 0
    assert (stats.hits, stats.misses) == (6, 0)
    assert stats.disk is not None and stats.disk.hits == 6
    assert stats.memory.hits == 0
    fresh(x)  # memory hits now
    stats = fresh.cache_instance.stats()
    assert stats.memory.hits == 6 and stats.disk is not None and stats.disk.hits == 6


def test_the_disk_hits_of_one_instance_are_not_anothers(cache_root: Path) -> None:
    cls = cached(Counting, persistent=True, max_memory_cache_size=0)
    first, second = cls(), cls()  # one key: one disk tier
    x = torch.randn(6, 4)
    first(x)
    first.cache_instance.flush()
    second(x)
    second(x)
    disks = [m.cache_instance.stats().disk for m in (first, second)]
    assert [d.hits if d is not None else None for d in disks] == [0, 12]


def test_a_lower_disk_budget_on_a_later_run_holds_before_anything_is_written(cache_root: Path) -> None:
    model, plain = pair(persistent=True, max_memory_cache_size=0, max_persistent_cache_size="4MB")
    x = torch.randn(4000, 4)  # 4,000 entries of 16 floats: about 400 kB
    model(x)
    model.cache_instance.flush()
    smaller = cached(Counting, persistent=True, max_memory_cache_size=0, max_persistent_cache_size="100kB")()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # the index, sized for 4 MB, is compacted: said once
        assert_same(smaller(x[:1]), plain(x[:1]))  # one call: a hit or a miss, nothing else written
    disk = smaller.cache_instance.stats().disk
    assert disk is not None and 0 < disk.entries < 4000 and disk.bytes <= 100_000


@pytest.mark.parametrize("base", [Counting, MultiOut])
def test_a_single_item_found_on_disk_comes_back_whole(base: type[nn.Module], cache_root: Path) -> None:
    """A lone disk hit: its row, cut from a frame of any length, is viewed at each leaf's dtype."""
    model, plain = pair(base, persistent=True, max_memory_cache_size=0)
    x = torch.randn(5, 4)
    model(x[:3])
    model.cache_instance.flush()
    assert_same(model(x[1:2]), plain(x[1:2]))  # the whole batch is one disk hit
    assert_same(model(x[2:]), plain(x[2:]))  # one disk hit among misses
    disk = model.cache_instance.stats().disk
    assert disk is not None and disk.hits == 2
    assert model.seen == [3, 2]


@pytest.mark.parametrize(
    ("given", "expected"), [("2GB", 2 * 10**9), ("500MiB", 500 * 2**20), (1e9, 10**9), (12345, 12345)]
)
def test_size_options_accept_numbers_and_unit_strings(given: Any, expected: int) -> None:
    model, _ = pair(persistent=True, max_memory_cache_size=given, max_persistent_cache_size=given)
    stats = model.cache_instance.stats()
    assert stats.memory.max_bytes == expected
    assert stats.disk is not None and stats.disk.max_bytes == expected


def test_clear_removes_memory_and_disk_entries_of_the_module(cache_root: Path) -> None:
    other, _ = pair(Counting, 4, 16, 5, persistent=True)
    model, plain = pair(persistent=True)
    x = torch.randn(5, 4)
    other(x)
    model(x)
    model.cache_instance.flush()
    other.cache_instance.flush()
    mine = model.cache_instance.cache_dir
    assert len(entry_files(mine)) == 5

    model(x)  # a memory hit, counted until clear()
    assert model.cache_instance.stats().hits == 5
    model.cache_instance.clear()
    stats = model.cache_instance.stats()
    assert stats.memory.entries == 0
    assert stats.disk is not None and stats.disk.entries == 0
    assert (stats.hits, stats.misses, stats.memory.hits, stats.disk.hits) == (0, 0, 0, 0)  # counters reset
    assert entry_files(mine) == []
    assert len(entry_files(other.cache_instance.cache_dir)) == 5  # other modules keep theirs

    assert_same(model(x), plain(x))
    assert model.seen == [5, 5]  # found neither in memory nor on disk
    assert (model.cache_instance.stats().hits, model.cache_instance.stats().misses) == (0, 5)


def test_flush_waits_for_background_writes(cache_root: Path) -> None:
    model, _ = pair(persistent=True)
    model(torch.randn(40, 4))
    model.cache_instance.flush()
    assert len(entry_files(cache_root)) == 40
    assert_all_entries_decode(cache_root)


def test_disk_layout_and_metadata(cache_root: Path) -> None:
    model, _ = pair(persistent=True)
    model(torch.randn(12, 4))
    model.cache_instance.flush()
    key = model.cache_instance.module_hash
    module_dir = cache_root / key
    assert model.cache_instance.cache_dir == module_dir
    assert [p.name for p in cache_root.iterdir()] == [key]

    # the module directory: metadata, the store's index and lock files, segment files;
    # no 1.0 layout (``<3 hex>/<key>.tce``) is written any more
    names = {p.name for p in module_dir.iterdir()}
    segments = {name for name in names if re.fullmatch(r"seg-[0-9a-f]{8}\.tcs", name)}
    assert {"torchcache.json", "index.lmdb"} <= names
    assert segments
    assert names - segments <= {"torchcache.json", "index.lmdb", "index.lmdb-lock", "compact.lock", "index.lock"}
    assert all(p.is_file() for p in module_dir.iterdir())
    assert not list(cache_root.rglob("*.tce"))

    # every item is one entry of the store, keyed by 32 hex digits, holding a valid frame
    with PackedStore(module_dir, 10**9) as store:
        keys = sorted(store.keys())
        assert len(keys) == len(store) == 12
        assert all(re.fullmatch(r"[0-9a-f]{32}", k) for k in keys)
        frames = store.get_many(keys)
        assert all(frame is not None for frame in frames)
        for frame in frames:
            assert frame is not None
            decode_frame(bytes(frame))
        usage = store.usage()
    assert usage["entries"] == 12
    assert usage["payload"] == sum(len(frame) for frame in frames if frame is not None)
    assert usage["payload"] == model.cache_instance.stats().disk.bytes
    assert sum((module_dir / name).stat().st_size for name in segments) >= usage["records"] > usage["payload"]
    assert [module_dir / k for k in keys] == entry_files(cache_root)

    meta = json.loads((module_dir / "torchcache.json").read_text())
    assert isinstance(meta, dict)
    assert meta["kind"] == "module"
    assert meta["module_key"] == key


def test_module_hash_and_cache_dir(cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory_only, _ = pair()
    key = memory_only.cache_instance.module_hash
    assert isinstance(key, str) and key
    assert memory_only.cache_instance.cache_dir is None

    persistent, _ = pair(persistent=True)
    assert persistent.cache_instance.cache_dir == cache_root / persistent.cache_instance.module_hash

    explicit, _ = pair(persistent=True, persistent_cache_dir=tmp_path / "explicit")
    assert explicit.cache_instance.cache_dir == tmp_path / "explicit" / explicit.cache_instance.module_hash
    explicit(torch.randn(3, 4))
    explicit.cache_instance.flush()
    assert len(entry_files(tmp_path / "explicit")) == 3
    assert entry_files(cache_root) == []

    monkeypatch.delenv("TORCHCACHE_DIR")
    default, _ = pair(persistent=True)
    assert default.cache_instance.cache_dir is not None
    assert default.cache_instance.cache_dir.parent == Path(platformdirs.user_cache_path("torchcache"))


# -- options and their errors -------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("enabled", "yes"),
        ("persistent", 2),
        ("persistent_cache_dir", 42),
        ("persistent_cache_dir", ""),
        ("persistent_cache_dir", "cache\0dir"),
        ("persistent_cache_dir", "https://host/cache"),
        ("persistent_cache_dir", "file:///tmp/cache"),
        ("persistent_cache_dir", "redis:/host"),  # a URL mistyped: not a folder named "redis:" in the working dir
        ("persistent_cache_dir", "redis:host:6379"),
        ("persistent_cache_dir", "GS:/bucket/prefix"),
        ("persistent_cache_dir", "rediss+cluster:/host"),
        ("persistent_module_hash", ""),
        ("persistent_module_hash", 3),
        ("max_memory_cache_size", -1),
        ("max_memory_cache_size", "2XB"),
        ("max_persistent_cache_size", "lots"),
        ("max_local_cache_size", "lots"),
        ("max_persistent_cache_size", float("nan")),
        ("memory_cache_device", "not-a-device"),
        ("memory_cache_device", "meta"),
        ("max_memory_cache_size", "1e999999999"),
        ("max_persistent_cache_size", "1e999999999 GB"),
        ("subsample_count", 0),
        ("subsample_count", 1.5),
        ("cache_dtype", torch.int32),
        ("cache_dtype", "float16"),
        ("cache_dtype", torch.float8_e4m3fn),
        ("shared_args", "mask"),
        ("shared_args", None),
        ("key_ignore", None),
        ("batch_dims", {"x": -1}),
        ("batch_dims", ["x"]),
        ("keep_eval", 2),
        ("brotli_quality", 12),
        ("brotli_quality", -1),
    ],
)
def test_invalid_option_raises_config_error_naming_it(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name) as info:
        torchcache(**{name: value})
    assert isinstance(info.value, ValueError)


def test_a_folder_whose_name_starts_like_a_url_is_written_with_a_leading_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"got redis:scores \(a directory named so: './redis:scores'\)"):
        torchcache(persistent_cache_dir="redis:scores")
    with pytest.raises(ConfigError, match=r"got redis:\*\*\*@host:6379/0$") as info:  # a password in a typo stays out
        torchcache(persistent_cache_dir="redis:/:s3cret@host:6379/0")
    assert "s3cret" not in str(info.value)
    monkeypatch.chdir(tmp_path)
    model, plain = pair(persistent=True, persistent_cache_dir="./redis:scores")
    x = torch.randn(3, 4)
    assert_same(model(x), plain(x))
    assert model.cache_instance.cache_dir is not None
    assert (tmp_path / "redis:scores") in model.cache_instance.cache_dir.resolve().parents


def test_an_argument_both_shared_and_batched_on_another_dimension_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\['mask'\] named in both shared_args \(whole\) and batch_dims"):
        torchcache(shared_args=("mask",), batch_dims={"mask": 1})


@pytest.mark.parametrize("value", ["redis://", "https://host/cache", "redis:/host:6379"])
def test_a_torchcache_dir_that_cannot_be_used_is_one_warning_and_calls_stay_in_memory(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHCACHE_DIR", value)
    model, plain = pair(persistent=True)
    x = torch.randn(3, 4)
    with pytest.warns(CacheWarning, match="TORCHCACHE_DIR"):
        assert_same(model(x), plain(x))
    assert_same(model(x), plain(x))
    assert model.cache_instance.cache_dir is None and model.cache_instance.stats().memory.hits == 3


def test_invalid_instance_override_raises_config_error() -> None:
    class Bad(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.torchcache_brotli_quality = 42

    decorated = torchcache()(Bad)
    with pytest.raises(ConfigError, match=r"Bad\.torchcache_brotli_quality: brotli_quality must be"):
        decorated()


def test_an_invalid_override_is_named_past_a_valid_one_whose_name_begins_it() -> None:
    class Bad(Counting):
        torchcache_persistent = True  # valid, and a prefix of the option at fault

        def __init__(self) -> None:
            super().__init__()
            self.torchcache_persistent_module_hash = 123

    with pytest.raises(ConfigError, match=r"Bad\.torchcache_persistent_module_hash: persistent_module_hash must"):
        torchcache()(Bad)()


def test_numpy_flags_and_counts_are_taken_as_pythons_and_key_alike() -> None:
    as_numpy = cached(Counting, persistent=np.bool_(False), subsample_count=np.int64(10_000))()
    as_python = cached(Counting, persistent=False, subsample_count=10_000)()
    settings = as_numpy.cache_instance.settings
    assert type(settings.persistent) is bool and type(settings.subsample_count) is int
    assert settings == as_python.cache_instance.settings
    with pytest.raises(ConfigError, match="subsample_count must be an int >= 64"):
        torchcache(subsample_count=np.float64(10_000.0))


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="max_cache_size"):
        torchcache(max_cache_size=10)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("zstd_compression", True),
        ("zstd_compression_level", 3),
        ("zstd_compression_threads", 2),
        ("use_mmap_on_load", True),
    ],
)
def test_legacy_options_are_accepted_with_a_future_warning(name: str, value: Any) -> None:
    with pytest.warns(FutureWarning, match=name):
        decorate = torchcache(check_items=False, **{name: value})
    model = decorate(type("Legacy", (Counting,), {}))()
    x = torch.randn(3, 4)
    assert_same(model(x), Counting()(x))
    assert_same(model(x), Counting()(x))
    assert model.seen == [3]


def test_instance_overrides(tmp_path: Path) -> None:
    class Overridden(Counting):
        def __init__(self, budget: str) -> None:
            super().__init__()
            self.torchcache_max_memory_cache_size = budget
            self.torchcache_persistent = True
            self.torchcache_persistent_cache_dir = tmp_path / "own"

    decorated = torchcache(max_memory_cache_size=10**9)(Overridden)
    model = decorated("1MB")
    cache = model.cache_instance
    assert cache.stats().memory.max_bytes == 10**6
    assert cache.cache_dir == tmp_path / "own" / cache.module_hash
    x = torch.randn(4, 4)
    assert_same(model(x), Counting()(x))
    cache.flush()
    assert len(entry_files(tmp_path / "own")) == 4
    assert decorated("2MB").cache_instance.stats().memory.max_bytes == 2 * 10**6


def test_instance_can_turn_caching_off_and_then_may_train() -> None:
    class Trainable(nn.Module):
        def __init__(self, cache: bool) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)
            self.calls = 0
            if cache:
                self.requires_grad_(False)
            else:
                self.torchcache_enabled = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.linear(x)

    decorated = torchcache()(Trainable)
    model = decorated(cache=False)
    assert model.cache_instance is None
    x = torch.randn(3, 4)
    out = model(x)
    model(x)
    assert model.calls == 2
    assert out.requires_grad
    assert decorated(cache=True).cache_instance is not None


def test_enabled_false_returns_the_target_unchanged() -> None:
    class Plain(Counting):
        pass

    init, forward = Plain.__init__, Plain.forward
    assert torchcache(enabled=False)(Plain) is Plain
    assert Plain.__init__ is init and Plain.forward is forward
    assert not hasattr(Plain(), "cache_instance")

    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    assert torchcache(enabled=False)(f) is f


def test_trainable_module_is_refused_with_a_config_error() -> None:
    class Trainable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    decorated = torchcache()(Trainable)
    with pytest.raises(ConfigError) as info:
        decorated()
    assert "requires_grad_(False)" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, AssertionError)


# -- functions, argument keys ---------------------------------------------------------------
def test_function_with_defaults_and_keyword_arguments() -> None:
    calls: list[int] = []

    @torchcache(check_items=False)
    def affine(x: torch.Tensor, scale: float = 2.0, *, shift: float = 0.0, **extra: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * scale + shift + len(extra)

    assert affine.__name__ == "affine"
    assert affine.cache_instance is not None
    x = torch.randn(4, 3)
    assert_same(affine(x), x * 2.0 + 0.0)
    assert_same(affine(x, 2.0), x * 2.0 + 0.0)  # the default, given explicitly
    assert calls == [4]
    assert_same(affine(x, 3.0), x * 3.0 + 0.0)
    assert_same(affine(x, scale=3.0), x * 3.0 + 0.0)
    assert calls == [4, 4]
    assert_same(affine(x, shift=1.0), x * 2.0 + 1.0)
    assert_same(affine(x, tag="a"), x * 2.0 + 0.0 + 1)
    assert_same(affine(x, tag="b"), x * 2.0 + 0.0 + 1)
    assert calls == [4, 4, 4, 4, 4]
    assert_same(affine(x, tag="b"), x * 2.0 + 0.0 + 1)
    assert calls == [4, 4, 4, 4, 4]


def test_non_tensor_arguments_are_keyed_by_type() -> None:
    calls: list[object] = []

    @torchcache(check_items=False)
    def tagged(x: torch.Tensor, flag: object) -> torch.Tensor:
        calls.append(flag)
        return x + len(calls)

    x = torch.randn(3, 2)
    values: list[object] = [True, 1, 1.0, "1", None]
    first = [tagged(x, v) for v in values]
    assert calls == values
    again = [tagged(x, v) for v in values]
    assert calls == values
    for a, b in zip(first, again):
        assert_same(a, b)
    stats = tagged.cache_instance.stats()
    assert (stats.hits, stats.misses) == (15, 15)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (0, False),
        ((1, 2), [1, 2]),
        ((1, 2), (2, 1)),
        ({"k": 1}, {"k": 1.0}),
        ({"k": 1}, {"j": 1}),
        (torch.float32, torch.float64),
        (torch.device("cpu"), "cpu"),
        (0.1, 0.1 + 1e-16 * 2**4),
        ("é", "e"),
    ],
)
def test_distinct_non_tensor_values_are_distinct_keys(a: object, b: object) -> None:
    calls: list[object] = []

    @torchcache(check_items=False)
    def f(x: torch.Tensor, option: object) -> torch.Tensor:
        calls.append(option)
        return x * len(calls)

    x = torch.randn(2, 3)
    f(x, a)
    f(x, b)
    f(x, a)
    assert len(calls) == 2


def test_non_tensor_arguments_are_keyed_by_name() -> None:
    calls: list[int] = []

    @torchcache(check_items=False)
    def f(x: torch.Tensor, a: int = 0, b: int = 0) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * (a + 1) + b

    x = torch.randn(3, 2)
    assert_same(f(x, a=1), x * 2)
    assert_same(f(x, b=1), x + 1)
    assert_same(f(x, 1), x * 2)  # positional and keyword give the same call
    assert calls == [3, 3]
    assert_same(f(x, 1, 1), x * 2 + 1)
    assert len(calls) == 3


@pytest.mark.parametrize(
    "value",
    [threading.Lock(), [1, threading.Lock()], {"a": (x for x in ())}, {1: torch.zeros(2)}, (torch.zeros(3, 1),)],
)
def test_unsupported_argument_type_raises_type_error_naming_it(value: object) -> None:
    @torchcache()
    def f(x: torch.Tensor, weird_arg: object) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match="weird_arg"):
        f(torch.randn(2, 2), value)


def test_batch_size_mismatch_raises_value_error() -> None:
    @torchcache()
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    with pytest.raises(ValueError, match="batch") as info:
        f(torch.randn(3, 2), torch.randn(4, 2))
    assert "y" in str(info.value)


def test_zero_dim_tensor_raises_value_error() -> None:
    model, _ = pair()
    with pytest.raises(ValueError, match=r"0-d|\(batch"):
        model(torch.tensor(1.0))


# -- module keys ---------------------------------------------------------------------------
def test_training_flag_is_part_of_the_key() -> None:
    model, plain = pair()
    x = torch.randn(4, 4)
    model.eval()
    model(x)
    model.train()
    assert_same(model(x), plain(x))
    assert model.seen == [4, 4]
    model(x)
    model.eval()
    model(x)
    assert model.seen == [4, 4]


def test_training_flag_separates_outputs_of_a_dropout_module() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(x)

    model = torchcache()(Drop)()
    x = torch.ones(64, 8)
    model.train()
    with pytest.warns(CacheWarning, match="training mode"):
        trained = model(x)
    assert not torch.equal(trained, x)
    model.eval()
    assert_same(model(x), x)


def test_instances_with_different_init_args_never_share(cache_root: Path) -> None:
    class Scale(nn.Module):
        def __init__(self, factor: float) -> None:
            super().__init__()
            self.factor = factor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.factor

    decorated = torchcache(persistent=True)(Scale)
    two, three = decorated(2.0), decorated(3.0)
    assert two.cache_instance.module_hash != three.cache_instance.module_hash
    x = torch.randn(5, 3)
    assert_same(two(x), x * 2.0)
    two.cache_instance.flush()
    assert_same(three(x), x * 3.0)
    assert three.cache_instance.stats().hits == 0
    assert_same(decorated(2.0)(x), x * 2.0)
    assert_same(decorated(3.0)(x), x * 3.0)


def test_instances_with_equal_init_args_and_weights_share_disk_entries(cache_root: Path) -> None:
    first, plain = pair(persistent=True)
    x = torch.randn(6, 4)
    first(x)
    first.cache_instance.flush()
    second = cached(Counting, persistent=True)()
    assert second.cache_instance.module_hash == first.cache_instance.module_hash
    assert_same(second(x), plain(x))
    assert second.seen == []


def test_weights_loaded_before_the_first_forward_change_the_key(cache_root: Path) -> None:
    decorated = cached(Counting, persistent=True)
    original = decorated()
    x = torch.randn(5, 4)
    original(x)
    original.cache_instance.flush()

    other = Counting(seed=7)
    reloaded = decorated()
    assert reloaded.cache_instance.module_hash == original.cache_instance.module_hash
    reloaded.load_state_dict(other.state_dict())
    assert reloaded.cache_instance.module_hash != original.cache_instance.module_hash
    assert_same(reloaded(x), other(x))
    assert reloaded.seen == [5]
    assert_same(reloaded(x), other(x))

    # and in memory only
    mem = cached(Counting)()
    mem.load_state_dict(other.state_dict())
    assert_same(mem(x), other(x))


def test_weights_loaded_after_the_first_forward_are_not_answered_from_the_old_key(cache_root: Path) -> None:
    model = cached(Counting, persistent=True)()
    other = Counting(seed=7)
    x = torch.randn(6, 4)
    assert_same(model(x), Counting()(x))
    old_key, old_dir = model.cache_instance.module_hash, model.cache_instance.cache_dir
    model.load_state_dict(other.state_dict())
    assert_same(model(x), other(x))
    assert model.seen == [6, 6]
    assert model.cache_instance.module_hash != old_key
    assert model.cache_instance.cache_dir != old_dir
    assert model.cache_instance.stats().memory.entries == 6
    assert_same(model(x), other(x))
    assert model.seen == [6, 6]


def test_loading_weights_into_a_parent_module_rekeys_the_cached_child() -> None:
    child = cached(Counting)()
    parent = torch.nn.Sequential(child)
    x = torch.randn(3, 4)
    parent(x)
    parent.load_state_dict(torch.nn.Sequential(Counting(seed=3)).state_dict())
    assert_same(parent(x), Counting(seed=3)(x))
    assert child.seen == [3, 3]


def test_dtype_conversion_rekeys_and_a_device_move_keeps_the_entries() -> None:
    model = cached(Counting)()
    x = torch.randn(4, 4)
    model(x)
    key = model.cache_instance.module_hash
    model.to("cpu")
    model(x)
    assert model.seen == [4]
    assert model.cache_instance.module_hash == key
    model.double()
    out = model(x.double())
    assert out.dtype == torch.float64
    assert_same(out, Counting().double()(x.double()))
    assert model.seen == [4, 4]
    assert model.cache_instance.module_hash != key


def test_persistent_module_hash_overrides_the_key_with_a_warning(cache_root: Path) -> None:
    with torchcache_log() as records:
        model = cached(Counting, persistent=True, persistent_module_hash="my-encoder.v1")()
    warnings_logged = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings_logged) == 1
    assert "my-encoder.v1" in warnings_logged[0].getMessage()
    cache = model.cache_instance
    assert cache.module_hash == "my-encoder.v1"
    assert cache.cache_dir == cache_root / "my-encoder.v1"
    x = torch.randn(3, 4)
    model(x)
    cache.flush()
    assert len(entry_files(cache_root / "my-encoder.v1")) == 3
    assert [p.name for p in cache_root.iterdir()] == ["my-encoder.v1"]


def test_persistent_module_hash_keeps_apart_what_other_storing_options_store(cache_root: Path) -> None:
    x = torch.randn(3, 4)
    half = cached(Counting, persistent=True, persistent_module_hash="enc", cache_dtype=torch.float16)()
    half(x)
    half.cache_instance.flush()
    full = cached(Counting, persistent=True, persistent_module_hash="enc", max_memory_cache_size=0)()
    assert_same(full(x), Counting()(x))  # not the float16 rows of the same name
    assert full.cache_instance.module_hash == "enc" and half.cache_instance.module_hash.startswith("enc-")
    assert sorted(p.name for p in cache_root.iterdir()) == sorted(["enc", half.cache_instance.module_hash])


# -- cache_dtype, devices, returned tensors ------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True])
def test_cache_dtype_stores_low_precision_and_returns_the_module_dtype(persistent: bool, cache_root: Path) -> None:
    options: dict[str, Any] = {"cache_dtype": torch.float16}
    if persistent:
        options.update(persistent=True, max_memory_cache_size=0)
    model = cached(MultiOut, **options)()
    plain = MultiOut()
    x = torch.randn(6, 4) * 3
    model(x[:4])
    if persistent:
        model.cache_instance.flush()
    out = model(x)
    want = plain(x)
    hit = {
        "emb": want["emb"][:4].half().float(),
        "pair": (want["pair"][0][:4].half().double(), [want["pair"][1][0][:4], want["pair"][1][1][:4]]),
    }
    assert out["emb"].dtype == torch.float32
    assert out["pair"][0].dtype == torch.float64
    assert out["pair"][1][0].dtype == want["pair"][1][0].dtype
    assert_same(out["emb"][:4], hit["emb"])
    assert_same(out["pair"][0][:4], hit["pair"][0])
    assert_same(out["pair"][1][0][:4], hit["pair"][1][0])
    assert_same(out["pair"][1][1][:4], hit["pair"][1][1])
    assert not torch.equal(out["emb"][:4], want["emb"][:4])  # it really was rounded
    assert_same(out["emb"][4:], want["emb"][4:])  # the new items are computed at full precision
    full = model(x[:4])  # every item a hit
    assert_same(full, hit)
    if persistent:
        model.cache_instance.flush()
        frames = stored_entries(cache_root)
        assert len(frames) == 6
        for frame in frames.values():
            header, _ = decode_frame(frame)
            # stored as float16 ("f2"), given back as float32 ("f4")
            assert any(leaf[0] == "f2" and leaf[2:] == ["f4"] for leaf in header["l"])


def test_memory_cache_device_none_keeps_outputs_on_their_device() -> None:
    model, plain = pair(memory_cache_device=None)
    x = torch.randn(6, 4)
    model(x[:3])
    assert_same(model(x), plain(x))
    assert_same(model(x), plain(x))
    assert model.items == 6
    assert model.cache_instance.stats().memory.entries == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("memory_cache_device", ["cpu", None])
def test_hits_come_back_on_the_device_of_a_real_call(memory_cache_device: str | None) -> None:
    model = cached(MultiOut, memory_cache_device=memory_cache_device)().cuda()
    plain = MultiOut().cuda()
    x = torch.randn(6, 4, device="cuda")
    model(x[:3])
    assert_same(model(x), plain(x))
    assert_same(model(x), plain(x))
    assert model.items == 6


@pytest.mark.parametrize("persistent", [False, True])
def test_returned_tensors_are_new_and_independent(persistent: bool) -> None:
    options: dict[str, Any] = {"persistent": True, "max_memory_cache_size": 0} if persistent else {}
    model, plain = pair(MultiOut, **options)
    x = torch.randn(8, 4)
    want = plain(x)

    def spoil(out: dict[str, Any]) -> None:
        out["emb"].fill_(1e6)
        out["pair"][0].mul_(-3)
        out["pair"][1][0].add_(5)
        out["pair"][1][1].logical_not_()

    spoil(model(x[:4]))  # miss
    if persistent:
        model.cache_instance.flush()
    spoil(model(x[:4]))  # hit
    spoil(model(x))  # partial hit
    if persistent:
        model.cache_instance.flush()
    first = model(x)
    assert_same(first, want)
    spoil(first)
    assert_same(model(x), want)
    assert_same(model(x[:4]), plain(x[:4]))
    assert model.items == 8
    if persistent:
        fresh = cached(MultiOut, persistent=True)()
        assert_same(fresh(x), want)
        assert fresh.items == 0


def test_returned_tensors_do_not_alias_each_other() -> None:
    model, plain = pair()
    x = torch.randn(4, 4)
    model(x)
    a = model(x)
    b = model(x)
    a.zero_()
    assert_same(b, plain(x))


def test_torchcache_works_without_parentheses_on_classes_instances_methods_and_functions() -> None:
    @torchcache
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.randn(3, 4)
    assert_same(double(x), x * 2)
    assert_same(double(x), x * 2)
    assert double.cache_instance.stats().hits == 3  # type: ignore[attr-defined]

    Decorated = torchcache(type("CountingBare", (Counting,), {"__module__": Counting.__module__}))
    module = Decorated()
    module(x)
    module(x)
    assert module.seen == [
        3,
        2,
        1,
        1,
    ]  # every option at its default: the first call checks items 2 and 0, then 1, then 0

    instance = torchcache(Counting())
    instance(x)
    instance(x)
    assert instance.seen == [3, 2, 1, 1] and instance.cache_instance.stats().hits == 3

    owner = Counting()
    method = torchcache(owner.forward)
    method(x)
    method(x)
    assert owner.seen == [3, 2, 1, 1]


def test_an_output_of_zero_bytes_per_item_is_a_disk_hit(tmp_path: Path) -> None:
    @torchcache(persistent=True, persistent_cache_dir=tmp_path, max_memory_cache_size=0)
    def empty(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], 0)

    x = torch.arange(8.0).reshape(2, 4)
    empty(x)
    empty.cache_instance.flush()
    out = empty(x)  # read from disk: rows of no bytes, viewed as nothing
    disk = empty.cache_instance.stats().disk
    assert out.shape == (2, 0) and out.dtype == torch.float32 and disk is not None and disk.hits == 2


def test_decorating_a_class_of_an_installed_package_leaves_that_class_plain() -> None:
    cached_tanh = torchcache()(nn.Tanh)
    assert cached_tanh is not nn.Tanh and issubclass(cached_tanh, nn.Tanh)
    assert "cache_instance" not in vars(nn.Tanh())  # every other nn.Tanh (and subclass) is left alone
    model = cached_tanh()
    x = torch.randn(4, 3)
    assert torch.equal(model(x), torch.tanh(x)) and torch.equal(model(x), torch.tanh(x))
    assert model.cache_instance.stats().hits == 4
    nn.MultiheadAttention(4, 2)  # its NonDynamicallyQuantizableLinear, a trainable nn.Linear, is built as before


def test_a_trainable_class_of_an_installed_package_is_refused_with_the_way_to_wrap_an_instance() -> None:
    cached_linear = torchcache()(nn.Linear)
    with pytest.raises(
        ConfigError, match=r"installed package.*torchcache\(\)\(Linear\(\.\.\.\)\.requires_grad_\(False\)"
    ):
        cached_linear(3, 2)
    assert nn.Linear(3, 2).weight.requires_grad


_REGISTERED: list[str] = []


class _Scaling(nn.Module):
    """Each subclass names its scale in its class statement (class Tripled(_Scaling, k=3.0)), and is registered."""

    k = 1.0

    def __init_subclass__(cls, k: float = 1.0, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.k = k
        _REGISTERED.append(cls.__qualname__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class _Tripled(_Scaling, k=3.0):
    pass


def test_wrapping_an_instance_does_not_run_its_class_init_subclass_again() -> None:
    registered = list(_REGISTERED)
    model, x = torchcache()(_Tripled()), torch.randn(3, 2)
    assert type(model) is not _Tripled and "__init_subclass__" not in _Tripled.__dict__  # put back as it was
    assert type(model).k == 3.0 and torch.equal(model(x), x * 3)
    own = _Scaling.__dict__["__init_subclass__"]
    assert torch.equal(torchcache()(_Scaling())(x), x) and _Scaling.__dict__["__init_subclass__"] is own
    assert registered == _REGISTERED


def _try_release(lock: Any) -> bool:
    """Whether ``lock`` could be taken (and is given back at once)."""
    taken = bool(lock.acquire(blocking=False))
    if taken:
        lock.release()
    return taken


def test_the_cached_subclass_is_made_one_at_a_time() -> None:
    from torchcache.module import subclass

    held = []

    class Watching(type):
        def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> Any:
            free: list[bool] = []  # whether another thread could make one now (it would take the stand-in hook)
            other = threading.Thread(target=lambda: free.append(_try_release(subclass._making)))
            other.start()
            other.join()
            held.append(not free[0])
            return super().__new__(mcs, name, bases, namespace)

    class Watched(nn.Module, metaclass=Watching):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    torchcache()(Watched())
    assert held == [False, True]


def test_a_metaclass_that_wraps_a_module_while_the_cached_subclass_is_made_does_not_wait_for_itself() -> None:
    wrapped: list[nn.Module] = []

    class Wrapping(type):
        def __init__(cls, *args: Any) -> None:
            super().__init__(*args)
            if wrapped == []:  # the cached subclass of Outer: wrap another module now
                wrapped.append(torchcache()(nn.Identity()))

    class Outer(nn.Module, metaclass=Wrapping):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    wrapped.clear()
    x = torch.randn(3, 2)
    assert torch.equal(torchcache()(Outer())(x), x * 2) and torch.equal(wrapped[0](x), x)


def test_a_class_made_by_exec_without_a_module_name_is_decorated_in_place_as_the_users() -> None:
    namespace: dict[str, Any] = {}
    exec(
        "from torch import nn\nclass Doubling(nn.Module):\n    def forward(self, x):\n        return x * 2\n", namespace
    )
    made = namespace["Doubling"]
    assert made.__module__ == "builtins"  # what exec() gives a class without __name__ in its globals
    assert torchcache()(made) is made
    x = torch.randn(3, 2)
    assert torch.equal(made()(x), x * 2)
