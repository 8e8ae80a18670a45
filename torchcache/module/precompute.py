"""Fill a cache ahead of time: run a decorated module or function over batches of inputs.

:func:`precompute` is a plain loop over the decorated call, under ``torch.no_grad()``,
with a progress bar and a flush at the end: it stores exactly what later calls look up,
so a module run in the same mode (``train()``/``eval()``, part of every key) on the same
inputs hits. Stopping it early keeps what finished: every entry is written whole by the
background writer (a store indexes an entry only once it is written), and the flush on the way out, on an
interrupt too, waits for the entries of the batches already computed.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..stats import CacheStats
from .engine import Cache
from .instances import cache_of

__all__ = ["precompute"]


def precompute(module_or_fn: Callable[..., Any], batches: Iterable[Any], progress: bool = True) -> CacheStats:
    """Run a decorated module or function over ``batches`` to fill its cache.

    Args:
        module_or_fn: An instance of an ``nn.Module`` class decorated with ``@torchcache()``,
            or a function decorated with it (use ``persistent=True`` to keep the entries
            across runs).
        batches: An iterable of batches, each one call: a tensor (the only argument), a
            tuple or list (positional arguments) or a mapping (keyword arguments). A
            ``DataLoader`` works as is when its batches are the inputs of the call; for
            ``(input, label)`` batches pass ``(x for x, _ in loader)``.
        progress: Show a progress bar (items, items/s, hit rate) when stderr is a
            terminal or the code runs in a notebook and tqdm is installed (the
            ``progress`` extra).

    Returns:
        The cache's statistics after every entry is written (``cache_instance.stats()``
        after ``cache_instance.flush()``).

    Raises:
        TypeError: If ``module_or_fn`` is not decorated with ``@torchcache()`` (or has
            caching turned off), ``batches`` is one batch (a tensor, a dict) or no iterable, a
            batch does not fit the call (checked before it runs), or ``progress`` is not a bool.
        KeyboardInterrupt: Re-raised once the entries of the finished batches are on disk.

    Example:
        >>> from torchcache import torchcache
        >>> @torchcache()
        ... def square(x: torch.Tensor) -> torch.Tensor:
        ...     return x * x
        >>> batches = [torch.randn(4, 2) for _ in range(3)]
        >>> precompute(square, batches, progress=False).misses
        12
        >>> precompute(square, batches, progress=False).hits
        12
    """
    cache = _cache_of(module_or_fn)
    if not isinstance(progress, bool):
        raise TypeError(f"precompute(progress=...) must be True or False, got {progress!r}")
    if isinstance(batches, (torch.Tensor, Mapping, str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(
            f"precompute() takes an iterable of batches, got {type(batches).__name__}; pass a list of batches "
            "([x], [{'x': x}]) or split a tensor into batches (x.split(256))"
        )
    bar = _progress_bar(_total_items(batches)) if progress and _interactive() else None
    start = cache.stats() if bar is not None else None
    try:
        with torch.no_grad():
            for number, batch in enumerate(batches):
                _check_batch(cache, batch, module_or_fn, number)
                _call(module_or_fn, batch)
                if bar is not None and start is not None:
                    now = cache.stats()
                    hits, misses = now.hits - start.hits, now.misses - start.misses
                    bar.update(hits + misses - bar.n)
                    bar.set_postfix_str(f"hit rate {hits / max(hits + misses, 1):.0%}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
        cache.flush()
    return cache.stats()


def _cache_of(obj: object) -> Cache:
    """The cache behind a decorated module instance or function, or a TypeError saying how to get one."""
    if isinstance(obj, type):
        raise TypeError(
            f"precompute() needs a module instance, got the class {obj.__qualname__}; "
            f"pass an instance: precompute({obj.__qualname__}(...), batches)"
        )
    cache = cache_of(obj) if isinstance(obj, torch.nn.Module) else getattr(obj, "__dict__", {}).get("cache_instance")
    if isinstance(cache, Cache):  # an instance unpickled or loaded since it was cached gets its cache now
        return cache
    if isinstance(obj, torch.nn.Module):
        if "cache_instance" in obj.__dict__:
            raise TypeError(
                f"this {type(obj).__qualname__} instance has caching turned off (torchcache_enabled=False); "
                "precompute() needs an instance whose cache is enabled"
            )
        inner = [name for name, m in obj.named_modules() if isinstance(m.__dict__.get("cache_instance"), Cache)]
        hint = (
            f"; its submodule {inner[0]!r} is cached: precompute(model.{inner[0]}, batches)"
            if inner
            else f"; wrap it (model = torchcache(persistent=True)(model)) or decorate its class "
            f"{type(obj).__qualname__} with @torchcache(persistent=True)"
        )
        raise TypeError(f"precompute() needs a cached module (a wrapped instance or a decorated class){hint}")
    raise TypeError(
        f"precompute() needs a module instance or a function decorated with @torchcache(), got {obj!r}; "
        "decorate it with @torchcache(persistent=True) to fill a cache that later runs read"
    )


def _check_batch(cache: Cache, batch: Any, fn: Any, number: int) -> None:
    """Say clearly when a batch does not fit the call (``[index, images]`` from a loader).

    A method decorated in its class body is called bound: its instance comes first.
    """
    args, kwargs = ((), dict(batch)) if isinstance(batch, Mapping) else ((batch,), {})
    if isinstance(batch, (tuple, list)):
        args = tuple(batch)
    signature = cache._splitter.signature
    with_self = inspect.ismethod(fn) and len(signature.parameters) > len(inspect.signature(fn).parameters)
    bound = (fn.__self__, *args) if with_self else args
    try:
        signature.bind(*bound, **kwargs)
    except TypeError as exc:
        kinds = ", ".join(type(v).__name__ for v in (kwargs.values() if kwargs else args))
        shape = f"a mapping with keys {list(kwargs)}" if kwargs else f"a {type(batch).__name__} of {len(args)}"
        raise TypeError(
            f"precompute(): each batch is one call of {cache.name}{signature}, but batch {number} is "
            f"{shape} ({kinds}), which does not fit it ({exc}). Pass only the inputs of the call, e.g. "
            "(x for x, _ in loader) for (inputs, labels) batches, (x for _, x in loader) for (index, inputs) "
            "batches, or a mapping of keyword arguments"
        ) from None


def _call(fn: Callable[..., Any], batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return fn(**batch)
    if isinstance(batch, (tuple, list)):
        return fn(*batch)
    return fn(batch)


def _batch_size(batch: Any) -> int | None:
    """The leading size of the first tensor argument of a batch."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _total_items(batches: Iterable[Any]) -> int | None:
    """Items in all batches, when known without running through them."""
    if isinstance(batches, (list, tuple)):
        sizes = [_batch_size(batch) for batch in batches]
        return None if None in sizes else sum(s for s in sizes if s is not None)
    sampler = getattr(batches, "sampler", None)
    if (
        sampler is not None
        and getattr(batches, "batch_size", None) is not None
        and not getattr(batches, "drop_last", True)
    ):
        try:
            return len(sampler)
        except TypeError:
            return None
    return None


def _interactive() -> bool:
    """Whether a bar would be seen: stderr is a terminal, or this is a notebook kernel."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except ValueError:  # closed stream
        return False
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return shell is not None and hasattr(shell, "kernel")


def _progress_bar(total: int | None) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="precompute", unit="item", dynamic_ncols=True)
