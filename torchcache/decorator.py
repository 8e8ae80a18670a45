"""``@torchcache()``: cache the per-item outputs of a module class or a function.

Decorating a class wraps its ``__init__`` and ``forward`` in place (the class stays the
same class, so ``isinstance``, pickling of the class and ``state_dict`` are unchanged).
Each instance gets its own :class:`~torchcache.engine.Cache` as ``cache_instance``, keyed
by the class source, the init arguments and the weights at the first forward call.
Settings can be overridden per instance with ``self.torchcache_<name>`` in ``__init__``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from .codec import DEFAULT_QUALITY
from .config import LEGACY_OPTIONS, Settings
from .engine import Cache
from .errors import ConfigError
from .keys import describe_init, fingerprint_function, fingerprint_module

__all__ = ["torchcache"]

T = TypeVar("T")
_PREFIX = "torchcache_"
_OPTION_NAMES = tuple(f.name for f in Settings.__dataclass_fields__.values())
_initializing = threading.local()


def torchcache(
    *,
    enabled: bool = True,
    persistent: bool = False,
    persistent_cache_dir: str | Path | None = None,
    persistent_module_hash: str | None = None,
    max_memory_cache_size: int | float | str = int(1e9),
    max_persistent_cache_size: int | float | str = int(10e9),
    memory_cache_device: str | torch.device | None = "cpu",
    subsample_count: int | None = 10000,
    cache_dtype: torch.dtype | None = None,
    brotli_quality: int = DEFAULT_QUALITY,
    **legacy: Any,
) -> Callable[[T], T]:
    """Cache the outputs of an ``nn.Module`` subclass or a function, per batch item.

    Always called with parentheses. Every tensor argument must be shaped ``(batch, ...)``
    with the same batch; other arguments (``None``, ``bool``, ``int``, ``float``, ``str``,
    ``torch.dtype``, ``torch.device`` and tuples, lists and dicts of them) are part of the
    key. The output is a tensor ``(batch, ...)`` or a tuple, list or dict of them.

    Args:
        enabled: ``False`` returns the class or function unchanged.
        persistent: Also keep entries on disk, across runs and processes.
        persistent_cache_dir: The cache root; default ``$TORCHCACHE_DIR``, else the user
            cache directory (``platformdirs.user_cache_path("torchcache")``).
        persistent_module_hash: Use this directory name instead of the computed module key
            (changes to the code or weights then no longer invalidate the cache).
        max_memory_cache_size: Byte budget of the memory tier (``1e9``, ``"2GB"``, ``"500MiB"``).
        max_persistent_cache_size: Byte budget of this module's directory on disk.
        memory_cache_device: Where the memory tier keeps outputs; ``None``: on their own device.
        subsample_count: On accelerators, hash at most this many elements of each item
            (``None``: every element). CPU inputs are always hashed in full.
        cache_dtype: Store floating outputs at this precision (returned in their own dtype).
        brotli_quality: brotli quality 0-11 for disk entries (stored raw when it does not pay).
        **legacy: ``zstd_compression``, ``zstd_compression_level``,
            ``zstd_compression_threads`` and ``use_mmap_on_load`` of torchcache 0.6 are
            accepted and ignored, with a ``DeprecationWarning``.

    Returns:
        A decorator for a module class or a function.

    Raises:
        ConfigError: If an option has an invalid value.
        TypeError: If an unknown option is given.

    Example:
        >>> @torchcache()
        ... def double(x: torch.Tensor) -> torch.Tensor:
        ...     return x * 2
        >>> double(torch.ones(3, 2)).sum().item(), double(torch.ones(3, 2)).sum().item()
        (12.0, 12.0)
        >>> double.cache_instance.stats().hits
        3
    """
    unknown = sorted(set(legacy) - set(LEGACY_OPTIONS))
    if unknown:
        raise TypeError(
            f"torchcache() got unexpected option(s) {', '.join(map(repr, unknown))}; "
            f"valid options are {', '.join(_OPTION_NAMES)}"
        )
    settings = Settings.create(
        enabled=enabled,
        persistent=persistent,
        persistent_cache_dir=persistent_cache_dir,
        persistent_module_hash=persistent_module_hash,
        max_memory_cache_size=max_memory_cache_size,
        max_persistent_cache_size=max_persistent_cache_size,
        memory_cache_device=memory_cache_device,
        subsample_count=subsample_count,
        cache_dtype=cache_dtype,
        brotli_quality=brotli_quality,
        **legacy,
    )

    def decorate(target: T) -> T:
        if not settings.enabled:
            return target
        if inspect.isclass(target) and issubclass(target, torch.nn.Module):
            return _decorate_class(target, settings)  # type: ignore[return-value]
        if inspect.isfunction(target) or inspect.ismethod(target) or isinstance(target, functools.partial):
            return _decorate_function(target, settings)  # type: ignore[return-value]
        raise TypeError(
            f"@torchcache() decorates nn.Module subclasses and functions, got {target!r}; "
            "note that it is always called with parentheses: @torchcache()"
        )

    if inspect.isclass(enabled) or callable(enabled):  # pragma: no cover - guarded by keyword-only
        raise TypeError("use @torchcache() with parentheses")
    return decorate


def _check_frozen(module: torch.nn.Module, name: str) -> None:
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if trainable:
        shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
        raise ConfigError(
            f"{name} has parameters that require grad ({shown}): cached outputs carry no gradient, "
            "so training them through the cache would silently stop. Freeze the module, e.g. "
            "call self.requires_grad_(False) at the end of __init__, or set "
            "self.torchcache_enabled = False for a trainable instance"
        )


def _decorate_class(cls: type[torch.nn.Module], settings: Settings) -> type[torch.nn.Module]:
    original_init = cls.__init__
    original_forward = cls.forward
    name = f"{cls.__module__}.{cls.__qualname__}"
    signature = inspect.signature(original_forward)
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])

    @functools.wraps(original_init)
    def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        active: set[int] = getattr(_initializing, "ids", None) or set()
        _initializing.ids = active
        if id(self) in active:
            original_init(self, *args, **kwargs)
            return
        active.add(id(self))
        try:
            original_init(self, *args, **kwargs)
        finally:
            active.discard(id(self))
        overrides = {n: getattr(self, _PREFIX + n) for n in _OPTION_NAMES if hasattr(self, _PREFIX + n)}
        instance_settings = settings.override(**overrides)
        if not instance_settings.enabled:
            self.__dict__["cache_instance"] = None
            return
        _check_frozen(self, type(self).__qualname__)
        init_digest = describe_init(args, kwargs)
        module_ref = _WeakModule(self)
        key_settings = instance_settings.key_settings()

        def fingerprint() -> str:
            module = module_ref()
            _check_frozen(module, type(module).__qualname__)
            return fingerprint_module(module, init_digest, key_settings)

        cache = Cache(instance_settings, name, "module", signature, fingerprint)
        self.__dict__["cache_instance"] = cache
        # load_state_dict() on this module or on any module that contains it runs this hook.
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            lambda module, incompatible: cache.weights_changed()
        )

    @functools.wraps(original_forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        cache: Cache | None = self.__dict__.get("cache_instance")
        if cache is None:
            return original_forward(self, *args, **kwargs)
        return cache(functools.partial(original_forward, self), args, kwargs, self.training)

    original_apply: Callable[..., Any] = cls._apply

    @functools.wraps(original_apply)
    def _apply(self: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # .to(), .half(), .cuda() and the like: a dtype change gives other outputs.
        result = original_apply(self, fn, *args, **kwargs)
        cache: Cache | None = self.__dict__.get("cache_instance")
        if cache is not None:
            cache.weights_changed()
        return result

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls._apply = _apply  # type: ignore[method-assign]
    cls.forward = forward  # type: ignore[method-assign]
    return cls


class _WeakModule:
    """A weak reference to a module that raises a clear error once it is gone."""

    def __init__(self, module: torch.nn.Module) -> None:
        import weakref

        self._ref = weakref.ref(module)

    def __call__(self) -> torch.nn.Module:
        module = self._ref()
        if module is None:  # pragma: no cover - the cache lives on the module
            raise ReferenceError("the cached module no longer exists")
        return module


def _decorate_function(fn: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    key_settings = settings.key_settings()
    key = fingerprint_function(fn, key_settings)
    cache = Cache(settings, name, "function", inspect.signature(fn), lambda: key)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return cache(fn, args, kwargs)

    wrapper.cache_instance = cache  # type: ignore[attr-defined]
    return wrapper
