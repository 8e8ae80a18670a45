"""What a function, class or Python module is, for a key: its code, followed where it leads.

User code (outside the standard library and installed packages) is keyed by what the
interpreter runs, never by source text: a function by its code object, defaults, closure
and the globals it reads, followed in turn (attribute chains through user modules such as
``helpers.scale``, and a user's function put into an installed module, ``F.gelu = mine``);
a class by everything in its ``__dict__`` and its bases'. Line numbers, file names and
docstrings are not part of a key. Installed code is keyed by module, qualified name and
the package's version (``torch==2.13.0``); the closures and defaults of installed
functions are still followed, since they hold the user's values.
"""

from __future__ import annotations

import dis
import functools
import os
import struct
import sys
import types
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from ..errors import KeyingError
from .globals import encode_globals
from .notes import INFERENCE_MODE_READ, note_mode_read
from .objects import Binding, collect
from .origins import (
    OWN_PACKAGE,
    extension_digest,
    is_installed_file,
    is_users_object,
    made_elsewhere,
    origin_of_module,
    version_of,
)
from .reads import names_off_objects, reads_of
from .tags import Tag, raw, tagged, text

__all__ = ["Encoder", "encode_builtin", "encode_class", "encode_function", "encode_python_module", "scan_code"]

_pack_double = struct.Struct("<d").pack
_MAX_CODE_DEPTH = 100
#: Class attributes that describe the class rather than what its instances compute.
_CLASS_METADATA = (  # __slotnames__: cached by copyreg the first time an instance is copied or pickled
    frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__slots__"})
    | frozenset({"__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__", "__match_args__"})
    | frozenset({"__dataclass_fields__", "__dataclass_params__", "_abc_impl", "__slotnames__"})
    | frozenset({"__torchcache_subclass__"})
)
_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})
_LOADS_ATTRIBUTE = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_HAS_DOCSTRING = 0x4000000  # CO_HAS_DOCSTRING, Python 3.14 and later


class Encoder(Protocol):
    """What this module needs of the canonical encoder (:class:`~torchcache.canonical.KeyEncoder`)."""

    def child(self, value: object, path: str, depth: int) -> bytes:
        """Encode a value found at ``path``, ``depth`` levels down."""

    def refuse(self, path: str, why: str) -> KeyingError:
        """The error for a value at ``path`` that cannot be encoded."""

    def ignored(self, path: str, name: str) -> bool:
        """Whether ``name`` at ``path`` is declared as not changing outputs."""

    #: The attributes the user's code encoded so far reads (``self.helper``): such a helper of the user's put
    #: on an installed class is keyed.
    names: set[str]


# -- code objects ----------------------------------------------------------------------------------------
class Scan(NamedTuple):
    """What one code object says about itself, nested code included."""

    described: bytes
    chains: tuple[tuple[str, ...], ...]  # global names, each with the attributes read from it
    imports: tuple[tuple[str, int, tuple[str, ...]], ...]  # (module, level, names taken from it)
    modal: bool = False  # it names a check of inference mode (is_inference_mode_enabled, is_inference)
    names: frozenset[str] = frozenset()  # attributes it reads off other than a global (self.helper), and strings


_Chains = set[tuple[str, ...]]  # global names, each with the attributes read from it
_Imports = set[tuple[str, int, tuple[str, ...]]]
_scans: weakref.WeakKeyDictionary[types.CodeType, Scan] = weakref.WeakKeyDictionary()


def scan_code(code: types.CodeType) -> Scan:
    """The description of a code object and of the globals it reads (cached: code never changes)."""
    found = _scans.get(code)
    if found is None:
        chains: _Chains = set()
        imports: _Imports = set()
        described = _describe(code, chains, imports, 0)
        modal, names = reads_of(code)
        found = _scans[code] = Scan(described, tuple(sorted(chains)), tuple(sorted(imports)), modal, names)
    return found


