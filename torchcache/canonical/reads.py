"""What the user's code reads besides its globals: checks of inference mode, and attribute names.

Both come from a code object's instructions, nested code included (lambdas,
comprehensions, inner functions). A read of ``torch.is_inference_mode_enabled()`` (or of a
tensor's ``is_inference()``) keys a forward's calls by inference mode; the attributes it
reads off anything but a module (``self.helper``, ``type(self).helper``, ``MODEL.helper``,
``nn.Module.helper``; not ``torch.log``) and, in code that looks names up, the names among
its constant strings (``getattr(self, "helper")``) decide which helpers of the user's put
on an installed class (``nn.Module.helper = f``) are keyed.
"""

from __future__ import annotations

import builtins
import dis
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["names_off_objects", "reads_of"]

#: Names whose read in a user's code keys calls by inference mode (``h.is_inference()`` too).
_MODE_CHECKS = frozenset({"is_inference_mode_enabled", "is_inference"})
_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_LOADS_ATTRIBUTE = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_LOOKUPS = frozenset({"getattr", "hasattr", "attrgetter", "methodcaller"})


def reads_of(code: types.CodeType) -> tuple[bool, frozenset[str]]:
    """Whether ``code`` names a check of inference mode, and the attribute names it reads (see above).

    Example:
        >>> def forward(self, x):
        ...     return torch.log(self.helper(x)) if torch.is_inference_mode_enabled() else x
        >>> modal, names = reads_of(forward.__code__)
        >>> modal, sorted(names)
        (True, ['helper'])
    """
    codes = list(_codes_in(code))
    modal = any(_MODE_CHECKS & {*inner.co_names, *inner.co_consts} for inner in codes)
    return modal, frozenset(name for inner in codes for name in _attributes_read(inner))


def _codes_in(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code objects nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes_in(const)


def _attributes_read(code: types.CodeType) -> Iterator[str]:
    """The attributes ``code`` reads off anything but a global, and, where it looks names up, its strings."""
    off_global = False
    by_name = not _LOOKUPS.isdisjoint(code.co_names)  # getattr(self, "helper"), methodcaller("helper")
    for instruction in dis.get_instructions(code):
        name, value = instruction.opname, instruction.argval
        if name in _LOADS_ATTRIBUTE:
            if not off_global:
                yield value
            continue
        off_global = name in _LOADS_GLOBAL
        if by_name and name == "LOAD_CONST" and isinstance(value, str) and value.isidentifier():
            yield value


def names_off_objects(namespace: Mapping[str, Any], chains: Iterable[tuple[str, ...]]) -> Iterator[str]:
    """The attributes global chains read off objects that are not modules (``MODEL.helper``, ``nn.Module.helper``).

    ``torch.log`` reads ``log`` off a module: not one of them. Modules are walked through
    their ``__dict__``: no module code runs.
    """
    for root, *attributes in chains:
        value = namespace.get(root, vars(builtins).get(root))
        for attribute in attributes:
            if not isinstance(value, types.ModuleType):
                yield attribute
                break
            value = vars(value).get(attribute)
