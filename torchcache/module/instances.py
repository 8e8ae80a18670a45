"""One cache per module instance: the wrapper of ``forward``, and the cache each instance makes at its first call.

The wrapper is set on a class (a decorated one, or the cached subclass an instance is
moved to); each instance carries an :class:`InstanceBinding` (its settings and init
arguments' digest), so that a copy or an unpickled module makes a cache of its own.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Settings
from .callables import weights_loaded, without_self
from .engine import Cache
from .fingerprint import fingerprint_module
from .guards import check_frozen, outside_compile, warn_if_training
from .subclass import BINDING

__all__ = ["InstanceBinding", "attach", "bind", "cached_forward", "cached_method", "forwards", "make_cache", "patch"]


class _Running(threading.local):
    """The forward each module's cached call runs, per thread (another forward of it called inside runs plain)."""

    def __init__(self) -> None:
        self.forwards: dict[int, Callable[..., Any]] = {}


_calling = _Running()
#: The forward each fx graph module's cache was made for (a call begun before a recompile runs the old one uncached).
forwards: weakref.WeakKeyDictionary[Cache, Callable[..., Any]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class InstanceBinding:
    """What a module instance needs to (re)make its cache: picklable, copied with the module."""

    settings: Settings
    init_digest: bytes
    name: str


def make_cache(module: torch.nn.Module, binding: InstanceBinding, forward: Callable[..., Any]) -> Cache:
    """Make the cache of one module instance (without touching the module: it may be half-copied)."""
    module_ref = weakref.ref(module)
    key_settings = binding.settings.key_settings()

    def fingerprint() -> str:
        owner = module_ref()
        if owner is None:  # pragma: no cover - the cache lives on the module
            raise ReferenceError("the cached module no longer exists")
        check_frozen(owner, type(owner).__qualname__)
        return fingerprint_module(owner, binding.init_digest, key_settings, ignore=binding.settings.key_ignore)

    def signature() -> inspect.Signature:  # of the forward that runs now (one set on a base class later)
        return without_self(_running_forward(type(module_ref())) or forward)

    cache = Cache(binding.settings, binding.name, "module", signature, fingerprint)
    cache.bind_owner(module, lambda owner: make_cache(owner, binding, forward))
    cache.watch_weights(module)
    return cache


def _running_forward(kind: type) -> Callable[..., Any] | None:
    """The forward a cached instance of ``kind`` runs now (under a subclass's own), or ``None``: it is not cached."""
    wrappers = (getattr(k.__dict__.get("forward"), "torchcache_plain", None) for k in kind.__mro__)
    current = next((found for found in wrappers if found is not None), None)
    return None if current is None else current(kind)  # type: ignore[no-any-return]


def attach(module: torch.nn.Module, binding: InstanceBinding, forward: Callable[..., Any]) -> Cache:
    """Make the cache of one module instance and store it as ``module.cache_instance``."""
    check_frozen(module, type(module).__qualname__)
    cache = module.__dict__["cache_instance"] = make_cache(module, binding, forward)
    if binding.settings.keep_eval:
        module.train(False)
    return cache


def cache_of(module: torch.nn.Module) -> Cache | None:
    """The module's cache, made now for an instance unpickled or copied since it was cached (``None``: none)."""
    cache = module.__dict__.get("cache_instance")
    if isinstance(cache, Cache) and cache.belongs_to(module):
        return cache
    binding: InstanceBinding | None = module.__dict__.get(BINDING)
    forward = _running_forward(type(module))
    if binding is None or forward is None:  # caching is off for this instance, or it is not cached
        return None
    return attach(module, binding, forward)


def cached_forward(
    module: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``forward(module, *args, **kwargs)`` through the module's cache (made now if it has none)."""
    cache = module.__dict__.get("cache_instance")
    if cache is None or not cache.belongs_to(module):
        binding: InstanceBinding | None = module.__dict__.get(BINDING)
        if binding is None:  # caching is off for this instance
            return forward(module, *args, **kwargs)
        cache = attach(module, binding, forward)  # an unpickled module, or a copy.copy() of one
    elif forwards.get(cache, forward) is not forward:  # begun before an fx recompile made a cache for new code
        return forward(module, *args, **kwargs)
    running = _calling.forwards
    outer = running.get(id(module))
    if outer is not None and outer is not forward:  # in a cached call of another forward (super().forward() of
        return forward(module, *args, **kwargs)  # a decorated base): its rows are not the module's
    warn_if_training(cache, module)
    running[id(module)] = forward
    try:
        return cache(functools.partial(forward, module), args, kwargs, module.training)
    finally:
        if outer is None:
            del running[id(module)]


def cached_method(forward: Callable[..., Any], owner: type[torch.nn.Module] | None = None) -> Callable[..., Any]:
    """The wrapper of ``forward`` set on ``owner``; with one, the forward past it runs (looked up at each call)."""

    def current(kind: type[torch.nn.Module]) -> Callable[..., Any]:  # past owner in the instance's class's order
        return forward if owner is None else super(owner, kind).forward  # type: ignore[misc,no-any-return]

    def cached(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return cached_forward(self, current(type(self)), args, kwargs)

    def plain(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:  # traced by fx
        return current(type(self))(self, *args, **kwargs)

    wrapper = functools.update_wrapper(outside_compile(cached, plain=plain), forward)
    wrapper.torchcache_plain = current  # type: ignore[attr-defined]
    return wrapper


def patch(cls: type[torch.nn.Module], forward: Callable[..., Any], inherited: bool) -> None:
    """Set the wrappers of cached instances on ``cls`` (a decorated class, or a per-class subclass).

    ``inherited``: ``forward`` is not ``cls``'s own, and the one its bases have when called runs.
    """
    cached = cached_method(forward, cls if inherited else None)
    original_apply: Callable[..., Any] = cls._apply
    original_train: Callable[..., Any] = cls.train

    @functools.wraps(original_apply)
    def _apply(self: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # .to(), .half(), .cuda() and the like: a dtype change gives other outputs.
        result = original_apply(self, fn, *args, **kwargs)
        cache = self.__dict__.get("cache_instance")
        if isinstance(cache, Cache):
            cache.weights_changed()
        return result

    @functools.wraps(original_train)
    def train(self: torch.nn.Module, mode: bool = True) -> Any:
        binding: InstanceBinding | None = self.__dict__.get(BINDING)
        return original_train(self, False if binding is not None and binding.settings.keep_eval else mode)

    cls.forward, cls._apply, cls.train = cached, _apply, train  # type: ignore[method-assign]


def bind(module: torch.nn.Module, binding: InstanceBinding, forward: Callable[..., Any]) -> None:
    """Give ``module`` its binding and its cache (its weights loaded later take its key again)."""
    module.__dict__[BINDING] = binding
    module.register_load_state_dict_post_hook(weights_loaded)  # type: ignore[no-untyped-call]
    attach(module, binding, forward)
