"""Containers of tensors among a call's arguments: rebuilt around smaller batches, and a mapping class's own state.

A tuple, list or mapping that holds per-item tensors is rebuilt around the rows of a
smaller batch (the item check's, a partial hit's misses) as the class it was: a
namedtuple by ``_make``, another tuple or list subclass by its constructor with the
caller's attributes, a ``dict`` or ``UserDict`` subclass by a copy (its attributes,
a ``defaultdict``'s factory, come along, and the caller's items stay), another mapping
by its constructor with its public attributes carried over, or refused.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import KeyingError
from ..keys import encode_value

__all__ = ["MAX_DEPTH", "container_state", "holds_tensor", "map_tensors"]

#: How deep containers of tensors among the arguments are followed.
MAX_DEPTH = 16


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], depth: int = 0) -> Any:
    """``value`` with every tensor inside it replaced by ``fn(tensor)``, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if depth > MAX_DEPTH or not holds_tensor(value):
        return value
    if isinstance(value, tuple):
        items = [map_tensors(v, fn, depth + 1) for v in value]
        made = value._make(items) if hasattr(value, "_fields") else type(value)(items)  # type: ignore[attr-defined]
        return _with_attributes(value, made)
    if isinstance(value, list):
        return _with_attributes(value, type(value)(map_tensors(v, fn, depth + 1) for v in value))
    if isinstance(value, Mapping):
        mapped = {k: map_tensors(v, fn, depth + 1) for k, v in value.items()}
        return mapped if type(value) is dict else _rebuilt(value, mapped)
    return value


def _rebuilt(value: Mapping[Any, Any], mapped: dict[Any, Any]) -> Any:
    """A mapping of the class of ``value``, with its attributes (a ``defaultdict``'s factory), holding ``mapped``."""
    if isinstance(value, (dict, collections.UserDict)):  # a copy holds its own items: the caller's stay
        try:
            new = copy.copy(value)
            for key, item in mapped.items():
                new[key] = item
            return new
        except Exception:  # noqa: BLE001 - a mapping that cannot be copied or written: made from its items
            pass
    try:
        made: Any = type(value)(mapped)  # type: ignore[call-arg]
        held = getattr(made, "__dict__", None)
        for name, attribute in _public_state(value).items():  # keyed: carried over
            if held is None:
                raise TypeError(f"the new mapping cannot hold its attribute {name!r}")
            held[name] = attribute
        missing = set(getattr(value, "__dict__", None) or ()) - set(held or ())
        if missing:
            raise TypeError(f"the new mapping lacks the attributes {sorted(missing)}")
        return made
    except Exception as exc:  # noqa: BLE001 - any failure means the class cannot be rebuilt
        raise KeyingError(
            f"cannot make a {type(value).__qualname__} holding part of a batch: copy.copy and item assignment, "
            f"and {type(value).__qualname__}(dict) fail ({type(exc).__name__}: {exc}); pass a dict"
        ) from None


def _with_attributes(value: Any, made: Any) -> Any:
    """``made`` (a tuple or list subclass rebuilt from its items) with the attributes ``value`` holds."""
    state = getattr(value, "__dict__", None)
    if state:
        try:
            made.__dict__.update({k: v for k, v in state.items() if k not in made.__dict__})
        except Exception as exc:  # noqa: BLE001 - any failure means the class cannot be rebuilt
            raise KeyingError(
                f"cannot make a {type(value).__qualname__} holding part of a batch with the attributes of the "
                f"caller's ({type(exc).__name__}: {exc}); pass a tuple or a list"
            ) from None
    return made


def holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether a tensor is inside ``value`` (tuples, lists and mappings, to :data:`MAX_DEPTH` levels)."""
    if isinstance(value, torch.Tensor):
        return True
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        return any(holds_tensor(v, depth + 1) for v in value.values())
    return False


def _public_state(value: Any) -> dict[str, Any]:
    """A container's public attributes but its items (a ModelOutput's fields).

    What a library keeps per batch in private ones (a BatchEncoding's ``_encodings``) is
    not configuration, and is not keyed.
    """
    items = list(value.values()) if isinstance(value, Mapping) else list(value)
    state = getattr(value, "__dict__", None) or {}
    return {k: v for k, v in state.items() if k[:1] != "_" and not any(v is item for item in items)}


def container_state(value: Any, label: str) -> bytes:
    """What a container class other than ``dict``, ``tuple`` and ``list`` holds besides its items.

    Its public attributes, and a ``defaultdict``'s factory.
    """
    state = _public_state(value)
    if isinstance(value, collections.UserDict):
        state.pop("data", None)  # its items
    factory = getattr(value, "default_factory", None)
    if factory is not None:
        state["<default_factory>"] = factory
    return encode_value(state, f"argument {label!r} attributes") if state else b""
