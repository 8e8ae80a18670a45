"""A features row's layout: random samples of every field kind round-trip through the row and the header."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.dtypes import ALIGN, NUMPY_OF, OUTPUT_DTYPES
from torchcache.stores.features.layout import SampleLayout

_TENSOR_DTYPES = sorted(OUTPUT_DTYPES, key=str)
_NUMPY_DTYPES = sorted({dt.str for dt in NUMPY_OF.values()})
_shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    data = torch.randint(0, 255, (int(np.prod(shape)) * dtype.itemsize,), generator=torch.Generator().manual_seed(seed))
    return data.to(torch.uint8).view(dtype).reshape(shape) if dtype != torch.bool else (data % 2).bool().reshape(shape)


@st.composite
def _value(draw: st.DrawFn, seed: int) -> Any:
    kind = draw(st.sampled_from(["tensor", "array", "scalar", "int", "float", "bool"]))
    if kind == "tensor":
        return _tensor(draw(st.sampled_from(_TENSOR_DTYPES)), draw(_shapes), seed)
    if kind == "int":
        return draw(st.integers(-(2**63), 2**63 - 1))
    if kind == "float":
        return draw(st.floats(allow_nan=False))
    if kind == "bool":
        return draw(st.booleans())
    dtype = np.dtype(draw(st.sampled_from(_NUMPY_DTYPES)))
    shape = draw(_shapes) if kind == "array" else ()
    raw = np.random.default_rng(seed).integers(0, 255, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    values = raw.view(dtype).reshape(shape) if dtype != np.bool_ else (raw % 2).astype(bool).reshape(shape)
    return values.copy() if kind == "array" else values.reshape(-1)[0] if values.size else dtype.type(0)


@st.composite
def samples(draw: st.DrawFn) -> tuple[list[Any], int | str, torch.Tensor]:
    """Two samples of one layout, the name of their input field, and two rows of features."""
    count = draw(st.integers(1, 5))
    container = draw(st.sampled_from(["tensor", "tuple", "list", "dict"]))
    if container == "tensor":
        count = 1
    firsts = [draw(_value(seed=i)) for i in range(count)]
    seconds = [_like(value, seed=100 + i) for i, value in enumerate(firsts)]
    input_at = draw(st.integers(0, count - 1))
    features = _tensor(draw(st.sampled_from(_TENSOR_DTYPES)), (2, *draw(_shapes)), 7)
    keys = [f"k{i}" for i in range(count)]
    built = []
    for values in (firsts, seconds):
        values = list(values)
        values[input_at] = torch.zeros(2)  # the backbone's input: replaced by the features
        if container == "tensor":
            built.append(values[0])
        elif container == "dict":
            built.append(dict(zip(keys, values)))
        else:
            built.append(tuple(values) if container == "tuple" else values)
    return built, (keys[input_at] if container == "dict" else input_at), features


def _like(value: Any, seed: int) -> Any:
    """Another value of the same field kind, dtype and shape."""
    if isinstance(value, torch.Tensor):
        return _tensor(value.dtype, tuple(value.shape), seed)
    if isinstance(value, np.ndarray):
        return value[::-1].copy() if value.ndim else value.copy()
    if isinstance(value, bool):
        return not value
    if isinstance(value, (np.generic, int, float)):
        return value
    raise AssertionError(type(value))


def _same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bytes(got.reshape(-1).contiguous().view(torch.uint8).numpy()) == bytes(
            want.reshape(-1).contiguous().view(torch.uint8).numpy()
        )
    elif isinstance(want, (np.ndarray, np.generic)):
        assert got.dtype == want.dtype and np.asarray(got).tobytes() == np.asarray(want).tobytes()
    else:
        assert got == want


@settings(max_examples=150, deadline=None)
@given(samples())
def test_every_field_kind_round_trips_through_the_row_and_the_header(drawn: Any) -> None:
    pair, input_name, features = drawn
    layout = SampleLayout.of_sample(pair[0], input_name).with_features(features[0])
    assert SampleLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    at = 0  # each field where a packed row puts it, in the sample's order
    for name in layout.names:
        field = next(f for f in layout.fields if f.name == name)
        assert field.offset == at
        at += -(-field.nbytes // ALIGN) * ALIGN
    assert layout.stride == -(-max(at, 1) // 16) * 16
    _, columns = layout.split(pair)
    rows = np.full((2, layout.stride), 0xAB, np.uint8)  # every byte of every field is written
    layout.fill(rows, features, columns)
    for got, sample, row in zip(layout.decode(rows), pair, features):
        if layout.container == "tensor":
            _same(got, row)
            continue
        items = got.items() if isinstance(got, dict) else enumerate(got)
        want = dict(sample) if isinstance(sample, dict) else dict(enumerate(sample))
        for key, value in items:
            _same(value, row if str(key) == str(input_name) else want[key])


@pytest.mark.parametrize("container", ["tuple", "dict"])
def test_the_input_field_may_be_anywhere_in_the_sample(container: str) -> None:
    values = [np.float32(1.5), torch.zeros(3), 7]
    sample = tuple(values) if container == "tuple" else dict(zip("abc", values))
    layout = SampleLayout.of_sample(sample, 1 if container == "tuple" else "b").with_features(torch.ones(4))
    assert [f.offset for f in layout.fields] == [8, 0, 24] and layout.to_json()["input"] == 1
