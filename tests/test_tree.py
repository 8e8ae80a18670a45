"""Output structures: flatten and rebuild, layouts, and their JSON headers."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import python_env, run_python
from torchcache import torchcache
from torchcache.errors import KeyingError
from torchcache.output_types import RebuildError
from torchcache.tree import DTYPES, MAX_DEPTH, Layout, describe, flatten, leaf_paths, unflatten

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
    """Structural identity: same types, fields, keys and order, and the very same leaves."""
    if isinstance(a, torch.Tensor):
        return a is b
    if a is None or type(a) is not type(b):
        return a is None and b is None
    if dataclasses.is_dataclass(a):
        names = [f.name for f in dataclasses.fields(a)]
        same_dict = not isinstance(a, dict) or list(a) == list(b)
        return same_dict and all(_same(getattr(a, n), getattr(b, n)) for n in names)
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
        ({"a": [torch.zeros(2), "none"]}, "output['a'][1]"),
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


def _long(layout: Layout) -> dict[str, Any]:
    """The long form of a layout's header, as torchcache 1.0 wrote it."""
    short = layout.to_header()
    leaves = [
        {"dtype": item[0], "shape": item[1], "offset": offset, **({"out_dtype": item[2]} if len(item) == 3 else {})}
        for item, offset in zip(short["l"], layout.offsets)
    ]
    return {"tree": short["t"], "leaves": leaves}


_HEADER_OUTPUT = {"a": torch.zeros(2, 3), "b": (torch.zeros(2, 5, dtype=torch.int8), torch.zeros(2, 2))}


def _header() -> dict[str, Any]:
    """A long-form header (torchcache 1.0's), checked to parse."""
    layout = _layout(_HEADER_OUTPUT)
    header = json.loads(json.dumps(_long(layout)))
    assert Layout.from_header(copy.deepcopy(header)) == layout
    return header


def _short_header() -> dict[str, Any]:
    """A short-form header (what is written now), checked to parse."""
    layout = Layout.of(*flatten(_HEADER_OUTPUT), torch.float16)  # the first leaf names its out_dtype
    header = json.loads(json.dumps(layout.to_header()))
    assert Layout.from_header(copy.deepcopy(header)) == layout and len(header["l"][0]) == 3
    return header


def _edit(path: str, value: Any, make: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    header = (make or _header)()
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


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("l.0.0", "float33"),
        ("l.0.0", "__class__"),
        ("l.0.0", ["float32"]),
        ("l.0.2", "object"),
        ("l.0.1", [-1]),
        ("l.1.1", [5, -2]),
        ("l.0.1", [1.5]),
        ("l.0.1", "3"),
        ("l.0.1", [True]),
        ("l.0", []),
        ("l.0", ["float16"]),
        ("l.0", ["float16", [3], "float32", "x"]),
        ("l.0", {"dtype": "float16", "shape": [3]}),
        ("l", "T"),
        ("t", ["dict", [["a", "T"], ["b", ["tuple", ["T"]]]]]),
        ("t", "T"),
        ("t", ["set", [["a", "T"]]]),
    ],
)
def test_from_header_rejects_invalid_fields_of_the_short_form(path: str, value: Any) -> None:
    header = _edit(path, value, _short_header)
    with pytest.raises(ValueError):
        Layout.from_header(header)


def test_the_header_of_a_lone_tensor_leaves_its_tree_out() -> None:
    layout = _layout(torch.zeros(2, 768))
    assert layout.to_header() == {"l": [["f4", [768]]]}
    assert Layout.from_header({"l": [["f4", [768]]], "t": "T"}) == layout
    assert "t" in _layout((torch.zeros(2, 768),)).to_header()
    with pytest.raises(ValueError, match="number of leaves"):
        Layout.from_header({"l": [["float32", [768]], ["float32", [768]]]})


@pytest.mark.parametrize("dtype", sorted(DTYPES.values(), key=str))
def test_a_header_names_each_dtype_by_a_code_and_reads_its_name_too(dtype: torch.dtype) -> None:
    layout = _layout(torch.zeros(2, 3, dtype=dtype))
    header = layout.to_header()
    code = header["l"][0][0]
    assert len(code) <= 3 and code != str(dtype).removeprefix("torch.")
    if dtype is not torch.bfloat16:  # numpy's type string
        assert np.dtype(code) == torch.zeros(0, dtype=dtype).numpy().dtype
    assert Layout.from_header(header) == layout
    assert Layout.from_header({"l": [[str(dtype).removeprefix("torch."), [3]]]}) == layout


