"""Submodules that draw at random in training mode: their calls cannot be cached.

Dropout with ``p > 0`` (every ``_DropoutNd``: ``Dropout``, ``Dropout1d`` to ``3d``,
``AlphaDropout``, ``FeatureAlphaDropout``), ``RReLU``, ``MultiheadAttention`` with
``dropout > 0``; the dropout, stochastic depth and drop blocks of other libraries, known
by a class name (or a base class's) holding ``DropPath``, ``StochasticDepth`` or
``DropBlock`` or ending in ``Dropout`` (timm's ``DropPath``, torchvision's
``StochasticDepth`` and ``DropBlock2d``, Hugging Face's ``Dinov2DropPath`` and
``StableDropout``) with a probability above 0 in ``p``, ``prob``, ``rate`` or an
attribute named for dropping (below); and a module holding a float above 0 under a name
with ``dropout`` or ``drop`` among its words (``dropout``, ``attention_dropout``,
``dropout_p``, ``dropout_rate``, ``attn_drop``, ``drop_prob``: Hugging Face's and T5's
attention layers, which call ``F.dropout(x, p=self.dropout, training=self.training)``,
or give ``dropout_p`` to ``scaled_dot_product_attention``). Such a submodule counts when
the cached forward runs it (a forward pre-hook watches it through the item check's
forwards): a dropout the cached method does not reach (a head's, under
``forward_features``) is left alone.

The item check would see their draws only where one shows in the rows it compares: a
narrow output or a small ``p`` often drops nothing there, and a replayed mask would
follow.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["calls_of", "drawing_submodules"]


def drawing_submodules(fn: Callable[..., Any]) -> list[tuple[str, torch.nn.Module | None]]:
    """The submodules in training mode of the module ``fn`` calls that draw at random, each with its description.

    The module itself, if it draws, comes as ``None``: its forward is the one cached.
    """
    module = _module_of(fn)
    if module is None:
        return []
    return [
        (f"{f'{name} ' if name else ''}({type(sub).__name__}, p={_probability(sub)})", sub if name else None)
        for name, sub in module.named_modules()
        if sub.training and _draws(sub)
    ]


@contextlib.contextmanager
def calls_of(named: list[tuple[str, torch.nn.Module | None]]) -> Iterator[list[str]]:
    """The descriptions of those of ``named`` that run while the block runs (each seen by a forward pre-hook)."""
    called = [what for what, sub in named if sub is None]
    hooked = [(what, sub) for what, sub in named if sub is not None]
    handles = [sub.register_forward_pre_hook(lambda *_, what=what: called.append(what)) for what, sub in hooked]
    try:
        yield called
    finally:
        for handle in handles:
            handle.remove()


def _module_of(fn: Any) -> torch.nn.Module | None:
    while isinstance(fn, functools.partial):  # the cached forward, with its module first
        if fn.args and isinstance(fn.args[0], torch.nn.Module):
            return fn.args[0]
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


_PROBABILITIES = ("p", "prob", "rate")
_NAMES = ("DropPath", "StochasticDepth", "DropBlock")


def _probability(module: torch.nn.Module) -> Any:
    if isinstance(module, torch.nn.RReLU):
        return "random slopes"
    if isinstance(module, torch.nn.MultiheadAttention):
        return module.dropout
    named = (getattr(module, name, None) for name in _PROBABILITIES)
    dropping = (value for name, value in vars(module).items() if _names_dropping(name))
    return next((p for value in (*named, *dropping) if (p := _number(value)) is not None), None)


def _names_dropping(name: str) -> bool:
    """Whether an attribute's name has ``dropout`` or ``drop`` among its words (``attn_drop``, ``dropout_p``)."""
    words = name.lower().strip("_").split("_")
    return "dropout" in words or "drop" in words


def _number(value: object) -> float | None:
    """A probability as a float (a Python or numpy number, a tensor of one element); ``None`` for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, np.number)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return float(value)  # type: ignore[arg-type]
    return None


def _draws(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, torch.nn.RReLU):
        return True
    if isinstance(module, torch.nn.MultiheadAttention):
        return bool(module.dropout > 0)
    names = [cls.__name__ for cls in type(module).__mro__]
    if any(any(part in name for part in _NAMES) or name.endswith("Dropout") for name in names):
        p = _probability(module)
        return p is not None and p > 0
    return any(
        _names_dropping(name) and (p := _number(value)) is not None and p > 0
        for name, value in vars(module).items()
        if not isinstance(value, torch.Tensor) or value.numel() == 1
    )
