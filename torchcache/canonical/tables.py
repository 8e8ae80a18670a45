"""pandas values in keys: by every row, their index, columns and dtypes, and the files their paths name.

``hash_pandas_object`` hashes rows fast but not exactly: ``-0.0`` as ``0.0``, every NaN
as one, ``None`` as NaN in object columns, and any other object by its text (a
``pathlib`` path, a 0-d tensor printed at four decimals). So float columns are keyed by
their bytes too, object columns by the type of each cell, and the paths in them through
the encoder (with a dataset's, by their files). A frame with object cells other than
strings, bytes, numbers, ``None`` and paths (lists, tuples, arrays, tensors) is keyed
cell by cell by the encoder instead.
"""

from __future__ import annotations

import sys
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from .tags import Tag, raw, tagged

if TYPE_CHECKING:
    from .values import KeyEncoder

__all__ = ["encode_pandas"]


def encode_pandas(encoder: KeyEncoder, value: object, path: str, depth: int) -> bytes | None:
    """A pandas ``DataFrame``, ``Series`` or ``Index``; ``None`` for anything else."""
    pandas = sys.modules.get("pandas")
    if pandas is None or not isinstance(value, (pandas.DataFrame, pandas.Series, pandas.Index)):
        return None
    head = encoder.child(type(value), path, depth)
    attrs = getattr(value, "attrs", None)
    tail = encoder.child(dict(attrs), f"{path}.attrs", depth) if attrs else b""
    objects = _object_columns(pandas, value)
    if not all(isinstance(cell, _PLAIN) for column in objects for cell in column):
        # Cells pandas hashes by their text (a 0-d tensor printed at 4 decimals, a tuple holding a path)
        # or cannot hash (lists, dicts, arrays): each by the encoder
        return tagged(Tag.PANDAS, head + _cells(encoder, pandas, value, path, depth) + tail)
    try:
        digest = _digest(pandas, value)
    except (TypeError, ValueError, RuntimeError):  # a cell pandas cannot hash after all
        return tagged(Tag.PANDAS, head + _cells(encoder, pandas, value, path, depth) + tail)
    paths = [cell for column in objects for cell in column if isinstance(cell, PurePath)]
    files = encoder.child(paths, f"{path}.<paths>", depth) if paths else b""  # their files, not their text
    return tagged(Tag.PANDAS, head + raw(digest) + files + tail)


#: Cells of object columns that pandas hashes exactly (paths by their text: their files are keyed apart).
_PLAIN = (str, bytes, bool, int, float, complex, type(None), np.number, np.bool_, PurePath)


def _object_columns(pandas: Any, value: Any) -> list[Any]:
    """The object-dtype columns of a pandas value, its index included, as numpy arrays."""
    if isinstance(value, pandas.Index):
        parts = [value]
    elif isinstance(value, pandas.DataFrame):
        parts = [value.iloc[:, i] for i in range(value.shape[1])] + [value.index]
    else:
        parts = [value, value.index]
    return [part.to_numpy() for part in parts if part.dtype == np.dtype(object)]


def _cells(encoder: KeyEncoder, pandas: Any, value: Any, path: str, depth: int) -> bytes:
    """A pandas value cell by cell: index, columns with their dtypes, and each column's cells."""
    index = value if isinstance(value, pandas.Index) else value.index
    parts = [encoder.child([list(index.names), _dtype(pandas, index.dtype), index.tolist()], f"{path}.index", depth)]
    if isinstance(value, pandas.DataFrame):
        parts.append(encoder.child([value.columns.name, list(value.columns)], f"{path}.columns", depth))
        for i, name in enumerate(value.columns):
            column = value.iloc[:, i]
            described = [name, _dtype(pandas, column.dtype), column.tolist()]
            parts.append(encoder.child(described, f"{path}[{name!r}]", depth))
    elif not isinstance(value, pandas.Index):
        parts.append(encoder.child([value.name, _dtype(pandas, value.dtype), value.tolist()], path, depth))
    return b"".join(parts)


def _dtype(pandas: Any, dtype: Any) -> object:
    """A dtype by its name, a categorical one with its categories in order and whether it is ordered."""
    if isinstance(dtype, pandas.CategoricalDtype):
        return [str(dtype), dtype.categories.tolist(), bool(dtype.ordered)]
    return str(dtype)


def _digest(pandas: Any, value: Any) -> bytes:
    """Every row (``hash_pandas_object``), the index, columns and dtypes; float columns by their bytes too.

    Raises:
        TypeError, ValueError, RuntimeError: If pandas cannot hash a cell (a list, a dict, a tensor).
    """
    hashed = pandas.util.hash_pandas_object
    rows = hashed(value, index=not isinstance(value, pandas.Index))
    h = xxhash.xxh3_128(np.ascontiguousarray(rows.to_numpy()).view(np.uint8).data)
    index = value if isinstance(value, pandas.Index) else value.index
    h.update(repr((list(index.names), [str(t) for t in getattr(index, "dtypes", [index.dtype])])).encode())
    if isinstance(value, pandas.DataFrame):
        h.update(repr((list(value.columns), [str(t) for t in value.dtypes])).encode())
        columns = [value.iloc[:, i] for i in range(value.shape[1])]
    else:
        h.update(repr((value.name, str(value.dtype))).encode())
        columns = [value]
    for column in [*columns, *([] if isinstance(value, pandas.Index) else [index.to_series()])]:
        dtype = column.dtype
        if isinstance(dtype, pandas.CategoricalDtype):  # its categories in order, used or not
            h.update(b"categories|%d|" % dtype.ordered)
            h.update(np.ascontiguousarray(hashed(dtype.categories, index=False).to_numpy()).view(np.uint8).data)
        elif dtype == np.dtype(object):  # None and NaN hash alike: the type of each cell tells them apart
            names = pandas.Index([type(cell).__qualname__ for cell in column.to_numpy()])
            h.update(np.ascontiguousarray(hashed(names, index=False).to_numpy()).view(np.uint8).data)
        elif isinstance(dtype, np.dtype) and dtype.kind in "fc":  # -0.0 and NaN payloads, as themselves
            h.update(np.ascontiguousarray(column.to_numpy()).view(np.uint8).data)
    return h.digest()
