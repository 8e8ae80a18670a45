"""How one sample of a features cache lies in a row of fixed size, and back.

A sample is what the dataset returns: a tensor (the backbone's input), or a tuple, list
or dict whose ``input`` field goes through the backbone and whose other fields (a
label, a weight, a mask) are stored beside the output. Each field has one kind, dtype
and shape for the whole dataset, so that every row has the same size: the stored
sample is the backbone's output in place of its input, and the other fields as the
dataset returned them (a Python ``int`` comes back an ``int``, a numpy scalar a numpy
scalar, a tensor a tensor). What cannot be stored in a fixed size (strings, ``None``,
nested containers, a field whose shape varies) is refused with a message naming it.

The layout is stored in the file's header in the language of every cached value
(:mod:`torchcache.tree`): ``{"l": [[dtype, shape], ...], "t": structure, "input": leaf,
"stride": bytes}``, the fields in the sample's order, each at the offset a packed row
gives it (the sum of the earlier fields' sizes, each rounded up to 8 bytes), ``input``
the position of the features among them, and rows ``stride`` bytes apart (a multiple of
16). It is checked field by field when it is read back: names come from closed tables,
so reading a layout can never reach anything but numpy and torch dtypes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...dtypes import ALIGN, CODE_OF, NAME_OF, NUMPY_OF, OUTPUT_DTYPES, dtype_named, standard_strides
from ...errors import ConfigError, CorruptEntryError
from ...tree import leaf_kinds

__all__ = ["Field", "SampleLayout", "VariableLayoutError"]

_ALIGN = 16
_MAX_FIELDS = 64
_MAX_ROW = 1 << 30
#: Dtypes of tensor fields by name, and of numpy fields by name (from :mod:`torchcache.dtypes`).
_TENSOR = {NAME_OF[dt]: dt for dt in OUTPUT_DTYPES}
_NUMPY = {dt.name: dt for dt in NUMPY_OF.values()}
_PLAIN = {"int": np.dtype("<i8"), "float": np.dtype("<f8"), "bool": np.dtype("bool")}
_PLAIN_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}
#: The leaf kind (:mod:`torchcache.tree`) that stores each kind of field, and back.
_LEAF_OF = {"features": "T", "tensor": "T", "array": "A", "scalar": "S", "int": "i", "float": "f", "bool": "b"}
_KIND_OF = {"T": "tensor", "A": "array", "S": "scalar", "i": "int", "f": "float", "b": "bool"}
_PLAIN_LEAF = {"int": ["i8", []], "float": ["f8", []], "bool": ["b1", []]}
_NUMPY_STR = {dt.str: dt for dt in _NUMPY.values()}  # numpy dtypes by type string (native order)


class VariableLayoutError(ConfigError):
    """The samples do not fit one fixed-size row: a field of another kind or shape, or one of no fixed size."""


def _up(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class Field:
    """One field of a stored sample: where it is in the row and what it becomes when read."""

    name: str  # the position in a tuple or list, or the key of a dict
    kind: str  # a key of _LEAF_OF; "features" is the backbone's output
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
        """The backbone's inputs of a batch of samples, and each other field's values (a column per field).

        Raises:
            VariableLayoutError: If a sample is not of the first one's structure (its
                container, its fields in order): each sample is then kept whole.
        """
        kind = {"tensor": torch.Tensor, "tuple": tuple, "list": list, "dict": Mapping}[self.container]
        if kind is torch.Tensor:
            alike = all(isinstance(sample, kind) for sample in samples)
        elif kind is Mapping:
            alike = all(isinstance(sample, kind) and tuple(sample) == self.names for sample in samples)
        else:  # the names of a tuple's or list's fields are its positions: its length says them
            width = len(self.names)
            alike = all(isinstance(sample, kind) for sample in samples) and all(len(s) == width for s in samples)
        if not alike:
            raise VariableLayoutError(
                f"a sample is not of the first one's structure ({self.container} of {list(self.names)}): "
                "a features cache needs samples of one structure"
            )
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
        return SampleLayout.placed(
            self.container, self.names, (first, *(f for f in self.fields if f.kind != "features"))
        )

    @classmethod
    def placed(cls, container: str, names: Sequence[str], fields: Sequence[Field]) -> SampleLayout:
        """The layout of ``fields`` (the features first) with their offsets and the stride set.

        Each field lies where a packed row puts it: after the fields before it in the
        sample, each rounded up to :data:`~torchcache.dtypes.ALIGN` bytes.
        """
        by_name = {f.name: f for f in fields}
        offsets, at = {}, 0
        for name in names:
            offsets[name] = at
            at += _up(by_name[name].nbytes, ALIGN)
        placed = tuple(Field(f.name, f.kind, f.dtype, f.shape, offsets[f.name]) for f in fields)
        return cls(container, tuple(names), fields[0].name, placed, _up(max(at, 1), _ALIGN))

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
        flat = standard_strides(features.detach().to("cpu").contiguous().reshape(count, -1))
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
            return standard_strides(value.detach().to("cpu").contiguous().reshape(-1)).view(torch.uint8).numpy()
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
        """The layout as JSON-able data, for the file's header (see the module's description)."""
        by_name = {f.name: f for f in self.fields}
        ordered = [by_name[name] for name in self.names]
        leaves = [[_code(f), list(f.shape)] for f in ordered]
        kinds = [_LEAF_OF[f.kind] for f in ordered]
        layout: dict[str, Any] = {"l": leaves, "input": self.names.index(self.input), "stride": self.stride}
        if self.container == "dict":
            layout["t"] = ["dict", [[name, kind] for name, kind in zip(self.names, kinds, strict=True)]]
        elif self.container != "tensor":
            layout["t"] = [self.container, kinds]
        return layout

    @classmethod
    def from_json(cls, data: object) -> SampleLayout:
        """A layout read from a file's header, checked field by field.

        Raises:
            CorruptEntryError: If the data does not describe a valid layout.
        """
        try:
            return cls._parse(data)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CorruptEntryError(f"the header's sample layout is invalid ({str(exc)[:200]})") from None

    @classmethod
    def _parse(cls, data: Any) -> SampleLayout:
        if not isinstance(data, dict) or not set(data) <= {"l", "t", "input", "stride"}:
            raise ValueError("not a features layout")
        tree, leaves, input, stride = data.get("t", "T"), data["l"], data["input"], data["stride"]
        kinds = leaf_kinds(tree, values=True)
        if not isinstance(leaves, list) or not 1 <= len(leaves) == len(kinds) <= _MAX_FIELDS:
            raise ValueError("the leaves do not match the structure")
        children = [] if tree == "T" else tree[1] if tree[0] != "dict" else [child for _, child in tree[1]]
        if tree == "T":
            container, names = "tensor", ["0"]
        elif not all(type(child) is str for child in children) or len(children) != len(kinds):
            raise ValueError("fields nested in containers, or not stored in the row")
        elif tree[0] in ("tuple", "list"):
            container, names = tree[0], [str(i) for i in range(len(kinds))]
        elif tree[0] == "dict" and all(type(key) is str for key, _ in tree[1]):
            container, names = "dict", [key for key, _ in tree[1]]
        else:
            raise ValueError("a structure other than a tensor, or a tuple, list or dict of fields")
        if type(input) is not int or not 0 <= input < len(kinds) or kinds[input] != "T":
            raise ValueError(f"input {str(input)[:20]} is not a tensor field")
        fields = [_field(name, kind, leaf, name == names[input]) for name, kind, leaf in zip(names, kinds, leaves)]
        first = fields[input]
        layout = cls.placed(container, names, (first, *(f for f in fields if f is not first)))
        if type(stride) is not int or not layout.stride <= stride <= _MAX_ROW or stride % _ALIGN:
            raise ValueError(f"invalid stride {str(stride)[:20]}")
        return SampleLayout(container, layout.names, layout.input, layout.fields, stride)


def _code(f: Field) -> str:
    """How a field's dtype is named in a layout: a tensor dtype's code, a numpy type string."""
    if f.kind in ("features", "tensor"):
        return CODE_OF[_TENSOR[f.dtype]]
    return f.numpy_dtype.str if f.kind in ("array", "scalar") else str(_PLAIN_LEAF[f.kind][0])


def _field(name: str, kind: str, leaf: Any, features: bool) -> Field:
    """The field of one leaf of a layout read from a file.

    Raises:
        ValueError: If the leaf is not one a features row can hold.
    """
    if kind not in _KIND_OF or type(leaf) is not list or len(leaf) != 2:
        raise ValueError(f"invalid field {name[:20]}")
    code, shape = leaf
    if not isinstance(shape, list) or len(shape) > 16 or not all(type(n) is int and 0 <= n <= _MAX_ROW for n in shape):
        raise ValueError(f"invalid shape of field {name[:20]}")
    field_kind = "features" if features else _KIND_OF[kind]
    if kind == "T":
        dtype = dtype_named(code, OUTPUT_DTYPES)
        if dtype is None:
            raise ValueError(f"invalid dtype of field {name[:20]}")
        f = Field(name, field_kind, NAME_OF[dtype], tuple(shape))
    elif kind in ("A", "S"):
        if not isinstance(code, str) or code not in _NUMPY_STR or (kind == "S" and shape):
            raise ValueError(f"invalid field {name[:20]}")
        f = Field(name, field_kind, _NUMPY_STR[code].name, tuple(shape))
    else:
        if leaf != _PLAIN_LEAF[field_kind]:
            raise ValueError(f"invalid field {name[:20]}")
        f = Field(name, field_kind, _PLAIN[field_kind].name, ())
    if f.nbytes > _MAX_ROW:
        raise ValueError(f"field {name[:20]} is too large")
    return f


def _batch(f: Field, rows: np.ndarray[Any, Any], count: int) -> torch.Tensor:
    """Field ``f`` of every row as one contiguous tensor, the batch first."""
    if f.kind in ("features", "tensor"):
        if not f.nbytes:
            return torch.zeros((count, *f.shape), dtype=_TENSOR[f.dtype])
        copied = torch.from_numpy(rows)[:, f.offset : f.offset + f.nbytes].contiguous()  # on torch's threads
        return copied.view(_TENSOR[f.dtype]).reshape(count, *f.shape)
    if not f.nbytes:
        return torch.from_numpy(np.zeros((count, *f.shape), f.numpy_dtype))
    values = np.ascontiguousarray(rows[:, f.offset : f.offset + f.nbytes]).view(f.numpy_dtype)
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
    arrays = values.reshape(count, *f.shape)
    return list(arrays) if f.shape else [np.array(value) for value in arrays]  # 0-d arrays stay arrays
