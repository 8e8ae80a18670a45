"""Names code reads that do not exist yet when a key is taken: imports not yet run, globals not yet defined.

A function's code may import a module of the user's inside its body (``import helpers``
in ``forward``), or read a global defined further down its file. A key that recorded
them as absent would stay the same whatever they turn out to be, across runs too. So a
module imported inside a function is found without running it where it is installed code
(keyed by its package's version) and imported where it is the user's (keyed by its code);
one that cannot be found is keyed as absent (an ``ImportError`` there is the code's own
fallback, as for an optional dependency). A global that is not defined when the key is
taken at the first call is keyed as absent (a name in a branch that never runs, an
optional import that failed). A key taken early (a function at its decoration, a module
when it is wrapped), while names are missing or a module is still being imported, is
provisional: :func:`deferring` notes them, and the key is taken again at the first call.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.util
import inspect
import sys
import types
from typing import Protocol

from ..errors import KeyingError
from .notes import Notes
from .origins import is_installed_file, origin_of_module, version_of

__all__ = ["deferring", "import_for_key", "missing_global", "names_modules"]

_missing = Notes()


class _Refuses(Protocol):
    def refuse(self, path: str, why: str) -> KeyingError: ...


def deferring(active: bool = True) -> contextlib.AbstractContextManager[list[str]]:
    """Note the globals found undefined in the block (this thread), if ``active``.

    Yields:
        The paths of the globals found undefined; a key taken with any is provisional.
    """
    return _missing.block(active)


def missing_global(path: str) -> None:
    """A global code reads is not defined, or a module it imports is being imported: noted in :func:`deferring`."""
    _missing.add(path)


def import_for_key(name: str, encoder: _Refuses, path: str) -> types.ModuleType | str | None:
    """The module an import statement inside a function names.

    Returns:
        The module if this process imported it (noted by :func:`deferring` if it is still
        being imported: a cycle), else ``package==version`` for installed code (not
        imported), the module for the user's own code (imported now, as the function
        would), or ``None`` if it cannot be found.

    Raises:
        KeyingError: If the user's module fails to import.
    """
    found = sys.modules.get(name)
    if found is not None:
        if getattr(getattr(found, "__spec__", None), "_initializing", False):
            missing_global(path)  # its code has not run to its end: keyed again at the first call
        return found
    top = name.partition(".")[0]
    try:
        spec = sys.modules[top].__spec__ if top in sys.modules else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if top in sys.modules and spec is None:
        installed = origin_of_module(top) is not None
    elif spec is None:
        return None
    else:
        where = [spec.origin] if spec.origin and spec.has_location else list(spec.submodule_search_locations or ())
        installed = spec.origin in ("built-in", "frozen") or any(is_installed_file(place) for place in where)
    if installed:
        return version_of(top)
    try:
        return importlib.import_module(name)
    except ImportError:  # as the function's own import would fail now; maybe not at its first call (a cycle)
        missing_global(path)
        return None
    except Exception as exc:
        raise encoder.refuse(path, f"importing it to key its code failed ({type(exc).__name__}: {exc})") from exc


_FRAME_GETTERS = (
    (sys, "_getframe"),
    (inspect, "currentframe"),
    (inspect, "stack"),
    (inspect, "trace"),
    (inspect, "getouterframes"),
    (inspect, "getinnerframes"),
)


#: What reaches modules, frames or namespaces named only at run time: ``(module, name, what it does)``.
_AT_RUN_TIME = (
    (importlib, "import_module", "imports a module named at run time"),
    (sys, "modules", "reads modules from sys.modules"),
    (inspect, "getmodule", "reads the module of an object"),
    (builtins, "__dict__", "reads names from the builtins' namespace"),
    *((module, name, "reads frames, and with them their names") for module, name in _FRAME_GETTERS),
)


def names_modules(value: object, attribute: tuple[str, ...]) -> str | None:
    """How ``value`` (with ``attribute`` read from it) reaches modules, frames or namespaces named at run time."""
    for module, name, what in _AT_RUN_TIME:
        if (value is module and attribute == (name,)) or (name != "__dict__" and value is getattr(module, name)):
            return what
    return None