def _describe(code: types.CodeType, chains: _Chains, imports: _Imports, depth: int) -> bytes:
    if depth > _MAX_CODE_DEPTH:
        raise KeyingError(f"{code.co_qualname}: functions nest more than {_MAX_CODE_DEPTH} levels deep")
    _read_globals(code, chains, imports)
    consts = code.co_consts
    if consts and _has_docstring(code):
        consts = consts[1:]  # a docstring documents; it computes nothing
    parts = [
        raw(code.co_code),
        raw(getattr(code, "co_exceptiontable", b"")),
        _const((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)),
        _const((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)),
    ]
    for const in consts:
        code_object = isinstance(const, types.CodeType)
        parts.append(_describe(const, chains, imports, depth + 1) if code_object else _const(const))
    return tagged(Tag.CODE, b"".join(parts))


#: What an empty closure cell reads as (a name bound later, ``nonlocal x`` before ``x = ...``).
EMPTY = object()


def _has_docstring(code: types.CodeType) -> bool:
    if sys.version_info >= (3, 14):
        return bool(code.co_flags & _HAS_DOCSTRING)
    # Up to 3.13 the compiler puts a function's docstring, or None, first; other code
    # objects (comprehensions, lambdas, class bodies) have no docstring slot.
    return not code.co_name.startswith("<") and isinstance(code.co_consts[0], str)


def _const(value: Any) -> bytes:
    """A constant of compiled code: ``None``, numbers, strings, bytes, tuples and frozensets of them."""
    kind = type(value)
    if value is None:
        return Tag.NONE
    if kind is bool:
        return Tag.BOOL + (b"\x01" if value else b"\x00")
    if kind is float:
        return Tag.FLOAT + _pack_double(value)  # type: ignore[arg-type]
    if kind is complex:
        return Tag.COMPLEX + _pack_double(value.real) + _pack_double(value.imag)  # type: ignore[attr-defined]
    if kind is int:
        return tagged(Tag.INT, str(value).encode())
    if kind is str:
        return text(value)  # type: ignore[arg-type]
    if kind is bytes:
        return tagged(Tag.BYTES, value)  # type: ignore[arg-type]
    if kind is tuple:
        return tagged(Tag.TUPLE, b"".join(map(_const, value)))  # type: ignore[arg-type]
    if kind is frozenset:
        return tagged(Tag.FROZENSET, b"".join(sorted(map(_const, value))))  # type: ignore[arg-type]
    if value is Ellipsis:
        return Tag.ELLIPSIS
    return tagged(Tag.RAW, f"{kind.__qualname__}:{value!r}".encode("utf-8", "surrogatepass"))


def _read_globals(code: types.CodeType, chains: _Chains, imports: _Imports) -> None:
    """Collect the globals ``code`` reads or assigns (with the attributes read from each), and its imports."""
    chain: list[str] | None = None
    constants: list[Any] = []
    pending_import: tuple[str, int] | None = None
    taken: list[str] = []
    bound = ""  # the local name an import binds a whole module to
    previous = ""
    for instruction in dis.get_instructions(code):
        name = instruction.opname
        if previous == "IMPORT_NAME" and name.startswith("STORE_"):
            bound = instruction.argval
        previous = name
        if name in _LOADS_ATTRIBUTE and chain is not None:
            chain.append(instruction.argval)
            continue
        if chain is not None:
            chains.add(tuple(chain))
            chain = None
        if name in _LOADS_GLOBAL:
            chain = [instruction.argval]
        elif name == "LOAD_CONST":
            constants = [*constants[-1:], instruction.argval]
        elif name == "IMPORT_NAME":
            if pending_import is not None:
                imports.update(_imported(code, *pending_import, taken, bound))
            level = constants[0] if len(constants) == 2 and type(constants[0]) is int else 0
            pending_import, taken, bound = (instruction.argval, level), [], ""
        elif name == "IMPORT_FROM":
            taken.append(instruction.argval)
    if chain is not None:
        chains.add(tuple(chain))
    if pending_import is not None:
        imports.update(_imported(code, *pending_import, taken, bound))


#: Modules whose attribute reaches modules named at run time, when a function imports them whole.
_NAMING_MODULES = {"importlib": "import_module", "sys": "modules"}
_LOADS_LOCAL = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLOSURE", "LOAD_FAST_CHECK"})


