# Ported from the tests/ of torchcache 0.6.0 (github.com/meakbiyik/torchcache, MIT licence).
"""The test suite of torchcache 0.6, run against the current torchcache.

Each test names the 0.6 test it comes from. Where 0.6 read its private internals (the
``cache`` dict, ``hash_tensor``, ``_load_from_file``, the ``is_*_cache_full`` flags),
the same behaviour is checked through the public API (``cache_instance.stats()``,
``cache_dir``, ``flush()``). Where torchcache changed on purpose (see "Migrating from
torchcache 0.6" in docs/usage.md), a comment names the difference.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.helpers import entry_files
from torchcache import ConfigError, set_logger_config, torchcache
from torchcache.stores.packed.format import HEADER
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES
from torchcache.tiers.memory import ENTRY_BYTES


# Test Module
class SimpleModule(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2


def _entry_files(directory: Path) -> list[Path]:
    """The entries stored under one module directory, one per item (see ``tests/helpers.entry_files``).

    0.6 wrote one ``<hash>.pt.br`` pickle per item directly in the module directory; the
    entries are now frames packed as records of one store (``index.lmdb`` and
    ``seg-*.tcs`` segment files, documented in docs/file-format.md) next to a
    ``torchcache.json``, so they are counted through the store's index.
    """
    return entry_files(directory)


#: What the packed store charges an entry's budget besides its frame: the record
#: header, the key (32 hex digits in 16 bytes) and the index's share.
_ENTRY_OVERHEAD = HEADER.size + 16 + INDEX_ENTRY_BYTES


@pytest.fixture
def default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The root used by ``persistent=True`` without ``persistent_cache_dir``.

    0.6 used a fresh temporary directory, deleted at exit; the default is now the user
    cache directory, kept across runs, or ``$TORCHCACHE_DIR``. Point it at ``tmp_path``.
    """
    root = tmp_path / "default-root"
    monkeypatch.setenv("TORCHCACHE_DIR", str(root))
    return root


# -- tests/test_torchcache.py of 0.6 -------------------------------------------------------


# Test basic functionality of the caching mechanism without persistent storage.
def test_basic_caching():
    """From 0.6 ``test_basic_caching``: in-memory caching, hits, larger batches.

    0.6 read ``cache_instance.cache`` (its private dict) and ``hash_tensor``; the memory
    entries and hits are read from ``cache_instance.stats()`` instead.
    """

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)

    # Assert that the cache is empty
    assert model.cache_instance.stats().memory.entries == 0

    # First pass, caching should occur
    output = model(input_tensor)
    assert torch.equal(output, input_tensor * 2)

    # Assert that the cache is not empty
    assert model.cache_instance.stats().memory.entries == input_tensor.shape[0]

    # Check that each item of the input tensor is in the cache (0.6: each row's hash
    # was a key of the dict): every row alone is a hit.
    for row in input_tensor:
        hits = model.cache_instance.stats().hits
        assert torch.equal(model(row.unsqueeze(0)), row.unsqueeze(0) * 2)
        assert model.cache_instance.stats().hits == hits + 1

    # Second pass, should retrieve from cache but result should be the same
    output_cached = model(input_tensor)
    assert torch.equal(output, output_cached)

    # Third time is the charm, but let's use a bigger batch size
    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.float32)
    output_cached = model(input_tensor)
    assert torch.equal(output, output_cached[:2])

    # 0.6 raised ValueError for zstd_compression without persistence. The zstd options
    # are now accepted and ignored with a FutureWarning (documented).
    with pytest.warns(FutureWarning, match="zstd_compression"):

        @torchcache(persistent=False, zstd_compression=True)
        class CachedModule(SimpleModule):
            pass

        CachedModule()


