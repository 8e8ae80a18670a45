"""Module and function fingerprints: the part of every key that names *what* computes.

A module's key covers its class and every base class outside torch (name and source),
its init arguments (for a decorated class) and every attribute of the module and of each
submodule that torch does not manage itself, as they were when the module was built (a
decorated class) or wrapped (numbers, strings, lists, dicts,
functions, configuration objects, tensors kept as plain attributes: everything, by the
canonical encoder of :mod:`torchcache.canonical`), every parameter and buffer, the
format version and the settings that change what is stored. A function's key covers
its qualified name, its compiled code (so two lambdas on one source line differ), its
defaults, its attributes and the values its closure captured. A ``functools.partial``
adds its bound arguments; a bound method adds its instance.

A value the encoder cannot describe exactly is refused with a :class:`KeyingError`
naming its path, never skipped. What a fingerprint cannot see: global variables a
function reads and files a module reads at call time; ``persistent_module_hash`` or a
``__torchcache_key__()`` method is the remedy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import xxhash

from ..canonical import KeyEncoder, class_source, own_classes
from ..keys import FORMAT_VERSION, encode_value, tag, tensor_digest

__all__ = [
    "describe_init",
    "describe_instance",
    "fingerprint_function",
    "fingerprint_module",
    "module_encoder",
    "tensor_attributes",
]

_MODULE_REMEDY = (
    "If it does not change outputs, leave it out of the key: torchcache(..., key_ignore=({name!r},)); "
    "otherwise give the key yourself: a __torchcache_key__() method on its class, or persistent_module_hash"
)
_FUNCTION_REMEDY = (
    "Give the key yourself with persistent_module_hash, or pass the value as an argument of the cached call"
)


def module_encoder(ignore: Collection[str] = ()) -> KeyEncoder:
    """The encoder for a module's init arguments and attributes (refusals suggest ``key_ignore``)."""
    return KeyEncoder(_MODULE_REMEDY, ignore=ignore)


def describe_init(
    init_args: Sequence[object], init_kwargs: Mapping[str, object], ignore: Collection[str] = ()
) -> bytes:
    """Digest a module's ``__init__`` arguments canonically (tensors by content).

    Taken at construction so that the arguments themselves are not kept alive.

    Raises:
        KeyingError: If an argument cannot be encoded exactly (the message names it).
    """
    encoder = module_encoder(ignore)
    h = xxhash.xxh3_128()
    for i, value in enumerate(init_args):
        h.update(encoder.encode(value, f"init argument {i}"))
    for key in sorted(init_kwargs):
        if key not in ignore:
            h.update(tag(b"k", key.encode()) + encoder.encode(init_kwargs[key], f"init argument {key!r}"))
    return h.digest()


def describe_instance(module: torch.nn.Module, ignore: Collection[str] = ()) -> bytes:
    """Digest the attributes of a module and of every submodule, weights excepted.

    Every attribute counts except those torch manages itself (hooks and the registries of
    parameters, buffers and submodules, which are keyed on their own), ``training``
    (part of every call's key) and the names in ``ignore`` (bare attribute names, or
    dotted paths below the module such as ``"encoder.layer.0.fn"``).

    Raises:
        KeyingError: If an attribute cannot be encoded exactly (the message names its path).
    """
    root = type(module).__qualname__
    encoder = KeyEncoder(_MODULE_REMEDY, ignore=ignore, root=root)
    h = xxhash.xxh3_128()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        h.update(tag(b"k", prefix.encode()) + encoder.module_attributes(sub, f"{root}.{prefix}" if prefix else root))
    return h.digest()


def tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors kept as plain attributes (neither parameters nor buffers), by dotted name."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{name}", value))
    return sorted(found, key=lambda item: item[0])


def fingerprint_module(
    module: torch.nn.Module,
    init_digest: bytes,
    settings: Mapping[str, object],
    method: str = "forward",
) -> str:
    """The module key: class, source, init arguments and attributes, weights, format and settings.

    Args:
        module: The module instance with its current weights.
        init_digest: :func:`describe_init` of the arguments its ``__init__`` received
            and :func:`describe_instance` of its attributes, both taken when it was built
            (a decorated class) or wrapped.
        settings: Settings that change what is stored (``cache_dtype``, ``subsample_count``).
        method: The name of the method whose outputs are cached.

    Returns:
        32 hex digits.
    """
    h = xxhash.xxh3_128()
    cls = type(module)
    h.update(tag(b"q", f"{cls.__module__}.{cls.__qualname__}".encode()))
    if method != "forward":
        h.update(tag(b"m", method.encode()))
    for klass in own_classes(cls):
        h.update(tag(b"c", f"{klass.__module__}.{klass.__qualname__}".encode()))
        h.update(tag(b"S", class_source(klass).encode()))
    h.update(tag(b"a", init_digest))
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    h.update(tag(b"w", tensor_digest(named).encode()))
    attributes = tensor_attributes(module)
    if attributes:
        h.update(tag(b"t", tensor_digest(attributes).encode()))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def fingerprint_function(fn: Callable[..., Any], settings: Mapping[str, object]) -> str:
    """The key of a decorated function: name, code, defaults, attributes, closure, format, settings.

    ``functools.partial`` objects add their bound arguments, bound methods their instance.

    Raises:
        KeyingError: If a captured value or default cannot be encoded exactly.
    """
    target = getattr(fn, "func", fn)
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    h = xxhash.xxh3_128()
    h.update(KeyEncoder(_FUNCTION_REMEDY).encode(fn, name))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def _settings_bytes(settings: Mapping[str, object]) -> bytes:
    parts = [tag(b"V", str(FORMAT_VERSION).encode())]
    for key in sorted(settings):
        parts.append(tag(b"o", key.encode()) + encode_value(settings[key], key))
    return b"".join(parts)
