"""The canonical encoder: every value a key covers becomes exact, typed bytes, or is refused.

One encoder serves every key: a module's init arguments, attributes, classes and hooks
(and those of every submodule), a function's code, defaults, closure and globals, a
dataset's fingerprint and the non-tensor arguments of a call. Two values get equal
encodings only when they are equal *and* of the same type: every encoding starts with a
tag of its own kind and is self-delimiting (:mod:`torchcache.canonical.tags`), floats are
encoded by their bit pattern (``-0.0`` and NaN payloads stay apart), dicts keep their
order, and tensors and arrays are encoded by their exact content. Functions and classes
are what their code says (:mod:`torchcache.canonical.code`).

What the encoder cannot encode exactly it refuses with a :class:`KeyingError` that names
the path of the value (``ResNet.layer1.0.fn``) and the remedies. It never skips a value
silently. Objects the encoder has no rule for are encoded by their class and the state
that :meth:`object.__reduce_ex__` gives, the protocol pickle uses to save them; nothing
is unpickled, the state is only hashed.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import itertools
import struct
import types
import weakref
from collections.abc import Callable, Collection, Iterable
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import KeyingError
from . import code, graphs, modules, objects, operators, runs, tables
from .tags import Tag, raw, tagged, text

__all__ = ["KeyEncoder", "encode_key_value"]

_MAX_DEPTH = 100
_MAX_NODES = 20_000_000
_LONG = 256  # containers longer than this are streamed into a digest, chunk by chunk
_pack_double = struct.Struct("<d").pack


class KeyEncoder:
    """Encodes values for one key, exactly or not at all.

    Args:
        remedy: What the refusal message suggests (which ways of giving the key apply);
            ``{name}`` stands for the name of the refused attribute.
        ignore: Attribute names, or dotted attribute paths below the root, to leave out.
        tensors: Encode tensors by content; ``False`` refuses them (call arguments, where
            a tensor is keyed per item and cannot hide inside another object).
        files: Encode ``pathlib`` paths and ``np.memmap`` arrays with the size and
            modification time of their file (dataset fingerprints).
        root: The path of the value being keyed; paths in ``ignore`` are relative to it
            (default: the path of the first value encoded).

    Example:
        >>> encoder = KeyEncoder("give a key")
        >>> encoder.encode(1, "x") != encoder.encode(1.0, "x") != encoder.encode(True, "x")
        True
    """

    def __init__(
        self,
        remedy: str,
        *,
        ignore: Collection[str] = (),
        tensors: bool = True,
        files: bool = False,
        root: str = "",
    ) -> None:
        self._remedy = remedy
        self._ignore = frozenset(ignore)
        self.tensors = tensors
        self.files = files
        self._active: dict[int, int] = {}
        self._memo: dict[int, bytes] = {}
        self._alive: list[object] = []  # keeps memoized objects alive, so their ids stay theirs
        self._plain: dict[type, bytes | None] = {}  # classes whose instances are their __dict__
        self._nodes = self._streaming = 0
        self._root = root
        self.walked = 0  #: entries of directories keyed by their files so far (``files``)
        self.names: set[str] = set()  #: attributes the user's code read (self.helper): helpers on installed classes

    # -- the entry points ---------------------------------------------------------------------------
    def encode(self, value: object, path: str) -> bytes:
        """Encode ``value``, found at ``path`` (used in error messages and by ``ignore``).

        Raises:
            KeyingError: If the value, or anything inside it, cannot be encoded exactly.
        """
        if not self._root:
            self._root = path
        return self.child(value, path, 0)

    def refuse(self, path: str, why: str) -> KeyingError:
        """The error for a value at ``path`` that cannot be encoded."""
        name = path.rsplit(".", 1)[-1].split("[", 1)[0].strip("<>()") or path
        error = KeyingError(f"{path}: cannot be part of the cache key: {why}. {self._remedy.format(name=name)}")
        error.path = path
        return error

    def ignored(self, path: str, name: str) -> bool:
        """Whether the attribute ``name`` at ``path`` is declared as not changing outputs."""
        if not self._ignore:
            return False
        full = f"{path}.{name}"
        relative = full[len(self._root) + 1 :] if full.startswith(self._root + ".") else full
        return name in self._ignore or relative in self._ignore

    def remember_plain(self, cls: type, encoding: bytes) -> None:
        """Encode later instances of ``cls`` as their class's ``encoding`` and their ``__dict__``."""
        self._plain[cls] = encoding

    def plain_encoding(self, cls: type) -> bytes | None:
        """The encoding of ``cls`` if its instances were seen to be their ``__dict__``, else ``None``."""
        return self._plain.get(cls)

    @staticmethod
    def scalars(kind: type) -> Callable[[Any], bytes] | None:
        """The encoding function of a scalar type (``None``, numbers, strings, torch dtypes), else ``None``."""
        return _SCALARS.get(kind)

    # -- dispatch ----------------------------------------------------------------------------------
    def child(self, value: object, path: str, depth: int) -> bytes:
        """Encode a value found at ``path``, ``depth`` levels below the value :meth:`encode` was given."""
        cls = type(value)
        scalar = _SCALARS.get(cls)
        if scalar is not None:
            return scalar(value)
        self._nodes += 1
        if self._nodes > _MAX_NODES:
            raise self.refuse(path, f"the value holds more than {_MAX_NODES:,} objects")
        if depth > _MAX_DEPTH:
            raise self.refuse(path, f"the value nests more than {_MAX_DEPTH} levels deep")
        ident = id(value)
        if cls is tuple or cls is list:  # the bulk of large values: no memo, a cycle check only
            if ident in self._active:
                return tagged(Tag.CYCLE, str(depth - self._active[ident]).encode())
            self._active[ident] = depth
            try:
                return self._sequence(value, cls is tuple, path, depth + 1)  # type: ignore[arg-type]
            finally:
                del self._active[ident]
        memo = self._memo.get(ident)
        if memo is not None:
            return memo
        if ident in self._active:  # a cycle: name the object it leads back to by its depth
            return tagged(Tag.CYCLE, str(depth - self._active[ident]).encode())
        self._active[ident] = depth
        try:
            encoded = self._object(value, cls, path, depth + 1)
        finally:
            del self._active[ident]
        if not self._streaming or cls in _HEAVY:  # the items of a long container are not kept
            self._memo[ident] = encoded
            self._alive.append(value)
        return encoded

    def _object(self, value: Any, cls: type, path: str, depth: int) -> bytes:
        plain = self._plain.get(cls, b"")
        if plain:
            return objects.encode_plain(self, value, plain, path, depth)
        if cls is dict or cls is collections.OrderedDict:
            return self._mapping(value, cls is dict, path, depth)
        if isinstance(value, torch.Tensor):
            return objects.encode_tensor(self, value, path, depth)
        if isinstance(value, enum.Enum):
            return tagged(Tag.ENUM, self.child(cls, path, depth) + self.child(value.value, f"{path}.value", depth))
        if isinstance(value, np.ndarray):
            return objects.encode_array(self, value, path, depth)
        if isinstance(value, torch.nn.Module):
            return modules.encode_module(self, value, path, depth)
        if cls is torch.Size:
            return tagged(Tag.TORCH_SIZE, repr(tuple(value)).encode())
        if cls is set or cls is frozenset:
            self._nodes += len(value)
            return objects.encode_set(self, value, cls is set, path, depth)
        if isinstance(value, tuple) and hasattr(cls, "_fields"):  # a namedtuple
            fields = [(name, getattr(value, name)) for name in cls._fields]
            extra = objects.extra_state(value, cls._fields)
            return tagged(
                Tag.NAMEDTUPLE, self.child(cls, path, depth) + objects.encode_fields(self, fields, extra, path, depth)
            )
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = [f.name for f in dataclasses.fields(value)]
            fields = [(name, getattr(value, name)) for name in names if hasattr(value, name)]
            extra = objects.extra_state(value, names)
            return tagged(
                Tag.DATACLASS, self.child(cls, path, depth) + objects.encode_fields(self, fields, extra, path, depth)
            )
        if isinstance(value, functools.partial):
            parts = [
                self.child(value.func, f"{path}.func", depth),
                self.child(list(value.args), f"{path}.args", depth),
                self.child(dict(value.keywords), f"{path}.keywords", depth),
            ]
            return tagged(Tag.PARTIAL, b"".join(parts))
        if isinstance(value, types.FunctionType):
            return code.encode_function(self, value, path, depth)
        if isinstance(value, types.MethodType):
            func = self.child(value.__func__, f"{path}.__func__", depth)
            return tagged(Tag.METHOD, func + self.child(value.__self__, f"{path}.__self__", depth))
        if isinstance(value, _FUNCTION_TYPES):
            return code.encode_builtin(self, value, path, depth)
        if isinstance(value, type):
            return code.encode_class(self, value, path, depth)
        if isinstance(value, types.ModuleType):
            return code.encode_python_module(self, value, path, depth)
        if isinstance(value, weakref.ref):
            return tagged(Tag.WEAKREF, self.child(value(), f"{path}()", depth))
        if isinstance(value, PurePath):
            return objects.encode_path(self, value, path)
        if isinstance(value, memoryview):  # its items' format and shape, then their bytes in C order
            return tagged(Tag.BYTE_BUFFER, text(f"memoryview {value.format} {value.shape}") + raw(value.tobytes()))
        if isinstance(value, bytearray):
            return tagged(Tag.BYTE_BUFFER, text(cls.__qualname__) + raw(bytes(value)))
        if isinstance(value, range):
            return tagged(Tag.RANGE, self.child((value.start, value.stop, value.step), path, depth))
        if isinstance(value, slice):
            return tagged(Tag.SLICE, self.child((value.start, value.stop, value.step), path, depth))
        if isinstance(value, np.generic):
            if value.dtype.fields is not None:  # a structured scalar: its fields' names and types, as an array's
                return tagged(Tag.NUMPY_SCALAR, self.child(np.array(value), path, depth))
            return tagged(Tag.NUMPY_SCALAR, text(value.dtype.str) + raw(value.tobytes()))
        if isinstance(value, np.dtype):
            return tagged(Tag.NUMPY_DTYPE, repr(value).encode())
        if isinstance(value, types.MappingProxyType):
            return tagged(Tag.MAPPING_PROXY, self.child(dict(value), path, depth))
        operator = operators.operator_name(value)
        if operator is not None:  # scale(x) of a custom_op, an alias of torch.ops.ns.name: by what defines it
            namespace, name, overload = operator
            defined = operators.encode_operator(self, namespace, name, path, depth)
            return tagged(Tag.OPERATOR, text(f"{namespace}::{name}.{overload}") + defined)
        if isinstance(value, torch.fx.Graph):
            return graphs.encode_fx_graph(self, value, path, depth)
        pandas = tables.encode_pandas(self, value, path, depth)
        if pandas is not None:
            return pandas
        return objects.encode_state(self, value, cls, path, depth)

    # -- containers ----------------------------------------------------------------------------------
    def _sequence(self, value: list[Any] | tuple[Any, ...], is_tuple: bool, path: str, depth: int) -> bytes:
        """A tuple or list, item by item; a long one streamed into a digest chunk by chunk."""
        self._nodes += len(value)
        if len(value) <= _LONG:
            return tagged(Tag.TUPLE if is_tuple else Tag.LIST, runs.encode_items(self, value, path, 0, depth))
        h = xxhash.xxh3_128()
        self._streaming += 1
        try:
            for start in range(0, len(value), runs.CHUNK):
                h.update(runs.encode_chunk(self, value[start : start + runs.CHUNK], path, start, depth))
        finally:
            self._streaming -= 1
        return tagged(Tag.LONG_TUPLE if is_tuple else Tag.LONG_LIST, f"{len(value)}|".encode() + h.digest())

    def _mapping(self, value: dict[Any, Any], is_dict: bool, path: str, depth: int) -> bytes:
        """A dict or ``OrderedDict`` in order; a long one streamed, its keys and values chunk by chunk."""
        self._nodes += len(value)
        if len(value) <= _LONG:
            return tagged(Tag.DICT if is_dict else Tag.ORDERED_DICT, self.items(value.items(), path, depth))
        h = xxhash.xxh3_128()
        keys, values = iter(value), iter(value.values())  # in step: no tuple per item
        self._streaming += 1
        try:
            for start in itertools.count(0, runs.CHUNK):
                chunk = list(itertools.islice(keys, runs.CHUNK))
                if not chunk:
                    break
                h.update(runs.encode_chunk(self, chunk, f"{path} key", start, depth))
                h.update(runs.encode_chunk(self, list(itertools.islice(values, runs.CHUNK)), path, start, depth))
        finally:
            self._streaming -= 1
        long = Tag.LONG_DICT if is_dict else Tag.LONG_ORDERED_DICT
        return tagged(long, f"{len(value)}|".encode() + h.digest())

    def items(self, items: Iterable[tuple[Any, Any]], path: str, depth: int, attributes: bool = False) -> bytes:
        """Key and value pairs, in order (as attributes: by name, those in ``ignore`` left out)."""
        parts = []
        for key, item in items:
            if attributes:
                if self.ignored(path, str(key)):
                    continue
                where = f"{path}.{key}"
            else:
                where = f"{path}[{key!r}]"
            parts.append(self.child(key, f"{path} key", depth) + self.child(item, where, depth))
        return b"".join(parts)

    def attributes(self, items: Iterable[tuple[Any, Any]], path: str, depth: int) -> bytes:
        """Named attributes, those in ``ignore`` left out."""
        return tagged(Tag.ATTRIBUTES, self.items(items, path, depth, attributes=True))