# Test caching mechanism with persistent storage.
def test_persistent_caching(tmp_path):
    """From 0.6 ``test_persistent_caching``: entries go to disk and a new class reads them.

    Disk writes are now in the background, so ``flush()`` comes before counting entries,
    and the entries are frames packed into one store, not files (documented). 0.6 patched
    ``_load_from_file`` to see that the disk was read; ``stats().disk.hits`` says so.
    """

    @torchcache(persistent=True, persistent_cache_dir=tmp_path)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)

    # First pass, caching should occur and save to file
    output = model(input_tensor)
    assert torch.equal(output, input_tensor * 2)

    # Check if cache entries were created
    model.cache_instance.flush()
    assert len(_entry_files(tmp_path / model.cache_instance.module_hash)) == 2

    # Second pass, should retrieve from cache from memory
    output_cached = model(input_tensor)
    assert torch.equal(output, output_cached)

    # Now create a new instance of the model and check if the cache is loaded from disk
    # We re-define the class to flush the cache
    @torchcache(persistent=True, persistent_cache_dir=tmp_path)
    class CachedModule(SimpleModule):
        pass

    model2 = CachedModule()
    output_cached = model2(input_tensor)
    assert torch.equal(output, output_cached)
    assert model2.cache_instance.stats().disk.hits == input_tensor.shape[0]


# Test temporary cachedir
def test_persistent_caching_temporary_cachedir(default_root):
    """From 0.6 ``test_persistent_caching_temporary_cachedir``: ``persistent=True`` without a directory.

    0.6 used a temporary directory deleted at exit; the default root is now the user
    cache directory or ``$TORCHCACHE_DIR`` (documented), set to a temporary path here.
    """

    @torchcache(persistent=True)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    temporary_path = model.cache_instance.cache_dir
    assert temporary_path.parent == default_root

    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)

    # First pass, caching should occur and save to file
    output = model(input_tensor)
    assert torch.equal(output, input_tensor * 2)

    # Check if cache entries were created
    model.cache_instance.flush()
    assert len(_entry_files(temporary_path)) == 2

    # Second pass, should retrieve from cache but result should be the same
    output_cached = model(input_tensor)
    assert torch.equal(output, output_cached)


# Test hashing functionality.
def test_hashing():
    """From 0.6 ``test_hashing``: one hash per batch item.

    0.6 built its private ``_TorchCache`` and called ``hash_tensor``, checking that a
    batch of two rows gives two hashes. The public counterpart: a batch of two distinct
    rows makes two entries.
    """

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)
    model(input_tensor)

    assert model.cache_instance.stats().memory.entries == input_tensor.shape[0]


def test_compression(tmp_path):
    """From 0.6 ``test_compression``: the persistent round trip with ``zstd_compression=True``.

    ``zstd_compression`` is accepted and ignored with a FutureWarning (entries are
    brotli frames; documented). The rest is adapted as in ``test_persistent_caching``.
    """
    with pytest.warns(FutureWarning, match="zstd_compression"):

        @torchcache(persistent=True, persistent_cache_dir=tmp_path, zstd_compression=True)
        class CachedModule(SimpleModule):
            pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)

    # First pass, caching should occur and save to file
    output = model(input_tensor)
    assert torch.equal(output, input_tensor * 2)

    # Check if cache entries were created
    model.cache_instance.flush()
    assert len(_entry_files(tmp_path / model.cache_instance.module_hash)) == 2

    # Second pass, should retrieve from cache from memory
    output_cached = model(input_tensor)
    assert torch.equal(output, output_cached)

    # Now create a new instance of the model and check if the cache is loaded from disk
    # We re-define the class to flush the cache in memory
    with pytest.warns(FutureWarning, match="zstd_compression"):

        @torchcache(persistent=True, persistent_cache_dir=tmp_path, zstd_compression=True)
        class CachedModule(SimpleModule):
            pass

    model2 = CachedModule()
    output_cached = model2(input_tensor)
    assert torch.equal(output, output_cached)
    assert model2.cache_instance.stats().disk.hits == input_tensor.shape[0]


