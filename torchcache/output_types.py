"""Output classes that torchcache stores by name and rebuilds: namedtuples, dataclasses, dicts.

A structure spec names the class of a typed node as ``"module:qualname"``. Rebuilding
looks the name up among the modules this process has already imported
(``sys.modules``), walking the qualified name through module and class ``__dict__``
entries only: no module is imported, no module ``__getattr__`` or descriptor runs, and
the only code called is the class found, after it has been checked to be of the kind
the spec says. There are three kinds, each checked on the class itself:

* ``namedtuple``: a tuple subclass with ``_fields`` (``collections.namedtuple``,
  ``typing.NamedTuple``), rebuilt with ``cls._make(values)``;
* ``dataclass``: ``dataclasses.is_dataclass(cls)``, rebuilt with its stored fields set
  on a new instance, without running ``__init__`` or ``__post_init__`` again (one that
  transforms a field would transform it twice), and refused at store time if it holds
  attributes beyond its fields; a ``dict`` subclass is rebuilt with ``cls(**fields)``.
  This covers Hugging Face ``ModelOutput`` (an ``OrderedDict`` subclass and a
  dataclass): its fields that were ``None`` are stored as ``None`` and the class
  leaves them out of its dict part again;
* ``mapping``: a dict subclass (``OrderedDict`` included) that inherits ``__init__``
  and ``__new__`` from ``dict`` or ``OrderedDict``, rebuilt with ``cls(items)``.

An entry whose class cannot be rebuilt (its module is not imported in this process,
the name is not a class of that kind, its fields changed, or its ``__init__``
rejects the stored fields) raises :class:`RebuildError`. The entry itself is intact
(its process simply lacks the class), so it is a miss to recompute, not a corrupt
file. Outputs whose class could never be rebuilt by name (a class defined inside a
function, a dict subclass with its own ``__init__``) are rejected when they are
first cached, with a :class:`KeyingError` naming the type and the path.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections import OrderedDict
from types import ModuleType
from typing import Any

import torch

from .errors import KeyingError, TorchCacheError

__all__ = [
    "KINDS",
    "LIBRARY_FLAGS",
    "RebuildError",
    "build",
    "describe_type",
    "is_type_name",
    "kind_of",
    "members",
    "resolve",
    "type_name",
    "unplain_tensor",
]

#: The node kinds of a spec that name a class.
KINDS = ("namedtuple", "dataclass", "mapping")
_MAX_NAME = 500


class RebuildError(TorchCacheError, TypeError):
    """A stored output names a class that cannot be rebuilt in this process.

    The entry is intact; recomputing the output (which imports the class) is the fix.
    """


def type_name(cls: type) -> str:
    """The ``"module:qualname"`` of a class, as a spec stores it.

    Example:
        >>> type_name(OrderedDict)
        'collections:OrderedDict'
    """
    return f"{cls.__module__}:{cls.__qualname__}"


def describe_type(cls: type) -> str:
    """A class's dotted name for messages, such as ``collections.OrderedDict``."""
    return f"{cls.__module__}.{cls.__qualname__}"


#: Attributes libraries set on tensors that change no value (their own bookkeeping): left out of keys, and
#: lost on a stored copy without harm (torch.compile's hints, nn.Buffer's flags, Hugging Face's initialisation).
LIBRARY_FLAGS = frozenset(
    {
        "_is_hf_initialized",
        "_dynamo_static_input_type",
        "_dynamo_dynamic_indices",
        "_dynamo_weak_dynamic_indices",
        "_dynamo_dynamic_range",
        "_dynamo_hint_overrides",
        "_has_dynamo_dim_marking",
        "_specialize_on",
        "_is_buffer",
        "persistent",
    }
)