def _imported(
    code: types.CodeType, module: str, level: int, taken: list[str], bound: str
) -> list[tuple[str, int, tuple[str, ...]]]:
    """An import statement's entries, with the attribute that names modules at run time if the code reads it.

    A module imported whole inside a function is a local variable (``bound``): the
    attributes read from it are not followed, except ``import_module`` of ``import
    importlib`` (or of ``import importlib.util``, which binds ``importlib`` too) and
    ``modules`` of ``import sys``, read from that local by name or as the string that
    follows it (``getattr(importlib, "import_module")``).
    """
    entries = [(module, level, tuple(taken))]
    top = module.partition(".")[0]
    attribute = _NAMING_MODULES.get(top) if not level else None
    if not taken and attribute is not None and bound and _reads_attribute(code, bound, attribute):
        entries.append((top, 0, (attribute,)))
    return entries


def _reads_attribute(code: types.CodeType, local: str, attribute: str) -> bool:
    """Whether ``code`` reads ``attribute`` from its local variable ``local`` (or names it right after loading it)."""
    after = False
    for instruction in dis.get_instructions(code):
        if after and instruction.argval == attribute and instruction.opname in {*_LOADS_ATTRIBUTE, "LOAD_CONST"}:
            return True
        after = instruction.opname in _LOADS_LOCAL and instruction.argval == local
    return False


# -- functions -----------------------------------------------------------------------------------------
class Attributes(Mapping[str, Any]):
    """A function's or a closure cell's attributes by name, as a :class:`~.objects.Binding`'s namespace.

    ``what`` names the binding in messages; ``ignore`` is the name ``key_ignore`` takes for
    it, if any. Reading one is a C-level ``getattr``.
    """

    __slots__ = ("get", "ident", "ignore", "what")

    def __init__(self, owner: object, what: str, ignore: str | None = None) -> None:
        self.get: Any = functools.partial(getattr, owner)  # an emptied cell raises: HeldValues takes it as a change
        self.ident = id(owner)
        self.what = what
        self.ignore = ignore

    def __getitem__(self, name: str) -> Any:
        try:
            return self.get(name)
        except (AttributeError, ValueError):  # ValueError: an emptied cell
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def encode_function(encoder: Encoder, fn: types.FunctionType, path: str, depth: int) -> bytes:
    """A Python function: its code and what it reads, or its package's version for installed code.

    torchcache's own wrappers stand for the function they wrap (``__wrapped__``), so a
    decorated class is keyed by its own methods, not by the cache around them.

    Raises:
        KeyingError: If a default, a captured value or a global it reads cannot be encoded.
    """
    compiled = fn.__dict__.get("_torchdynamo_orig_callable")
    if compiled is not None:  # torch.compile's wrapper holds ids that differ per process: what it compiles
        return tagged(Tag.WRAPPER, text("torch.compile") + encoder.child(compiled, f"{path}.<compiled>", depth))
    code = fn.__code__
    module = fn.__module__ or ""
    if os.path.abspath(code.co_filename).startswith(OWN_PACKAGE):  # functools.wraps gave it its wrapped's name
        wrapped = fn.__dict__.get("__wrapped__")
        inner = encoder.child(wrapped, f"{path}.__wrapped__", depth) if wrapped is not None else b""
        return tagged(Tag.WRAPPER, text(code.co_name) + inner)
    parts = [text(f"{module}.{fn.__qualname__}")]
    home = str(fn.__globals__.get("__name__") or module)  # where it was defined (functools.wraps copies __module__)
    installed = home != "__main__" and is_installed_file(code.co_filename)  # a script run is the user's
    if installed:
        parts.append(text(version_of(home.partition(".")[0]) if home else code.co_filename))
    else:
        scan = scan_code(code)
        parts.append(scan.described)
        if scan.modal:  # a branch on inference mode: its calls are keyed by it
            collect(INFERENCE_MODE_READ)
        encoder.names.update(scan.names, names_off_objects(fn.__globals__, scan.chains))
        for member in ("__code__", "__defaults__", "__kwdefaults__"):  # replaced later: the key is taken again
            collect(Binding(Attributes(fn, f"{member} of {fn.__qualname__}"), member, getattr(fn, member)))
    parts.append(encoder.child(fn.__defaults__ or (), f"{path}.__defaults__", depth))
    parts.append(encoder.child(fn.__kwdefaults__ or {}, f"{path}.__kwdefaults__", depth))
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        if encoder.ignored(path, name):
            continue
        try:
            captured = cell.cell_contents
        except ValueError:  # an empty cell
            captured = EMPTY
        if not installed:  # rebound later (nonlocal), or filled: the key is taken again
            collect(Binding(Attributes(cell, f"captured value {name!r}", name), "cell_contents", captured))
        parts.append(Tag.EMPTY_CELL if captured is EMPTY else encoder.child(captured, f"{path}.<{name}>", depth))
    attributes = {k: v for k, v in sorted(vars(fn).items()) if k not in ("__doc__", "__annotations__")}
    if attributes:
        parts.append(_attributes(encoder, attributes, path, depth))
        if not installed:  # helper.scale = 5.0 later: the key is taken again
            for name, value in attributes.items():
                if not encoder.ignored(path, name):
                    collect(Binding(vars(fn), name, value))
    if not installed:
        parts.append(encode_globals(encoder, fn, scan_code(fn.__code__), path, depth))
    return tagged(Tag.INSTALLED_FUNCTION if installed else Tag.FUNCTION, b"".join(parts))


