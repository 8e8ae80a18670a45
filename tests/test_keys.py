"""Item keys, canonical value encoding, and module and function fingerprints."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import math
import struct
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache import keys as keys_module
from torchcache import torchcache
from torchcache.errors import KeyingError
from torchcache.keys import Context, encode_value, hash_items
from torchcache.module.fingerprint import describe_init, fingerprint_function, fingerprint_module

CTX = Context("test-module").digest()
SETTINGS: dict[str, object] = {"cache_dtype": None, "subsample_count": 10000}

# -- encode_value -------------------------------------------------------------------------


def test_scalars_of_different_types_encode_differently() -> None:
    values: list[object] = [True, 1, 1.0, "1", None, False, 0, 0.0, "0", "", "None", "True"]
    encoded = [encode_value(v) for v in values]
    assert len(set(encoded)) == len(values)


def test_encoding_is_deterministic_and_equal_for_equal_values() -> None:
    value = {"a": (1, 2.5, [None, "x"]), "b": {"c": torch.float16, "d": torch.device("cpu")}}
    assert encode_value(value) == encode_value(copy.deepcopy(value))


def test_containers_are_distinguished_by_kind_and_nesting() -> None:
    values: list[object] = [
        (1, 2),
        [1, 2],
        ((1, 2),),
        [[1, 2]],
        (1, (2,)),
        ((1,), 2),
        ("ab",),
        ("a", "b"),
        {"a": 1},
        {"a": (1,)},
        {1: "a"},
        {"1": "a"},
        (),
        [],
        {},
    ]
    encoded = [encode_value(v) for v in values]
    assert len(set(encoded)) == len(values)


def test_dict_order_is_part_of_the_key() -> None:
    # A function may iterate a dict: two orders can give two outputs, so they are two keys.
    forward = {"a": 1, "b": [2, 3], "c": {"x": None, "y": 1.5}}
    backward = {"c": {"y": 1.5, "x": None}, "b": [2, 3], "a": 1}
    assert list(forward) != list(backward)
    assert encode_value(forward) != encode_value(backward)
    assert encode_value(forward) == encode_value(dict(forward))
    assert encode_value(forward) != encode_value({**forward, "a": 2})


def test_float_encoding_is_exact() -> None:
    assert encode_value(0.1 + 0.2) != encode_value(0.3)
    assert encode_value(0.0) != encode_value(-0.0)
    assert encode_value(1.0) != encode_value(math.nextafter(1.0, 2.0))
    quiet, payload = (
        struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000))[0],
        struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0],
    )
    assert math.isnan(quiet) and math.isnan(payload)
    assert encode_value(quiet) != encode_value(payload)


def test_torch_dtypes_and_devices_are_encoded() -> None:
    values: list[object] = [torch.float16, torch.bfloat16, torch.device("cpu"), "torch.float16", "cpu"]
    assert len({encode_value(v) for v in values}) == len(values)


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (threading.Lock(), "alpha"),
        ([1, threading.Lock()], "alpha[1]"),
        ({"k": (0, {"deep": threading.Lock()})}, "alpha['k'][1]['deep']"),
        ((torch.zeros(2),), "alpha[0]"),
        (_Opaque, None),
    ],
)
def test_unsupported_values_raise_keying_error_naming_the_argument(value: object, path: str | None) -> None:
    if path is None:  # a class is keyed by its name and source
        assert encode_value(value, "alpha") == encode_value(value, "alpha")
        return
    with pytest.raises(KeyingError) as info:
        encode_value(value, "alpha")
    assert isinstance(info.value, TypeError)
    assert path in str(info.value)


def _scalars(keys: bool = False) -> st.SearchStrategy[Any]:
    floats = st.floats(allow_nan=not keys)
    return st.one_of(st.none(), st.booleans(), st.integers(), floats, st.text(max_size=5))


def _values() -> st.SearchStrategy[Any]:
    return st.recursive(
        _scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(_scalars(keys=True), inner, max_size=3),
        ),
        max_leaves=8,
    )


def _strict(value: Any) -> Any:
    """A hashable form that is equal exactly when two values should share a key."""
    if value is None or isinstance(value, (bool, str)):
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_strict(v) for v in value))
    assert isinstance(value, dict)
    return ("dict", tuple((_strict(k), _strict(v)) for k, v in value.items()))


@settings(max_examples=100, deadline=None)
@given(_values(), _values())
def test_encoding_is_equal_exactly_for_strictly_equal_values(a: Any, b: Any) -> None:
    assert encode_value(a) == encode_value(copy.deepcopy(a))
    assert (encode_value(a) == encode_value(b)) == (_strict(a) == _strict(b))


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def _long_list_encoding(items: list[Any]) -> bytes:
    """The documented encoding of a long list: its length and the xxh3_128 of its chunks of 4,096 items.

    A chunk of ints alone is their 8-byte integers, or beyond 64 bits their decimals, space-separated;
    any other chunk here is its items' encodings.
    """
    h = xxhash.xxh3_128()
    for start in range(0, len(items), 4096):
        chunk = items[start : start + 4096]
        if {type(v) for v in chunk} == {int}:
            if all(-(2**63) <= v < 2**63 for v in chunk):
                h.update(_field(b"4", struct.pack(f"<{len(chunk)}q", *chunk)))
            else:
                h.update(_field(b"1", " ".join(map(str, chunk)).encode()))
        else:
            h.update(_field(b"#", b"".join(encode_value(v) for v in chunk)))
    return _field(b"V", f"{len(items)}|".encode() + h.digest())


@pytest.mark.parametrize(
    "items",
    [
        [i % 10 for i in range(10_000)],  # labels: few distinct ints
        list(range(-5_000, 5_000)),  # ids: all distinct
        [2**70, -(2**70), 0, *range(5_000)],  # beyond 64 bits
        [1] * 4_096 + [True] + [1] * 4_096,  # a bool among ints is not an int
        [3] * 4_096 + ["3", 3.0, None] + [3] * 300,  # a chunk of ints beside a chunk of mixed items
    ],
    ids=["labels", "ids", "big", "bool", "mixed"],
)
def test_a_long_list_is_keyed_by_the_digest_of_its_items_whatever_they_are(items: list[Any]) -> None:
    assert encode_value(items) == _long_list_encoding(items)
    changed = list(items)
    changed[len(items) // 2 + 1] = -7  # any one item changed changes the key
    assert encode_value(changed) != encode_value(items)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(_scalars(keys=True), _values(), min_size=2, max_size=6), st.randoms())
def test_dict_encoding_follows_insertion_order(mapping: dict[Any, Any], rnd: Any) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    assert (encode_value(mapping) == encode_value(dict(items))) == (list(mapping) == [k for k, _ in items])


# -- hash_items -----------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).clone()


@st.composite
def _batches(draw: st.DrawFn) -> torch.Tensor:
    """A tensor shaped (batch, ...) of any stored dtype with arbitrary bit patterns."""
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(1, 4))
    item_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    shape = (batch, *item_shape)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=numel, max_size=numel))).reshape(shape)
    size = numel * dtype.itemsize
    return _from_bytes(draw(st.binary(min_size=size, max_size=size)), dtype, shape)


def _change_one_element(draw: st.DrawFn, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A copy of ``tensor`` with one element's bytes changed; returns it and the item changed."""
    changed = tensor.clone()
    flat = changed.reshape(-1)
    index = draw(st.integers(0, flat.numel() - 1))
    if tensor.dtype == torch.bool:
        flat[index] = not bool(flat[index])
    else:
        as_bytes = flat.view(torch.uint8).reshape(flat.numel(), -1)
        old = bytes(as_bytes[index].tolist())
        new = draw(st.binary(min_size=len(old), max_size=len(old)).filter(lambda b: b != old))
        as_bytes[index] = torch.tensor(list(new), dtype=torch.uint8)
    per_item = flat.numel() // tensor.shape[0]
    return changed, index // per_item


