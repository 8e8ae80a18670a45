"""How one sample of a features cache lies in a row of fixed size, and back.

A sample is what the dataset returns: a tensor (the backbone's input), or a tuple, list
or dict whose ``input`` field goes through the backbone and whose other fields (a
label, a weight, a mask) are stored beside the output. Each field has one kind, dtype
and shape for the whole dataset, so that every row has the same size: the stored
sample is the backbone's output in place of its input, and the other fields as the
dataset returned them (a Python ``int`` comes back an ``int``, a numpy scalar a numpy
scalar, a tensor a tensor). What cannot be stored in a fixed size (strings, ``None``,
nested containers, a field whose shape varies) is refused with a message naming it.

The layout is described in JSON (field names, kinds, dtype names, shapes, offsets) in
the file's header and checked field by field when it is read back: names come from a
closed list, so reading a layout can never reach anything but numpy and torch dtypes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...dtypes import NAME_OF, NUMPY_OF, OUTPUT_DTYPES
from ...errors import ConfigError, CorruptEntryError

__all__ = ["Field", "SampleLayout", "VariableLayoutError"]

_ALIGN = 16
_MAX_FIELDS = 64
_MAX_ROW = 1 << 30
#: Dtypes of tensor fields by name, and of numpy fields by name (from :mod:`torchcache.dtypes`).
_TENSOR = {NAME_OF[dt]: dt for dt in OUTPUT_DTYPES}
_NUMPY = {dt.name: dt for dt in NUMPY_OF.values()}
_PLAIN = {"int": np.dtype("<i8"), "float": np.dtype("<f8"), "bool": np.dtype("bool")}
_PLAIN_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}
_KINDS = ("features", "tensor", "array", "scalar", "int", "float", "bool")
_CONTAINERS = ("tensor", "tuple", "list", "dict")


class VariableLayoutError(ConfigError):
    """The samples do not fit one fixed-size row: a field of another kind or shape, or one of no fixed size."""


def _up(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class Field:
    """One field of a stored sample: where it is in the row and what it becomes when read."""

    name: str  # the position in a tuple or list, or the key of a dict
    kind: str  # one of _KINDS; "features" is the backbone's output
    dtype: str  # a torch dtype name for tensors and features, a numpy one for arrays and scalars
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def itemsize(self) -> int:
        """Bytes of one element."""
        if self.kind in ("features", "tensor"):
            return _TENSOR[self.dtype].itemsize
        return self.numpy_dtype.itemsize

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the field's bytes (uint8 for torch dtypes numpy lacks)."""
        if self.kind in _PLAIN:
            return _PLAIN[self.kind]
        if self.kind in ("features", "tensor"):
            return np.dtype(f"u{_TENSOR[self.dtype].itemsize}") if self.dtype == "bfloat16" else _NUMPY[self.dtype]
        return _NUMPY[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the field in a row."""
        return math.prod(self.shape) * self.itemsize


def describe_field(name: str, value: object) -> Field:
    """The field that stores ``value`` (a field other than the backbone's input).

    Raises:
        ConfigError: If the value cannot be stored in a fixed number of bytes.
    """
    if isinstance(value, bool):
        return Field(name, "bool", "bool", ())
    if isinstance(value, np.generic) and value.dtype.name in _NUMPY:  # before float: np.float64 is a float
        return Field(name, "scalar", value.dtype.name, ())
    if isinstance(value, int):
        return Field(name, "int", "int64", ())
    if isinstance(value, float):
        return Field(name, "float", "float64", ())
    if isinstance(value, torch.Tensor) and str(value.dtype).removeprefix("torch.") in _TENSOR:
        return Field(name, "tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape))
    if isinstance(value, np.ndarray) and value.dtype.name in _NUMPY:
        return Field(name, "array", value.dtype.name, tuple(value.shape))
    raise VariableLayoutError(
        f"field {name} of the samples is a {type(value).__name__}, which a features cache cannot store in a fixed "
        "number of bytes: the fields beside the backbone's input must be ints, floats, bools, numpy scalars, "
        "arrays or tensors of one shape (map a string label to a class index, for example)"
    )


@dataclass(frozen=True)
class SampleLayout:
    """Where each field of a sample lies in a row, and the row's size.

    Args:
        container: ``"tensor"`` (the sample is the input itself), ``"tuple"``, ``"list"`` or ``"dict"``.
        names: The fields in the sample's order (positions as strings, or dict keys).
        input: The name of the field that goes through the backbone.
        fields: The stored fields, the features first; offsets set by :meth:`place`.
        stride: Bytes per row.
    """

    container: str
    names: tuple[str, ...]
    input: str
    fields: tuple[Field, ...]
    stride: int = 0

    @classmethod
    def of_sample(cls, sample: object, input: int | str) -> SampleLayout:
        """The layout of samples like ``sample`` (features to be set by :meth:`with_features`).

        Raises:
            ConfigError: If ``input`` names no field of the sample, or a field cannot be stored.
        """
        if isinstance(sample, torch.Tensor):
            return cls("tensor", ("0",), "0", ())
        if isinstance(sample, Mapping):
            names = tuple(sample)
            if not all(isinstance(n, str) for n in names):
                raise ConfigError(f"dict samples need string keys, got {names!r}")
            container = "dict"
        elif isinstance(sample, (tuple, list)):
            names = tuple(str(i) for i in range(len(sample)))
            container = "tuple" if isinstance(sample, tuple) else "list"
        else:
            raise ConfigError(
                f"the dataset's samples are {type(sample).__name__} objects; extract_features needs a tensor, "
                "or a tuple, list or dict of fields such as (image, label)"
            )
        name = str(input)
        if name not in names or (container != "dict" and isinstance(input, str)):
            shown = list(names) if container == "dict" else f"0 to {len(names) - 1}"
            raise ConfigError(f"input={input!r} names no field of the dataset's samples (fields: {shown})")
        values = sample.values() if isinstance(sample, Mapping) else sample
        others = tuple(describe_field(n, v) for n, v in zip(names, values, strict=True) if n != name)
        return cls(container, names, name, others)

    @functools.cached_property
    def _keys(self) -> tuple[Any, tuple[Any, ...]]:
        """The input's key in a sample, and the other stored fields' keys (positions, or dict keys)."""
        convert = (lambda name: name) if self.container == "dict" else int
        return convert(self.input), tuple(convert(f.name) for f in self.fields if f.kind != "features")

    def split(self, samples: Sequence[Any]) -> tuple[list[Any], list[list[Any]]]:
        """The backbone's inputs of a batch of samples, and each other field's values (a column per field)."""
        if self.container == "tensor":
            return list(samples), []
        key, others = self._keys
        return [sample[key] for sample in samples], [[sample[k] for sample in samples] for k in others]

    def with_features(self, output: torch.Tensor) -> SampleLayout:
        """The layout completed with the features of one sample's output, offsets placed.

        Raises:
            ConfigError: If the output's dtype cannot be stored.
        """
        dtype = str(output.dtype).removeprefix("torch.")
        if dtype not in _TENSOR:
            raise ConfigError(f"the backbone returns {output.dtype} outputs, which a features cache cannot store")
        first = Field(self.input, "features", dtype, tuple(output.shape))
        placed, at = [], 0
        for f in (first, *(f for f in self.fields if f.kind != "features")):
            at = _up(at, min(f.itemsize, _ALIGN))
            placed.append(Field(f.name, f.kind, f.dtype, f.shape, at))
            at += f.nbytes
        return SampleLayout(self.container, self.names, self.input, tuple(placed), _up(max(at, 1), _ALIGN))

    @property
    def features(self) -> Field:
        """The backbone's output field."""
        return self.fields[0]

    # -- rows -----------------------------------------------------------------------
    def fill(self, rows: np.ndarray[Any, Any], features: torch.Tensor, columns: Sequence[Sequence[Any]]) -> None:
        """Write a batch of samples into ``rows`` (``(batch, stride)`` uint8, zero between fields).

        ``columns`` holds each other field's values, as :meth:`split` gives them. Every
        byte of every field is written, so a buffer may be filled again for each batch.

        Raises:
            ConfigError: If a sample does not fit the layout (a shape or kind that varies).
        """
        first = self.features
        count = len(rows)
        if tuple(features.shape[1:]) != first.shape or str(features.dtype).removeprefix("torch.") != first.dtype:
            raise VariableLayoutError(
                f"the backbone returned {features.dtype} outputs of shape {tuple(features.shape[1:])} for a sample, "
                f"but {first.dtype} outputs of shape {first.shape} for the first one: a features cache needs outputs "
                "of one shape"
            )
        flat = features.detach().to("cpu").contiguous().reshape(count, -1)
        raw = flat.view(torch.uint8).numpy() if first.nbytes else np.zeros((count, 0), np.uint8)
        rows[:, first.offset : first.offset + first.nbytes] = raw.reshape(count, first.nbytes)
        for j, f in enumerate(self.fields[1:]):
            column = rows[:, f.offset : f.offset + f.nbytes]
            values = columns[j]
            plain = _PLAIN_TYPES.get(f.kind)
            if plain is not None and all(type(v) is plain for v in values):  # the common case: one array
                try:
                    column[:] = np.asarray(values, f.numpy_dtype).view(np.uint8).reshape(count, f.nbytes)
                except OverflowError:
                    raise ConfigError(f"field {f.name} of a sample is beyond a 64-bit integer") from None
                continue
            for row, value in zip(column, values, strict=True):
                row[:] = self._field_bytes(f, value)

    def _field_bytes(self, f: Field, value: object) -> np.ndarray[Any, Any]:
        found = describe_field(f.name, value)
        if (found.kind, found.dtype, found.shape) != (f.kind, f.dtype, f.shape):
            raise VariableLayoutError(
                f"field {f.name} of a sample is {found.kind} {found.dtype} {found.shape}, but {f.kind} {f.dtype} "
                f"{f.shape} in the first sample: a features cache needs every field in one kind and shape"
            )
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            return np.ascontiguousarray(np.asarray(value, f.numpy_dtype)).reshape(-1).view(np.uint8)
        except OverflowError:
            raise ConfigError(f"field {f.name} of a sample is {value!r}, beyond a 64-bit integer") from None

    def decode(self, rows: np.ndarray[Any, Any]) -> list[Any]:
        """The samples stored in ``rows`` (``(batch, stride)`` uint8): tensors view ``rows``."""
        count = len(rows)
        columns = [_column(f, rows, count) for f in self.fields]
        if self.container == "tensor":
            return columns[0]
        by_name = dict(zip((f.name for f in self.fields), columns, strict=True))
        ordered = [by_name[name] for name in self.names]
        if self.container == "tuple":
            return list(zip(*ordered, strict=True))
        if self.container == "list":
            return [list(values) for values in zip(*ordered, strict=True)]
        return [dict(zip(self.names, values, strict=True)) for values in zip(*ordered, strict=True)]

    def collate(self, rows: np.ndarray[Any, Any]) -> Any:
        """The samples stored in ``rows`` as one batch, as ``default_collate`` makes it of :meth:`decode`'s samples.

        Each field is one contiguous tensor with the batch first (tuples and lists become
        lists of fields, as ``default_collate`` makes them); one copy of each field's bytes.
        """
        count = len(rows)
        columns = [_batch(f, rows, count) for f in self.fields]
        if self.container == "tensor":
            return columns[0]
        by_name = dict(zip((f.name for f in self.fields), columns, strict=True))
        if self.container == "dict":
            return {name: by_name[name] for name in self.names}
        return [by_name[name] for name in self.names]

    # -- JSON -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The layout as JSON-able data, for the file's header."""
        return {
            "container": self.container,
            "names": list(self.names),
            "input": self.input,
            "stride": self.stride,
            "fields": [
                {"name": f.name, "kind": f.kind, "dtype": f.dtype, "shape": list(f.shape), "offset": f.offset}
                for f in self.fields
            ],
        }

    @classmethod
    def from_json(cls, data: object) -> SampleLayout:
        """A layout read from a file's header, checked field by field.

        Raises:
            CorruptEntryError: If the data does not describe a valid layout.
        """
        try:
            layout = cls._parse(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptEntryError(f"the header's sample layout is invalid ({exc})") from None
        if layout is None:
            raise CorruptEntryError("the header's sample layout is invalid")
        return layout

    @classmethod
    def _parse(cls, data: Any) -> SampleLayout | None:
        container, names, name, stride = data["container"], data["names"], data["input"], data["stride"]
        raw_fields = data["fields"]
        if (
            container not in _CONTAINERS
            or not isinstance(names, list)
            or not all(isinstance(n, str) for n in names)
            or len(set(names)) != len(names)
            or not isinstance(raw_fields, list)
            or not 1 <= len(raw_fields) <= _MAX_FIELDS
            or len(raw_fields) != len(names)
            or type(stride) is not int
            or not 0 < stride <= _MAX_ROW
            or stride % _ALIGN
        ):
            return None
        fields = []
        for i, raw in enumerate(raw_fields):
            kind, dtype, shape, offset = raw["kind"], raw["dtype"], raw["shape"], raw["offset"]
            if (
                kind not in _KINDS
                or (kind == "features") != (i == 0)
                or not isinstance(shape, list)
                or len(shape) > 16
                or not all(type(n) is int and 0 <= n <= _MAX_ROW for n in shape)
                or type(offset) is not int
                or not isinstance(raw["name"], str)
                or raw["name"] not in names
            ):
                return None
            if kind in ("features", "tensor") and dtype not in _TENSOR:
                return None
            if kind in ("array", "scalar") and dtype not in _NUMPY:
                return None
            if kind in _PLAIN and dtype != _PLAIN[kind].name:
                return None
            f = Field(raw["name"], kind, dtype, tuple(shape), offset)
            if kind in ("scalar", *_PLAIN) and f.shape:
                return None
            if f.nbytes > _MAX_ROW or not 0 <= offset <= stride - f.nbytes or offset % min(f.itemsize, _ALIGN):
                return None
            fields.append(f)
        if fields[0].name != name or (container == "tensor" and names != ["0"]):
            return None
        if {f.name for f in fields} != set(names):
            return None
        return cls(container, tuple(names), name, tuple(fields), stride)


def _batch(f: Field, rows: np.ndarray[Any, Any], count: int) -> torch.Tensor:
    """Field ``f`` of every row as one contiguous tensor, the batch first."""
    raw = rows[:, f.offset : f.offset + f.nbytes]
    if f.kind in ("features", "tensor"):
        if not f.nbytes:
            return torch.zeros((count, *f.shape), dtype=_TENSOR[f.dtype])
        return torch.from_numpy(np.ascontiguousarray(raw)).view(_TENSOR[f.dtype]).reshape(count, *f.shape)
    if not f.nbytes:
        return torch.from_numpy(np.zeros((count, *f.shape), f.numpy_dtype))
    values = np.ascontiguousarray(raw).view(f.numpy_dtype)
    return torch.from_numpy(values.reshape(count, *f.shape))


def _column(f: Field, rows: np.ndarray[Any, Any], count: int) -> list[Any]:
    """Field ``f`` of every row, one value per row (tensors view ``rows``)."""
    raw = rows[:, f.offset : f.offset + f.nbytes]
    if f.kind in ("features", "tensor"):
        if not f.nbytes:
            return list(torch.zeros((count, *f.shape), dtype=_TENSOR[f.dtype]).unbind(0))
        return list(torch.from_numpy(raw).view(_TENSOR[f.dtype]).reshape(count, *f.shape).unbind(0))
    values = raw.view(f.numpy_dtype) if f.nbytes else np.zeros((count, 0), f.numpy_dtype)
    if f.kind in _PLAIN:
        return values.reshape(count).tolist()  # type: ignore[no-any-return]
    if f.kind == "scalar":
        return list(values.reshape(count))
    return list(values.reshape(count, *f.shape))