# Test cache size limits
def test_cache_size(tmp_path):
    """From 0.6 ``test_cache_size``: the memory and disk budgets.

    0.6 read its ``is_memory_cache_full`` / ``is_persistent_cache_full`` flags and
    stopped storing once a tier was full. Tiers now evict (MRU) and keep storing
    (documented), and there are no such flags: the budgets are checked through
    ``stats()``. 0.6 entries were ``torch.save`` pickles of about 1100 bytes, so its
    2400-byte disk budget held two; an entry now costs its frame (about ten times
    smaller, documented format) plus the packed store's share (:data:`_ENTRY_OVERHEAD`),
    so a second cache with a budget of two and a half entries checks that the disk tier
    stops at its budget and still keeps what fits (the store evicts whole segments, so
    it may keep fewer than two).
    """

    # Overhead of saving a tensor in disk is around 1100 bytes
    @torchcache(
        persistent=True,
        persistent_cache_dir=tmp_path,
        max_persistent_cache_size=2400,
        max_memory_cache_size=20 + ENTRY_BYTES,  # 0.6: 20; the index of an entry counts now
    )
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor1 = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)
    input_tensor2 = torch.tensor([[7, 8, 9], [10, 11, 12]], dtype=torch.float32)

    # First pass, caching should occur and save to file
    output = model(input_tensor1)
    assert torch.equal(output, input_tensor1 * 2)

    # Check if cache entries were created
    model.cache_instance.flush()
    assert len(_entry_files(tmp_path / model.cache_instance.module_hash)) == 2

    # Check that the persistent budget is not reached, but the memory one is: one item
    # (12 bytes and its index) fits, two do not.
    stats = model.cache_instance.stats()
    assert stats.disk.entries == 2
    assert stats.disk.bytes <= 2400
    assert stats.memory.entries == 1
    assert stats.memory.bytes <= 20 + ENTRY_BYTES

    # Now pass a tensor that is bigger than the cache size
    output = model(input_tensor2)
    assert torch.equal(output, input_tensor2 * 2)
    model.cache_instance.flush()
    stats = model.cache_instance.stats()
    assert stats.disk.bytes <= 2400
    assert stats.memory.entries <= 1
    assert stats.memory.bytes <= 20 + ENTRY_BYTES
    assert torch.equal(model(torch.cat([input_tensor1, input_tensor2])), torch.cat([input_tensor1, input_tensor2]) * 2)

    # A disk budget of two and a half entries: at most two entries are kept.
    entry_bytes = stats.disk.bytes // stats.disk.entries + _ENTRY_OVERHEAD
    budget = entry_bytes * 5 // 2

    @torchcache(persistent=True, persistent_cache_dir=tmp_path / "small", max_persistent_cache_size=budget)
    class SmallDiskModule(SimpleModule):
        pass

    small = SmallDiskModule()
    assert torch.equal(small(input_tensor1), input_tensor1 * 2)
    assert torch.equal(small(input_tensor2), input_tensor2 * 2)
    small.cache_instance.flush()
    stats = small.cache_instance.stats()
    assert stats.disk.bytes + stats.disk.entries * _ENTRY_OVERHEAD <= budget
    assert 0 < stats.disk.entries <= 2
    assert len(_entry_files(small.cache_instance.cache_dir)) == stats.disk.entries


# Test for mixed cache hits
def test_mixed_cache_hits():
    """From 0.6 ``test_mixed_cache_hits``: a batch with cached and new items. Ported as it was."""

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor1 = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)
    input_tensor2 = torch.tensor([[7, 8, 9], [10, 11, 12]], dtype=torch.float32)

    # First pass for caching
    model(input_tensor1)
    # Second pass where one tensor is cached and the other isn't
    combined_output = model(torch.cat([input_tensor1, input_tensor2], dim=0))

    assert torch.equal(combined_output[:2], input_tensor1 * 2)
    assert torch.equal(combined_output[2:], input_tensor2 * 2)


# Test monkey patching
def test_monkey_patching():
    """From 0.6 ``test_monkey_patching``: the second call goes through the patched forward. Ported as it was."""

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3]], dtype=torch.float32)

    # First pass for caching
    model(input_tensor)
    # Monkey-patching should be applied here
    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)


def test_multiple_inputs():
    """From 0.6 ``test_multiple_inputs``: a forward with two tensor arguments. Ported as it was."""

    class DoubleInputModule(nn.Module):
        def forward(self, x, y):
            return x * 2 + y * 3

    @torchcache(persistent=False)
    class CachedModule(DoubleInputModule):
        pass

    model = CachedModule()
    input_tensor1 = torch.tensor([[1, 2, 3]], dtype=torch.float32)
    input_tensor2 = torch.tensor([[4, 5, 6]], dtype=torch.float32)

    output = model(input_tensor1, input_tensor2)

    assert torch.equal(output, input_tensor1 * 2 + input_tensor2 * 3)

    # Second pass, should retrieve from cache but result should be the same
    output = model(input_tensor1, input_tensor2)

    assert torch.equal(output, input_tensor1 * 2 + input_tensor2 * 3)


# Test different tensor shapes
def test_different_shapes():
    """From 0.6 ``test_different_shapes``: a 4-d input. Ported as it was."""

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.randn((5, 5, 5, 5))

    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)