def test_both_forms_of_a_header_give_one_layout() -> None:
    for cache_dtype in (None, torch.float16):
        layout = Layout.of(*flatten(_HEADER_OUTPUT), cache_dtype)
        assert Layout.from_header(layout.to_header()) == Layout.from_header(_long(layout)) == layout
    short = _short_header()
    for missing in ("l", "t"):
        with pytest.raises(ValueError):
            Layout.from_header({k: v for k, v in short.items() if k != missing})
    short["l"].append(short["l"][-1])
    with pytest.raises(ValueError, match="number of leaves"):
        Layout.from_header(short)


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
    assert plain["l"] == [["f4", [3]], ["i8", [4]]]
    halved = Layout.of(spec, leaves, torch.float16).to_header()
    assert halved["l"] == [["f2", [3], "f4"], ["i8", [4]]]
    for header in (plain, halved):
        assert Layout.from_header(header) == Layout.of(spec, leaves, None if header is plain else torch.float16)
    spelled_out = {**plain, "l": [[*item, item[0]] for item in plain["l"]]}
    assert Layout.from_header(spelled_out) == Layout.from_header(plain)
    long = _long(Layout.of(spec, leaves, None))
    assert ["out_dtype" in leaf for leaf in long["leaves"]] == [False, False]
    long_spelled_out = {**long, "leaves": [dict(leaf, out_dtype=leaf["dtype"]) for leaf in long["leaves"]]}
    assert Layout.from_header(long_spelled_out) == Layout.from_header(plain)


# -- typed outputs: namedtuples, dataclasses, dict subclasses, None ---------------------------

Pair = collections.namedtuple("Pair", ["x", "y"])


class Typed(NamedTuple):
    features: torch.Tensor
    extra: torch.Tensor | None


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: Any = None
    aux: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    scores: torch.Tensor


