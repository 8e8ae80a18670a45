"""The canonical encoding: a tag per kind, self-delimiting, equal only for equal values of equal types."""

from __future__ import annotations

import collections
import enum
import math
import struct
from typing import Any, NamedTuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.canonical import KeyEncoder
from torchcache.canonical.tags import FIXED, TAGS


class _Color(enum.Enum):
    RED = 1
    BLUE = 2


class _Pair(NamedTuple):
    a: Any
    b: Any


def _encode(value: Any) -> bytes:
    return KeyEncoder("remedy").encode(value, "value")


def test_every_kind_has_a_tag_of_its_own() -> None:
    assert len(set(TAGS.values())) == len(TAGS)
    assert all(len(tag) == 1 for tag in TAGS.values())
    assert set(FIXED) <= set(TAGS.values())


def _split(encoded: bytes) -> list[bytes]:
    """Cut a run of encodings apart by their tags and lengths alone, as any reader could."""
    pieces, at = [], 0
    while at < len(encoded):
        tag = encoded[at : at + 1]
        if tag in FIXED:
            end = at + 1 + FIXED[tag]
        else:
            (length,) = struct.unpack_from("<Q", encoded, at + 1)
            end = at + 9 + length
        pieces.append(encoded[at:end])
        at = end
    assert at == len(encoded)
    return pieces


def _scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=2**63, max_value=2**70),
        st.floats(allow_nan=False),
        st.complex_numbers(allow_nan=False),
        st.text(max_size=5),
        st.binary(max_size=5),
        st.binary(max_size=5).map(bytearray),
        st.sampled_from([_Color.RED, _Color.BLUE, torch.float32, torch.float16, Ellipsis, NotImplemented]),
    )


def _hashable() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3), st.binary(max_size=3))


def _values() -> st.SearchStrategy[Any]:
    return st.recursive(
        _scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.builds(_Pair, inner, inner),
            st.dictionaries(st.text(max_size=3), inner, max_size=3),
            st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict),
            st.sets(_hashable(), max_size=3),
            st.frozensets(_hashable(), max_size=3),
            # long containers are streamed chunk by chunk: runs of one kind, or mixed
            st.lists(st.integers(), min_size=257, max_size=300),
            st.lists(st.one_of(st.integers(), st.booleans(), st.text(max_size=2)), min_size=257, max_size=300),
            st.lists(st.text(max_size=3), min_size=257, max_size=300).map(tuple),
        ),
        max_leaves=10,
    )


def _strict(value: Any) -> Any:
    """A form that is equal exactly when two values are equal and of the same types, all the way down."""
    kind = type(value)
    if isinstance(value, float):
        return (kind.__name__, value.hex())
    if isinstance(value, complex):
        return (kind.__name__, value.real.hex(), value.imag.hex())
    if isinstance(value, (list, tuple)):
        return (kind.__name__, tuple(_strict(v) for v in value))
    if isinstance(value, dict):
        return (kind.__name__, tuple((_strict(k), _strict(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (kind.__name__, frozenset(_strict(v) for v in value))
    if isinstance(value, bytearray):
        return (kind.__name__, bytes(value))
    return (kind.__name__, value)


@settings(max_examples=120, deadline=None)
@given(_values(), _values())
def test_two_values_encode_alike_exactly_when_they_are_equal_and_of_the_same_types(a: Any, b: Any) -> None:
    assert _encode(a) == _encode(a)
    assert (_encode(a) == _encode(b)) == (_strict(a) == _strict(b))


@settings(max_examples=40, deadline=None)
@given(st.lists(_values(), min_size=1, max_size=4))
def test_a_run_of_encodings_splits_back_into_its_values(values: list[Any]) -> None:
    encoded = [_encode(v) for v in values]
    assert _split(b"".join(encoded)) == encoded


def test_floats_are_keyed_by_their_bits() -> None:
    assert _encode(0.0) != _encode(-0.0)
    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    assert math.isnan(nan) and _encode(nan) != _encode(math.nan)