# Test overriding torchcache arguments with module attributes that starts with "torchcache_"
def test_override_torchcache_args(default_root):
    """From 0.6 ``test_override_torchcache_args``: ``self.torchcache_persistent = True`` wins.

    0.6 read ``cache_instance.persistent``, an attribute of its private cache class;
    the public signs of persistence are ``cache_dir`` and ``stats().disk`` (both
    ``None`` without it). The default root is redirected as in
    ``test_persistent_caching_temporary_cachedir``.
    """

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        def __init__(self):
            super().__init__()
            self.torchcache_persistent = True

    model = CachedModule()
    input_tensor = torch.randn((5, 5, 5, 5))

    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)
    assert model.cache_instance.cache_dir is not None
    assert model.cache_instance.stats().disk is not None


# Test training with forward and backward to ensure that
# there are no missing detach calls.
def test_training():
    """From 0.6 ``test_training``: a cached module inside a trained one. Ported as it was."""

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.randn(5, 5)

        def forward(self, x):
            return x @ self.weight

    class TrainedModule(SimpleModule):
        def __init__(self):
            super().__init__()
            self.cached_module = CachedModule()
            self.weight = nn.Parameter(torch.randn(5, 5))

        def forward(self, x):
            return self.cached_module(x) @ self.weight

    model = TrainedModule()
    input_tensor = torch.randn((1, 5))

    output = model(input_tensor)
    loss = output.sum()
    loss.backward()

    assert torch.equal(output, input_tensor @ model.cached_module.weight @ model.weight)
    assert model.weight.grad is not None

    # run again to ensure that the graph is sane
    input_tensor = torch.randn((1, 5))
    output = model(input_tensor)
    loss = output.sum()
    loss.backward()


# Ensure that wrapping fails if there is a parameter that requires grad
def test_fails_with_parameter():
    """From 0.6 ``test_fails_with_parameter``: a trainable parameter is refused at construction.

    0.6 raised AssertionError (an ``assert``); it is now ConfigError, a ValueError
    (documented).
    """

    @torchcache(persistent=False)
    class CachedModule(SimpleModule):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 5))

        def forward(self, x):
            return x @ self.weight

    with pytest.raises(ConfigError):
        CachedModule()


# Check using different dtype for caching
def test_different_dtype(default_root):
    """From 0.6 ``test_different_dtype``: ``cache_dtype=torch.half``, hits come back as float32.

    Ported as it was; the default root is redirected as in
    ``test_persistent_caching_temporary_cachedir``.
    """

    @torchcache(persistent=True, cache_dtype=torch.half)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3]], dtype=torch.float32)

    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)

    # Second pass, should retrieve from cache but result should be the same
    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)


def test_persistent_module_hash(tmp_path):
    """From 0.6 ``test_persistent_module_hash``: two classes sharing ``persistent_module_hash``.

    Ported as it was. The 0.6 test calls the first model again where its comment speaks
    of the second; the second model is also called here, after ``flush()`` (background
    writes, documented), and reads the first one's entry.
    """

    @torchcache(persistent=True, persistent_module_hash="test", persistent_cache_dir=tmp_path)
    class CachedModule(SimpleModule):
        pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3]], dtype=torch.float32)

    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)

    # Create another Module with the same persistent_module_hash but different forward pass
    @torchcache(persistent=True, persistent_module_hash="test", persistent_cache_dir=tmp_path)
    class CachedModule2(SimpleModule):
        def forward(self, x):
            return x * 3

    model2 = CachedModule2()

    # Second pass, should retrieve from cache but result should be the same
    # as the first module since the persistent_module_hash is the same
    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)

    model.cache_instance.flush()
    assert model2.cache_instance.module_hash == "test"
    assert torch.equal(model2(input_tensor), input_tensor * 2)


def test_mmap_on_load(tmp_path):
    """From 0.6 ``test_mmap_on_load``: ``use_mmap_on_load=True`` still caches.

    ``use_mmap_on_load`` is accepted and ignored with a FutureWarning (documented).
    """
    with pytest.warns(FutureWarning, match="use_mmap_on_load"):

        @torchcache(
            persistent=True,
            persistent_cache_dir=tmp_path,
            use_mmap_on_load=True,
        )
        class CachedModule(SimpleModule):
            pass

    model = CachedModule()
    input_tensor = torch.tensor([[1, 2, 3]], dtype=torch.float32)

    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)

    # Second pass, should retrieve from cache but result should be the same
    output = model(input_tensor)

    assert torch.equal(output, input_tensor * 2)


