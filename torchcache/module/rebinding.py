"""Values a key read that were rebound: which rebindings change nothing, and the warnings for those that recur."""

from __future__ import annotations

import collections
import math
import warnings
from types import MappingProxyType
from typing import Any

import torch

from ..canonical.globals import ProcessState
from ..canonical.objects import Binding
from ..errors import CacheWarning
from ..faults import user_stacklevel

__all__ = ["ALIKE_WARN", "REBOUND_WARN", "alike", "note_alike", "note_rebound", "note_written"]

_rebound: collections.Counter[tuple[object, str]] = collections.Counter()
#: Rebinding a global this often takes the key as often: a warning says so, once.
REBOUND_WARN = 3


#: Immutable types whose equal values are encoded alike: rebinding one to an equal value changes no key.
_ALIKE = frozenset({type(None), bool, int, str, bytes, torch.dtype, torch.device})


def alike(was: Any, now: Any) -> bool:
    """Whether ``now`` is a value equal to ``was`` and of its type, which a key encodes alike (``-0.0`` apart)."""
    if type(was) is not type(now):
        return False
    if isinstance(was, tuple):
        return len(was) == len(now) and all(map(alike, was, now))
    if isinstance(was, (float, complex)):  # -0.0 and 0.0 are equal, and encoded apart
        signs = [math.copysign(1.0, x) for x in (was.real, was.imag, now.real, now.imag)]
        return bool(was == now and signs[:2] == signs[2:])
    return type(was) in _ALIKE and bool(was == now)


def note_rebound(binding: Binding) -> None:
    """Count a rebinding of what a key read; warn once it was rebound :data:`REBOUND_WARN` times."""
    space = binding.namespace  # the same at each key: a class's by its name (vars() makes a new proxy)
    ident = (space.get("__module__"), space.get("__qualname__")) if isinstance(space, MappingProxyType) else id(space)
    where = (getattr(space, "ident", ident), binding.name)
    _rebound[where] += 1
    if _rebound[where] == REBOUND_WARN:
        kind = "global" if any(k in binding.namespace for k in ("__builtins__", "__build_class__")) else "attribute"
        what, ignore = getattr(space, "what", f"{kind} {binding.name!r}"), getattr(space, "ignore", binding.name)
        warnings.warn(
            f"torchcache: the {what} that a cached forward reads was rebound {REBOUND_WARN} times; each time the "
            "module key is taken again (its weights hashed) and earlier entries no longer match"
            + (f". If outputs do not depend on it, name it in key_ignore ({ignore!r})" if ignore else ""),
            CacheWarning,
            stacklevel=user_stacklevel(),
        )


def note_written(state: ProcessState) -> ProcessState:
    """``state`` as it is now; a write to it counted, and said once it was written :data:`REBOUND_WARN` times."""
    if not state.changed():
        return state
    _rebound[(state.what, state.where)] += 1
    if _rebound[(state.what, state.where)] == REBOUND_WARN:
        warnings.warn(
            f"torchcache: {state.what}, which a cached forward reads, was written {REBOUND_WARN} times; each time "
            "the module key is taken again (its weights hashed) and earlier entries no longer match. Read what it "
            "needs in __init__ (an attribute is keyed by its value), or, if outputs do not depend on it, name the "
            "module your code reads it through in key_ignore (such as 'os')",
            CacheWarning,
            stacklevel=user_stacklevel(),
        )
    return state._replace(seen=type(state.seen)(state.current()))  # type: ignore[call-arg]


#: Key retakes in a row that gave the same key, after which a warning says what they cost.
ALIKE_WARN = 8


def note_alike(name: str, before: int) -> int:
    """Count a key of ``name`` taken again alike (``before`` in a row until now); warn at :data:`ALIKE_WARN`."""
    if before + 1 == ALIKE_WARN:
        warnings.warn(
            f"torchcache: the key of {name} was taken again {ALIKE_WARN} times in a row and came out the same: "
            "something it covers is replaced or written at each call without changing (a hook removed and "
            "registered again as a new bound method or functools.partial, a weight copied in place with the same "
            "values), and each time its weights are hashed again. Register such a hook once, or skip the write",
            CacheWarning,
            stacklevel=user_stacklevel(),
        )
    return before + 1
