"""The dtypes a cache stores, and the limits of a stored value: one table for every format.

Module outputs, dataset samples and feature rows name a dtype the same way: by its torch
name (``"float32"``), or in the headers of module outputs by a short code (``"f4"``).
Reading a file only ever looks a name or a code up here, so no stored byte can name
anything else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "ALIGN",
    "CODE_OF",
    "DTYPES",
    "MAX_DEPTH",
    "NAME_OF",
    "NUMPY_DTYPES",
    "NUMPY_OF",
    "OUTPUT_DTYPES",
    "channels_last_format",
    "dtype_named",
    "standard_strides",
]

#: Containers nested deeper than this are neither cached nor read from a file.
MAX_DEPTH = 32

#: Stored leaves start at multiples of this many bytes.
ALIGN = 8

_NAMES = (
    *("float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128"),
    *("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"),
    *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"),
)

#: Every tensor dtype that can be stored, by name (the names this torch has).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}

#: The name of each dtype in :data:`DTYPES`.
NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}

#: The dtypes of module outputs and feature rows: those whose batches torch can gather and
#: assign on every device (the others lack ``index_copy`` or ``==`` kernels).
OUTPUT_DTYPES: frozenset[torch.dtype] = frozenset(
    DTYPES[name]
    for name in (
        *("float64", "float32", "float16", "bfloat16", "complex64", "complex128"),
        *("int64", "int32", "int16", "int8", "uint8", "bool"),
    )
)

#: Short codes of module output headers: numpy's type strings, and ``"bf2"`` for bfloat16
#: (a (768,) entry's header is 25 bytes with names, 20 with codes).
CODE_OF: dict[torch.dtype, str] = {
    torch.float64: "f8",
    torch.float32: "f4",
    torch.float16: "f2",
    torch.bfloat16: "bf2",
    torch.complex64: "c8",
    torch.complex128: "c16",
    torch.int64: "i8",
    torch.int32: "i4",
    torch.int16: "i2",
    torch.int8: "i1",
    torch.uint8: "u1",
    torch.bool: "b1",
}

_BY_NAME_OR_CODE: dict[str, torch.dtype] = {**DTYPES, **{code: dt for dt, code in CODE_OF.items()}}

# Built with numpy (faster) where numpy has the dtype; the others (bfloat16, float8...)
# with torch.frombuffer. ``hasattr(np, "bool")`` would warn under numpy 1.x, hence names.
_NUMPY_NAMES = frozenset(("float64", "float32", "float16", "complex64", "complex128", "bool"))

#: The numpy dtype of each tensor dtype numpy has.
NUMPY_OF: dict[torch.dtype, np.dtype[Any]] = {
    DTYPES[name]: np.dtype(name) for name in DTYPES if name in _NUMPY_NAMES or name.startswith(("int", "uint"))
}

#: Numpy array dtypes that can be stored, by ``dtype.str`` (both byte orders). Where two types share
#: one (``long`` and ``longlong`` are both ``<i8`` on Linux), the sized name's type wins: ``np.int64``
#: comes back as ``np.int64``.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    dt.str: dt
    for code in [*"?bBhHiIlLqQefdFD", "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
    for dt in (np.dtype(code).newbyteorder("<"), np.dtype(code).newbyteorder(">"))
}


def dtype_named(name: object, allowed: frozenset[torch.dtype] | None = None) -> torch.dtype | None:
    """The dtype a stored name or code stands for, or ``None`` if it names none.

    Args:
        name: A name from a file (``"float32"`` or ``"f4"``); anything else gives ``None``.
        allowed: Only these dtypes count (default: every dtype in :data:`DTYPES`).

    Example:
        >>> dtype_named("f4"), dtype_named("float32"), dtype_named("float31")
        (torch.float32, torch.float32, None)
    """
    if not isinstance(name, str):
        return None
    dtype = _BY_NAME_OR_CODE.get(name)
    if dtype is None or (allowed is not None and dtype not in allowed):
        return None
    return dtype


def standard_strides(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` with the strides torch gives a new one: a view, no copy.

    Torch counts a tensor as contiguous whatever the stride of a dimension of size one
    (``torch.arange(5.0).view(1, 5).T``), while ``view(torch.uint8)`` needs the last
    stride to be 1.
    """
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= max(size, 1)
    wanted = tuple(reversed(strides))
    return tensor if tensor.stride() == wanted else tensor.as_strided(tensor.shape, wanted, tensor.storage_offset())


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def channels_last_format(tensor: torch.Tensor) -> torch.memory_format | None:
    """``torch.channels_last`` (4-D) or ``channels_last_3d`` (5-D) where ``tensor`` is so and not also contiguous."""
    layout = _CHANNELS_LAST.get(tensor.dim())
    return (
        layout
        if layout is not None and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=layout)
        else None
    )