def _attributes(encoder: Encoder, items: dict[str, Any], path: str, depth: int) -> bytes:
    parts = []
    for name, value in items.items():
        if not encoder.ignored(path, name):
            parts.append(text(name) + encoder.child(value, f"{path}.{name}", depth))
    return tagged(Tag.ATTRIBUTES, b"".join(parts))


# -- classes and modules ---------------------------------------------------------------------------------
def encode_class(encoder: Encoder, cls: type, path: str, depth: int) -> bytes:
    """A class: each class of its method resolution order by its members, or installed ones by version.

    Raises:
        KeyingError: If a member of a user class cannot be encoded.
    """
    parts = []
    for klass in cls.__mro__:
        if klass is object or vars(klass).get("__torchcache_subclass__"):
            continue
        name = f"{klass.__module__}.{klass.__qualname__}"
        origin = origin_of_module(klass.__module__)
        if origin is not None and not made_elsewhere(klass):
            if "forward" in vars(klass):  # nn.GELU.forward = nn.Tanh.forward later: a new key
                collect(Binding(vars(klass), "forward", vars(klass)["forward"]))
            patched = _patched_members(encoder, klass, f"{path}.<class {klass.__qualname__}>", depth)
            parts.append(tagged(Tag.INSTALLED_CLASS, text(name) + text(origin) + patched))
            continue
        members = []
        where = f"{path}.<class {klass.__qualname__}>" if klass is not cls else f"{path}.<class>"
        for member, value in sorted(vars(klass).items()):
            if member in _CLASS_METADATA or encoder.ignored(where, member):
                continue
            members.append(text(member) + _class_member(encoder, value, f"{where}.{member}", depth))
            collect(Binding(vars(klass), member, value))  # a method or a value rebound later (Net.K = 3): a new key
        parts.append(tagged(Tag.CLASS, text(name) + b"".join(members)))
    meta = type(cls)
    # The user's metaclass (a C extension's, pybind11's for a ScriptObject, has no module loaded: not the user's)
    if meta is not type and (made_elsewhere(meta) or (meta.__module__ in sys.modules and is_users_object(meta))):
        parts.append(text("metaclass") + encoder.child(meta, f"{path}.<metaclass>", depth))  # its properties, __call__
    return b"".join(parts)


