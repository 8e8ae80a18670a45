"""Cached functions and cached bound methods of modules.

A function's key covers its name, source, compiled code, defaults and closure (see
:mod:`torchcache.module.fingerprint`). A bound method of a module (``model.forward_features``,
``model.get_image_features``) is keyed as its module is: class source, configuration
attributes, weights, training flag, plus the method's name. It follows its module
through ``load_state_dict()`` and ``.to()``, and a deep copy of a model that holds a
cached method gets a cached method bound to the copy.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..config import Settings
from ..errors import ConfigError
from .arguments import PASSED_ON
from .engine import Cache
from .fingerprint import check_instance, fingerprint_function, fingerprint_module
from .guards import check_frozen, outside_compile, warn_if_training

__all__ = ["CachedMethod", "decorate_function", "method_caches", "weights_loaded"]

_method_caches: weakref.WeakKeyDictionary[torch.nn.Module, list[weakref.ref[Cache]]] = weakref.WeakKeyDictionary()


def method_caches(module: torch.nn.Module) -> list[Cache]:
    """The caches of the cached methods bound to ``module``."""
    return [cache for ref in _method_caches.get(module, ()) if (cache := ref()) is not None]


def weights_loaded(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict()`` ran on the module or a parent: take the keys again at the next call."""
    cache = module.__dict__.get("cache_instance")
    if isinstance(cache, Cache):
        cache.weights_changed()
    for method_cache in method_caches(module):
        method_cache.weights_changed()


def _conversion_state(module: torch.nn.Module) -> tuple[Any, ...]:
    """The dtype and device of the first parameter or buffer (what ``.to()`` changes)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return () if first is None else (first.dtype, first.device)


class CachedMethod:
    """A bound method of a module, cached per item and keyed by its module.

    Made by ``torchcache(...)(model.method)``; call it as the method. Its cache is
    ``.cache_instance``.
    """

    def __init__(self, module: torch.nn.Module, func: Callable[..., Any], settings: Settings, init: bytes) -> None:
        self._owner = module  # held, as a bound method holds its instance (the cache's closures do not hold it)
        self._module = weakref.ref(module)
        self._func = func
        self._settings = settings
        self._init = init
        cls = type(module)
        self._name = f"{cls.__module__}.{cls.__qualname__}.{func.__name__}"
        key_settings = settings.key_settings()
        module_ref = self._module
        name = self._name

        def fingerprint() -> str:
            owner = _alive(module_ref, name)
            check_frozen(owner, f"the instance of {name}")
            return fingerprint_module(owner, init, key_settings, method=func.__name__, ignore=settings.key_ignore)

        self.cache_instance = Cache(settings, self._name, "module", lambda: without_self(func), fingerprint)
        self.cache_instance.watch_weights(module, root_hooks=func.__name__ != "forward")  # self(x) runs them
        _method_caches.setdefault(module, []).append(weakref.ref(self.cache_instance))
        self._conversion: tuple[Any, ...] | None = None
        self._call = outside_compile(self._call_cached, plain=self._plain)
        functools.update_wrapper(self, func)  # type: ignore[arg-type]
        self.__signature__ = without_self(func)

    @classmethod
    def wrap(cls, method: Any, settings: Settings) -> CachedMethod:
        """Cache ``method``, a bound method of a frozen module.

        Raises:
            ConfigError: If the module has parameters that require grad, or
                ``keep_eval`` is set (it applies to a module: cache the module itself).
        """
        module: torch.nn.Module = method.__self__
        name = f"{type(module).__qualname__}.{method.__func__.__name__}"
        if settings.keep_eval:
            raise ConfigError(
                f"keep_eval applies to modules, not to the method {name}: cache the module itself "
                "(torchcache(keep_eval=True)(model)), or call model.eval() after model.train()"
            )
        check_frozen(module, f"the instance of {name}")
        module.register_load_state_dict_post_hook(weights_loaded)  # type: ignore[no-untyped-call]
        if settings.persistent_module_hash is None:  # else the user gave the key
            check_instance(module, settings.key_ignore)  # a refusal comes when the method is wrapped
        return cls(module, method.__func__, settings, b"")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the module and the method's name: unpickled (a spawned worker), it is cached again."""
        return (_cached_again, (self._owner, self._func.__name__, self._settings))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method through the cache."""
        return self._call(*args, **kwargs)

    def _plain(self, *args: Any, **kwargs: Any) -> Any:
        return self._func(_alive(self._module, self._name), *args, **kwargs)

    def _call_cached(self, *args: Any, **kwargs: Any) -> Any:
        owner = _alive(self._module, self._name)
        state = _conversion_state(owner)
        if state != self._conversion:  # .to(), .half(): other outputs
            if self._conversion is not None:
                self.cache_instance.weights_changed()
            self._conversion = state
        warn_if_training(self.cache_instance, owner)
        return self.cache_instance(functools.partial(self._func, owner), args, kwargs, owner.training)

    def __deepcopy__(self, memo: dict[int, Any]) -> CachedMethod:
        """A cached method bound to the copy of its module (when the module is copied too)."""
        owner = _alive(self._module, self._name)
        copied = memo.get(id(owner), owner)
        return CachedMethod(copied, self._func, self._settings, self._init)

    def __repr__(self) -> str:
        return f"<cached method {self._name} {self.cache_instance!r}>"


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def without_self(method: Callable[..., Any]) -> inspect.Signature:
    """The signature a method's calls are bound to, ``self`` left out (:func:`call_signature`)."""
    return call_signature(method, method=True)


