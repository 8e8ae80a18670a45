"""Checks and wrappers shared by every kind of cached callable.

A cached module must be frozen (cached outputs carry no gradient), have a ``forward``
defined as a method (calls are bound to its signature without ``self``), should not run in
training mode when it holds dropout or batch norm (the cache would replay one dropout
mask), and its lookup must stay out of ``torch.compile`` graphs (it is host-side
Python: hashing, locks, files).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import ConfigError
from ..faults import Fault
from .engine import Cache
from .fingerprint import tensor_attributes

__all__ = ["check_forward", "check_frozen", "outside_compile", "warn_if_training"]

T = TypeVar("T")
_STOCHASTIC = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)
_COMPILE_REASON = (
    "torchcache looks cached outputs up in host-side Python, outside compiled graphs; with "
    "fullgraph=True, compile the modules around the cached one (or leave fullgraph off)"
)


def check_forward(cls: type) -> None:
    """Refuse a class whose ``forward`` is not a method taking ``self`` (a ``staticmethod``, for one).

    Raises:
        ConfigError: If ``cls.forward`` is a ``staticmethod``, ``classmethod`` or ``functools.partialmethod``.
    """
    found = inspect.getattr_static(cls, "forward", None)
    if isinstance(found, (staticmethod, classmethod, functools.partialmethod)):
        raise ConfigError(
            f"{cls.__qualname__}.forward is a {type(found).__name__}, and torchcache caches a forward defined as a "
            "method taking self: define it as 'def forward(self, x): ...' (it may call the function it wraps)"
        )


def check_frozen(module: torch.nn.Module, name: str) -> None:
    """Refuse a module with tensors that require grad: cached outputs carry no gradient.

    Parameters, buffers and tensors kept as plain attributes (a learned temperature) count;
    a tensor computed from others (``nn.utils.weight_norm``'s ``weight``) follows those.

    Raises:
        ConfigError: If a tensor of ``module`` (called ``name`` in the message) requires grad.
    """
    held = [*module.named_parameters(), *module.named_buffers(), *tensor_attributes(module)]
    # a leaf: trained state; a non-leaf attribute was computed from others (weight_norm's weight) and follows them
    trainable = [n.lstrip(".") for n, p in held if p.requires_grad and p.is_leaf]
    if trainable:
        shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
        raise ConfigError(
            f"{name} has tensors that require grad ({shown}): cached outputs carry no gradient, "
            "so training them through the cache would silently stop. Freeze the module, e.g. "
            "call requires_grad_(False) on it (at the end of __init__ for a decorated class; a tensor kept as a "
            "plain attribute: store it detached), or "
            "set self.torchcache_enabled = False for a trainable instance"
        )


def warn_if_training(cache: Cache, module: torch.nn.Module) -> None:
    """Warn once when a module with dropout or batch norm is called through the cache in training mode.

    Only with ``check_items=False``: otherwise the check that items are independent sees
    what dropout and batch statistics do, and such calls run without the cache.
    """
    if not module.training or cache.faults.warned(Fault.TRAIN) or cache.settings.check_items:
        return
    if cache.stochastic is None:
        cache.stochastic = any(isinstance(m, _STOCHASTIC) for m in module.modules())
    if cache.stochastic:
        cache.faults.warn(
            Fault.TRAIN,
            "called in training mode, and it holds dropout or batch-norm layers: cached outputs replay one "
            "dropout mask and batch-norm statistics stop following the data. Call .eval() on it after "
            "model.train() (which a parent module passes down), or cache it with keep_eval=True",
        )


_symbolic_trace = torch.fx._symbolic_trace  # its flag read as is: is_fx_tracing() logs a warning in each process


def outside_compile(fn: Callable[..., T], plain: Callable[..., T] | None = None) -> Callable[..., T]:
    """``fn``, excluded from ``torch.compile`` tracing once ``torch._dynamo`` is loaded; ``plain`` under fx tracing.

    Importing ``torch._dynamo`` takes seconds, so a process that never compiles never
    pays for it; a process that compiles has loaded it before any graph is traced.
    ``torch.fx.symbolic_trace`` of a model holding a cached module records what ``plain``
    (the function without the cache, called with the same arguments) does.
    """
    disabled: Callable[..., T] | None = None

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> T:
        nonlocal disabled
        if plain is not None and getattr(_symbolic_trace, "_is_fx_tracing_flag", False):  # proxies: nothing to key
            return plain(*args, **kwargs)
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            import torch._dynamo

            disabled = torch._dynamo.disable(fn, recursive=True, reason=_COMPILE_REASON)  # type: ignore[no-untyped-call]
        return disabled(*args, **kwargs)

    # What torch._dynamo.disable marks, set without importing dynamo: a trace that reaches
    # this function does not go into it, from the first compile of a process on.
    inner._torchdynamo_disable = True  # type: ignore[attr-defined]
    inner._torchdynamo_disable_msg = _COMPILE_REASON  # type: ignore[attr-defined]
    return inner
