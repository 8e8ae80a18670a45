"""The globals a function's code reads: each followed through user modules, installed ones by version.

Each global read (and each attribute of a user module read through one) is noted as a
:class:`~.objects.Binding`, so that rebinding it later (``SCALE = 3``, ``F.gelu = F.silu``)
makes whoever holds the key take it again; a global the function assigns itself (a call
counter) is keyed as it first was.

The process's environment and command line are data of the process, not of the installed
module they are read through: code that reads ``os.environ``, ``os.getenv`` or
``sys.argv`` is keyed by their content as the key is taken (the whole environment, in
name order: which variable the code reads is known only when it runs), as a global bound
by ``from os import environ`` is, and whoever holds the key compares them at each call
(:class:`ProcessState`).
"""

from __future__ import annotations

import builtins as builtins_module
import os
import sys
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import KeyingError
from .notes import note_mode_read
from .objects import Binding, collect
from .operators import encode_operator
from .origins import is_users_object, origin_of_module
from .pending import import_for_key, missing_global, names_modules
from .tags import Tag, tagged, text

if TYPE_CHECKING:
    from .code import Encoder, Scan

__all__ = ["ProcessState", "encode_globals"]

#: Builtins that read or run what is named at run time: code that calls them reaches state a key cannot follow.
_DYNAMIC_BUILTINS = frozenset({"globals", "eval", "exec", "__import__"})
_DYNAMIC = "it {what}, so what it reads is known only when it runs"
#: Attributes that are a namespace read as a dict (``fn.__globals__["SCALE"]``, ``frame.f_globals``): no name is seen.
#: (A frame's ``f_locals``: the functions that hand out frames are refused.)
_NAMESPACES = frozenset({"__globals__", "__builtins__", "f_globals", "f_builtins"})
#: Builtins whose replacements do nothing to outputs (``print`` wrapped to print on one rank only): keyed by name.
_UNKEYED_BUILTINS = frozenset({"print", "breakpoint", "help", "exit", "quit", "copyright", "credits", "license", "_"})
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not one of C
#: The few builtin classes made as heap types (ExceptionGroup), as torchcache found them.
_HEAP_CLASSES = {k: v for k, v in vars(builtins_module).items() if isinstance(v, type) and v.__flags__ & _HEAPTYPE}


def encode_globals(encoder: Encoder, fn: types.FunctionType, scan: Scan, path: str, depth: int) -> bytes:
    """The globals a function reads (``scan``: what :func:`~.code.scan_code` found), followed through user modules."""
    namespace = fn.__globals__
    builtins = namespace.get("__builtins__", {})
    if isinstance(builtins, types.ModuleType):
        builtins = vars(builtins)
    parts = []
    where = f"{path}.__globals__"
    roots = [chain[0] for chain in scan.chains if chain[0] == "__builtins__"]  # __builtins__["abs"]
    if read := _NAMESPACES.intersection([*roots, *scan.names, *(name for chain in scan.chains for name in chain[1:])]):
        raise encoder.refuse(path, _DYNAMIC.format(what=f"reads names from {min(read)}, a namespace"))
    for chain in scan.chains:
        name = chain[0]
        if encoder.ignored(where, name):
            continue
        if name in namespace:
            value = namespace[name]
            if what := names_modules(value, chain[1:2]):
                raise encoder.refuse(f"{where}.{name}", _DYNAMIC.format(what=what))
            collect(Binding(namespace, name, value))  # rebound later (SCALE = 3, by forward too): a new key
        elif name in builtins:
            if name in _DYNAMIC_BUILTINS:
                raise encoder.refuse(f"{where}.{name}", _DYNAMIC.format(what=f"calls {name}()"))
            value = builtins[name]
            if name not in _UNKEYED_BUILTINS:
                collect(Binding(builtins, name, value))  # builtins.abs = other later: the key is taken again
            if name in _UNKEYED_BUILTINS or _as_shipped(name, value):
                parts.append(tagged(Tag.BUILTIN_NAME, name.encode()))
                continue  # one put in its place is keyed as a global is
        else:
            missing_global(f"{where}.{name}")
            parts.append(tagged(Tag.GLOBAL_MISSING, name.encode()))
            continue
        parts.append(text(name) + _follow(encoder, value, chain[1:], f"{where}.{name}", depth))
        if len(chain) > 3 and chain[1] == "ops" and getattr(value, "__name__", None) == "torch":
            parts.append(encode_operator(encoder, chain[2], chain[3], f"{where}.{'.'.join(chain[:4])}", depth))
    for module_name, level, names in scan.imports:
        absolute = _absolute(module_name, level, namespace)
        label = f"{where}.<import {module_name}>"
        imported = import_for_key(absolute, encoder, label)
        if imported is None or isinstance(imported, str):  # not found, or installed and not imported: by version
            parts.append(tagged(Tag.GLOBAL_MISSING, f"{absolute}|{imported}".encode()))
        elif names:
            for name in names:
                if what := names_modules(imported, (name,)):
                    raise encoder.refuse(label, _DYNAMIC.format(what=what))
                if name not in vars(imported) and getattr(imported, "__path__", None) is not None:
                    import_for_key(f"{absolute}.{name}", encoder, label)  # from a package import a submodule
                parts.append(text(name) + _follow(encoder, imported, (name,), label, depth))
        else:
            parts.append(encoder.child(imported, label, depth))
    return tagged(Tag.GLOBALS, b"".join(parts))