def test_one_key_per_item_of_sixteen_bytes() -> None:
    x = torch.randn(7, 3, 2)
    keys = hash_items(CTX, [x])
    assert len(keys) == 7
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 7


def test_equal_items_get_equal_keys() -> None:
    row = torch.randn(1, 5)
    other = torch.randn(1, 5)
    x = torch.cat([row, other, row.clone(), other.clone(), row])
    keys = hash_items(CTX, [x])
    assert keys[0] == keys[2] == keys[4]
    assert keys[1] == keys[3]
    assert keys[0] != keys[1]
    assert keys == hash_items(CTX, [x.clone()])


def test_keys_do_not_depend_on_batch_neighbours() -> None:
    x = torch.randn(6, 4)
    assert hash_items(CTX, [x[2:4]]) == hash_items(CTX, [x])[2:4]
    assert hash_items(CTX, [x[3:4]])[0] == hash_items(CTX, [x])[3]


def test_empty_batch_gives_no_keys() -> None:
    assert hash_items(CTX, [torch.empty(0, 3)]) == []


def test_items_with_no_elements_get_a_key_each_from_their_other_tensors() -> None:
    images, boxes = torch.randn(4, 3), torch.zeros(4, 0, 4)  # no boxes in this batch
    keys = hash_items(CTX, [images, boxes])
    assert len(set(keys)) == 4 and keys == hash_items(CTX, [images, torch.zeros(4, 0, 4)])
    assert keys[1:3] == hash_items(CTX, [images[1:3], boxes[1:3]])
    assert hash_items(CTX, [boxes]) == [hash_items(CTX, [boxes])[0]] * 4


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_any_change_to_one_element_changes_that_items_key(data: st.DataObject) -> None:
    x = data.draw(_batches())
    changed, item = _change_one_element(data.draw, x)
    before = hash_items(CTX, [x])
    after = hash_items(CTX, [changed])
    assert before[item] != after[item]
    assert [k for i, k in enumerate(before) if i != item] == [k for i, k in enumerate(after) if i != item]


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_any_change_to_one_element_of_any_argument_changes_the_key(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 3))
    tensors = []
    for _ in range(data.draw(st.integers(2, 3))):
        x = data.draw(_batches())
        tensors.append(x[:1].expand(batch, *x.shape[1:]).clone() if x.shape[0] < batch else x[:batch])
    which = data.draw(st.integers(0, len(tensors) - 1))
    changed, item = _change_one_element(data.draw, tensors[which])
    altered = [changed if i == which else t for i, t in enumerate(tensors)]
    assert hash_items(CTX, tensors)[item] != hash_items(CTX, altered)[item]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_a_change_anywhere_in_a_large_item_changes_the_key(dtype: torch.dtype) -> None:
    x = (torch.rand(2, 64, 300) > 0.5).to(dtype)
    base = hash_items(CTX, [x])
    for index in (0, 1, 9_999, 12_345, 64 * 300 - 1):
        changed = x.clone()
        flat = changed[1].reshape(-1)
        flat[index] = 1 - flat[index] if dtype != torch.bool else not bool(flat[index])
        keys = hash_items(CTX, [changed])
        assert keys[0] == base[0]
        assert keys[1] != base[1], f"{dtype} element {index}"