def unplain_tensor(tensor: torch.Tensor, parameters: bool = False) -> str:
    """What a stored copy of ``tensor`` would lose, and the way out; ``""`` for a plain tensor.

    A copy is a plain ``torch.Tensor``: a subclass loses its class and what it holds
    (torchvision's ``BoundingBoxes`` their format), a tensor its attributes set on it, and a
    nested tensor cannot be stored as one array. ``parameters``: an ``nn.Parameter`` counts
    as plain (a dataset sample's tensors come back as tensors that do not require grad).
    """
    if type(tensor) is not torch.Tensor and not (parameters and type(tensor) is torch.nn.Parameter):
        return (
            f"a {describe_type(type(tensor))}, a subclass of torch.Tensor: a stored copy would be a plain "
            "torch.Tensor without its class and attributes. Return t.as_subclass(torch.Tensor) and what the "
            "subclass holds beside it"
        )
    if tensor.is_nested:
        return "a nested tensor, which is not one array: pad it (torch.nested.to_padded_tensor) or return its parts"
    own = sorted(tensor.__dict__.keys() - LIBRARY_FLAGS)
    if own:
        return (
            f"a tensor with attributes set on it ({', '.join(own)}): a stored copy would have none. Return them "
            "beside it (t.detach() drops them)"
        )
    return ""


def is_type_name(name: object) -> bool:
    """Whether ``name`` is a well-formed ``"module:qualname"`` (dotted identifiers, no dunders in the qualname).

    Example:
        >>> is_type_name("collections:OrderedDict"), is_type_name("os:system.__class__")
        (True, False)
    """
    if not isinstance(name, str) or len(name) > _MAX_NAME or name.count(":") != 1:
        return False
    module, qualname = name.split(":")
    return all(part.isidentifier() for part in module.split(".")) and all(
        part.isidentifier() and not part.startswith("__") for part in qualname.split(".")
    )


def kind_of(cls: type) -> str | None:
    """The kind of a class that can be rebuilt by name, or ``None`` if it cannot be."""
    if dataclasses.is_dataclass(cls):
        return "dataclass"
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple) and hasattr(cls, "_make"):
        return "namedtuple"
    if issubclass(cls, dict) and _inherits_dict_init(cls):
        return "mapping"
    return None


def _inherits_dict_init(cls: type) -> bool:
    """Whether ``cls(items)`` runs the ``__init__`` and ``__new__`` of ``dict`` or ``OrderedDict``."""
    for klass in cls.__mro__:
        if klass is dict or klass is OrderedDict:
            return True
        if "__init__" in vars(klass) or "__new__" in vars(klass):
            return False
    return False


def members(node: object, kind: str, path: str) -> list[tuple[str, Any]]:
    """The stored fields or items of an output of a typed kind, in order.

    Args:
        node: The output.
        kind: ``kind_of(type(node))``.
        path: Where the node sits in the output, for messages.

    Raises:
        KeyingError: If the class cannot be found again by its name, or the instance
            holds state that rebuilding it would lose.
    """
    cls = type(node)
    what = describe_type(cls)
    try:
        found = resolve(type_name(cls))
    except RebuildError:
        found = None
    if found is not cls:
        raise KeyingError(
            f"{path}: cannot cache an output of type {what}: its class must be reachable by its module and "
            "qualified name, so that a cached entry can rebuild it; define it at the top level of a module "
            "(not inside a function)"
        )
    if kind == "dataclass":
        return _dataclass_members(node, what, path)
    state = getattr(node, "__dict__", None)
    if state:
        parts = "fields" if kind == "namedtuple" else "items"
        raise KeyingError(
            f"{path}: cannot cache an output of type {what}: the instance has attributes "
            f"({', '.join(map(str, state))}) that rebuilding it from its {parts} would lose"
        )
    if kind == "namedtuple":
        return list(zip(cls._fields, node))  # type: ignore[attr-defined, call-overload]
    items = list(node.items())  # type: ignore[attr-defined]
    for key, _ in items:
        if not isinstance(key, str):
            raise KeyingError(f"{path}: dict keys must be str to be cached, got {key!r}")
    return items


