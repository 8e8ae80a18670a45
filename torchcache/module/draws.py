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
or give ``dropout_p`` to ``scaled_dot_product_attention``). For a cached method other
than ``forward`` (``forward_features``), only what its code (and the methods of the
class it calls by name) reaches counts: a child it names, whole, and the module's own
attributes it reads; a head's dropout that ``forward_features`` never names is left
alone. Code that reaches children by a name given at run time (``getattr``,
``self.modules()``), uses ``self`` other than for an attribute (``self(x)``,
``helper(self, x)``), reads a member it cannot follow (a ``partialmethod``, a function
set on the instance) or runs where a forward hook is set counts every one. A module
that raises when looked at counts as drawing.

The item check would see their draws only where one shows in the rows it compares: a
narrow output or a small ``p`` often drops nothing there, and a replayed mask would
follow.
"""

from __future__ import annotations

import dis
import functools
import inspect
import itertools
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["drawing_submodule"]


def drawing_submodule(fn: Callable[..., Any]) -> str | None:
    """The first submodule in training mode that the cached ``fn`` may run and that draws at random, described.

    A module that cannot be looked at (an attribute that raises) counts as drawing.
    """
    module = _module_of(fn)
    if module is None:
        return None
    try:
        names = _names_read(fn, module)  # None: everything may run
    except Exception:  # noqa: BLE001 - a class attribute that raises when read: everything may run
        names = None
    for name, sub in module.named_modules(remove_duplicate=False):  # a child shared under two names, under each
        try:
            if not (sub.training and _draws(sub)):
                continue
            if names is not None and (name.partition(".")[0] not in names if name else not _reads_own(sub, names)):
                continue
            probability = _probability(sub)
        except Exception:  # noqa: BLE001 - cannot be told: as if it drew
            probability = "unknown"
        return f"{f'{name} ' if name else ''}({type(sub).__name__}, p={probability})"
    return None


#: Names that reach a module's children by a name given at run time.
_DYNAMIC = frozenset(
    {"getattr", "__getattr__", "__dict__", "modules", "named_modules", "children", "named_children", "_modules"}
)
_ON_AN_OBJECT = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR"})


def _names_read(fn: Any, module: torch.nn.Module) -> set[str] | None:
    """The names a cached method other than ``forward`` reads, through the class's methods it calls by name.

    ``None`` for ``forward``; for code that reaches children by a name given at run time;
    and for code that uses ``self`` other than to read or set an attribute (``self(x)``
    runs ``forward``, ``helper(self)`` whatever the helper does).
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(getattr(fn, "__func__", fn))  # a decorated method (torch.no_grad()): its own code
    code = getattr(fn, "__code__", None)
    if getattr(fn, "__name__", "forward") == "forward" or not isinstance(code, types.CodeType) or not code.co_argcount:
        return None  # forward, or a wrapper of something it does not name (*args): everything counts
    names: set[str] = set()
    todo, seen, selves = [code], set(), set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        if code.co_argcount and not code.co_name.startswith("<"):
            selves.add(code.co_varnames[0])
        if _uses_bare(code, selves):
            return None
        names.update(code.co_names)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for name in code.co_names:  # the class's methods (and properties) it calls by name, each of the MRO
            found = [vars(cls)[name] for cls in type(module).__mro__ if name in vars(cls)]
            if not found and callable(vars(module).get(name)):  # a function set on the instance: not followed
                return None
            for member in found:
                code_of = _code_of(member)
                if code_of is None:
                    return None  # a descriptor or callable not followed (partialmethod, a wrapper of *args)
                if isinstance(code_of, types.CodeType):
                    todo.append(code_of)
    if any(sub._forward_hooks or sub._forward_pre_hooks for sub in module.modules()):
        return None  # a hook on a child it names may run anything
    return None if names & _DYNAMIC else names


def _code_of(member: object) -> types.CodeType | bool | None:
    """The code of a class member a method reads by name: ``False`` for data, ``None`` where it cannot be followed."""
    if isinstance(member, property):
        member = member.fget
    elif isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, type):
        return False
    if not callable(member):  # a descriptor (partialmethod) gives what it wants when read: not followed
        return None if hasattr(type(member), "__get__") else False
    member = inspect.unwrap(member)
    code = getattr(member, "__code__", None)
    if isinstance(code, types.CodeType) and code.co_argcount:
        return code
    return False if isinstance(member, types.BuiltinFunctionType) else None


def _uses_bare(code: types.CodeType, selves: set[str]) -> bool:
    """Whether ``code`` uses one of ``selves`` other than to read or set an attribute of it."""
    instructions = list(dis.get_instructions(code))
    return any(
        instruction.opname in {"LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"}
        and instruction.argval in selves
        and (following.opname not in _ON_AN_OBJECT)
        for instruction, following in itertools.pairwise(instructions)
    )


def _reads_own(module: torch.nn.Module, names: set[str]) -> bool:
    """Whether ``names`` hold one of the module's own attributes that make it draw."""
    return any(name in names for name in vars(module) if name in _PROBABILITIES or _names_dropping(name))


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
    return "dropout" in words or "drop" in words or "pdrop" in words  # GPT-2's attn_pdrop


def _number(value: object) -> float | None:
    """A probability as a float (a Python or numpy number, a tensor of one element); ``None`` for anything else."""
    if isinstance(value, (bool, np.bool_, np.timedelta64)):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and value.layout == torch.strided
        and value.device.type != "meta"
        and not value.is_nested
        and not value.is_complex()
    ):
        return float(value.detach())
    return None


def _draws(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, torch.nn.RReLU):
        return True
    if isinstance(module, torch.nn.MultiheadAttention):
        return bool(module.dropout > 0)
    names = [cls.__name__ for cls in type(module).__mro__] + [str(getattr(module, "original_name", ""))]  # TorchScript
    if any(any(part in name for part in _NAMES) or name.endswith("Dropout") for name in names):
        p = _probability(module)
        return p is not None and p > 0
    return any(
        _names_dropping(name) and (p := _number(value)) is not None and p > 0 for name, value in vars(module).items()
    )
