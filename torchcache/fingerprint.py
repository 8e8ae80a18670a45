"""Module and function fingerprints: the part of every key that names *what* computes.

A module's key covers its class and every base class outside torch (name and source),
its init arguments (or, for an instance built elsewhere, its configuration
attributes), every parameter and buffer, plain tensor attributes (a random
projection kept as ``self.proj = torch.randn(...)``), the format version and the
settings that change what is stored. A function's key covers its qualified name, its
source, its compiled code (so two lambdas on one source line differ), its defaults,
and the values its closure captured. A ``functools.partial`` adds its bound
arguments; a bound method adds its instance.

What a fingerprint cannot see: global variables a function reads, files a module
reads at call time, and weights changed in place without ``load_state_dict()``. For
those, ``persistent_module_hash`` (or ``cache_instance.clear()``) is the remedy.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ._fork import after_fork
from .errors import KeyingError
from .keys import FORMAT_VERSION, encode_value, tag, tensor_digest

__all__ = ["describe_init", "describe_instance", "fingerprint_function", "fingerprint_module"]

_MAX_DEPTH = 8
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")
_source_lock = threading.Lock()
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_UNKEYED = frozenset({"training", "name_or_path"})


def _describe_object(value: object, name: str, depth: int = 0) -> bytes:
    """Encode an init argument: exact for plain values, tensors and arrays, by state otherwise.

    Objects whose ``repr`` is the default one (a class name and a memory address) are
    described by their class and their attributes, so that two configurations of one
    class never share a key; other objects by their ``repr`` without memory addresses.
    """
    if isinstance(value, torch.Tensor):
        return tag(b"X", tensor_digest([("", value)]).encode())
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        h = xxhash.xxh3_128(f"{value.dtype.str}|{value.shape}".encode())
        h.update(np.ascontiguousarray(value).view(np.uint8).reshape(-1).data)
        return tag(b"A", h.digest())
    if isinstance(value, torch.nn.Module):
        cls: type = type(value)
        state = tensor_digest(value.state_dict().items())
        text = _ADDRESS_RE.sub("", repr(value))
        return tag(b"M", f"{cls.__module__}.{cls.__qualname__}|{text}|{state}".encode())
    if depth > _MAX_DEPTH:
        return tag(b"R", _ADDRESS_RE.sub("", repr(value)).encode())
    if type(value) in (tuple, list):
        seq: Sequence[object] = value  # type: ignore[assignment]
        return tag(b"L", b"".join(_describe_object(v, name, depth + 1) for v in seq))
    if type(value) is dict:
        mapping: Mapping[object, object] = value  # type: ignore[assignment]
        items = sorted((repr(k), _describe_object(v, name, depth + 1)) for k, v in mapping.items())
        return tag(b"D", b"".join(k.encode() + v for k, v in items))
    try:
        return encode_value(value, name)
    except KeyingError:
        pass
    if isinstance(value, functools.partial):
        return tag(b"P", _describe_callable(value, depth + 1))
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return tag(b"F", _describe_callable(value, depth + 1))
    if callable(value) and hasattr(value, "__qualname__"):
        module = getattr(value, "__module__", "")
        return tag(b"C", f"{module}.{value.__qualname__}".encode())
    cls = type(value)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    attributes = getattr(value, "__dict__", None)
    if cls.__repr__ is object.__repr__ and isinstance(attributes, dict):
        return tag(b"O", qualname.encode() + _describe_object(dict(attributes), name, depth + 1))
    text = _ADDRESS_RE.sub("", repr(value))
    return tag(b"R", f"{qualname}|{text}".encode())


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


def _describe_code(code: types.CodeType, depth: int = 0) -> bytes:
    """The compiled body of a function: bytecode, constants (nested code too) and names."""
    parts = [tag(b"b", code.co_code), tag(b"n", repr(code.co_names).encode())]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            parts.append(tag(b"k", _describe_code(const, depth + 1) if depth < _MAX_DEPTH else b""))
        else:
            parts.append(tag(b"c", repr(const).encode()))
    return b"".join(parts)


def _describe_callable(fn: Callable[..., Any], depth: int = 0) -> bytes:
    """Name, source, code, defaults and captured values of a callable."""
    if isinstance(fn, functools.partial):
        return b"".join(
            (
                _describe_callable(fn.func, depth + 1),
                _describe_object(list(fn.args), "partial argument", depth + 1),
                _describe_object(dict(fn.keywords), "partial keyword", depth + 1),
            )
        )
    if isinstance(fn, types.MethodType):
        return _describe_callable(fn.__func__, depth + 1) + _describe_object(fn.__self__, "instance", depth + 1)
    target = inspect.unwrap(fn)
    parts = [tag(b"q", f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}".encode())]
    parts.append(tag(b"S", _source(target).encode()))
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):
        parts.append(_describe_code(code))
    if depth <= _MAX_DEPTH:
        defaults = getattr(target, "__defaults__", None) or ()
        kwdefaults = getattr(target, "__kwdefaults__", None) or {}
        parts.append(_describe_object(list(defaults), "default", depth + 1))
        parts.append(_describe_object(dict(kwdefaults), "default", depth + 1))
        for cell in getattr(target, "__closure__", None) or ():
            try:
                captured = cell.cell_contents
            except ValueError:  # an empty cell
                parts.append(b"e")
                continue
            parts.append(_describe_object(captured, "captured variable", depth + 1))
    return b"".join(parts)


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
        h.update(tag(b"k", key.encode()) + _describe_object(init_kwargs[key], key))
    return h.digest()


def describe_instance(module: torch.nn.Module) -> bytes:
    """Digest the configuration of a module built elsewhere (its init arguments are unknown).

    Covers the public attributes of the module and of every submodule that are plain
    values (numbers, strings, dtypes, tuples of these) or configuration objects (a
    Hugging Face ``config``: by its public ``to_dict()`` entries, else its ``repr``, or
    its attributes when that is the default one). Mutable containers (lists, dicts) are
    left out: modules use them for bookkeeping that changes from call to call. So is
    where the weights were loaded from (``name_or_path``): the weights themselves are
    keyed, so one checkpoint loaded from two places has one key.
    """
    h = xxhash.xxh3_128()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, value in sorted(vars(sub).items()):
            if name.startswith("_") or name in _UNKEYED or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            if isinstance(value, _SCALARS) or (type(value) is tuple and all(isinstance(v, _SCALARS) for v in value)):
                encoded = encode_value(value, name)
            elif isinstance(value, (list, dict, set)) or callable(value):
                continue
            else:
                encoded = _describe_object(_public_config(value), name)
            h.update(tag(b"k", f"{prefix}.{name}".encode()) + encoded)
    return h.digest()


def _public_config(value: object) -> object:
    """A configuration object's public entries, when it has ``to_dict()``; else the object."""
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            entries = to_dict()
        except Exception:  # noqa: BLE001 - any object may have a to_dict; fall back to describing it
            return value
        if isinstance(entries, dict):
            return {k: v for k, v in entries.items() if not (isinstance(k, str) and k.startswith("_"))}
    return value