def test_4096_distinct_inputs_with_small_values() -> None:
    values = torch.tensor(list(itertools.product(range(16), repeat=3)), dtype=torch.float32)
    assert values.shape == (4096, 3)
    assert len({tuple(row) for row in values.tolist()}) == 4096
    for x in (values, values.to(torch.int64), values.to(torch.float16), values[:, :, None].expand(4096, 3, 8)):
        assert len(set(hash_items(CTX, [x]))) == 4096


def test_different_contexts_give_different_keys() -> None:
    x = torch.randn(5, 3)
    a = hash_items(Context("module-a").digest(), [x])
    b = hash_items(Context("module-b").digest(), [x])
    assert all(ka != kb for ka, kb in zip(a, b))
    assert hash_items(Context("module-a").digest(), [x]) == a


def test_context_fields_are_length_prefixed() -> None:
    def digest(*fields: bytes) -> bytes:
        context = Context("m")
        for field in fields:
            context.add(field)
        return context.digest()

    assert digest(b"ab", b"c") != digest(b"a", b"bc")
    assert digest(b"ab", b"c") == digest(b"ab", b"c")
    assert len(digest(b"x")) == 16


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(6, 5).t(), id="transposed"),
        pytest.param(lambda: torch.randn(4, 10)[:, ::2], id="strided-columns"),
        pytest.param(lambda: torch.randn(10, 3)[1::3], id="strided-rows"),
        pytest.param(lambda: torch.randn(1, 5).expand(4, 5), id="expanded-batch"),
        pytest.param(lambda: torch.randn(4, 1).expand(4, 6), id="expanded-item"),
        pytest.param(lambda: torch.randn(3, 4, 5, 6).to(memory_format=torch.channels_last), id="channels-last"),
        pytest.param(lambda: torch.randn(3, 4, 5).permute(0, 2, 1), id="permuted"),
        pytest.param(lambda: torch.randn(3, 4, dtype=torch.complex64).conj(), id="conjugate-view"),
        pytest.param(lambda: (torch.rand(6, 5) > 0.5).t(), id="bool-transposed"),
        pytest.param(lambda: torch.randn(6, 5).to(torch.bfloat16).t(), id="bfloat16-transposed"),
    ],
)
def test_non_contiguous_inputs_hash_like_contiguous_copies(make: Any) -> None:
    x = make()
    copy_ = x.clone(memory_format=torch.contiguous_format).resolve_conj()
    assert copy_.is_contiguous()
    assert torch.equal(x, copy_)
    assert hash_items(CTX, [x]) == hash_items(CTX, [copy_])


