"""Modules for a key: a module's class and attributes, its forward hooks, a module held as a value.

A module's key is taken submodule by submodule (:func:`module_attributes`,
:func:`module_hooks`); its weights are keyed apart, since they are hashed again when they
change. A module held as a value (an attribute, a global a function reads) is keyed
whole by :func:`encode_module`, weights included.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .objects import CONFIG_UNKEYED, Binding, collect, slot_values, tensor_content_digest
from .tags import Tag, raw, tagged, text

if TYPE_CHECKING:
    from .values import KeyEncoder as Encoder

__all__ = [
    "CONFIG_UNKEYED",
    "MODULE_MANAGED",
    "OBSERVER_HOOKS",
    "WeakState",
    "encode_module",
    "module_attributes",
    "module_hooks",
]

#: Attributes of a module left out of its key: those torch itself manages on every
#: ``nn.Module`` (hooks, keyed on their own; the registries of weights and submodules,
#: keyed on their own), ``training`` (part of every call's key), where weights were
#: loaded from (``name_or_path``: the weights themselves are keyed) and torchcache's own.
MODULE_MANAGED = frozenset(vars(torch.nn.Module())) | {
    "_compiled_call_impl",
    "training",
    "name_or_path",
    "cache_instance",
    "_torchcache_binding",
    "_output_capturing_hooks_installed",  # transformers' mark for its observer hooks (OBSERVER_HOOKS)
}
#: Forward hooks that libraries install to observe, never to change, outputs, by module and
#: qualified name of the hook function: left out of keys, so that installing them in the
#: middle of a run does not change the key. transformers installs its output-capturing
#: hooks at the first call that asks for hidden states or attentions; they record outputs
#: only while a call collects them, and return nothing.
OBSERVER_HOOKS = frozenset(
    {("transformers.utils.output_capturing", "install_output_capuring_hook.<locals>.output_capturing_hook")}
)


class WeakState(Mapping[str, Any]):
    """An object's ``__dict__`` and ``__slots__`` values, read through a weak reference (a :class:`Binding`'s).

    A watch that lives on the module (its cache) and held the module's ``__dict__`` would
    keep a deleted model's weights until a garbage collection.
    """

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)
        self.ident = id(owner)  # one for the object, however often its key is taken

    def __getitem__(self, name: str) -> Any:
        owner = self._owner()
        state = getattr(owner, "__dict__", {}) if owner is not None else {}
        if name in state:
            return state[name]
        slot = _slot(type(owner), name)  # not a class attribute or a descriptor's getter: forward may never read those
        if slot is None:
            raise KeyError(name)
        try:
            return slot.__get__(owner)
        except AttributeError:  # a slot not set
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        owner = self._owner()
        if owner is None:
            return iter(())
        return iter([*getattr(owner, "__dict__", {}), *(name for name, _ in slot_values(owner))])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _slot(cls: type, name: str) -> types.MemberDescriptorType | None:
    """The ``__slots__`` member that ``name`` reads on instances of ``cls``, if that is what it reads."""
    for klass in cls.__mro__:
        member = vars(klass).get(name)
        if member is not None:
            return member if isinstance(member, types.MemberDescriptorType) else None
    return None


#: Forward pre-hooks that set a weight from keyed parameters at every call (``nn.utils.weight_norm``).
_DERIVED = (WeightNorm, SpectralNorm)


def module_attributes(encoder: Encoder, module: torch.nn.Module, path: str, depth: int = 0) -> bytes:
    """One module's class and the attributes torch does not manage, from ``__dict__`` and ``__slots__``.

    Its weights, submodules and hooks are keyed on their own.
    """
    own_key = getattr(module, "__torchcache_key__", None)
    if callable(own_key):
        return tagged(Tag.OWN_KEY, encoder.child(own_key(), f"{path}.__torchcache_key__()", depth))
    state = vars(module)
    items = [(k, v) for k, v in sorted(state.items()) if k not in MODULE_MANAGED]
    parts = [encoder.child(type(module), f"{path}.<class>", depth), encoder.attributes(items, path, depth)]
    derived = {getattr(hook, "name", None) for hook in module._forward_pre_hooks.values() if isinstance(hook, _DERIVED)}
    for name, value in items:  # rebound later (model.scale = 3.0, model.mask = other): the key is taken again
        if not encoder.ignored(path, name) and name not in derived:  # not what weight_norm's hook sets at each call
            collect(Binding(state, name, value))
    slots = slot_values(module)
    if slots:
        parts.append(tagged(Tag.SLOTS, encoder.items(slots, path, depth, attributes=True)))
        view = WeakState(module)
        for name, value in slots:
            if not encoder.ignored(path, name):
                collect(Binding(view, name, value))
    return tagged(Tag.NN_MODULE, b"".join(parts))


def module_hooks(encoder: Encoder, module: torch.nn.Module, path: str, depth: int = 0) -> bytes:
    """The forward hooks and pre-hooks of one module, in the order they run, with their flags."""
    parts = []
    for kind in ("_forward_pre_hooks", "_forward_hooks"):
        registry: dict[int, Any] = getattr(module, kind, None) or {}
        if registry and encoder.ignored(path, kind):
            continue
        flags = (
            getattr(module, f"{kind}_with_kwargs", {}),
            getattr(module, "_forward_hooks_always_call", {}) if kind == "_forward_hooks" else {},
        )
        for i, (handle, hook) in enumerate(registry.items()):
            if (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) in OBSERVER_HOOKS:
                continue
            marks = text(f"{kind}|{handle in flags[0]}|{handle in flags[1]}")
            parts.append(marks + encoder.child(hook, f"{path}.{kind}[{i}]", depth))
    return tagged(Tag.HOOKS, b"".join(parts)) if parts else b""


def encode_module(encoder: Encoder, module: torch.nn.Module, path: str, depth: int) -> bytes:
    """A module held as a value: class, attributes, training flag, hooks, weights and submodules.

    Its training flag is watched by whoever holds the key (:func:`collect`), as a registered
    submodule's is part of every call's key.
    """
    collect(module)
    parts = [module_attributes(encoder, module, path, depth), module_hooks(encoder, module, path, depth)]
    parts.append(text("training" if module.training else "eval"))
    for kind, registry in ((b"p", module._parameters), (b"b", module._buffers)):
        for key, tensor in registry.items():
            if not encoder.ignored(path, key):
                digest = b"" if tensor is None else tensor_content_digest(tensor, f"{path}.{key}")
                collect(tensor)
                parts.append(text(kind.decode() + key) + raw(digest))
    for key, sub in module._modules.items():
        parts.append(text(key) + encoder.child(sub, f"{path}.{key}", depth))
    return tagged(Tag.NN_MODULE, b"".join(parts))
