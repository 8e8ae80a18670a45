"""The tags of the canonical encoding: one byte per kind of value, each used for one kind only.

Every encoding starts with its kind's tag. A kind either has a fixed size (``None``,
bools, floats, complex numbers, ``...``) or its tag is followed by the payload's length
in 8 bytes and the payload, which is itself a sequence of encodings or a named raw field.
So an encoding is self-delimiting, and two values of different kinds never encode alike.
"""

from __future__ import annotations

import struct

__all__ = ["FIXED", "TAGS", "Tag", "raw", "tagged", "text"]

_LENGTH = struct.Struct("<Q").pack


class Tag:
    """The tag of each kind of value (a test checks that no two kinds share one)."""

    # fixed-size scalars
    NONE = b"N"
    BOOL = b"?"
    FLOAT = b"f"
    COMPLEX = b"x"
    ELLIPSIS = b"."
    NOT_IMPLEMENTED = b"!"
    # length-prefixed scalars
    INT = b"i"
    STR = b"s"
    BYTES = b"y"
    BYTE_BUFFER = b"Y"
    DTYPE = b"d"
    DEVICE = b"v"
    MEMORY_FORMAT = b"h"
    LAYOUT = b"L"
    QSCHEME = b"q"
    RAW = b"r"
    # containers
    TUPLE = b"t"
    LIST = b"l"
    LONG_TUPLE = b"T"
    LONG_LIST = b"V"
    DICT = b"D"
    ORDERED_DICT = b"o"
    LONG_DICT = b"G"
    LONG_ORDERED_DICT = b"g"
    MAPPING_PROXY = b"j"
    SET = b"S"
    FROZENSET = b"z"
    NAMEDTUPLE = b"U"
    DATACLASS = b"W"
    ATTRIBUTES = b"a"
    SLOTS = b"_"
    CYCLE = b"@"
    # chunks of a long container, streamed into its digest
    RUN = b"#"
    INT_RUN = b"1"
    FLOAT_RUN = b"2"
    STR_RUN = b"3"
    INT64_RUN = b"4"
    BOOL_RUN = b"5"
    OBJECT_RUN = b"6"
    # values with a type
    ENUM = b"E"
    TENSOR = b"X"
    ARRAY = b"A"
    MEMMAP = b"m"
    NUMPY_SCALAR = b"n"
    NUMPY_DTYPE = b"e"
    TORCH_SIZE = b"Z"
    NN_MODULE = b"M"
    HOOKS = b"k"
    PATH = b"p"
    RANGE = b"R"
    SLICE = b"c"
    PANDAS = b"H"
    OWN_KEY = b"J"
    CONFIG = b"Q"
    OBJECT = b"O"
    SINGLETON = b"I"
    WEAKREF = b"w"
    # code
    FUNCTION = b"F"
    INSTALLED_FUNCTION = b"P"
    BUILTIN_FUNCTION = b"C"
    PARTIAL = b"K"
    METHOD = b"B"
    CODE = b"b"
    CLASS = b"u"
    INSTALLED_CLASS = b"$"
    PYTHON_MODULE = b"%"
    INSTALLED_MODULE = b"&"
    GLOBALS = b"*"
    GLOBAL_MISSING = b"-"
    BUILTIN_NAME = b"+"
    DESCRIPTOR = b"="
    EMPTY_CELL = b"0"
    WRAPPER = b"~"
    OPERATOR = b"^"
    PROCESS_STATE = b"<"  # the environment or the command line, read through an installed module


#: Every tag, by the name of its kind.
TAGS: dict[str, bytes] = {name: value for name, value in vars(Tag).items() if name.isupper()}
#: Kinds whose encoding has a fixed size (no length field), by tag: the size of the payload.
FIXED: dict[bytes, int] = {
    Tag.NONE: 0,
    Tag.BOOL: 1,
    Tag.FLOAT: 8,
    Tag.COMPLEX: 16,
    Tag.ELLIPSIS: 0,
    Tag.NOT_IMPLEMENTED: 0,
}


def tagged(tag: bytes, payload: bytes) -> bytes:
    """A length-prefixed encoding: the tag, the payload's length in 8 bytes, the payload."""
    return tag + _LENGTH(len(payload)) + payload


def text(value: str) -> bytes:
    """The encoding of a string (a name inside a payload, or a ``str`` value)."""
    return tagged(Tag.STR, value.encode("utf-8", "surrogatepass"))


def raw(data: bytes) -> bytes:
    """A field of raw bytes inside a payload (a digest, bytecode)."""
    return tagged(Tag.RAW, data)
