"""Submodules that draw at random in training mode: their calls cannot be cached.

Dropout with ``p > 0`` (every ``_DropoutNd``: ``Dropout``, ``Dropout1d`` to ``3d``,
``AlphaDropout``, ``FeatureAlphaDropout``), ``RReLU``, ``MultiheadAttention`` with
``dropout > 0``, and the dropout and stochastic depth of other libraries by their names
(a class whose name, or a base class's, holds ``DropPath`` or ``StochasticDepth`` or
ends in ``Dropout``: timm's ``DropPath``, torchvision's ``StochasticDepth``, Hugging
Face's ``Dinov2DropPath`` and ``StableDropout``), or by a ``drop_prob`` attribute, with
a probability above 0 (or one that is not a number). The item check would see their
draws only where one shows in the rows it compares: a narrow output or a small ``p``
often drops nothing there, and a replayed mask would follow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["drawing_submodule"]


def drawing_submodule(fn: Callable[..., Any]) -> str | None:
    """The first submodule in training mode of the module ``fn`` calls that draws at random, named; else ``None``."""
    module = _module_of(fn)
    if module is None:
        return None
    for name, sub in module.named_modules():
        if sub.training and _draws(sub):
            where = f"{name} " if name else ""
            return f"{where}({type(sub).__name__}, p={_probability(sub)})"
    return None


def _module_of(fn: Any) -> torch.nn.Module | None:
    while isinstance(fn, functools.partial):  # the cached forward, with its module first
        if fn.args and isinstance(fn.args[0], torch.nn.Module):
            return fn.args[0]
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _probability(module: torch.nn.Module) -> Any:
    if isinstance(module, torch.nn.RReLU):
        return "random slopes"
    if isinstance(module, torch.nn.MultiheadAttention):
        return module.dropout
    return getattr(module, "p", getattr(module, "drop_prob", None))


def _draws(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, torch.nn.RReLU):
        return True
    if isinstance(module, torch.nn.MultiheadAttention):
        return bool(module.dropout > 0)
    names = [cls.__name__ for cls in type(module).__mro__]
    if hasattr(module, "drop_prob") or any(
        "DropPath" in name or "StochasticDepth" in name or name.endswith("Dropout") for name in names
    ):
        p = _probability(module)
        return not isinstance(p, (int, float)) or isinstance(p, bool) or p > 0
    return False
