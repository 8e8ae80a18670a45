"""Item keys and module fingerprints.

An item key is a 128-bit xxh3 digest of a *context* (the module fingerprint, the
argument names, each tensor argument's per-item shape and dtype, the non-tensor
arguments and the training flag) followed by the 128-bit xxh3 digest of the exact bytes
of every tensor argument's row for that item. Nothing is reduced arithmetically before hashing, so two items that
differ in any hashed byte, shape or dtype get different keys up to a 2**-128 chance.

Hashing is batched: each tensor argument is made contiguous and copied to the host once
per batch, and rows are hashed from one flat buffer, with no per-item torch call. On CPU
every element is hashed (a subsample touches every cache line anyway, so it saves
little). On an accelerator, items with more than ``subsample_count`` elements are
subsampled on the device in 64 evenly spread contiguous runs before the single copy to
the host; the count is part of the key.

Non-tensor arguments are encoded canonically with a type tag, so ``True``, ``1``,
``1.0``, ``"1"`` and ``None`` are five different keys.
"""

from __future__ import annotations

import inspect
import re
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ._fork import after_fork
from .errors import KeyingError

__all__ = [
    "FORMAT_VERSION",
    "Context",
    "describe_init",
    "encode_value",
    "fingerprint_function",
    "fingerprint_module",
    "hash_items",
    "tensor_digest",
]

#: Version of the key derivation and of the entry format; part of every module key.
FORMAT_VERSION = 2

_SUBSAMPLE_RUNS = 64
_MAX_DEPTH = 8
_source_lock = threading.Lock()
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")
_index_cache: dict[tuple[int, int, str], torch.Tensor] = {}