def _dataclass_members(node: object, what: str, path: str) -> list[tuple[str, Any]]:
    fields = dataclasses.fields(node)  # type: ignore[arg-type]
    for field in fields:
        if not field.init:
            raise KeyingError(
                f"{path}: cannot cache an output of type {what}: field {field.name!r} is not an __init__ "
                "argument (init=False), so a cached entry could not rebuild it"
            )
    values = [(field.name, getattr(node, field.name)) for field in fields]
    held = (k for k in getattr(node, "__dict__", ()) if not _lazily_made(node, k))
    extra = sorted(set(held) - {name for name, _ in values})
    if extra and not isinstance(node, dict):  # rebuilt from its fields alone, __post_init__ not run again
        raise KeyingError(
            f"{path}: cannot cache an output of type {what}: it holds attributes beyond its fields ({extra}), "
            "set by its __init__ or __post_init__, which a cached entry would not hold; make them fields"
        )
    if isinstance(node, dict):  # a ModelOutput: its dict part must follow from its fields
        names = [name for name, _ in values]
        keys = list(node)
        present = {name: value for name, value in values if name in node}
        if (
            keys != [name for name in names if name in node]
            or any(node[name] is not value for name, value in present.items())
            or any(value is not None for name, value in values if name not in node)
        ):
            raise KeyingError(
                f"{path}: cannot cache an output of type {what}: its items {keys} do not follow from its fields "
                f"{names} (each item must be a field, in field order, and each field left out must be None), "
                "so rebuilding it from its fields would change it"
            )
    return values


def _lazily_made(node: object, name: str) -> bool:
    """Whether attribute ``name`` is a ``functools.cached_property``'s value as it computes it (made again on hits)."""
    made = getattr(type(node), name, None)
    if not isinstance(made, functools.cached_property):
        return False
    try:
        again, held = made.func(node), vars(node)[name]
        if isinstance(held, torch.Tensor):
            return isinstance(again, torch.Tensor) and again.dtype == held.dtype and torch.equal(again, held)
        return type(again) is type(held) and bool(again == held)
    except Exception:  # noqa: BLE001 - not comparable: held as it is, so refused
        return False


def resolve(name: str) -> type:
    """The class a spec names, among the modules already imported.

    Raises:
        RebuildError: If the module is not imported, the name is not found there, or
            it is not a class spelled that way.
    """
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if not isinstance(module, ModuleType):
        raise RebuildError(
            f"cannot rebuild a cached output of type {name!r}: module {module_name!r} is not imported in this "
            "process (torchcache never imports what a cache entry names); import it before the cached call"
        )
    found: object = module
    for part in qualname.split("."):
        if found is not module and not isinstance(found, type):
            break
        found = vars(found).get(part)
    if not isinstance(found, type) or type_name(found) != name:
        raise RebuildError(f"cannot rebuild a cached output of type {name!r}: it names no class in this process")
    return found


_checked: dict[tuple[str, str, tuple[str, ...]], type] = {}


def _checked_class(kind: str, name: str, keys: list[str]) -> type:
    """The class ``name``, checked to be of ``kind`` with the fields ``keys`` (cached per class)."""
    fields = tuple(keys) if kind != "mapping" else ()
    cls = resolve(name)
    if _checked.get((kind, name, fields)) is cls:
        return cls
    found = kind_of(cls)
    if found != kind:
        raise RebuildError(
            f"cannot rebuild a cached output of type {name!r}: expected a {kind} class, found "
            f"{'a ' + found + ' class' if found else 'a class of no cacheable kind'}"
        )
    if kind == "namedtuple":
        current = tuple(cls._fields)  # type: ignore[attr-defined]
    elif kind == "dataclass":
        current = tuple(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]
    else:
        current = ()
    if current != fields:
        raise RebuildError(
            f"cannot rebuild a cached output of type {name!r}: it was stored with the fields {list(fields)}, "
            f"the class now has {list(current)}"
        )
    _checked[(kind, name, fields)] = cls
    return cls


def build(kind: str, name: str, keys: list[str], values: list[Any]) -> object:
    """Rebuild a typed node from its stored fields or items.

    Raises:
        RebuildError: If the class is missing, of another kind, has other fields, or
            rejects the stored values.
    """
    cls = _checked_class(kind, name, keys)
    try:
        if kind == "namedtuple":
            return cls._make(values)  # type: ignore[attr-defined]
        if kind == "dataclass" and issubclass(cls, dict):  # a ModelOutput: its __post_init__ makes its items
            return cls(**dict(zip(keys, values)))
        if kind == "dataclass":  # its fields as they were stored: __post_init__ ran when it was made
            node: object = object.__new__(cls)
            for key, value in zip(keys, values):
                object.__setattr__(node, key, value)
            return node
        return cls(zip(keys, values))
    except Exception as exc:
        raise RebuildError(f"cannot rebuild a cached output of type {name!r}: {type(exc).__name__}: {exc}") from exc
