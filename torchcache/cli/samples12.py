"""Dataset samples of torchcache 1.2 into the frames every cache writes now, for ``torchcache migrate``.

torchcache 1.2 kept dataset samples in frames of their own::

    magic "TCSM" | version u8 (1) | 3 reserved bytes | header length u32
    | header (JSON: the sample's tree) | data (its leaves, each at a multiple of 8 bytes)

Their data is the payload of today's frame (:mod:`torchcache.datasets.encode`) less the
last leaf's padding, and their tree says what today's layout says in other words, so a
sample is converted by rewriting its header, without building it. Only this module
reads the old frames; the library treats one it meets as a miss and says to migrate.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

from ..codec import encode_header, nested_deeper_than, seal
from ..datasets.decode import decode_sample
from ..datasets.encode import MAGIC_1_2, is_sample_1_2
from ..dtypes import ALIGN, CODE_OF, DTYPES, MAX_DEPTH
from ..errors import CorruptEntryError
from ..stores.batched import BatchedStore

__all__ = ["convert_sample", "migrate_samples"]
_PREFIX = struct.Struct("<4sBxxxI")
_BATCH = 256
_NUMBERS = {"i": ["i8", []], "f": ["f8", []], "c": ["c16", []]}


def convert_sample(frame: bytes | memoryview) -> bytes:
    """The frame of today's format holding the sample of a torchcache 1.2 frame.

    The result is checked as the library reads it (:func:`~torchcache.datasets.decode.decode_sample`).

    Raises:
        CorruptEntryError: If ``frame`` is not a whole, valid torchcache 1.2 sample frame.
    """
    view = memoryview(frame).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptEntryError("not a torchcache 1.2 sample frame: too short")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC_1_2 or version != 1 or _PREFIX.size + header_len > len(view):
        raise CorruptEntryError("not a torchcache 1.2 sample frame")
    start = _PREFIX.size + header_len
    try:
        tree = json.loads(bytes(view[_PREFIX.size : start]))
    except (ValueError, RecursionError):
        raise CorruptEntryError("not a torchcache 1.2 sample frame: its header is not JSON") from None
    if nested_deeper_than(tree, 2 * MAX_DEPTH + 4):
        raise CorruptEntryError("not a valid torchcache 1.2 sample: nested too deeply")
    leaves: list[list[Any]] = []
    try:
        new_tree = _convert(tree, 0, leaves)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise CorruptEntryError(f"not a valid torchcache 1.2 sample: {str(exc)[:200]}") from None
    header = encode_header({"l": leaves} if new_tree == "T" else {"l": leaves, "t": new_tree})
    data = view[start:]
    converted = seal(header, [data, bytes(-len(data) % ALIGN)])
    decode_sample(converted)  # raises CorruptEntryError if it does not hold what its header says
    return converted


def _convert(node: Any, depth: int, leaves: list[list[Any]]) -> Any:
    """Today's structure node of a 1.2 tree node; the leaves it holds are appended to ``leaves``."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if node is None:
        return "N"
    if node is True or node is False:
        return node
    if type(node) is str and node in _NUMBERS:
        leaves.append(_NUMBERS[node])
        return node
    tag, args = node[0], node[1:]
    if tag in ("s", "b"):
        leaves.append(["u1", [args[0]]])
        return "s" if tag == "s" else "y"
    if tag == "I":
        return ["I", args[0]]
    if tag == "t":
        leaves.append([CODE_OF.get(DTYPES[args[0]], args[0]), args[1]])
        return "T"
    if tag == "a":
        leaves.append([args[0], args[1]])
        return "A"
    if tag == "n":
        leaves.append([args[0], []])
        return "S"
    if tag in ("u", "l"):
        return ["tuple" if tag == "u" else "list", [_convert(child, depth + 1, leaves) for child in args[0]]]
    if tag == "d":
        keys, children = args
        if len(keys) != len(children):
            raise ValueError("a dict node with more keys than values, or fewer")
        return ["dict", [[key, _convert(child, depth + 1, leaves)] for key, child in zip(keys, children)]]
    raise ValueError(f"unknown node {str(node)[:40]}")


def migrate_samples(store: BatchedStore, tick: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Rewrite the torchcache 1.2 samples of a store in today's format, in place.

    Every entry is read; entries in today's format (and module outputs) are left as they
    are. A 1.2 sample that does not convert is removed (the cache computes it again).

    Returns:
        The samples converted, and those removed.

    Raises:
        OSError: If the store cannot be read or written (``StoreError`` included).
    """
    moved = dropped = 0
    everything = list(store.keys())  # listed before anything is written
    for start in range(0, len(everything), _BATCH):
        keys = everything[start : start + _BATCH]
        frames = store.get_many(keys)
        converted: list[tuple[str, bytes | memoryview]] = []
        damaged: list[str] = []
        for key, frame in zip(keys, frames):
            if frame is None or not is_sample_1_2(frame):
                continue
            try:
                converted.append((key, convert_sample(frame)))
            except CorruptEntryError:
                damaged.append(key)
        if converted:
            store.put_many(converted)
        if damaged:
            store.delete_many(damaged)
        moved, dropped = moved + len(converted), dropped + len(damaged)
        if tick is not None:
            tick(len(keys))
    return moved, dropped
