"""Keys of dataset samples: a fingerprint per dataset, a store key per sample.

A dataset's fingerprint covers its class (by its code and that of its base classes, or an
installed package's version), every attribute, exactly (by the canonical
encoder of :mod:`torchcache.canonical`: tensors, arrays and pandas objects by content,
lists and dicts item by item, functions by their code, ``pathlib`` paths and memmaps
by file name, size and modification time), ``len(dataset)``, torch's default dtype where
it is not float32, and a ``version``. What it cannot see (the content of files named by plain strings, a setting read in
``__getitem__``) is what ``version`` is for. A sample's store key is its index in 16
hex digits, so the keys of a store name their indices.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
import xxhash

from ..canonical import KeyEncoder
from ..canonical.objects import slot_values
from ..errors import KeyingError
from ..keys import tag

__all__ = ["fingerprint_dataset", "store_key"]

_HEX_KEYS = 1 << 64  # int keys below this are their own 16 hex digits
_REMEDY = (
    "Pass version= (to CachedDataset or extract_features; change it whenever the data changes) to key the "
    "dataset by it instead, or give the dataset's class a __torchcache_key__() method"
)


_MAX_COVERED = 32  #: parts of one value left to the version before it covers the whole value


def fingerprint_dataset(dataset: Any, version: object = None) -> str:
    """The key of a dataset: its class's code, attributes, length and ``version``.

    Every attribute is encoded exactly by :class:`~torchcache.canonical.KeyEncoder`
    (tensors and arrays by content, pandas objects by every row, ``pathlib`` paths and
    ``np.memmap`` arrays by file name, size and modification time, transforms and other
    objects by their class's code and their state). An attribute that cannot be encoded
    is refused, unless ``version`` is given: then it is the version that keys it.

    Args:
        dataset: A map-style dataset (with ``__len__``).
        version: Anything the encoder encodes (a string, a number, a tuple); change it to
            start a fresh cache.

    Returns:
        32 hex digits.

    Raises:
        TypeError: If the dataset has no length.
        KeyingError: If an attribute cannot be encoded and no ``version`` is given.
    """
    cls = type(dataset)
    h = xxhash.xxh3_128()
    h.update(tag(b"q", f"torchcache-dataset-3|{cls.__module__}.{cls.__qualname__}".encode()))
    root = cls.__qualname__
    encoder = KeyEncoder(_REMEDY, files=True, root=root)
    state = getattr(dataset, "__dict__", None)
    whole = isinstance(dataset, (torch.Tensor, np.ndarray, list, tuple, dict))
    own_key = callable(getattr(cls, "__torchcache_key__", None))  # its state given by it, not read
    covered = version if not own_key else (version, "__torchcache_key__")  # what its key may stand for
    h.update(_covered(cls, f"{root}.<class>", root, covered))  # its code, and that of its base classes
    if whole or own_key or not isinstance(state, dict):
        h.update(encoder.encode(dataset, root))  # a tensor, array or list used as a dataset: its values
    else:
        slots = [(tag(b"s", name.encode()), name, value) for name, value in slot_values(dataset)]  # __slots__ too
        for label, name, value in [(tag(b"k", n.encode()), n, v) for n, v in sorted(state.items())] + slots:
            h.update(label + _covered(value, f"{root}.{name}", root, version))
    h.update(tag(b"n", str(len(dataset)).encode()))
    if (dtype := torch.get_default_dtype()) != torch.float32:  # what torch.tensor([0.5]) in __getitem__ makes
        h.update(tag(b"D", str(dtype).encode()))
    h.update(tag(b"V", KeyEncoder(_REMEDY).encode(version, "version")))
    return h.hexdigest()


def _covered(value: object, path: str, root: str, version: object) -> bytes:
    """``value`` encoded; with a ``version``, what cannot be encoded is left to it, and only that.

    Each refused part (a global a method reads, an item of an attribute) is left out by its
    path and the value encoded again, so that the rest (the class's other code, the
    attribute's other items) stays in the key.

    Raises:
        KeyingError: If a part cannot be encoded and no ``version`` is given.
    """
    ignore: set[str] = set()
    for _ in range(_MAX_COVERED):
        try:
            return KeyEncoder(_REMEDY, files=True, root=root, ignore=ignore).encode(value, path)
        except KeyingError as exc:
            if version is None:
                raise
            refused = (exc.path or "").split("[", 1)[0]  # an item of a container: the attribute holding it
            relative = refused[len(root) + 1 :] if refused.startswith(root + ".") else ""
            if not relative or relative in ignore:
                break  # not a part the encoder can leave out
            ignore.add(relative)
    if isinstance(value, (dict, list, tuple)):  # item by item: the version covers only the items refused
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts = [KeyEncoder(_REMEDY).encode(k, path) + _covered(v, f"{path}[{k!r}]", root, version) for k, v in items]
        return tag(b"C", f"{type(value).__qualname__}|{len(parts)}".encode() + b"".join(parts))
    return b"version"  # the version covers the whole value


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