def _as_shipped(name: str, value: object) -> bool:
    """Whether builtin ``name`` is Python's own, not one put there: a class or function of C, or a constant."""
    if isinstance(value, type):  # int, OSError as IOError
        return not value.__flags__ & _HEAPTYPE or value is _HEAP_CLASSES.get(name)
    if isinstance(value, types.BuiltinFunctionType):  # abs, or open of io; not functools.wraps(abs)(mine)
        return value.__name__ == name and getattr(value.__self__, "__name__", None) in ("builtins", "io", "_io")
    return value is None or value is Ellipsis or value is NotImplemented or type(value) in (bool, str)


def _absolute(name: str, level: int, namespace: dict[str, Any]) -> str:
    """The absolute name of the module an import statement inside a function names."""
    if level:
        package = namespace.get("__package__") or ""
        base = package.rsplit(".", level - 1)[0] if level > 1 else package
        name = f"{base}.{name}" if name else base
    return name


def _follow(encoder: Encoder, value: object, attributes: tuple[str, ...], path: str, depth: int) -> bytes:
    """A global, and the attributes read from it as long as it is a user module (``helpers.scale``)."""
    made = b""  # the __getattr__ of the user modules passed through
    for i, attribute in enumerate(attributes):
        if not isinstance(value, types.ModuleType) or attribute == "__dict__":  # helpers.__dict__: all of it, as vars()
            break
        namespace = vars(value)
        if origin_of_module(value.__name__) is not None:  # installed: by version, unless what is read was put there
            member: object = value
            scope: dict[str, Any] = {}
            state = b""  # os.environ, sys.argv: by content
            for name in attributes[i:]:  # through its submodules (torch.nn.functional.gelu); no module code runs
                scope = vars(member) if isinstance(member, types.ModuleType) else {}
                member = scope.get(name, sys.modules.get(f"{scope.get('__name__')}.{name}"))
                state = state or _process_state(encoder, member, f"{path}.{name}", depth)
            if attributes[-1] in scope:  # F.gelu = F.silu after the key was taken: the key is taken again
                collect(Binding(scope, attributes[-1], member))
            note_mode_read(member)  # torch.is_inference_mode_enabled: its calls are keyed by the mode
            put = _put_there(member, attributes[-1], str(scope.get("__name__", "")))
            keyed = encoder.child(value, path, depth) + (_put(encoder, member, f"{path}.<put>", depth) if put else b"")
            return made + keyed + state
        if attribute not in namespace:
            submodule = f"{value.__name__}.{attribute}"
            maker = namespace.get("__getattr__")
            if submodule not in sys.modules and callable(maker):  # a module that makes names as read (PEP 562)
                try:
                    found = getattr(value, attribute)
                except Exception:  # noqa: BLE001 - not one it makes: missing, as forward would find it
                    return made + tagged(Tag.GLOBAL_MISSING, ".".join(attributes[: i + 1]).encode())
                if found is not sys.modules.get(submodule):  # a name it made (not a submodule it imported): by both
                    collect(Binding(namespace, "__getattr__", maker))
                    collect(Binding(namespace, attribute, None))  # defined there later (pkg.SCALE = 10): seen
                    made += encoder.child(maker, f"{path}.__getattr__", depth)
                    value, path = found, f"{path}.{attribute}"
                    continue
            if submodule in sys.modules:  # a submodule not yet bound
                value = sys.modules[submodule]
                path = f"{path}.{attribute}"
                continue
            return made + tagged(Tag.GLOBAL_MISSING, ".".join(attributes[: i + 1]).encode())
        value = namespace[attribute]
        collect(Binding(namespace, attribute, value))  # helpers.SCALE = 3 later: the key is taken again
        path = f"{path}.{attribute}"
    return made + encoder.child(value, path, depth) + _process_state(encoder, value, path, depth)