# Ensure that if one creates two instances of a module and
# only desires caching for one, they can disable caching via
# magic attribute torchcache_enabled
def test_duplicate_modules():
    """From 0.6 ``test_duplicate_modules``: ``self.torchcache_enabled = False`` on one instance.

    0.6 read ``cache_instance.cache`` (its private dict); ``stats().memory`` is read
    instead. The check that the disabled instance has no ``cache_instance`` is kept.
    """

    @torchcache(persistent=False)
    class MyModule(SimpleModule):
        def __init__(self, cache=True):
            super().__init__()
            self.torchcache_enabled = cache

    cached_module = MyModule()
    noncached_module = MyModule(cache=False)

    input_tensor = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)
    # Assert that the cache is empty
    assert cached_module.cache_instance.stats().memory.entries == 0
    # First pass, caching should occur
    output = cached_module(input_tensor)
    assert torch.equal(output, input_tensor * 2)
    # Assert that the cache is not empty
    assert cached_module.cache_instance.stats().memory.entries == input_tensor.shape[0]

    # Assert that the other module has no cache
    # Documented difference: a disabled instance has cache_instance = None (0.6 set no attribute).
    assert noncached_module.cache_instance is None


# Test pure function decorator basic behavior
def test_pure_function_basic():
    """From 0.6 ``test_pure_function_basic``: a decorated function runs once per input. Ported as it was."""
    calls = []

    @torchcache(check_items=False, persistent=False)
    def mul_fn(x):
        calls.append(x.clone())
        return x * 3

    input_tensor = torch.tensor([[1], [2]], dtype=torch.float32)
    out1 = mul_fn(input_tensor)
    assert torch.equal(out1, input_tensor * 3)
    # second call same input, should not re-execute function
    out2 = mul_fn(input_tensor)
    assert torch.equal(out2, input_tensor * 3)
    assert len(calls) == 1


# Test pure function with persistence and disk files
def test_pure_function_persistent(tmp_path):
    """From 0.6 ``test_pure_function_persistent``: a persistent function stores one entry per item.

    0.6 dug its private wrapper module out of ``add_fn.__closure__``; the function's
    ``cache_instance`` (public in 0.6 too) gives ``cache_dir``. Entries are counted after
    ``flush()`` as in ``test_persistent_caching``.
    """

    @torchcache(persistent=True, persistent_cache_dir=tmp_path)
    def add_fn(x):
        return x + 5

    input_tensor = torch.tensor([[3], [4]], dtype=torch.float32)
    out = add_fn(input_tensor)
    assert torch.equal(out, input_tensor + 5)

    cache_dir = add_fn.cache_instance.cache_dir
    add_fn.cache_instance.flush()
    assert cache_dir.exists()
    # should have one entry per batch element
    assert len(_entry_files(cache_dir)) == input_tensor.shape[0]

    # second call should use cache
    out2 = add_fn(input_tensor)
    assert torch.equal(out2, out)


def test_non_tensor_args_kwargs_affect_cache():
    """From 0.6 ``test_non_tensor_args_kwargs_affect_cache``: non-tensor arguments are keyed.

    0.6 read ``len(cache_instance.cache)``; ``stats().memory.entries`` is read instead.
    """

    @torchcache(persistent=False)
    class CachedScaleModule(SimpleModule):
        def forward(self, x, scale):
            return x * scale

    model = CachedScaleModule()
    input_tensor = torch.tensor([[1, 2], [3, 4]], dtype=torch.float32)

    def entries():
        return model.cache_instance.stats().memory.entries

    # initial cache empty
    assert entries() == 0

    # call with positional non-tensor arg
    out1 = model(input_tensor, 2)
    assert torch.equal(out1, input_tensor * 2)
    assert entries() == input_tensor.shape[0]

    # call with different pos arg, should add new entries
    out2 = model(input_tensor, 3)
    assert torch.equal(out2, input_tensor * 3)
    assert entries() == 2 * input_tensor.shape[0]

    # repeat first call, cache size should not change
    out3 = model(input_tensor, 2)
    assert torch.equal(out3, input_tensor * 2)
    assert entries() == 2 * input_tensor.shape[0]

    # call with kwarg instead of positional
    out4 = model(input_tensor, scale=3)
    assert torch.equal(out4, input_tensor * 3)
    assert entries() == 2 * input_tensor.shape[0]