# Shape and dtype are hashed through the per-batch context that the cache builds from the
# arguments; these tests go through the decorator so that they check the whole key.


def _keys_collide(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether any item of ``second`` is served from the entries ``first`` left."""

    @torchcache()
    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], 1)

    probe(first)
    probe(second)
    stats = probe.cache_instance.stats()  # type: ignore[attr-defined]
    assert stats.hits + stats.misses == first.shape[0] + second.shape[0]
    return bool(stats.hits)


def test_the_collision_probe_detects_equal_inputs() -> None:
    x = torch.randn(3, 4)
    assert _keys_collide(x, x.clone())
    assert not _keys_collide(x, x + 1)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_same_bytes_with_another_item_shape_give_other_keys(data: st.DataObject) -> None:
    x = data.draw(_batches())
    per_item = math.prod(x.shape[1:])
    shapes = {(per_item,), (per_item, 1), (1, per_item)}
    for a in range(1, per_item + 1):
        if per_item % a == 0:
            shapes.add((a, per_item // a))
    shapes.discard(tuple(x.shape[1:]))
    other = data.draw(st.sampled_from(sorted(shapes)))
    reshaped = x.reshape(x.shape[0], *other)
    assert torch.equal(reshaped.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))
    assert not _keys_collide(x, reshaped)


_SAME_ITEMSIZE = {
    1: [torch.uint8, torch.int8, torch.bool],
    2: [torch.float16, torch.bfloat16, torch.int16],
    4: [torch.float32, torch.int32],
    8: [torch.float64, torch.int64, torch.complex64],
}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_same_bytes_as_another_dtype_give_other_keys(data: st.DataObject) -> None:
    x = data.draw(_batches())
    options = [d for d in _SAME_ITEMSIZE[x.dtype.itemsize] if d != x.dtype]
    if (
        x.dtype != torch.bool
        and torch.bool in options
        and not bool(((x.view(torch.uint8) == 0) | (x.view(torch.uint8) == 1)).all())
    ):
        options.remove(torch.bool)
    viewed = x.view(data.draw(st.sampled_from(options)))
    assert viewed.shape == x.shape
    assert not _keys_collide(x, viewed)


# -- fingerprints ---------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self, width: int = 4, scale: float = 1.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.scale


def _build(*args: Any, **kwargs: Any) -> tuple[torch.nn.Module, bytes]:
    torch.manual_seed(1)
    return _Net(*args, **kwargs), describe_init(args, kwargs)


def test_fingerprint_is_stable_for_identically_built_modules() -> None:
    a, da = _build(4, scale=2.0)
    b, db = _build(4, scale=2.0)
    assert a is not b
    key = fingerprint_module(a, da, SETTINGS)
    assert isinstance(key, str) and len(key) == 32 and int(key, 16) >= 0
    assert fingerprint_module(b, db, SETTINGS) == key


def test_fingerprint_changes_with_init_arguments() -> None:
    module, digest = _build(4, scale=2.0)
    key = fingerprint_module(module, digest, SETTINGS)
    for args, kwargs in [((4,), {"scale": 3.0}), ((4,), {}), ((4, 2.0), {}), ((), {"width": 4, "scale": 2.0})]:
        other = describe_init(args, kwargs)
        assert other != digest
        assert fingerprint_module(module, other, SETTINGS) != key


def test_describe_init_ignores_keyword_order() -> None:
    assert describe_init((), {"a": 1, "b": 2}) == describe_init((), {"b": 2, "a": 1})
    assert describe_init((), {"a": 1, "b": 2}) != describe_init((), {"a": 2, "b": 1})


def test_fingerprint_changes_with_a_parameter_value() -> None:
    module, digest = _build()
    key = fingerprint_module(module, digest, SETTINGS)
    with torch.no_grad():
        module.linear.weight[1, 2] += 1e-3
    assert fingerprint_module(module, digest, SETTINGS) != key
    with torch.no_grad():
        module.linear.weight[1, 2] -= 1e-3
    assert fingerprint_module(module, digest, SETTINGS) == key


def test_fingerprint_changes_with_a_buffer() -> None:
    module, digest = _build()
    key = fingerprint_module(module, digest, SETTINGS)
    module.norm.running_mean[0] = 0.5
    assert fingerprint_module(module, digest, SETTINGS) != key


def test_fingerprint_changes_with_cache_settings() -> None:
    module, digest = _build()
    keys = {
        fingerprint_module(module, digest, s)
        for s in [
            SETTINGS,
            {"cache_dtype": "torch.float16", "subsample_count": 10000},
            {"cache_dtype": None, "subsample_count": 5000},
            {"cache_dtype": None, "subsample_count": None},
        ]
    }
    assert len(keys) == 4


_SOURCE = """
import torch


class Probe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x {op}
"""


def _load(path: Path, op: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    path.write_text(_SOURCE.format(op=op))
    spec = importlib.util.spec_from_file_location("torchcache_probe_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "torchcache_probe_module", module)
    spec.loader.exec_module(module)
    return module


def test_fingerprint_changes_with_class_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def key_of(filename: str, op: str) -> str:
        module = _load(tmp_path / filename, op, monkeypatch)
        return fingerprint_module(module.Probe(), describe_init((), {}), SETTINGS)

    original = key_of("v1.py", "* 2")
    assert key_of("v1_copy.py", "* 2") == original
    assert key_of("v2.py", "* 3") != original


def test_init_arguments_with_memory_addresses_are_stable() -> None:
    a, b = object(), object()
    assert repr(a) != repr(b)
    assert describe_init((a,), {}) == describe_init((b,), {})
    c, d = _Opaque(), _Opaque()
    assert describe_init((), {"helper": c}) == describe_init((), {"helper": d})
    assert describe_init((c,), {}) != describe_init((a,), {})


def test_tensor_init_arguments_are_keyed_by_content() -> None:
    t = torch.randn(100, 50)
    assert describe_init((t,), {}) == describe_init((t.clone(),), {})
    changed = t.clone()
    changed[57, 23] += 1.0
    assert describe_init((t,), {}) != describe_init((changed,), {})
    assert describe_init((t,), {}) != describe_init((t.double(),), {})
    assert describe_init((t,), {}) != describe_init((t.reshape(50, 100),), {})
    assert describe_init((), {"w": t}) != describe_init((), {"w": changed})


def test_numpy_init_arguments_are_keyed_by_content() -> None:
    a = np.zeros(10_000)
    b = a.copy()
    b[5_000] = 1.0
    assert describe_init((a,), {}) == describe_init((a.copy(),), {})
    assert describe_init((a,), {}) != describe_init((b,), {})


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _plus_two(x: torch.Tensor) -> torch.Tensor:
    return x + 2


def test_fingerprint_function_differs_with_source() -> None:
    _plus_two.__qualname__ = _plus_one.__qualname__
    try:
        assert fingerprint_function(_plus_one, SETTINGS) == fingerprint_function(_plus_one, SETTINGS)
        assert fingerprint_function(_plus_one, SETTINGS) != fingerprint_function(_plus_two, SETTINGS)
    finally:
        _plus_two.__qualname__ = "_plus_two"


def test_fingerprint_function_differs_with_settings() -> None:
    assert fingerprint_function(_plus_one, SETTINGS) != fingerprint_function(
        _plus_one, {"cache_dtype": "torch.float16", "subsample_count": 10000}
    )


def test_a_subsample_and_whole_items_of_the_same_bytes_get_different_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Subsamples are taken on accelerators only; here item_rows is made to say its rows are one.
    x = torch.arange(12.0).reshape(3, 4)
    whole = hash_items(b"ctx", [x])
    real = keys_module.item_rows
    monkeypatch.setattr(keys_module, "item_rows", lambda tensor, count: (real(tensor, count)[0], True))
    subsampled = hash_items(b"ctx", [x])
    assert len(set(whole)) == 3 and not set(whole) & set(subsampled)