class ProcessState(NamedTuple):
    """The environment or the command line as a key read it: whoever holds the key sees it written later."""

    current: Callable[[], object]  #: the live object (no copy: compared at every call)
    seen: object  #: a copy, as the key read it (a dict or a list)
    what: str  #: what it is, for a warning: ``the environment (os.environ)``
    where: str  #: the path the key read it at (its writes are counted there)

    def changed(self) -> bool:
        """Whether it was written since the key read it (``os.environ["MODE"] = "b"``, ``sys.argv.append(...)``)."""
        return bool(self.current() != self.seen)


def _environment() -> Mapping[Any, Any]:
    """The environment as the process holds it: ``os.environ``'s own dict where it has one (CPython's)."""
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else dict(os.environ)


def _process_state(encoder: Encoder, value: object, path: str, depth: int) -> bytes:
    """The content of the environment or command line that ``value`` reads or is, else nothing.

    ``os.environ`` and ``os.getenv`` read the environment, ``os.environb`` and
    ``os.getenvb`` its bytes, ``sys.argv`` and ``sys.orig_argv`` are the command line.
    """
    bytes_readers = (getattr(os, "environb", os.environ), getattr(os, "getenvb", os.getenv))
    if value is os.environ or value is os.getenv or value is bytes_readers[0] or value is bytes_readers[1]:
        content: object = sorted(os.environ.items())  # (os.environb holds the same variables)
        collect(ProcessState(_environment, dict(_environment()), "the environment (os.environ)", path))
    elif value is sys.argv or value is sys.orig_argv:
        content = list(value)  # type: ignore[call-overload]
        read = (lambda: sys.argv) if value is sys.argv else (lambda: sys.orig_argv)
        collect(ProcessState(read, content, "the command line (sys.argv)", path))  # (the encoder only reads it)
    else:
        return b""
    return tagged(Tag.PROCESS_STATE, encoder.child(content, f"{path}.<content>", depth))


def _put_there(member: object, name: str, module: str) -> bool:
    """Whether ``member``, read as ``name`` from the installed ``module``, may have been put there by other code.

    The user's functions and classes, and any callable that is not a plain function,
    builtin or class named ``name`` of ``module``'s package (``F.gelu = F.silu``,
    ``torch.tanh = torch.sigmoid``, a partial, a bound method): keyed in full. An
    installed callable that is an alias under another name is keyed too, by its name and
    version, which changes nothing.
    """
    if isinstance(member, (types.FunctionType, type)) and is_users_object(member):
        return True
    if not callable(member) or isinstance(member, types.ModuleType):
        return False
    top = module.partition(".")[0]
    owner = getattr(member, "__self__", None)  # a method bound to an object: the module's own (random.random)?
    own_owner = owner is None or isinstance(owner, (types.ModuleType, type)) or _top(type(owner)) == top
    compiled = type(member).__name__ in _COMPILED  # Cython's functions (numpy.random.default_rng): as builtins
    plain = isinstance(member, (types.FunctionType, type)) or (
        (compiled or isinstance(member, (types.BuiltinFunctionType, types.MethodType))) and own_owner
    )
    if owner is None or isinstance(owner, types.ModuleType):
        package = _top(member)
    else:  # a method: of the package its object's class comes from
        package = _top(owner if isinstance(owner, type) else type(owner))
    return not plain or getattr(member, "__name__", None) != name or package != top


#: The types of compiled functions that are not builtins (Cython's): an installed package's own when named so.
_COMPILED = frozenset({"cython_function_or_method", "fused_cython_function"})


def _top(thing: object) -> str:
    return str(getattr(thing, "__module__", None) or "").partition(".")[0]


def _put(encoder: Encoder, member: object, path: str, depth: int) -> bytes:
    """A member that may have been put in an installed module: in full, else by its type and name."""
    try:
        return encoder.child(member, path, depth)
    except KeyingError:  # an installed object the encoder does not follow: which one it is
        named = f"{type(member).__module__}.{type(member).__qualname__}|{getattr(member, '__qualname__', '?')}"
        return tagged(Tag.INSTALLED_CLASS, text(named))
