"""What the user's code reads besides its globals: checks of inference mode, and attribute names.

Both come from a code object's instructions, nested code included (lambdas,
comprehensions, inner functions). A read of ``torch.is_inference_mode_enabled()`` (or of a
tensor's ``is_inference()``) keys a forward's calls by inference mode; the attributes it
reads off anything but a global (``self.helper``, ``type(self).helper``, not ``torch.log``)
and the names among its constant strings (``getattr(self, "helper")``) decide which
helpers of the user's put on an installed class (``nn.Module.helper = f``) are keyed.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Iterator

__all__ = ["reads_of"]

#: Names whose read in a user's code keys calls by inference mode (``h.is_inference()`` too).
_MODE_CHECKS = frozenset({"is_inference_mode_enabled", "is_inference"})
_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_LOADS_ATTRIBUTE = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


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
    """The attributes ``code`` reads off anything but a global, and its constant strings that are names."""
    off_global = False
    for instruction in dis.get_instructions(code):
        name, value = instruction.opname, instruction.argval
        if name in _LOADS_ATTRIBUTE:
            if not off_global:
                yield value
            continue
        off_global = name in _LOADS_GLOBAL
        if name == "LOAD_CONST" and isinstance(value, str) and value.isidentifier():
            yield value
