"""Dataset samples <-> bytes, without pickle.

A sample is what a dataset's ``__getitem__`` returns: CPU tensors of any dtype and
shape, numpy arrays and scalars of numbers, ``bool``, ``int``, ``float``, ``complex``,
``str``, ``bytes``, ``None``, and tuples, lists and dicts (``str`` or ``int`` keys) of
these, nested up to :data:`~torchcache.dtypes.MAX_DEPTH` containers. Each sample carries its own shapes,
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

from ..errors import KeyingError

__all__ = [
    "C128",
    "F64",
    "I64",
    "INT64_RANGE",
    "MAGIC",
    "MAX_DIMS",
    "MAX_ELEMENT_BYTES",
    "MAX_HEADER",
    "MAX_NODES",
    "PREFIX",
    "SampleTypeError",
    "VERSION",
]


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


INT64_RANGE = (-(2**63), 2**63 - 1)


class SampleTypeError(KeyingError):
    """A sample holds a value that cannot be cached (the message names it and its path)."""
