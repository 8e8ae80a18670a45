"""Output structures: flatten and rebuild, layouts, and their JSON headers."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.errors import KeyingError
from torchcache.tree import DTYPES, Layout, flatten, unflatten

# -- flatten / unflatten --------------------------------------------------------------------

_leaves = st.builds(
    lambda n, dtype: torch.arange(n * 2).reshape(2, n).to(dtype),
    st.integers(0, 3),
    st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float16]),
)
_outputs = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
    ),
    max_leaves=8,
)


def _same(a: Any, b: Any) -> bool:
    """Structural identity: same container types, keys and order, and the very same leaves."""
    if isinstance(a, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _count_tensors(node: Any) -> int:
    if isinstance(node, torch.Tensor):
        return 1
    values = node.values() if isinstance(node, dict) else node
    return sum(_count_tensors(v) for v in values)


@settings(max_examples=100, deadline=None)
@given(_outputs)
def test_flatten_unflatten_round_trip(output: Any) -> None:
    spec, leaves = flatten(output)
    assert len(leaves) == _count_tensors(output)
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    assert _same(unflatten(spec, leaves), output)
    # the spec survives JSON, as it does in a stored entry's header
    assert _same(unflatten(json.loads(json.dumps(spec)), leaves), output)


def _same_structure(a: Any, b: Any) -> bool:
    """Equal containers, keys and order; any tensors as leaves."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_structure(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_same_structure(x, y) for x, y in zip(a, b))


@settings(max_examples=100, deadline=None)
@given(_outputs, _outputs)
def test_specs_are_equal_exactly_for_equal_structures(a: Any, b: Any) -> None:
    assert (flatten(a)[0] == flatten(b)[0]) == _same_structure(a, b)
    assert flatten(a)[0] == flatten(copy.copy(a))[0]


def test_flatten_keeps_leaf_order_and_dict_order() -> None:
    t = [torch.full((2, 1), float(i)) for i in range(5)]
    output = {"z": t[0], "a": (t[1], [t[2], {"m": t[3]}]), "k": t[4]}
    spec, leaves = flatten(output)
    assert all(x is y for x, y in zip(leaves, t))
    rebuilt = unflatten(spec, leaves)
    assert list(rebuilt) == ["z", "a", "k"]
    assert isinstance(rebuilt["a"], tuple) and isinstance(rebuilt["a"][1], list)


def test_empty_containers_round_trip() -> None:
    for output in [(), [], {}, ([], {}), {"a": ()}]:
        spec, leaves = flatten(output)
        assert leaves == []
        assert unflatten(spec, leaves) == output
        assert type(unflatten(spec, leaves)) is type(output)


@pytest.mark.parametrize(
    ("output", "path"),
    [
        ({1: torch.zeros(2)}, "output"),
        ({"a": [torch.zeros(2), {2: torch.zeros(2)}]}, "output['a'][1]"),
        ((torch.zeros(2), {None: torch.zeros(2)}), "output[1]"),
    ],
)
def test_non_str_dict_keys_raise_naming_the_path(output: Any, path: str) -> None:
    with pytest.raises(KeyingError) as info:
        flatten(output)
    assert isinstance(info.value, TypeError)
    assert str(info.value).startswith(path + ":")


@pytest.mark.parametrize(
    ("output", "path"),
    [
        (3, "output"),
        ((torch.zeros(2), 3), "output[1]"),
        ({"a": [torch.zeros(2), None]}, "output['a'][1]"),
        ({"logits": torch.zeros(2), "text": "hello"}, "output['text']"),
        ([torch.zeros(2), {"x": (torch.zeros(2), {1, 2})}], "output[1]['x'][1]"),
    ],
)
def test_unsupported_leaves_raise_naming_the_path(output: Any, path: str) -> None:
    with pytest.raises(KeyingError) as info:
        flatten(output)
    assert str(info.value).startswith(path + ":")


def test_flatten_uses_the_given_name() -> None:
    with pytest.raises(KeyingError, match=r"^result\[0\]"):
        flatten([1], name="result")


# -- layouts --------------------------------------------------------------------------------


def _layout(output: Any, cache_dtype: torch.dtype | None = None) -> Layout:
    spec, leaves = flatten(output)
    return Layout.of(spec, leaves, cache_dtype)


def test_layout_records_per_item_shape_and_dtypes() -> None:
    layout = _layout((torch.zeros(5, 3, 2), torch.zeros(5, dtype=torch.int64)))
    assert [leaf.shape for leaf in layout.leaves] == [(3, 2), ()]
    assert [leaf.dtype for leaf in layout.leaves] == [torch.float32, torch.int64]
    assert [leaf.out_dtype for leaf in layout.leaves] == [torch.float32, torch.int64]
    assert layout.nbytes == 3 * 2 * 4 + 8
    assert layout.spec == ["tuple", ["T", "T"]]


def test_layout_does_not_depend_on_batch_size() -> None:
    assert _layout(torch.zeros(3, 4)) == _layout(torch.zeros(17, 4))
    assert _layout(torch.zeros(3, 4)) != _layout(torch.zeros(3, 5))
    assert _layout(torch.zeros(3, 4)) != _layout((torch.zeros(3, 4),))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_cache_dtype_casts_only_floating_leaves(cache_dtype: torch.dtype) -> None:
    dtypes = list(DTYPES.values())
    output = {str(dt): torch.zeros(2, 3, dtype=dt) for dt in dtypes}
    layout = _layout(output, cache_dtype)
    for dt, leaf in zip(dtypes, layout.leaves):
        assert leaf.out_dtype == dt
        assert leaf.dtype == (cache_dtype if dt.is_floating_point else dt)
    assert layout.leaves[dtypes.index(torch.complex64)].dtype == torch.complex64
    assert layout.nbytes == sum(3 * leaf.dtype.itemsize for leaf in layout.leaves)