def _patched_members(encoder: Encoder, klass: type, path: str, depth: int) -> bytes:
    """The methods of an installed class that other code replaced (``nn.ReLU.forward = f``, ``= nn.SiLU.forward``).

    A replaced method overrides one of a base class (``forward``, ``extra_repr``); a
    method another package only added (transformers adds ``nn.Module.smart_apply``) is
    not keyed, so that keys stay the same whether or not that package was used.
    """
    top = klass.__module__.partition(".")[0]
    bases = [vars(base) for base in klass.__mro__[1:] if base is not object]
    parts = []
    for member, value in sorted(vars(klass).items()):
        func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not isinstance(func, types.FunctionType):
            continue
        own = func.__qualname__ in (f"{klass.__qualname__}.{member}", f"{klass.__qualname__}.{func.__name__}")
        if (func.__module__ or "").partition(".")[0] == top and (own or "." not in func.__qualname__):
            continue  # its package's own (nn.GELU.forward = nn.SiLU.forward is not)
        # a helper of the user's put there, that the user's code keyed so far reads (self.helper(x))
        users = member in encoder.names and not encoder.ignored(path, member)
        users = users and not is_installed_file(func.__code__.co_filename)
        if member == "forward" or any(member in base for base in bases) or users:
            parts.append(text(member) + _class_member(encoder, value, f"{path}.{member}", depth))
            collect(Binding(vars(klass), member, value))  # replaced again later: a new key
    return b"".join(parts)


def _class_member(encoder: Encoder, value: object, path: str, depth: int) -> bytes:
    """A member of a class's ``__dict__``: functions, descriptors by what they call, plain values."""
    if isinstance(value, (staticmethod, classmethod)):
        inner = encoder.child(value.__func__, path, depth)
        return tagged(Tag.DESCRIPTOR, text(type(value).__name__) + inner)
    if isinstance(value, property):
        inner = b"".join(encoder.child(f, path, depth) for f in (value.fget, value.fset, value.fdel))
        return tagged(Tag.DESCRIPTOR, text("property") + inner)
    if isinstance(value, functools.cached_property):
        return tagged(Tag.DESCRIPTOR, text("cached_property") + encoder.child(value.func, path, depth))  # type: ignore[attr-defined]
    if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
        return tagged(Tag.DESCRIPTOR, text(f"{type(value).__name__}:{value.__name__}"))
    return encoder.child(value, path, depth)


def encode_python_module(encoder: Encoder, module: types.ModuleType, path: str, depth: int) -> bytes:
    """A Python module used as a whole: its package's version, or the members a user module defines.

    A user module's functions and classes (its own and those it imported from the user's
    other modules), its submodules, and its plain values are keyed; names it imported from
    packages and modules it imported are left to whatever reads them.
    """
    name = module.__name__
    origin = origin_of_module(name)
    if origin is not None:
        return tagged(Tag.INSTALLED_MODULE, text(name) + text(origin))
    parts = [text(name)]
    for member, value in sorted(vars(module).items()):
        if member.startswith("__") and member.endswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            if not value.__name__.startswith(name + "."):
                continue  # an imported module: keyed where it is read
        elif (
            isinstance(value, (type, types.FunctionType))
            and getattr(value, "__module__", name) != name
            and not is_users_object(value)  # the user's, imported from another module: keyed (getattr(mod, name))
        ):
            continue  # imported from a package: keyed where it is read, by version
        if encoder.ignored(path, member):
            continue
        parts.append(text(member) + encoder.child(value, f"{path}.{member}", depth))
        collect(Binding(vars(module), member, value))  # rebound later: the key is taken again
    return tagged(Tag.PYTHON_MODULE, b"".join(parts))


def encode_builtin(encoder: Encoder, value: Any, path: str, depth: int) -> bytes:
    """A function or method written in C (``torch.relu``, ``np.add``), with the object it is bound to."""
    note_mode_read(value)  # from torch import is_inference_mode_enabled
    owner = getattr(value, "__self__", None)
    bound = (
        b""
        if owner is None or isinstance(owner, (types.ModuleType, type))
        else encoder.child(owner, f"{path}.__self__", depth)
    )
    module = getattr(value, "__module__", None) or getattr(owner, "__name__", None) or ""
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", "")
    origin = origin_of_module(module) if isinstance(module, str) and module else None
    origin = origin or (extension_digest(module) if isinstance(module, str) else None)  # a user's: by its file
    return tagged(Tag.BUILTIN_FUNCTION, text(f"{module}.{qualname}") + text(origin or "") + bound)