def call_signature(fn: Callable[..., Any], method: bool = False) -> inspect.Signature:
    """The signature calls of ``fn`` are bound to (without ``self`` for a ``method``), only to name arguments.

    A ``functools.wraps`` wrapper's own: its defaults are what its callers get (a wrapper
    taking ``scale=None`` may pass its own value on). A wrapper that only passes
    ``(*args, **kwargs)`` on names them as the function it wraps does, without that
    function's defaults (the wrapper may fill them otherwise) and taking any other
    argument too (a keyword it renames).
    """
    signature = inspect.signature(fn, follow_wrapped=False)
    params = list(signature.parameters.values())
    if method and params and params[0].kind in _POSITIONAL:
        params = params[1:]  # a wrapper taking (*args, **kwargs) passes self in args
    if params and all(p.kind in _VARIADIC for p in params) and inspect.unwrap(fn) is not fn:
        inner = call_signature(inspect.unwrap(fn), method)
        named = [p.replace(default=PASSED_ON) if p.kind not in _VARIADIC else p for p in inner.parameters.values()]
        kinds, taken = {p.kind for p in named}, {p.name for p in named}
        if inspect.Parameter.VAR_POSITIONAL not in kinds:
            at = sum(p.kind in _POSITIONAL for p in named)
            named.insert(at, inspect.Parameter(_free("args", taken), inspect.Parameter.VAR_POSITIONAL))
        if inspect.Parameter.VAR_KEYWORD not in kinds:
            named.append(inspect.Parameter(_free("kwargs", taken), inspect.Parameter.VAR_KEYWORD, annotation=PASSED_ON))
        params = named
    return signature.replace(parameters=params)


def _free(name: str, taken: set[str]) -> str:
    while name in taken:
        name = "_" + name
    return name


def _cached_again(module: torch.nn.Module, name: str, settings: Settings) -> CachedMethod:
    """The method ``name`` of ``module`` cached with ``settings`` (what a pickled :class:`CachedMethod` gives)."""
    return CachedMethod.wrap(getattr(module, name), settings)


def _alive(ref: weakref.ref[torch.nn.Module], name: str) -> torch.nn.Module:
    module = ref()
    if module is None:
        raise ReferenceError(f"the module of {name} no longer exists")
    return module


def decorate_function(fn: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    """Cache a function (a ``functools.partial`` or a bound method of a plain object too)."""
    if settings.keep_eval:
        raise ConfigError("keep_eval applies to modules; a function has no training mode")
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
    cache = Cache(
        settings,
        name,
        "function",
        lambda: call_signature(fn),
        lambda: fingerprint_function(fn, settings.key_settings(), settings.key_ignore),
    )
    cache.take_key(early=True)  # now: what cannot be keyed is refused where the function is decorated

    def cached(*args: Any, **kwargs: Any) -> Any:
        return cache(fn, args, kwargs)

    wrapper = functools.update_wrapper(outside_compile(cached, plain=fn), fn)
    wrapper.cache_instance = cache  # type: ignore[attr-defined]
    return wrapper