def test_no_cache_dtype_keeps_every_dtype() -> None:
    output = [torch.zeros(2, 3, dtype=dt) for dt in DTYPES.values()]
    layout = _layout(output)
    assert all(leaf.dtype == leaf.out_dtype for leaf in layout.leaves)


def test_unsupported_output_dtype_raises_keying_error() -> None:
    with pytest.raises(KeyingError):
        _layout((torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.uint16)))


_leaf_specs = st.lists(
    st.tuples(st.sampled_from(list(DTYPES.values())), st.lists(st.integers(0, 5), max_size=3)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=100, deadline=None)
@given(_leaf_specs)
def test_offsets_are_8_byte_aligned_and_do_not_overlap(specs: list[tuple[torch.dtype, list[int]]]) -> None:
    output = [torch.zeros(2, *shape, dtype=dt) for dt, shape in specs]
    layout = _layout(output)
    offsets = layout.offsets
    assert len(offsets) == len(specs)
    assert offsets[0] == 0
    assert all(o % 8 == 0 for o in offsets)
    for i, leaf in enumerate(layout.leaves):
        end = offsets[i] + leaf.nbytes
        assert end <= (offsets[i + 1] if i + 1 < len(offsets) else layout.row_bytes)
    assert layout.row_bytes % 8 == 0
    assert layout.row_bytes - (offsets[-1] + layout.leaves[-1].nbytes) < 8
    assert layout.nbytes == sum(t[0].numel() * t.dtype.itemsize for t in output)


@settings(max_examples=100, deadline=None)
@given(_outputs, st.sampled_from([None, torch.float16, torch.bfloat16]))
def test_header_round_trip(output: Any, cache_dtype: torch.dtype | None) -> None:
    spec, leaves = flatten(output)
    layout = Layout.of(spec, leaves, cache_dtype)
    header = json.loads(json.dumps(layout.to_header()))
    restored = Layout.from_header(header)
    assert restored == layout
    assert restored.offsets == layout.offsets
    assert restored.nbytes == layout.nbytes
    assert restored.spec == spec


def _header() -> dict[str, Any]:
    layout = _layout({"a": torch.zeros(2, 3), "b": (torch.zeros(2, 5, dtype=torch.int8), torch.zeros(2, 2))})
    header = json.loads(json.dumps(layout.to_header()))
    assert Layout.from_header(copy.deepcopy(header)) == layout
    return header


def _edit(path: str, value: Any) -> dict[str, Any]:
    header = _header()
    node: Any = header
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return header


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("leaves.0.dtype", "float33"),
        ("leaves.0.dtype", "__class__"),
        ("leaves.0.dtype", "torch.float32"),
        ("leaves.1.out_dtype", "object"),
        ("leaves.0.shape", [-1]),
        ("leaves.1.shape", [5, -2]),
        ("leaves.0.shape", [1.5]),
        ("leaves.0.shape", "3"),
        ("leaves.0.offset", 4),
        ("leaves.1.offset", 0),
        ("leaves.2.offset", 20),
        ("tree", ["dict", [["a", "T"], ["b", ["tuple", ["T"]]]]]),
        ("tree", ["dict", [["a", "T"], ["b", ["tuple", ["T", "T", "T"]]]]]),
        ("tree", "T"),
        ("tree", ["set", [["a", "T"]]]),
        ("tree", ["dict", [["a", "X"], ["b", ["tuple", ["T", "T"]]]]]),
    ],
)
def test_from_header_rejects_invalid_fields(path: str, value: Any) -> None:
    header = _edit(path, value)
    with pytest.raises((ValueError, KeyError)):
        Layout.from_header(header)


def test_from_header_rejects_missing_and_extra_leaves() -> None:
    header = _header()
    header["leaves"].pop()
    with pytest.raises((ValueError, KeyError)):
        Layout.from_header(header)
    header = _header()
    header["leaves"].append(dict(header["leaves"][-1], offset=header["leaves"][-1]["offset"] + 8))
    with pytest.raises((ValueError, KeyError)):
        Layout.from_header(header)


@pytest.mark.parametrize("missing", ["tree", "leaves"])
def test_from_header_rejects_missing_fields(missing: str) -> None:
    header = _header()
    del header[missing]
    with pytest.raises((ValueError, KeyError)):
        Layout.from_header(header)


def test_header_names_out_dtype_only_when_it_differs() -> None:
    spec, leaves = flatten((torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.int64)))
    plain = Layout.of(spec, leaves, None).to_header()
    assert ["out_dtype" in leaf for leaf in plain["leaves"]] == [False, False]
    halved = Layout.of(spec, leaves, torch.float16).to_header()
    assert [leaf.get("out_dtype") for leaf in halved["leaves"]] == ["float32", None]
    for header in (plain, halved):
        assert Layout.from_header(header) == Layout.of(spec, leaves, None if header is plain else torch.float16)
    spelled_out = {**plain, "leaves": [dict(leaf, out_dtype=leaf["dtype"]) for leaf in plain["leaves"]]}
    assert Layout.from_header(spelled_out) == Layout.from_header(plain)