def test_pure_function_kwargs_affect_cache():
    """From 0.6 ``test_pure_function_kwargs_affect_cache``: a function's non-tensor argument is keyed.

    Ported as it was; the 0.6 test stops without checking the second call, which is
    checked here.
    """
    calls = []

    @torchcache(check_items=False, persistent=False)
    def add_fn(x, offset):
        calls.append(offset)
        return x + offset

    input_tensor = torch.tensor([[1], [2]], dtype=torch.float32)

    # first call with offset=5
    out1 = add_fn(input_tensor, 5)
    assert torch.equal(out1, input_tensor + 5)

    # call with different offset, should compute and cache new values
    out2 = add_fn(input_tensor, 6)
    assert torch.equal(out2, input_tensor + 6)
    assert calls == [5, 6]


def test_ensure_unique_function_cache(tmp_path):
    """From 0.6 ``test_ensure_unique_function_cache``: two functions never share entries.

    Entries are counted after ``flush()`` as in ``test_persistent_caching``.
    """

    @torchcache(persistent=True, persistent_cache_dir=tmp_path)
    def add_fn(x):
        return x + 1

    @torchcache(persistent=True, persistent_cache_dir=tmp_path)
    def add_fn2(x):
        return x + 2

    input_tensor = torch.tensor([[1], [2]], dtype=torch.float32)
    out1 = add_fn(input_tensor)
    assert torch.equal(out1, input_tensor + 1)
    # second call same input, should not re-execute function
    out2 = add_fn(input_tensor)
    assert torch.equal(out2, input_tensor + 1)
    add_fn.cache_instance.flush()
    assert len(_entry_files(tmp_path / add_fn.cache_instance.module_hash)) == 2

    # check that the two functions have different module hashes
    assert add_fn.cache_instance.module_hash != add_fn2.cache_instance.module_hash

    # check that the second function does not use the first function's cache
    out3 = add_fn2(input_tensor)
    assert torch.equal(out3, input_tensor + 2)
    add_fn2.cache_instance.flush()
    assert len(_entry_files(tmp_path / add_fn2.cache_instance.module_hash)) == 2


def test_fail_on_bad_parameters():
    """From 0.6 ``test_fail_on_bad_parameters``: accepted and refused calls, and a non-module class.

    The exception types of 0.6 are kept (KeyingError is a ValueError); its messages
    are not, so they are not matched. Two calls that 0.6 refused are now accepted
    (documented under "Inputs and outputs" in docs/usage.md): a 1-d tensor is a batch
    of scalars (a 0-d tensor is refused instead), and lists of plain values are keyed
    (an object without a state that can be encoded exactly, such as a lock, is refused instead).
    """

    @torchcache()
    class CachedModule(SimpleModule):
        def forward(self, *args, **kwargs):
            return torch.tensor([0])

    module = CachedModule()

    module(torch.tensor([[1, 2, 3]]), "hello", 1, 1.0, boolean_argument=True)

    # quickly test keyword args
    module(hi=torch.tensor([[1, 2, 3]]))

    # 0.6: module(torch.tensor([1, 2, 3])) -> "All inputs must have at least 2 dimensions"
    with pytest.raises(ValueError):
        module(torch.tensor(1))

    with pytest.raises(ValueError):  # 0.6: "No tensor inputs found"
        module([1, 2, 3])

    # 0.6: module(torch.tensor([[1, 2, 3]]), [1, 2, 3]) -> "All non-Tensor extra args to the call"
    assert torch.equal(module(torch.tensor([[1, 2, 3]]), [1, 2, 3]), torch.tensor([0]))
    with pytest.raises(ValueError):
        module(torch.tensor([[1, 2, 3]]), threading.Lock())

    with pytest.raises(ValueError):  # 0.6: "All inputs must have the same batch dimension"
        module(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[7, 8, 9]]))

    with pytest.raises(TypeError):  # 0.6: "torchcache can only decorate nn.Module subclasses"

        @torchcache()
        class NonModuleClass:
            def forward(self, x):
                return x * 2


