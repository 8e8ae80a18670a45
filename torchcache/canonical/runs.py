"""Chunks of long containers, streamed into their digest: a run of one kind encoded in one step.

A list, tuple or dict longer than a few hundred items is keyed by its length and the
digest of its chunks of 4,096 items (keys and values of a dict chunk by chunk), so that
its encoding never sits whole in memory. A chunk whose items are all of one kind is
encoded in one step: ints as 8-byte integers (or their decimals, beyond 64 bits), floats
by their bits, strings by their lengths and joined text, bools as bytes, and plain
objects of one class column by column. Any other chunk is its items' encodings. Each
form has a tag of its own, so two chunks encode alike only when they hold equal items of
equal types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .tags import Tag, raw, tagged, text

if TYPE_CHECKING:
    from .values import KeyEncoder

__all__ = ["CHUNK", "encode_chunk", "encode_items"]

CHUNK = 4096


def encode_items(encoder: KeyEncoder, items: Sequence[Any], path: str, start: int, depth: int) -> bytes:
    """Items one after another, each by its own encoding (its path names its index)."""
    scalars = encoder.scalars
    encode = encoder.child
    parts = []
    for i, item in enumerate(items, start):
        scalar = scalars(type(item))
        parts.append(scalar(item) if scalar is not None else encode(item, f"{path}[{i}]", depth))
    return b"".join(parts)


def encode_chunk(encoder: KeyEncoder, chunk: Sequence[Any], path: str, start: int, depth: int) -> bytes:
    """One chunk of a long container, in one step when its items are all of one kind."""
    kinds = set(map(type, chunk))
    if len(kinds) == 1:
        kind = kinds.pop()
        if kind is int:
            try:
                return tagged(Tag.INT64_RUN, np.array(chunk, dtype=np.int64).tobytes())
            except OverflowError:  # beyond 64 bits
                return tagged(Tag.INT_RUN, " ".join(map(str, chunk)).encode())
        if kind is float:
            return tagged(Tag.FLOAT_RUN, np.array(chunk, dtype=np.float64).tobytes())
        if kind is str:  # the lengths in characters split the joined text again, so they are enough
            lengths = np.fromiter(map(len, chunk), dtype=np.int64, count=len(chunk)).tobytes()
            return tagged(Tag.STR_RUN, raw(lengths) + raw("".join(chunk).encode("utf-8", "surrogatepass")))
        if kind is bool:
            return tagged(Tag.BOOL_RUN, bytes(chunk))
        columns = _object_columns(encoder, chunk, kind, path, start, depth)
        if columns is not None:
            return columns
    return tagged(Tag.RUN, encode_items(encoder, chunk, path, start, depth))


def _object_columns(
    encoder: KeyEncoder, chunk: Sequence[Any], kind: type, path: str, start: int, depth: int
) -> bytes | None:
    """Plain objects of one class with the same attributes, column by column; ``None`` for any other chunk."""
    encoder.child(chunk[0], f"{path}[{start}]", depth)  # refuses it, or learns whether its class is plain
    cls_encoding = encoder.plain_encoding(kind)
    if cls_encoding is None:
        return None
    states = [vars(item) for item in chunk]
    names = states[0].keys()
    if not all(state.keys() == names for state in states):
        return None
    parts = [cls_encoding]
    for name in sorted(names):
        if not encoder.ignored(path, name):
            column = [state[name] for state in states]
            parts.append(text(name) + encode_chunk(encoder, column, f"{path}[...].{name}", start, depth))
    return tagged(Tag.OBJECT_RUN, b"".join(parts))
