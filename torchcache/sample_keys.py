"""Keys of dataset samples: a fingerprint per dataset, a store key per sample.

A dataset's fingerprint covers its class (module, qualified name, and the source of it
and of its base classes outside torch), its public attributes (numbers, strings and
paths exactly; tensors and arrays by content, sampled past 16 MiB so that a memmap is
not read; lists by length and up to 1,000 evenly spaced items; functions by their
code; other objects by their ``repr`` without memory addresses), ``len(dataset)`` and
a ``version``. What it cannot see (files changed on disk, a setting read in
``__getitem__``) is what ``version`` is for. A sample's store key is its index in 16
hex digits, so the keys of a store name their indices.
"""

from __future__ import annotations

import functools
import operator
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from .errors import KeyingError
from .fingerprint import _source, fingerprint_function
from .keys import tag

__all__ = ["fingerprint_dataset", "store_key"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MAX_ITEMS = 1000
_MAX_DEPTH = 4
_MAX_HASHED = 1 << 24
_HEX_KEYS = 1 << 64  # int keys below this are their own 16 hex digits
_SCALARS = (type(None), bool, int, float, complex, str, bytes, Path, torch.dtype, torch.device)


def _describe(value: object, h: Any, depth: int = 0) -> None:
    """Feed a canonical description of an attribute value to the hash ``h``."""
    if isinstance(value, _SCALARS):
        h.update(tag(b"v", f"{type(value).__name__}:{value!r}".encode("utf-8", "surrogatepass")))
    elif isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        h.update(tag(b"t", f"{data.dtype}{tuple(data.shape)}".encode()))
        _digest_bytes(data.reshape(-1).view(torch.uint8).numpy(), h)
    elif isinstance(value, np.ndarray) and not value.dtype.hasobject:
        h.update(tag(b"a", f"{value.dtype.str}{value.shape}".encode()))
        _digest_bytes(np.ascontiguousarray(value).reshape(-1).view(np.uint8), h)
    elif depth >= _MAX_DEPTH:
        h.update(tag(b"x", type(value).__qualname__.encode()))
    elif isinstance(value, (list, tuple, dict, set, frozenset, np.ndarray)):
        # Lists by length and evenly spaced items; dicts in insertion order; sets sorted.
        items: Any = (
            list(value.items())
            if isinstance(value, dict)
            else sorted(value, key=repr)
            if isinstance(value, (set, frozenset))
            else value
        )
        h.update(tag(b"l", f"{type(value).__name__}:{len(items)}".encode()))
        for i in range(0, len(items), max(1, len(items) // _MAX_ITEMS)):
            _describe(items[i], h, depth + 1)
    elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        function = value.__func__ if isinstance(value, types.MethodType) else value
        h.update(tag(b"f", fingerprint_function(function, {}).encode()))
    elif type(value).__repr__ is object.__repr__ and isinstance(getattr(value, "__dict__", None), dict):
        h.update(tag(b"o", f"{type(value).__module__}.{type(value).__qualname__}".encode()))
        _describe_attributes(value, h, depth + 1)
    else:
        h.update(tag(b"r", _ADDRESS.sub("", repr(value)).encode("utf-8", "surrogatepass")))


def _digest_bytes(data: np.ndarray[Any, np.dtype[np.uint8]], h: Any) -> None:
    """Hash an array's bytes: all of them up to 16 MiB, else 256 evenly spaced 4 KiB pieces (a memmap stays unread)."""
    if data.size <= _MAX_HASHED:
        h.update(data.data)
        return
    step = data.size // 256
    for start in range(0, step * 256, step):
        h.update(data[start : start + 4096].data)


def _describe_attributes(obj: object, h: Any, depth: int) -> None:
    for name, value in sorted(vars(obj).items()):
        if not name.startswith("_"):
            h.update(tag(b"k", name.encode()))
            _describe(value, h, depth)


def fingerprint_dataset(dataset: Any, version: object = None) -> str:
    """The key of a dataset: its class and sources, public attributes, length and ``version``.

    Args:
        dataset: A map-style dataset (with ``__len__``).
        version: Anything with a stable ``repr``; change it to start a fresh cache.

    Returns:
        32 hex digits.

    Raises:
        TypeError: If the dataset has no length.
    """
    cls = type(dataset)
    h = xxhash.xxh3_128()
    h.update(tag(b"q", f"torchcache-dataset-1|{cls.__module__}.{cls.__qualname__}".encode()))
    for klass in cls.__mro__:
        if klass is not object and not klass.__module__.startswith(("torch.", "builtins", "typing")):
            h.update(tag(b"S", f"{klass.__module__}.{klass.__qualname__}|{_source(klass)}".encode()))
    if isinstance(dataset, (torch.Tensor, np.ndarray, list, tuple, dict)) or not isinstance(
        getattr(dataset, "__dict__", None), dict
    ):  # a tensor, array or list used as a dataset: its values
        _describe(dataset, h, 0)
    else:
        _describe_attributes(dataset, h, 0)
    h.update(tag(b"n", str(len(dataset)).encode()))
    h.update(tag(b"V", repr(version).encode("utf-8", "surrogatepass")))
    return h.hexdigest()


def store_key(key: int | str) -> str:
    """The store key of a sample key: 16 hex digits for an int in ``[0, 2**64)``, else a 32-digit hash.

    Raises:
        KeyingError: If the key is neither an int nor a str.

    Example:
        >>> store_key(255), len(store_key("cat.jpg"))
        ('00000000000000ff', 32)
    """
    if type(key) is int and 0 <= key < _HEX_KEYS:  # the common case first: a dataset index
        return f"{key:016x}"
    if isinstance(key, str):
        return xxhash.xxh3_128_hexdigest(b"s" + key.encode("utf-8", "surrogatepass"))
    if isinstance(key, bool):
        raise KeyingError(f"a sample key must be an int or a str, got {key!r}")
    try:
        index = operator.index(key)
    except TypeError:
        raise KeyingError(f"a sample key must be an int or a str, got {type(key).__name__}") from None
    return f"{index:016x}" if 0 <= index < _HEX_KEYS else xxhash.xxh3_128_hexdigest(f"i{index}".encode())
