"""Module and function fingerprints: the part of every key that names *what* computes.

A module's key is the closure of what its forward can reach, by the canonical encoder of
:mod:`torchcache.canonical`: its init arguments (for a decorated class); for the module
and each submodule, its class (by the code of its methods, followed through closures,
defaults and the globals they read; an installed package's classes by its version) and
every attribute torch does not manage itself, from ``__dict__`` and ``__slots__``; the
forward hooks and pre-hooks of every submodule and those registered for all modules;
every parameter, buffer and plain tensor attribute; the format version and the settings
that change what is stored. All of it is taken at the first call, and again when
:class:`~torchcache.module.versions.VersionWatch` sees a change (attributes are also
described when the module is wrapped, so that a refusal comes then). A function's key
covers its code, defaults, attributes, the values its closure captured and the globals
it reads. A ``functools.partial`` adds its bound arguments; a bound method adds its
instance. A value the encoder cannot describe exactly is refused with a
:class:`KeyingError` naming its path, never skipped. What a fingerprint cannot see:
files a module reads at call time; ``persistent_module_hash`` or a
``__torchcache_key__()`` method is the remedy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import xxhash

from ..canonical import KeyEncoder, deferring, module_attributes, module_hooks
from ..keys import FORMAT_VERSION, encode_value, tag, tensor_digest

__all__ = [
    "check_instance",
    "describe_hooks",
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
    "If it does not change outputs, leave it out of the key: torchcache(..., key_ignore=({name!r},)); "
    "otherwise give the key yourself with persistent_module_hash, or pass the value as an argument of the "
    "cached call"
)
_HOOK_REMEDY = (
    "Register the hook after the calls you cache, or on a module outside the cached one; if it does not "
    "change outputs, leave the module's hooks out of the key: torchcache(..., key_ignore=({name!r},)); or "
    "make the hook an object whose class has a __torchcache_key__() method"
)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
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
    """Digest the classes and attributes of a module and of every submodule, weights and hooks excepted.

    Every attribute counts, from ``__dict__`` and ``__slots__``, except those torch
    manages itself (hooks and the registries of parameters, buffers and submodules, which
    are keyed on their own), ``training`` (part of every call's key) and the names in
    ``ignore`` (bare names, or dotted paths below the module such as
    ``"encoder.layer.0.fn"``). Each class counts by its code (:mod:`torchcache.canonical`).

    Raises:
        KeyingError: If an attribute cannot be encoded exactly (the message names its path).
    """
    root = type(module).__qualname__
    encoder = KeyEncoder(_MODULE_REMEDY, ignore=ignore, root=root)
    h = xxhash.xxh3_128()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        h.update(tag(b"k", prefix.encode()) + module_attributes(encoder, sub, f"{root}.{prefix}" if prefix else root))
    return h.digest()


def check_instance(module: torch.nn.Module, ignore: Collection[str] = ()) -> None:
    """:func:`describe_instance` when a module is wrapped, so that a refusal comes then.

    Globals not defined yet are left for the key taken at the first call.

    Raises:
        KeyingError: If an attribute cannot be encoded exactly (the message names its path).
    """
    with deferring():
        describe_instance(module, ignore)


def describe_hooks(module: torch.nn.Module, ignore: Collection[str] = (), include_root: bool = False) -> bytes:
    """Digest the forward hooks and pre-hooks that run inside a cached call, as functions.

    Those of every submodule, and those registered for all modules
    (``register_module_forward_hook``), in the order they run. The module's own hooks run
    around the cached forward, on hits too, so they are left out unless ``include_root``
    (a cached method, which its module's ``__call__`` does not run).

    Raises:
        KeyingError: If a hook cannot be encoded exactly (the message names where it is registered).
    """
    root = type(module).__qualname__
    encoder = KeyEncoder(_HOOK_REMEDY, ignore=ignore, root=root)
    parts = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if prefix or include_root:
            hooks = module_hooks(encoder, sub, f"{root}.{prefix}" if prefix else root)
            if hooks:
                parts.append(tag(b"k", prefix.encode()) + hooks)
    parts.append(global_hooks(encoder))
    return b"".join(parts)


def global_hooks(encoder: KeyEncoder) -> bytes:
    """The forward hooks and pre-hooks registered for every module, as ``encoder`` encodes them."""
    registry = torch.nn.modules.module
    parts = []
    for name in _GLOBAL_HOOKS:
        hooks: dict[int, Any] = getattr(registry, name, None) or {}
        for handle, hook in hooks.items():
            flags = (handle in getattr(registry, name + "_with_kwargs", {}), handle in _always_called(registry, name))
            parts.append(
                tag(b"g", f"{name}|{flags}".encode()) + encoder.encode(hook, f"torch.nn.modules.module.{name}")
            )
    return b"".join(parts)


def _always_called(registry: Any, name: str) -> dict[int, Any]:
    return getattr(registry, "_global_forward_hooks_always_call", {}) if name == "_global_forward_hooks" else {}


def unignored(named: list[tuple[str, torch.Tensor]], ignore: Collection[str]) -> list[tuple[str, torch.Tensor]]:
    """``named`` tensors without those ``key_ignore`` names, by dotted path or last name (a memo table)."""
    if not ignore:
        return named
    return [(n, t) for n, t in named if n.lstrip(".") not in ignore and n.rsplit(".", 1)[-1] not in ignore]


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
    ignore: Collection[str] = (),
    root_hooks: bool = False,
) -> str:
    """The module key: classes, init arguments and attributes, hooks, weights, format and settings.

    Args:
        module: The module instance with its current weights.
        init_digest: :func:`describe_init` of the arguments its ``__init__`` received
            (a decorated class), taken when it was built; empty for a wrapped instance.
        settings: Settings that change what is stored (``cache_dtype``, ``subsample_count``).
        method: The name of the method whose outputs are cached.
        ignore: ``key_ignore``: hooks registered on modules of these names are left out.
        root_hooks: Key the module's own forward hooks too, as for a method other than
            ``forward``: stored outputs include what they did (extracted features).

    Returns:
        32 hex digits.

    Raises:
        KeyingError: If an attribute, a class or a forward hook cannot be encoded exactly.
    """
    h = xxhash.xxh3_128()
    cls = type(module)
    h.update(tag(b"q", f"{cls.__module__}.{cls.__qualname__}".encode()))
    if method != "forward":
        h.update(tag(b"m", method.encode()))
    h.update(tag(b"a", init_digest))
    h.update(tag(b"i", describe_instance(module, ignore)))
    h.update(tag(b"h", describe_hooks(module, ignore, include_root=root_hooks or method != "forward")))
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    h.update(tag(b"w", tensor_digest(unignored(named, ignore)).encode()))
    attributes = unignored(tensor_attributes(module), ignore)
    if attributes:
        h.update(tag(b"t", tensor_digest(attributes).encode()))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def fingerprint_function(fn: Callable[..., Any], settings: Mapping[str, object], ignore: Collection[str] = ()) -> str:
    """The key of a decorated function: code, defaults, attributes, closure, globals, format, settings.

    ``functools.partial`` objects add their bound arguments, bound methods their
    instance; forward hooks registered for all modules are added when there are any.

    Raises:
        KeyingError: If a captured value, default or global cannot be encoded exactly.
    """
    target = getattr(fn, "func", fn)
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    encoder = KeyEncoder(_FUNCTION_REMEDY, ignore=ignore)
    h = xxhash.xxh3_128()
    h.update(encoder.encode(fn, name))
    h.update(global_hooks(KeyEncoder(_HOOK_REMEDY, ignore=ignore)))
    h.update(_settings_bytes(settings))
    return h.hexdigest()


def _settings_bytes(settings: Mapping[str, object]) -> bytes:
    parts = [tag(b"V", str(FORMAT_VERSION).encode())]
    for key in sorted(settings):
        parts.append(tag(b"o", key.encode()) + encode_value(settings[key], key))
    return b"".join(parts)