_FUNCTION_TYPES = (
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    np.ufunc,
)
#: Kinds still memoized inside long containers: few, and costly to encode twice.
_HEAVY = frozenset({type, types.FunctionType, types.ModuleType, torch.Tensor, np.ndarray})


def _int(value: int) -> bytes:
    return tagged(Tag.INT, str(value).encode())


_SCALARS: dict[type, Callable[[Any], bytes]] = {
    type(None): lambda value: Tag.NONE,
    bool: lambda value: Tag.BOOL + (b"\x01" if value else b"\x00"),
    int: _int,
    float: lambda value: Tag.FLOAT + _pack_double(value),
    complex: lambda value: Tag.COMPLEX + _pack_double(value.real) + _pack_double(value.imag),
    str: text,
    bytes: lambda value: tagged(Tag.BYTES, value),
    torch.dtype: lambda value: tagged(Tag.DTYPE, str(value).encode()),
    torch.device: lambda value: tagged(Tag.DEVICE, str(value).encode()),
    torch.memory_format: lambda value: tagged(Tag.MEMORY_FORMAT, str(value).encode()),
    torch.layout: lambda value: tagged(Tag.LAYOUT, str(value).encode()),
    torch.qscheme: lambda value: tagged(Tag.QSCHEME, str(value).encode()),
    type(Ellipsis): lambda value: Tag.ELLIPSIS,
    type(NotImplemented): lambda value: Tag.NOT_IMPLEMENTED,
}


def encode_key_value(value: object, name: str = "argument") -> bytes:
    """Encode a non-tensor call argument canonically, type included (the per-call fast path).

    Args:
        value: Any value the canonical encoder takes, without tensors inside objects.
        name: The argument's name, for error messages.

    Raises:
        KeyingError: If the value cannot be encoded exactly.
    """
    scalar = _SCALARS.get(type(value))
    if scalar is not None:
        return scalar(value)
    encoder = KeyEncoder(
        "Pass a value torchcache can key (numbers, strings, containers, dataclasses, enums, objects with "
        "plain state), or give the object's class a __torchcache_key__() method",
        tensors=False,
    )
    return encoder.encode(value, name)
