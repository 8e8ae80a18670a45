"""``@torchcache()``: cache the per-item outputs of a module class, a module instance, a method or a function.

Decorating a class of yours wraps its ``__init__``, ``forward``, ``_apply`` and ``train``
in place (``isinstance``, pickling and ``state_dict`` are unchanged); a class of an
installed package gets a cached subclass named like it instead, so its other instances
stay plain. Each instance gets its own :class:`~torchcache.module.engine.Cache` as
``cache_instance``, keyed at its first call; ``self.torchcache_<name>`` in ``__init__``
overrides a setting for one instance.

Wrapping an *instance* (``torchcache()(model)``) never touches its class or other
instances: it moves to a subclass made once per class, named like it, with the same
wrappers. A bound method (``torchcache()(model.forward_features)``) gives a cached
function keyed by its instance as a module is.

The lookup is host-side Python: it runs outside ``torch.compile`` graphs, so a compiled
model that holds a cached module compiles everything around it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar, overload

import torch

from ..canonical.origins import is_users_object
from ..codec import DEFAULT_QUALITY
from ..config import LEGACY_OPTIONS, Settings, legacy_note
from ..errors import ConfigError
from .callables import CachedMethod, decorate_function
from .engine import Cache
from .fingerprint import check_instance, describe_init
from .guards import check_forward, check_frozen
from .instances import InstanceBinding, attach, bind, cached_method, forwards, patch
from .subclass import BINDING, compile_graph, graph_methods, make_subclass, plain_namespace, rebuild_plain

__all__ = ["torchcache"]

T = TypeVar("T")
_PREFIX = "torchcache_"
_OPTION_NAMES = tuple(f.name for f in Settings.__dataclass_fields__.values())
#: The settings each class was decorated with (in place: a second decoration with others is refused).
_decorated: weakref.WeakKeyDictionary[type, Settings] = weakref.WeakKeyDictionary()
_initializing = threading.local()
_subclasses: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


@overload
def torchcache(target: T, /) -> T: ...


@overload
def torchcache(target: None = None, /, **options: Any) -> Callable[[T], T]: ...


def torchcache(
    target: Any = None,
    /,
    *,
    enabled: bool = True,
    persistent: bool = False,
    persistent_cache_dir: str | Path | None = None,
    local_cache_dir: str | Path | None = None,
    storage_options: Mapping[str, Any] | None = None,
    max_local_cache_size: int | float | str | None = None,
    persistent_module_hash: str | None = None,
    max_memory_cache_size: int | float | str = int(1e9),
    max_persistent_cache_size: int | float | str = int(10e9),
    memory_cache_device: str | torch.device | None = "cpu",
    subsample_count: int | None = None,
    cache_dtype: torch.dtype | None = None,
    brotli_quality: int = DEFAULT_QUALITY,
    shared_args: Collection[str] = (),
    batch_dims: Mapping[str, int] | None = None,
    keep_eval: bool = False,
    key_ignore: Collection[str] = (),
    verify_weights: int | None = None,
    exact_batches: bool = False,
    check_items: bool = True,
    **legacy: Any,
) -> Any:
    """Cache the outputs of a module class or instance, a method or a function, per batch item.

    Used as ``@torchcache()`` with options, or as ``@torchcache`` with the defaults, like
    :func:`functools.lru_cache`. Every tensor argument (also inside a tuple, list or
    dict argument) is per item, shaped ``(batch, ...)`` with the same batch, unless it
    is named in ``shared_args``; other arguments (``None``, ``bool``, ``int``, ``float``,
    ``str``, ``torch.dtype``, ``torch.device`` and tuples, lists and dicts of them) are
    part of the key. The output is a tensor ``(batch, ...)`` or a tuple, list, dict,
    namedtuple, dataclass or ``OrderedDict`` (Hugging Face ``ModelOutput``) of them,
    ``None`` leaves included.

    Args:
        target: The class, instance, method or function to cache, when used without
            parentheses (``@torchcache``); then every option has its default.
        enabled: ``False`` returns the target unchanged.
        persistent: Also keep entries on disk, across runs and processes.
        persistent_cache_dir: The cache root; default ``$TORCHCACHE_DIR``, else the user
            cache directory (``platformdirs.user_cache_path("torchcache")``); or a Redis URL
            (``redis://host:6379/0``, ``rediss://``, ``redis+cluster://``) to share entries
            between machines (``pip install 'torchcache[redis]'``), or a bucket URL
            (``s3://bucket/prefix``, ``gs://...``; ``pip install 'torchcache[s3]'``).
        local_cache_dir: With a Redis URL: a directory on this machine that keeps a copy of
            the entries this machine reads and writes, so that their hits do not cross the
            network (bounded by ``max_persistent_cache_size`` too); default
            ``$TORCHCACHE_LOCAL_DIR``, else none (with a bucket URL, ``copies`` under the cache
            root). Not for a local ``persistent_cache_dir``.
        storage_options: With a bucket URL (``s3://``, ``gs://``): options for its fsspec
            filesystem (``endpoint_url``, ``profile``...), over ``$TORCHCACHE_STORAGE_OPTIONS``;
            never logged or written.
        max_local_cache_size: The budget of the local copy (``None``: ``max_persistent_cache_size``).
            A copy smaller than the cache keeps a fixed subset of it (most recently used
            entries are evicted first) and reads the rest from the URL.
        persistent_module_hash: Use this name for the module's directory instead of the
            computed module key (changes to the code or weights then no longer
            invalidate the cache). Any string; unsafe characters are mapped.
        max_memory_cache_size: Byte budget of the memory tier (``1e9``, ``"2GB"``, ``"500MiB"``).
        max_persistent_cache_size: Byte budget of this module's directory on disk.
        memory_cache_device: Where the memory tier keeps outputs; ``None``: on their own device.
        subsample_count: On accelerators, key each item by 64 runs of about this many of
            its elements instead of every byte: an opt-in for those who accept that two
            items differing only elsewhere share an entry. ``None`` (the default) hashes
            every byte, on the device (CPU inputs are always hashed in full).
        cache_dtype: Store floating outputs at this precision (returned in their own dtype).
        brotli_quality: brotli quality 0-11 for disk entries (stored raw when it does not pay).
        shared_args: Names of arguments that are the same for the whole batch (a
            ``(T, T)`` attention mask): hashed whole into every item's key and passed
            whole, never sliced per item.
        batch_dims: Arguments and outputs whose batch is not the first dimension, by
            argument name or output path (``{"x": 1, "output[1][0]": 1}`` for an LSTM
            with ``batch_first=False``).
        keep_eval: Keep the module in eval mode: ``model.train()`` on it or on a parent
            leaves it (and its submodules) in eval mode, so dropout and batch norm never
            run in training mode under the cache.
        key_ignore: Attributes of the module (or its submodules) and init arguments that do
            not change outputs and that the key cannot encode (a lock, a logger handle), by
            name (``"fn"``: that name anywhere) or dotted path below the module
            (``"layer1.0.fn"``). Everything else is part of the key, or refused with a
            :class:`~torchcache.KeyingError` that names it.
        verify_weights: Hash the weights every this many calls and take the key again if
            they changed (``None``: never). In-place changes made by torch operations
            (``copy_``, ``mul_``, optimizer steps, EMA, batch norm) are seen at every call
            without it; it is for writes that bypass torch's version counters
            (``p.data.copy_()``, writes through ``p.numpy()``).
        exact_batches: Compute a batch with any miss whole, as an uncached call would, so
            that no returned batch mixes items computed in batches of other sizes (CPU
            and GPU kernels can differ in the last bits between batch sizes). Hits then
            come only from batches found whole in the cache.
        check_items: At the first call of each call context (the arguments other than
            the items, the per-item shapes, the mode) in a process, compute some of its
            items again in other batches and raise :class:`~torchcache.KeyingError` if
            their outputs changed: a module whose items depend on each other (CLIP's
            logits, batch norm with batch statistics) or that draws at random cannot be
            cached per item. Costs two forwards of one or two items per context.
        **legacy: ``zstd_compression``, ``zstd_compression_level``,
            ``zstd_compression_threads`` and ``use_mmap_on_load`` of torchcache 0.6 are
            accepted and ignored, with a ``FutureWarning`` (shown by default, wherever the decorator is).

    Returns:
        A decorator for a module class, a module instance, a method or a function; or,
        called on one (``torchcache(model)``), the cached target itself.

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
        local_cache_dir=local_cache_dir,
        storage_options=storage_options,
        max_local_cache_size=max_local_cache_size,
        persistent_module_hash=persistent_module_hash,
        max_memory_cache_size=max_memory_cache_size,
        max_persistent_cache_size=max_persistent_cache_size,
        memory_cache_device=memory_cache_device,
        subsample_count=subsample_count,
        cache_dtype=cache_dtype,
        brotli_quality=brotli_quality,
        shared_args=shared_args,
        batch_dims=batch_dims if batch_dims is not None else {},
        keep_eval=keep_eval,
        key_ignore=key_ignore,
        verify_weights=verify_weights,
        exact_batches=exact_batches,
        check_items=check_items,
        **legacy,
    )

    def decorate(target: T) -> T:
        if not settings.enabled:
            return target
        if inspect.isclass(target) and issubclass(target, torch.nn.Module):
            return _decorate_class(target, settings)  # type: ignore[return-value]
        if isinstance(target, torch.nn.Module):
            return _wrap_instance(target, settings)  # type: ignore[return-value]
        if inspect.ismethod(target) and isinstance(target.__self__, torch.nn.Module):
            return CachedMethod.wrap(target, settings)  # type: ignore[return-value]
        if inspect.isfunction(target) or inspect.ismethod(target) or isinstance(target, functools.partial):
            return decorate_function(target, settings)  # type: ignore[return-value]
        raise TypeError(
            f"torchcache() caches nn.Module subclasses or instances, their methods, and functions; got {target!r}"
        )

    return decorate if target is None else decorate(target)


# -- modules ------------------------------------------------------------------------------
_Binding = InstanceBinding  # the name copies and pickles made by 1.3 hold


def _decorate_class(cls: type[torch.nn.Module], settings: Settings) -> type[torch.nn.Module]:
    if issubclass(cls, torch.fx.GraphModule):
        raise ConfigError(
            f"{cls.__qualname__} is an fx GraphModule class, and fx gives each instance a class of its own whose "
            "generated forward would replace the cached one: wrap instances instead, torchcache()(graph_module)"
        )
    # torchcache()(nn.Linear): a cached subclass, every other nn.Linear stays plain (a class made by exec() is yours)
    library = not is_users_object(cls) and getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls
    if library:
        cls = make_subclass(cls, plain_namespace(cls))
    decorated = _decorated.get(cls)
    if decorated is not None:  # the class is decorated in place: both names would be one class
        if decorated == settings:
            return cls
        raise ConfigError(
            f"{cls.__qualname__} is already decorated by torchcache with other settings, and a class is "
            f"decorated in place; for a second configuration, decorate a subclass (class Other({cls.__name__}): "
            "pass) or wrap instances (torchcache(...)(instance))"
        )
    check_forward(cls)
    _decorated[cls] = settings  # not a class attribute: it would be part of the module key
    original_init, original_forward = cls.__init__, cls.forward
    name = f"{cls.__module__}.{cls.__qualname__}"

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
        legacy = [n for n in LEGACY_OPTIONS if hasattr(self, _PREFIX + n)]
        if legacy:
            warnings.warn(legacy_note([_PREFIX + n for n in legacy]), FutureWarning, stacklevel=2)
        overrides = {n: getattr(self, _PREFIX + n) for n in _OPTION_NAMES if hasattr(self, _PREFIX + n)}
        try:
            instance_settings = settings.override(**overrides)
        except ConfigError as exc:  # a torchcache_<option> attribute, of the class or set in __init__
            named = max((n for n in overrides if str(exc).startswith(n)), key=len, default="<option>")
            raise ConfigError(f"{type(self).__qualname__}.{_PREFIX}{named}: {exc}") from None
        if not instance_settings.enabled:
            self.__dict__["cache_instance"] = None
            return
        init_digest = b""
        if instance_settings.persistent_module_hash is None:  # else the user gave the key
            ignore = instance_settings.key_ignore
            init_digest = describe_init(args, kwargs, ignore)
            check_instance(self, ignore)  # a refusal comes now, not at the first call
        try:
            bind(self, InstanceBinding(instance_settings, init_digest, name), original_forward)
        except ConfigError as exc:  # trainable: a class of a package cannot be frozen in its __init__
            if library:
                wrap = f"wrap a frozen instance instead, torchcache()({cls.__name__}(...).requires_grad_(False).eval())"
                raise ConfigError(f"{exc}. {name} is a class of an installed package: {wrap}") from None
            raise

    patch(cls, original_forward, "forward" not in cls.__dict__)
    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def _cached_subclass(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """A subclass of ``cls`` with the cache wrappers, made once per class, named like it."""
    sub = _subclasses.get(cls)
    if sub is None:
        sub = make_subclass(cls, {**plain_namespace(cls), **graph_methods(cls, _rewrap)})
        patch(sub, cls.forward, not issubclass(cls, torch.fx.GraphModule))  # fx: recompile() wraps again
        if not issubclass(cls, torch.fx.GraphModule):  # fx makes a class per instance: not kept past it
            _subclasses[cls] = sub
    return sub


def _rewrap(module: torch.nn.Module, like: torch.nn.Module) -> None:
    """Wrap ``module`` (an fx graph module recompiled, or a copy of one) as ``like`` is, with a new cache."""
    binding, kind = like.__dict__[BINDING], type(module)
    if module is like:  # recompiled: its plain class has a new forward
        plain: type[torch.nn.Module] = kind.__bases__[0]
        kind.forward = cached_method(plain.forward)  # type: ignore[method-assign]
    else:  # a copy, of a class fx made for it
        plain = kind
        module.__class__ = _cached_subclass(plain)
    module.__dict__[BINDING] = binding
    forwards[attach(module, binding, plain.forward)] = plain.forward


_rebuild_plain = rebuild_plain  # the name pickles of whole models made by 1.3 hold


_SCRIPTED = (
    "wrap it in a Python module that calls it, and name that module's key with persistent_module_hash "
    "(changed whenever the scripted file changes): torchcache(persistent_module_hash='v1')(Wrapper(scripted))"
)


def _wrap_instance(module: torch.nn.Module, settings: Settings) -> torch.nn.Module:
    existing = module.__dict__.get("cache_instance")
    if isinstance(existing, Cache):
        if existing.settings != settings:
            raise ConfigError(
                f"this {type(module).__qualname__} instance is already cached with other settings, and an "
                "instance keeps the settings it was first wrapped with: wrap each instance once. To change them, "
                "build the model again and wrap the new instance; in a notebook, re-run the cell that creates the "
                "model, then wrap it with the new options"
            )
        return module
    cls = type(module)
    if isinstance(module, torch.jit.ScriptModule):
        raise ConfigError(f"a TorchScript module cannot be cached itself: {_SCRIPTED}")
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        raise ConfigError(  # its compiled forward would run in place of the cached one
            "a module compiled with torch.compile() cannot be cached itself: wrap the module, then compile "
            "(torch.compile(torchcache()(model)), or model.compile() after wrapping it)"
        )
    name = f"{cls.__module__}.{cls.__qualname__}"
    check_forward(cls)
    check_frozen(module, cls.__qualname__)
    if settings.persistent_module_hash is None:  # else the user gave the key
        check_instance(module, settings.key_ignore)  # a refusal comes when the model is wrapped
    binding = InstanceBinding(settings, b"", name)
    compile_graph(module)
    module.__class__ = _cached_subclass(cls)
    bind(module, binding, cls.forward)
    return module