class Record(dict):  # type: ignore[type-arg]
    """A dict subclass with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass
class ModelOutputLike(OrderedDict):  # type: ignore[type-arg]
    """Like a Hugging Face ModelOutput: a dataclass whose dict part holds its fields that are not None."""

    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


class Outer:
    class Inner(NamedTuple):
        a: torch.Tensor

    Flat = collections.namedtuple("Flat", ["a"])  # its qualname is "Flat": not found by name


def _t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _round_trip(output: Any) -> Any:
    """Flatten, store the spec as a header would, read it back strictly, rebuild."""
    spec, leaves = flatten(output)
    layout = Layout.from_header(json.loads(json.dumps(Layout.of(spec, leaves, None).to_header())))
    assert layout.spec == spec
    rebuilt = unflatten(layout.spec, leaves)
    assert _same(rebuilt, output)
    return rebuilt


def test_namedtuple_round_trip_keeps_type_and_attributes() -> None:
    rebuilt = _round_trip(Pair(_t(2, 3), _t(2)))
    assert type(rebuilt) is Pair and rebuilt._fields == ("x", "y")
    assert rebuilt.y is rebuilt[1]


def test_typing_namedtuple_with_a_none_field_round_trips() -> None:
    features = _t(2, 4)
    assert len(flatten(Typed(features, None))[1]) == 1
    rebuilt = _round_trip(Typed(features, None))
    assert type(rebuilt) is Typed and rebuilt.features is features and rebuilt.extra is None


def test_nested_class_round_trips() -> None:
    rebuilt = _round_trip(Outer.Inner(_t(2)))
    assert type(rebuilt) is Outer.Inner
    assert flatten(Outer.Inner(_t(2)))[0][1].endswith(":Outer.Inner")


def test_dataclass_round_trip_keeps_type_and_attributes() -> None:
    out = Out(_t(2, 5), hidden=(_t(2, 3), [_t(2)]), aux=None)
    rebuilt = _round_trip(out)
    assert type(rebuilt) is Out and rebuilt.aux is None
    assert isinstance(rebuilt.hidden, tuple) and isinstance(rebuilt.hidden[1], list)
    frozen = _round_trip(FrozenOut(_t(2)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.scores = _t(2)  # type: ignore[misc]


def test_ordered_dict_and_dict_subclass_round_trip_in_order() -> None:
    rebuilt = _round_trip(OrderedDict([("z", _t(2)), ("a", _t(2, 2))]))
    assert type(rebuilt) is OrderedDict and list(rebuilt) == ["z", "a"]
    record = _round_trip(Record(b=_t(2), a={"c": _t(2)}))
    assert type(record) is Record and list(record) == ["b", "a"]
    assert record.b is record["b"] and type(record.a) is dict


def test_model_output_like_round_trip_leaves_none_fields_out_of_the_dict() -> None:
    out = ModelOutputLike(last_hidden_state=_t(2, 3, 4), hidden_states=(_t(2, 3), _t(2, 3)))
    assert list(out) == ["last_hidden_state", "hidden_states"]
    assert len(flatten(out)[1]) == 3
    rebuilt = _round_trip(out)
    assert type(rebuilt) is ModelOutputLike
    assert list(rebuilt) == ["last_hidden_state", "hidden_states"]
    assert rebuilt.pooler_output is None and "pooler_output" not in rebuilt
    assert rebuilt["last_hidden_state"] is rebuilt.last_hidden_state


def test_transformers_model_output_round_trips() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs", reason="transformers is not installed")
    cls = outputs.BaseModelOutputWithPooling
    out = cls(last_hidden_state=_t(2, 3, 4), pooler_output=_t(2, 4), hidden_states=(_t(2, 3, 4),))
    rebuilt = _round_trip(out)
    assert type(rebuilt) is cls
    assert list(rebuilt.keys()) == ["last_hidden_state", "pooler_output", "hidden_states"]
    assert rebuilt.attentions is None and "attentions" not in rebuilt
    assert rebuilt[1] is rebuilt.pooler_output and len(rebuilt.to_tuple()) == 3
    assert flatten(out)[0][1] == "transformers.modeling_outputs:BaseModelOutputWithPooling"


def test_none_leaves_store_nothing() -> None:
    features = _t(3, 2)
    for output in [None, (features, None), {"a": None, "b": [None, features]}]:
        leaves = flatten(output)[1]
        assert leaves == ([features] if output is not None else [])
        assert _same(_round_trip(output), output)


def test_nested_mixture_round_trips_with_paths_in_leaf_order() -> None:
    t = [_t(2, i + 1, seed=i) for i in range(5)]
    output = {
        "pair": Pair(t[0], Out(t[1], hidden=OrderedDict(k=t[2]), aux=None)),
        "items": [Typed(t[3], None), Record(r=ModelOutputLike(last_hidden_state=t[4]))],
    }
    leaves = flatten(output)[1]
    assert all(x is y for x, y in zip(leaves, t)) and len(leaves) == 5
    rebuilt = _round_trip(output)
    assert rebuilt["pair"].y.hidden["k"] is t[2]
    assert rebuilt["items"][1].r.last_hidden_state is t[4]


_rich_outputs = st.recursive(
    st.one_of(_leaves, st.none()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(tuple),
        st.builds(Pair, inner, inner),
        st.builds(Out, inner, inner, inner),
        st.dictionaries(st.text(max_size=4), inner, max_size=3).map(OrderedDict),
        st.dictionaries(st.text(max_size=4), inner, max_size=3).map(Record),
    ),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None)
@given(_rich_outputs)
def test_typed_outputs_round_trip(output: Any) -> None:
    _round_trip(output)


@settings(max_examples=100, deadline=None)
@given(_rich_outputs, _rich_outputs)
def test_typed_specs_are_equal_exactly_for_equal_structures(a: Any, b: Any) -> None:
    def shape(node: Any) -> Any:
        """The structure with every tensor replaced by one marker."""
        if isinstance(node, torch.Tensor) or node is None:
            return "T" if node is not None else None
        if dataclasses.is_dataclass(node):
            return (type(node), [(f.name, shape(getattr(node, f.name))) for f in dataclasses.fields(node)])
        if isinstance(node, dict):
            return (type(node), [(k, shape(v)) for k, v in node.items()])
        return (type(node), [shape(v) for v in node])

    assert (flatten(a)[0] == flatten(b)[0]) == (shape(a) == shape(b))


@settings(max_examples=100, deadline=None)
@given(_rich_outputs)
def test_leaf_paths_name_each_leaf_as_python_would(output: Any) -> None:
    spec, leaves = flatten(output)
    paths = leaf_paths(spec, "out")
    assert len(paths) == len(leaves)
    assert all(eval(path, {"out": output}) is leaf for path, leaf in zip(paths, leaves))


def test_leaf_paths_match_the_paths_in_errors() -> None:
    output = {"p": Pair(_t(2), Out(_t(2), hidden=OrderedDict(k=_t(2))))}
    paths = leaf_paths(flatten(output)[0])
    assert paths == ["output['p'].x", "output['p'].y.logits", "output['p'].y.hidden['k']"]
    output["p"].y.hidden["k"] = "text"
    with pytest.raises(KeyingError, match=r"^output\['p'\]\.y\.hidden\['k'\]: "):
        flatten(output)


def test_specs_of_plain_outputs_are_unchanged() -> None:
    """Entries written before typed outputs existed stay readable: the plain spec is the same."""
    header = {
        "tree": ["dict", [["a", "T"], ["b", ["tuple", ["T", ["list", []]]]]]],
        "leaves": [{"dtype": "float32", "shape": [3], "offset": 0}, {"dtype": "int64", "shape": [], "offset": 16}],
    }
    layout = Layout.from_header(header)
    output = {"a": torch.zeros(2, 3), "b": (torch.zeros(2, dtype=torch.int64), [])}
    assert layout == Layout.of(*flatten(output), None)
    assert flatten(output)[0] == header["tree"]


def test_describe_names_types_and_leaves() -> None:
    spec, leaves = flatten({"p": Pair(_t(2, 3), None), "o": OrderedDict(k=_t(2))})
    text = describe(spec, (f"{t.dtype}{list(t.shape[1:])}" for t in leaves))
    assert text == "{'p': Pair(x=torch.float32[3], y=None), 'o': OrderedDict({'k': torch.float32[]})}"


# -- what cannot be cached is rejected, naming the type and the path --------------------------


def _local_namedtuple() -> Any:
    Local = collections.namedtuple("Local", ["a"])
    return Local(_t(2))


@dataclasses.dataclass
class WithDerived:
    a: torch.Tensor
    b: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.b = self.a * 2


class Tagged(Pair):
    """A namedtuple subclass whose instances can carry attributes."""


@pytest.mark.parametrize(
    ("output", "path", "words"),
    [
        ({"a": [_local_namedtuple()]}, "output['a'][0]", ["Local", "top level"]),
        (Out(Outer.Flat(_t(2))), "output.logits", ["Flat", "qualified name"]),
        (defaultdict(list, a=_t(2)), "output", ["collections.defaultdict", "OrderedDict"]),
        ((_t(2), Counter(a=1)), "output[1]", ["collections.Counter"]),
        (Out(_t(2), hidden="text"), "output.hidden", ["str"]),
        (Pair(_t(2), {"k": {1, 2}}), "output.y['k']", ["set"]),
        (Record(a=OrderedDict([(1, _t(2))])), "output['a']", ["dict keys must be str"]),
        (WithDerived(_t(2)), "output", ["WithDerived", "init=False"]),
        ([torch.max(_t(2, 3), dim=1)], "output[0]", ["torch.return_types.max"]),
    ],
)
def test_uncacheable_types_raise_naming_type_and_path(output: Any, path: str, words: list[str]) -> None:
    with pytest.raises(KeyingError) as info:
        flatten(output)
    assert str(info.value).startswith(path + ":")
    for word in words:
        assert word in str(info.value)


def test_state_that_rebuilding_would_lose_is_rejected() -> None:
    tagged = Tagged(_t(2), _t(2))
    assert flatten(tagged)[0][0] == "namedtuple"
    tagged.note = "extra"  # type: ignore[attr-defined]
    with pytest.raises(KeyingError, match=r"^output: .*Tagged.*note"):
        flatten(tagged)
    out = ModelOutputLike(last_hidden_state=_t(2))
    out["extra"] = _t(2)
    with pytest.raises(KeyingError, match=r"^output\.x: .*ModelOutputLike.*fields"):
        flatten(Pair(out, None))
    record = Record(a=_t(2))
    record.__dict__["hidden"] = 1
    with pytest.raises(KeyingError, match=r"Record.*hidden"):
        flatten(record)


def test_nesting_is_limited_and_cycles_are_keying_errors() -> None:
    deep: Any = _t(2)
    for _ in range(MAX_DEPTH):
        deep = [deep]
    _round_trip(deep)
    with pytest.raises(KeyingError, match=f"more than {MAX_DEPTH} deep"):
        flatten(Pair(deep, None))
    cycle: list[Any] = [_t(2)]
    cycle.append(cycle)
    with pytest.raises(KeyingError, match=r"^output\[1\]\[1\]"):
        flatten(cycle)


# -- rebuilding only what is safe ---------------------------------------------------------------


def test_spec_naming_a_module_not_imported_fails_without_importing_it() -> None:
    candidates = ("this", "antigravity", "xml.dom.minidom", "turtle", "tkinter.dnd", "curses.textpad")
    unimported = [name for name in candidates if name not in sys.modules]
    assert unimported, "every candidate module was already imported by an earlier test"
    for module in unimported:
        spec = ["namedtuple", f"{module}:Pair", [["x", "T"]]]
        layout = Layout.from_header({"tree": spec, "leaves": [{"dtype": "float32", "shape": [], "offset": 0}]})
        with pytest.raises(RebuildError, match=f"module '{module}' is not imported") as info:
            unflatten(layout.spec, [_t(2)])
        assert isinstance(info.value, TypeError) and not isinstance(info.value, ValueError)
        assert module not in sys.modules


def test_spec_naming_a_function_or_another_class_never_calls_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))

    record.__module__, record.__qualname__ = "os", "system"
    monkeypatch.setattr(os, "system", record)
    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    monkeypatch.setattr(Counter, "__init__", record)
    for kind in ("namedtuple", "dataclass", "mapping"):
        for name in ("os:system", "subprocess:Popen", "builtins:type", "collections:Counter", "builtins:print"):
            with pytest.raises(RebuildError, match=f"'{name}'"):
                unflatten([kind, name, [["args", ["list", ["T"]]]]], [_t(2)])
    assert calls == []


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (["namedtuple", f"{__name__}:NoSuchClass", []], "names no class"),
        (["namedtuple", f"{__name__}:Pair.x", [["x", "T"]]], "names no class"),
        (["namedtuple", f"{__name__}:_t", [["x", "T"]]], "names no class"),
        (["dataclass", f"{__name__}:Pair", [["x", "T"], ["y", "T"]]], "expected a dataclass class"),
        (["mapping", f"{__name__}:Out", [["logits", "T"]]], "expected a mapping class"),
        (["namedtuple", "collections:OrderedDict", [["x", "T"]]], "expected a namedtuple class"),
        (["namedtuple", f"{__name__}:Pair", [["x", "T"], ["z", "T"]]], r"fields \['x', 'z'\]"),
        (["namedtuple", f"{__name__}:Pair", [["x", "T"]]], r"the class now has \['x', 'y'\]"),
        (["dataclass", f"{__name__}:Out", [["logits", "T"], ["hidden", "T"]]], "now has"),
        (["dataclass", f"{__name__}:FrozenOut", [["scores", "T"], ["extra", "T"]]], "now has"),
        (["mapping", "collections:defaultdict", [["x", "T"]]], "no cacheable kind"),
    ],
)
def test_specs_that_cannot_be_rebuilt_raise_rebuild_error(spec: Any, match: str) -> None:
    with pytest.raises(RebuildError, match=match):
        unflatten(spec, [_t(2), _t(2)])


def test_a_dataclass_is_rebuilt_from_its_stored_fields_without_running_post_init_again() -> None:
    made = []

    @dataclasses.dataclass
    class Checked:
        a: Any

        def __post_init__(self) -> None:
            made.append(self.a)  # a conversion here would convert a stored field twice

    Outer.Checked = Checked  # type: ignore[attr-defined]
    Checked.__qualname__ = "Outer.Checked"
    try:
        rebuilt = unflatten(["dataclass", f"{__name__}:Outer.Checked", [["a", "T"]]], [_t(2)])
        assert type(rebuilt) is Checked and torch.equal(rebuilt.a, _t(2)) and made == []
    finally:
        del Outer.Checked  # type: ignore[attr-defined]
    with pytest.raises(RebuildError, match="names no class"):
        unflatten(["dataclass", f"{__name__}:Outer.Checked", [["a", "T"]]], [_t(2)])


@dataclasses.dataclass
class _Boxes:
    boxes: torch.Tensor

    def __post_init__(self) -> None:
        self.area = self.boxes.prod(-1)  # not a field: a rebuilt entry would lack it


@dataclasses.dataclass
class _Scored:
    logits: torch.Tensor

    @functools.cached_property
    def probabilities(self) -> torch.Tensor:
        return self.logits.softmax(-1)  # made again on a rebuilt entry


def test_a_dataclass_with_a_cached_property_read_is_stored_and_rebuilt() -> None:
    node = _Scored(_t(2, 3))
    assert node.probabilities.shape == (2, 3)
    spec, leaves = flatten(node)
    rebuilt = unflatten(spec, leaves)
    assert torch.equal(rebuilt.logits, node.logits) and torch.equal(rebuilt.probabilities, node.probabilities)


def test_a_dataclass_whose_cached_property_was_assigned_is_refused() -> None:
    node = _Scored(_t(2, 3))
    node.probabilities = node.logits.sigmoid()  # not what the property makes: a rebuilt entry would differ
    with pytest.raises(KeyingError, match="probabilities"):
        flatten(node)


def test_a_dataclass_holding_attributes_beyond_its_fields_is_refused() -> None:
    with pytest.raises(KeyingError, match=r"attributes beyond its fields \(\['area'\]\)"):
        flatten(_Boxes(_t(2)))


def _nested(depth: int) -> Any:
    node: Any = "T"
    for _ in range(depth):
        node = ["tuple", [node]]
    return node


@pytest.mark.parametrize(
    "tree",
    [
        _nested(MAX_DEPTH + 1),
        _nested(50_000),
        ["namedtuple", f"{__name__}:Pair", [["x", _nested(MAX_DEPTH)]]],
        None,
        "X",
        {"kind": "tuple"},
        ["tuple"],
        ["tuple", "T"],
        ["tuple", ["T"], "extra"],
        ["set", ["T"]],
        ["Pair", ["T"]],
        ["namedtuple", ["T"]],
        ["namedtuple", "collections:OrderedDict"],
        ["namedtuple", "os:system.__class__", [["x", "T"]]],
        ["dataclass", "os.path:join.__globals__", [["x", "T"]]],
        ["dataclass", f"{__name__}:_local_namedtuple.<locals>.Local", [["a", "T"]]],
        ["dataclass", "a..b:X", [["x", "T"]]],
        ["dataclass", "mod:", [["x", "T"]]],
        ["dataclass", ":X", [["x", "T"]]],
        ["dataclass", "mod:X:Y", [["x", "T"]]],
        ["dataclass", "mod:X Y", [["x", "T"]]],
        ["dataclass", 3, [["x", "T"]]],
        ["dataclass", "m" * 600 + ":X", [["x", "T"]]],
        ["dataclass", "m:X", [["not a name", "T"]]],
        ["dataclass", "m:X", [["x", "T"], ["x", "N"]]],
        ["mapping", "m:X", [[1, "T"]]],
        ["mapping", "m:X", [["a"]]],
        ["mapping", "m:X", "T"],
        ["dict", [["a", "T", "N"]]],
        ["dict", [["a", "T"], ["a", "N"]]],
        ["dict", [[None, "T"]]],
        ["list", [["tuple", ["T"]], ["frozenset", []]]],
    ],
)
def test_from_header_rejects_hostile_structures(tree: Any) -> None:
    header = {"tree": tree, "leaves": [{"dtype": "float32", "shape": [], "offset": 0}]}
    with pytest.raises(ValueError):
        Layout.from_header(header)


def _deep_list(depth: int) -> Any:
    node: Any = [1]
    for _ in range(depth):
        node = [node]
    return node


_LEAF = {"dtype": "float32", "shape": [], "offset": 0}


@pytest.mark.parametrize(
    "header",
    [
        [],
        {"tree": "T", "leaves": "T"},
        {"tree": "T", "leaves": [_LEAF, _LEAF]},
        {"tree": "T", "leaves": [[]]},
        {"tree": "T", "leaves": [{**_LEAF, "shape": _deep_list(50_000)}]},
        {"tree": "T", "leaves": [{**_LEAF, "dtype": _deep_list(50_000)}]},
        {"tree": "T", "leaves": [{**_LEAF, "shape": [True]}]},
        {"tree": "T", "leaves": [{**_LEAF, "offset": _deep_list(50_000)}]},
        {"tree": ["dataclass", "m:X", [[_deep_list(50_000), "T"]]], "leaves": [_LEAF]},
    ],
)
def test_from_header_rejects_hostile_headers_with_value_error(header: Any) -> None:
    with pytest.raises(ValueError):
        Layout.from_header(header)


def test_from_header_accepts_the_deepest_allowed_structure() -> None:
    header = {"tree": _nested(MAX_DEPTH), "leaves": [{"dtype": "float32", "shape": [], "offset": 0}]}
    assert Layout.from_header(header).spec == _nested(MAX_DEPTH)


# -- through the decorator ----------------------------------------------------------------------

_PRODUCERS: dict[str, Any] = {
    "namedtuple": lambda x: Pair(x * 2, x.sum(dim=1)),
    "NamedTuple": lambda x: Typed(x + 1, None),
    "dataclass": lambda x: Out(x * 3, hidden=(x - 1,), aux=None),
    "OrderedDict": lambda x: OrderedDict(b=x * 4, a=x.long()),
    "tensor-None": lambda x: (x * 5, None),
    "ModelOutputLike": lambda x: ModelOutputLike(last_hidden_state=x * 6, hidden_states=(x, x + 1)),
}


def _assert_equal_outputs(got: Any, want: Any) -> None:
    """Same types and fields, tensors equal in values and dtype."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif want is None:
        assert got is None
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            _assert_equal_outputs(getattr(got, field.name), getattr(want, field.name))
        if isinstance(want, dict):
            assert list(got) == list(want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_equal_outputs(got[key], want[key])
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_equal_outputs(g, w)


@pytest.mark.parametrize("kind", list(_PRODUCERS))
def test_decorated_function_caches_typed_outputs(kind: str) -> None:
    produce = _PRODUCERS[kind]
    seen: list[int] = []

    @torchcache(check_items=False)
    def forward(x: torch.Tensor) -> Any:
        seen.append(x.shape[0])
        return produce(x)

    x = _t(6, 3)
    _assert_equal_outputs(forward(x[:4]), produce(x[:4]))
    assert seen == [4]
    hit = forward(x[:4])
    assert seen == [4]
    _assert_equal_outputs(hit, produce(x[:4]))
    mixed = forward(x[2:])  # two hits, two computed, merged in input order
    assert seen == [4, 2]
    _assert_equal_outputs(mixed, produce(x[2:]))
    stats = forward.cache_instance.stats()  # type: ignore[attr-defined]
    assert (stats.hits, stats.misses) == (6, 6)


def test_batch_dims_name_fields_of_typed_outputs() -> None:
    seen: list[int] = []

    def produce(x: torch.Tensor) -> Any:
        return Pair(x * 2, torch.stack([x, x + 1]))  # y is (2, batch, ...)

    @torchcache(check_items=False, batch_dims={"output.y": 1})
    def forward(x: torch.Tensor) -> Any:
        seen.append(x.shape[0])
        return produce(x)

    x = _t(5, 3)
    _assert_equal_outputs(forward(x[:3]), produce(x[:3]))
    _assert_equal_outputs(forward(x[1:]), produce(x[1:]))
    assert seen == [3, 2]


_SCRIPT = textwrap.dedent(
    """
    import collections, dataclasses, json, sys
    from collections import OrderedDict
    from typing import Any, NamedTuple

    import torch

    from torchcache import torchcache

    Pair = collections.namedtuple("Pair", ["x", "y"])


    class Typed(NamedTuple):
        features: torch.Tensor
        extra: Any


    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        aux: Any = None


    def make_pair(x):
        return Pair(x * 2, x.sum(dim=1))


    def make_typed(x):
        return Typed(x + 1, None)


    def make_out(x):
        return Out(x * 3, aux=None)


    def make_odict(x):
        return OrderedDict(b=x * 4, a=x.long())


    def make_none(x):
        return (x * 5, None)


    producers = [make_pair, make_typed, make_out, make_odict, make_none]
    try:
        from transformers.modeling_outputs import BaseModelOutputWithPooling
    except ImportError:
        pass
    else:
        def make_hf(x):
            return BaseModelOutputWithPooling(last_hidden_state=x * 6, pooler_output=x[:, 0])

        producers.append(make_hf)

    x = torch.arange(18.0).reshape(6, 3)
    report = {}
    for produce in producers:
        cached = torchcache(persistent=True, persistent_cache_dir=sys.argv[1])(produce)
        got, want = cached(x), produce(x)
        cached.cache_instance.flush()
        stats = cached.cache_instance.stats()
        fields = [f.name for f in dataclasses.fields(want)] if dataclasses.is_dataclass(want) else None
        values = [getattr(got, f) for f in fields] if fields else list(got.values() if isinstance(got, dict) else got)
        expected = [getattr(want, f) for f in fields] if fields else list(
            want.values() if isinstance(want, dict) else want
        )
        report[produce.__name__] = {
            "type": type(got).__qualname__,
            "same_type": type(got) is type(want),
            "keys": list(got) if isinstance(got, dict) else None,
            "equal": all(
                (g is None and w is None) or (g is not None and w is not None and torch.equal(g, w))
                for g, w in zip(values, expected)
            ) and len(values) == len(expected),
            "hits": stats.hits,
            "misses": stats.misses,
            "disk_hits": stats.disk.hits,
        }
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_typed_outputs_are_disk_hits_in_a_fresh_process(tmp_path: Path) -> None:
    script = tmp_path / "typed_outputs.py"
    runs = []
    for _ in range(2):
        proc = run_python(_SCRIPT, str(tmp_path / "cache"), path=script)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    first, second = runs
    expected_types = {
        "make_pair": "Pair",
        "make_typed": "Typed",
        "make_out": "Out",
        "make_odict": "OrderedDict",
        "make_none": "tuple",
        "make_hf": "BaseModelOutputWithPooling",
    }
    assert set(first) <= set(expected_types) and len(first) >= 5
    for name, report in first.items():
        assert (report["hits"], report["misses"], report["disk_hits"]) == (0, 6, 0), name
    for name, report in second.items():
        assert (report["hits"], report["misses"], report["disk_hits"]) == (6, 0, 6), name
        assert report["type"] == expected_types[name] and report["same_type"], name
        assert report["equal"], name
        assert report["keys"] == first[name]["keys"]
    if "make_hf" in second:
        assert second["make_hf"]["keys"] == ["last_hidden_state", "pooler_output"]


_LAZY_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from torchcache import torchcache


    def produce(x):
        import typed_outputs_mod  # imported by the forward only: a fresh process lacks it on a disk hit

        return typed_outputs_mod.Pair(x * 2, x)


    # check_items off: its extra forward would import the class before the first hit is rebuilt
    cached = torchcache(persistent=True, persistent_cache_dir=sys.argv[1], check_items=False)(produce)
    x = torch.arange(6.0).reshape(3, 2)
    report = {"types": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2):
                out = cached(x)
                report["types"].append(f"{type(out).__module__}.{type(out).__qualname__}")
                assert torch.equal(out.x, x * 2) and torch.equal(out.y, x)
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
    cached.cache_instance.flush()
    stats = cached.cache_instance.stats()
    report.update(hits=stats.hits, misses=stats.misses, warnings=[str(w.message) for w in caught])
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_entry_whose_class_is_not_imported_yet_is_recomputed(tmp_path: Path) -> None:
    # installed code (keyed by its version, not imported by the key), as a library's lazily imported output class
    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "typed_outputs_mod.py").write_text('import collections\nPair = collections.namedtuple("Pair", "x y")\n')
    env = python_env(packages)
    reports = []
    for _ in range(2):
        proc = run_python(_LAZY_SCRIPT, str(tmp_path / "cache"), env=env, path=tmp_path / "lazy.py")
        assert proc.returncode == 0, proc.stderr
        reports.append(json.loads(proc.stdout.splitlines()[-1]))
    first, second = reports
    assert first["error"] is None and (first["hits"], first["misses"]) == (3, 3)
    # the first call finds the entries but cannot rebuild Pair: it warns and computes;
    # the forward imported the class, so the second call is served from disk
    assert second["error"] is None, second["error"]
    assert second["types"] == ["typed_outputs_mod.Pair"] * 2
    assert (second["hits"], second["misses"]) == (3, 3)
    assert any("typed_outputs_mod:Pair" in w for w in second["warnings"])


def test_a_torch_structseq_output_is_refused_with_the_tuple_to_return() -> None:
    with pytest.raises(KeyingError, match=r"torch\.return_types\.max.*Return tuple\(result\)"):
        flatten(torch.randn(3, 4).max(-1))