# 0.6's autouse ``cleanup`` fixture removed ``*.pt.br`` files from the working directory
# after each test. It is left out: torchcache writes no such files, and writes nothing
# in the working directory (every test above names its cache root).


# -- tests/test_logging.py of 0.6 ----------------------------------------------------------


def test_set_logger_config(tmp_path, monkeypatch, torchcache_logger):
    """From 0.6 ``test_logging.py::test_set_logger_config``: defaults, the variables, an invalid level.

    Documented differences: ``set_logger_config`` is imported from ``torchcache`` (the
    ``torchcache.logging`` module is gone) and configures only the ``torchcache``
    logger, never the root logger; it writes to stderr, not stdout; its default format
    is ``%(asctime)s %(levelname)s %(name)s: %(message)s``; an invalid level gives a
    RuntimeWarning (0.6 logged a warning) and uses WARNING. The log file is put in
    ``tmp_path`` rather than the working directory.
    """
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level

    log = torchcache_logger
    set_logger_config()
    assert log.level == logging.WARN
    assert len(log.handlers) == 1
    assert isinstance(log.handlers[0], logging.StreamHandler)
    assert log.handlers[0].stream == sys.stderr
    assert log.handlers[0].formatter._fmt == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    assert log.handlers[0].formatter.datefmt == "%Y-%m-%d %H:%M:%S"
    # Also test various environment variable configurations
    monkeypatch.setenv("TORCHCACHE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("TORCHCACHE_LOG_FMT", "%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    monkeypatch.setenv("TORCHCACHE_LOG_DATEFMT", "%Y-%m-%d %H:%M:%S")
    monkeypatch.setenv("TORCHCACHE_LOG_FILE", str(tmp_path / "test.log"))
    set_logger_config()
    assert log.level == logging.DEBUG
    assert len(log.handlers) == 2
    assert isinstance(log.handlers[0], logging.StreamHandler)
    assert log.handlers[0].stream == sys.stderr
    assert log.handlers[0].formatter._fmt == "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
    assert log.handlers[0].formatter.datefmt == "%Y-%m-%d %H:%M:%S"
    assert isinstance(log.handlers[1], logging.FileHandler)
    assert log.handlers[1].formatter._fmt == "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
    assert log.handlers[1].formatter.datefmt == "%Y-%m-%d %H:%M:%S"
    assert log.handlers[1].baseFilename.endswith("test.log")
    # Test invalid log level
    monkeypatch.setenv("TORCHCACHE_LOG_LEVEL", "INVALID")
    with pytest.warns(RuntimeWarning, match="TORCHCACHE_LOG_LEVEL='INVALID'"):
        set_logger_config()
    assert log.level == logging.WARN

    assert root.handlers == root_handlers
    assert root.level == root_level


def test_0_6_flags_and_sizes_given_as_ints_or_numpy_numbers_are_taken():
    import numpy as np

    model = torchcache(persistent=0, enabled=1, max_memory_cache_size=np.int64(1_000_000))(
        nn.Linear(2, 2).requires_grad_(False)
    )
    x = torch.randn(3, 2)
    assert torch.equal(model(x), model(x)) and model.cache_instance.stats().hits == 3
    with pytest.raises(ConfigError, match="persistent must be True or False"):
        torchcache(persistent=2)


def test_a_class_decorated_again_with_other_settings_is_refused(tmp_path):
    class Base(nn.Module):
        def forward(self, x):
            return x * 2

    first = torchcache(persistent=True, persistent_cache_dir=tmp_path / "one")(Base)
    assert torchcache(persistent=True, persistent_cache_dir=tmp_path / "one")(Base) is first
    with pytest.raises(ConfigError, match="already decorated"):
        torchcache(persistent=True, persistent_cache_dir=tmp_path / "two")(Base)

    class Other(Base):
        pass

    second = torchcache(persistent=True, persistent_cache_dir=tmp_path / "two")(Other)
    assert second().cache_instance.settings.persistent_cache_dir == tmp_path / "two"
    assert first().cache_instance.settings.persistent_cache_dir == tmp_path / "one"


def test_an_option_of_0_6_set_to_false_is_still_said_to_be_ignored() -> None:
    with pytest.warns(FutureWarning, match=r"zstd_compression, use_mmap_on_load are accepted .* and ignored"):
        torchcache(zstd_compression=False, use_mmap_on_load=False)