def _tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors kept as plain attributes (neither parameters nor buffers), by dotted name."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{name}", value))
    return sorted(found, key=lambda item: item[0])


def fingerprint_module(
    module: torch.nn.Module, init_digest: bytes, settings: Mapping[str, object], method: str = "forward"
) -> str:
    """The module key: class, source, init arguments, weights, format and settings.

    Args:
        module: The module instance with its current weights.
        init_digest: :func:`describe_init` of the arguments its ``__init__`` received,
            or :func:`describe_instance` of a module built elsewhere.
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
    for klass in _own_classes(cls):
        h.update(tag(b"c", f"{klass.__module__}.{klass.__qualname__}".encode()))
        h.update(tag(b"S", _source(klass).encode()))
    h.update(tag(b"a", init_digest))
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    h.update(tag(b"w", tensor_digest(named).encode()))
    attributes = _tensor_attributes(module)
    if attributes:
        h.update(tag(b"t", tensor_digest(attributes).encode()))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def fingerprint_function(fn: Callable[..., Any], settings: Mapping[str, object]) -> str:
    """The key of a decorated function: name, source, code, defaults, closure, format, settings.

    ``functools.partial`` objects add their bound arguments, bound methods their instance.
    """
    h = xxhash.xxh3_128()
    h.update(_describe_callable(fn))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def _settings_bytes(settings: Mapping[str, object]) -> bytes:
    parts = [tag(b"V", str(FORMAT_VERSION).encode())]
    for key in sorted(settings):
        parts.append(tag(b"o", key.encode()) + encode_value(settings[key], key))
    return b"".join(parts)