def _tag(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def encode_value(value: object, name: str = "argument") -> bytes:
    """Encode a non-tensor argument canonically, type included.

    Args:
        value: ``None``, ``bool``, ``int``, ``float``, ``str``, ``torch.dtype``,
            ``torch.device``, or a tuple, list or dict of these.
        name: The argument's name, for error messages.

    Returns:
        Bytes that are equal for equal values of equal types, and different otherwise.

    Raises:
        KeyingError: If the value (or something inside it) has another type.

    Example:
        >>> len({encode_value(v) for v in (True, 1, 1.0, "1", None)})
        5
    """
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return _tag(b"i", str(value).encode())
    if isinstance(value, float):
        return _tag(b"f", value.hex().encode())
    if isinstance(value, str):
        return _tag(b"s", value.encode("utf-8", "surrogatepass"))
    if isinstance(value, torch.dtype):
        return _tag(b"d", str(value).encode())
    if isinstance(value, torch.device):
        return _tag(b"v", str(value).encode())
    if type(value) in (tuple, list):
        seq: Sequence[object] = value  # type: ignore[assignment]
        parts = [encode_value(v, f"{name}[{i}]") for i, v in enumerate(seq)]
        return _tag(b"t" if isinstance(value, tuple) else b"l", b"".join(parts))
    if type(value) is dict:
        mapping: Mapping[object, object] = value  # type: ignore[assignment]
        items = sorted((encode_value(k, f"{name} key"), encode_value(v, f"{name}[{k!r}]")) for k, v in mapping.items())
        return _tag(b"m", b"".join(k + v for k, v in items))
    if isinstance(value, torch.Tensor):
        raise KeyingError(
            f"{name}: tensors are only supported as top-level arguments shaped (batch, ...), "
            "not inside a tuple, list or dict"
        )
    raise KeyingError(
        f"{name}: cannot be part of a cache key: got {type(value).__name__}; expected a tensor "
        "shaped (batch, ...), None, bool, int, float, str, torch.dtype, torch.device, or a "
        "tuple, list or dict of these"
    )


class Context:
    """The per-batch part of every item key, hashed once into 16 bytes."""

    __slots__ = ("_hasher",)

    def __init__(self, module_key: str) -> None:
        self._hasher = xxhash.xxh3_128(module_key.encode())

    def add(self, data: bytes) -> None:
        """Append a length-prefixed field."""
        self._hasher.update(struct.pack("<Q", len(data)))
        self._hasher.update(data)

    def digest(self) -> bytes:
        """The 16-byte digest of everything added."""
        return self._hasher.digest()


def _subsample_index(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """Indices of ``count`` elements in evenly spread contiguous runs (cached per device)."""
    cache_key = (numel, count, str(device))
    index = _index_cache.get(cache_key)
    if index is None:
        runs = min(_SUBSAMPLE_RUNS, count)
        run_len = count // runs
        starts = torch.linspace(0, numel - run_len, runs).long()
        index = (starts[:, None] + torch.arange(run_len)[None, :]).reshape(-1).to(device)
        _index_cache[cache_key] = index
    return index


def item_rows(tensor: torch.Tensor, subsample_count: int | None) -> tuple[np.ndarray, bool]:
    """Return a ``(batch, nbytes)`` host uint8 array of each item's hashed bytes.

    Returns:
        The array, and whether the rows are a subsample.
    """
    batch = tensor.shape[0]
    flat = tensor.detach().reshape(batch, -1)
    subsampled = False
    if flat.device.type != "cpu":
        numel = flat.shape[1]
        if subsample_count is not None and numel > subsample_count:
            flat = flat.index_select(1, _subsample_index(numel, subsample_count, flat.device))
            subsampled = True
        flat = flat.cpu()
    flat = flat.resolve_conj().resolve_neg().contiguous()
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.shape[1] else flat.to(torch.uint8)
    return flat.numpy(), subsampled


def hash_items(context: bytes, tensors: Sequence[torch.Tensor], subsample_count: int | None = None) -> list[bytes]:
    """Compute the 16-byte key of every item of a batch.

    Args:
        context: The per-batch context digest (see :class:`Context`).
        tensors: Tensor arguments, each shaped ``(batch, ...)`` with the same batch size.
        subsample_count: Subsample items with more elements on accelerators; ``None``
            hashes every element.

    Returns:
        One key per item, in batch order.

    Example:
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> keys = hash_items(b"ctx", [x])
        >>> len(keys), len(set(keys)), keys == hash_items(b"ctx", [x.clone()])
        (3, 3, True)
    """
    batch = tensors[0].shape[0]
    if batch == 0:
        return []
    # One C call per row and one per item: a hasher object per row costs more in
    # Python than hashing a 3 KB row. Row digests have a fixed size, so their
    # concatenation is unambiguous.
    digest = xxhash.xxh3_128_digest
    flags = bytearray()
    row_digests: list[list[bytes]] = []
    for tensor in tensors:
        rows, subsampled = item_rows(tensor, subsample_count)
        flat, width = memoryview(rows.reshape(-1)), rows.shape[1]  # type: ignore[arg-type]
        row_digests.append([digest(flat[i * width : (i + 1) * width]) for i in range(batch)])
        flags.append(subsampled)
    prefix = context + bytes(flags)
    if len(row_digests) == 1:
        return [digest(prefix + d) for d in row_digests[0]]
    return [digest(prefix + b"".join(parts)) for parts in zip(*row_digests)]


def tensor_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A 128-bit digest of named tensors: names, dtypes, shapes and exact contents."""
    h = xxhash.xxh3_128()
    for name, tensor in tensors:
        h.update(_tag(b"n", name.encode()))
        h.update(_tag(b"d", str(tensor.dtype).encode()))
        h.update(_tag(b"s", repr(tuple(tensor.shape)).encode()))
        data = tensor.detach()
        if data.is_sparse or data.layout != torch.strided:
            data = data.to_dense()
        data = data.reshape(1, -1) if data.numel() else data.reshape(1, 0)
        rows, _ = item_rows(data, None)
        h.update(memoryview(rows.reshape(-1)))  # type: ignore[arg-type]
    return h.hexdigest()


def _describe_object(value: object, name: str, depth: int = 0) -> bytes:
    """Encode an init argument: exact for plain values, tensors and arrays, by state otherwise.

    Objects whose ``repr`` is the default one (a class name and a memory address) are
    described by their class and their attributes, so that two configurations of one
    class never share a key; other objects by their ``repr`` without memory addresses.
    """
    if isinstance(value, torch.Tensor):
        return _tag(b"X", tensor_digest([("", value)]).encode())
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        h = xxhash.xxh3_128(f"{value.dtype.str}|{value.shape}".encode())
        h.update(np.ascontiguousarray(value).view(np.uint8).reshape(-1).data)
        return _tag(b"A", h.digest())
    if isinstance(value, torch.nn.Module):
        cls: type = type(value)
        state = tensor_digest(value.state_dict().items())
        text = _ADDRESS_RE.sub("", repr(value))
        return _tag(b"M", f"{cls.__module__}.{cls.__qualname__}|{text}|{state}".encode())
    if depth > _MAX_DEPTH:
        return _tag(b"R", _ADDRESS_RE.sub("", repr(value)).encode())
    if type(value) in (tuple, list):
        seq: Sequence[object] = value  # type: ignore[assignment]
        return _tag(b"L", b"".join(_describe_object(v, name, depth + 1) for v in seq))
    if type(value) is dict:
        mapping: Mapping[object, object] = value  # type: ignore[assignment]
        items = sorted((repr(k), _describe_object(v, name, depth + 1)) for k, v in mapping.items())
        return _tag(b"D", b"".join(k.encode() + v for k, v in items))
    try:
        return encode_value(value, name)
    except KeyingError:
        pass
    if callable(value) and hasattr(value, "__qualname__"):
        module = getattr(value, "__module__", "")
        return _tag(b"C", f"{module}.{value.__qualname__}".encode())
    cls = type(value)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    attributes = getattr(value, "__dict__", None)
    if cls.__repr__ is object.__repr__ and isinstance(attributes, dict):
        return _tag(b"O", qualname.encode() + _describe_object(dict(attributes), name, depth + 1))
    text = _ADDRESS_RE.sub("", repr(value))
    return _tag(b"R", f"{qualname}|{text}".encode())


def _new_source_lock_after_fork() -> None:
    global _source_lock
    _source_lock = threading.Lock()


after_fork(_new_source_lock_after_fork)  # another thread may have held it at fork


def _source(obj: Callable[..., Any] | type) -> str:
    # inspect.getsource parses the file with ast, which is not thread-safe in CPython 3.11
    # ("AST constructor recursion depth mismatch" when two threads parse at once).
    with _source_lock:
        try:
            return inspect.getsource(obj)
        except (OSError, TypeError):
            return ""


def _own_classes(cls: type) -> list[type]:
    """The class and its base classes that are not part of torch or the standard library."""
    return [c for c in cls.__mro__ if c is not object and not c.__module__.startswith(("torch.", "builtins", "typing"))]


def describe_init(init_args: Sequence[object], init_kwargs: Mapping[str, object]) -> bytes:
    """Digest a module's ``__init__`` arguments canonically (tensors by content).

    Taken at construction so that the arguments themselves are not kept alive.
    """
    h = xxhash.xxh3_128()
    for i, value in enumerate(init_args):
        h.update(_describe_object(value, f"init argument {i}"))
    for key in sorted(init_kwargs):
        h.update(_tag(b"k", key.encode()) + _describe_object(init_kwargs[key], key))
    return h.digest()


def fingerprint_module(module: torch.nn.Module, init_digest: bytes, settings: Mapping[str, object]) -> str:
    """The module key: class, source, init arguments, weights, format and settings.

    Args:
        module: The module instance with its current weights.
        init_digest: :func:`describe_init` of the arguments its ``__init__`` received.
        settings: Settings that change what is stored (``cache_dtype``, ``subsample_count``).

    Returns:
        32 hex digits.
    """
    h = xxhash.xxh3_128()
    cls = type(module)
    h.update(_tag(b"q", f"{cls.__module__}.{cls.__qualname__}".encode()))
    for klass in _own_classes(cls):
        h.update(_tag(b"c", f"{klass.__module__}.{klass.__qualname__}".encode()))
        h.update(_tag(b"S", _source(klass).encode()))
    h.update(_tag(b"a", init_digest))
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    h.update(_tag(b"w", tensor_digest(named).encode()))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def fingerprint_function(fn: Callable[..., Any], settings: Mapping[str, object]) -> str:
    """The key of a decorated function: qualified name, source, format and settings."""
    h = xxhash.xxh3_128()
    target = inspect.unwrap(fn)
    h.update(_tag(b"q", f"{target.__module__}.{target.__qualname__}".encode()))
    h.update(_tag(b"S", _source(target).encode()))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def _settings_bytes(settings: Mapping[str, object]) -> bytes:
    parts = [_tag(b"V", str(FORMAT_VERSION).encode())]
    for key in sorted(settings):
        parts.append(_tag(b"o", key.encode()) + encode_value(settings[key], key))
    return b"".join(parts)
