"""Dataset samples <-> bytes, without pickle.

A sample is what a dataset's ``__getitem__`` returns: CPU tensors of any dtype and
shape, numpy arrays and scalars of numbers, ``bool``, ``int``, ``float``, ``complex``,
``str``, ``bytes``, ``None``, and tuples, lists and dicts (``str`` or ``int`` keys) of
these, nested up to :data:`MAX_DEPTH` containers. Each sample carries its own shapes,
so they may vary from sample to sample. Layout of a frame::

    magic "TCSM" | version u8 | 3 reserved bytes | header length u32
    | header (ASCII JSON: the tree, dtypes and shapes) | data (the leaves' bytes)

The header holds no values that vary between samples of one shape (numbers and
strings are in the data, each leaf at the next multiple of 8 bytes), so the samples of
a dataset share a few headers, and the decoder keeps the *plan* it compiled from each
header (validated once: known tags and dtypes, bounded depth, node count and
dimensions). Decoding checks that the data is exactly as long as the plan needs, copies
it once into a new ``bytearray`` and builds every leaf as a view of that copy: the
tensors it returns never alias the caller's buffer, and a hostile frame raises
:class:`~torchcache.errors.CorruptEntryError`, never allocates more than it holds.
Integrity (checksums) is the store's job.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from ..errors import KeyingError

__all__ = [
    "ALIGN",
    "C128",
    "F64",
    "I64",
    "INT64_RANGE",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_ELEMENT_BYTES",
    "MAX_HEADER",
    "MAX_NODES",
    "NUMPY_DTYPES",
    "NUMPY_OF",
    "PREFIX",
    "SampleTypeError",
    "TORCH_DTYPES",
    "TORCH_NAME",
    "VERSION",
]


#: Containers nested deeper than this are refused (encoding) or rejected (decoding).
MAX_DEPTH = 32


#: At most this many values (leaves and containers) in one sample.
MAX_NODES = 100_000


MAX_HEADER = 1 << 22


MAX_DIMS = 32


MAX_ELEMENT_BYTES = 1 << 62


MAGIC = b"TCSM"


VERSION = 1


PREFIX = struct.Struct("<4sBxxxI")


I64 = struct.Struct("<q")


F64 = struct.Struct("<d")


C128 = struct.Struct("<dd")


ALIGN = 8


INT64_RANGE = (-(2**63), 2**63 - 1)


_TORCH_NAMES = (
    *("float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128"),
    *("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"),
    *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"),
)


#: Tensor dtypes that can be cached, by name. Decoding only looks names up here.
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _TORCH_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}


TORCH_NAME = {dt: name for name, dt in TORCH_DTYPES.items()}


# Built with numpy (faster); the others (bfloat16, float8...) with torch.frombuffer.
# Names numpy has as dtypes (``hasattr(np, "bool")`` would warn under numpy 1.x).
_NUMPY_NAMES = frozenset(("float64", "float32", "float16", "complex64", "complex128", "bool"))


NUMPY_OF: dict[torch.dtype, np.dtype[Any]] = {
    TORCH_DTYPES[name]: np.dtype(name)
    for name in TORCH_DTYPES
    if name in _NUMPY_NAMES or name.startswith(("int", "uint"))
}


#: Numpy dtypes that can be cached, by ``dtype.str`` (both byte orders).
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    dt.str: dt
    for code in "?bBhHiIlLqQefdFD"
    for dt in (np.dtype(code).newbyteorder("<"), np.dtype(code).newbyteorder(">"))
}


class SampleTypeError(KeyingError):
    """A sample holds a value that cannot be cached (the message names it and its path)."""
