"""The canonical encoder: every value a key covers becomes exact, typed bytes, or is refused.

One encoder serves every key: a module's init arguments and attributes (and those of
every submodule), a function's defaults and closure, a dataset's fingerprint and the
non-tensor arguments of a call. Two values get equal encodings only when they are
equal *and* of the same type, so ``1``, ``1.0``, ``True`` and ``"1"`` differ, floats
are encoded by their bit pattern (``-0.0`` and NaN payloads stay apart), dicts keep
their order, and tensors and arrays are encoded by their exact content.

What the encoder cannot encode exactly it refuses with a :class:`KeyingError` that
names the path of the value (``ResNet.layer1.0.fn``) and the remedies: leave it out of
the key (``key_ignore``) when it does not change outputs, or give the key yourself
(``__torchcache_key__()``, ``persistent_module_hash``, a dataset's ``version=``). It
never skips a value silently.

Objects the encoder has no rule for are encoded by their class and the state that
:meth:`object.__reduce_ex__` gives, the protocol pickle uses to save them: a plain
object by its ``__dict__`` and ``__slots__``, a ``pathlib.Path`` by its parts, a
``logging.Logger`` by its name. Nothing is unpickled: the state is only hashed.

Length: every type the encoder covers has its branch here, side by side, where a reader
checks that none is missing.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import enum
import functools
import inspect
import linecache
import os
import struct
import sys
import threading
import types
import weakref
from collections.abc import Callable, Collection, Iterable
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
import xxhash

from ._fork import after_fork
from ._gc import collector_paused
from .errors import KeyingError

__all__ = ["KeyEncoder", "MODULE_MANAGED", "class_source", "encode_key_value", "tensor_content_digest"]

#: Attributes of a module left out of its key: those torch itself manages on every
#: ``nn.Module`` (hooks; the registries of weights and submodules, keyed on their own),
#: ``training`` (part of every call's key), where weights were loaded from
#: (``name_or_path``: the weights themselves are keyed) and torchcache's own.
MODULE_MANAGED = frozenset(vars(torch.nn.Module())) | {
    "_compiled_call_impl",
    "training",
    "name_or_path",
    "cache_instance",
    "_torchcache_binding",
}
#: Keys of a configuration's ``to_dict()`` that say where it was loaded from, not what it computes.
CONFIG_UNKEYED = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})
_MAX_DEPTH = 100
_MAX_NODES = 20_000_000
_LONG = 256  # sequences longer than this are encoded as their length and a digest of their items
_pack_double = struct.Struct("<d").pack
_source_lock = threading.Lock()
_FUNCTION_TYPES = (
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    np.ufunc,
)


def _new_source_lock_after_fork() -> None:
    global _source_lock
    _source_lock = threading.Lock()


after_fork(_new_source_lock_after_fork)  # another thread may have held it at fork


def class_source(obj: Callable[..., Any] | type) -> str:
    """The source of a class or function, or ``""`` when it has none (built in, made by ``exec``).

    A class's source is found once per class object: its file is parsed once (not once
    per class, as :func:`inspect.getsource` does), and the class keeps the source it was
    defined from, as its code does, even if the file is edited later.
    """
    # ast is not thread-safe in CPython 3.11 ("AST constructor recursion depth mismatch"
    # when two threads parse at once): every parse happens under the lock.
    with _source_lock:
        if isinstance(obj, type):
            cached = _class_sources.get(obj)
            if cached is None:
                cached = _class_sources[obj] = _find_class_source(obj)
            return cached
        try:
            return inspect.getsource(obj)
        except (OSError, TypeError):
            return ""


_class_sources: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_file_classes: dict[tuple[str, int], dict[str, str]] = {}


def _find_class_source(cls: type) -> str:
    """The source of ``cls`` from one parse of its file; :func:`inspect.getsource` where that fails."""
    try:
        filename = inspect.getsourcefile(cls)
        module = sys.modules.get(cls.__module__)
        lines = linecache.getlines(filename, module.__dict__ if module else None) if filename else []
    except (OSError, TypeError):
        return ""
    if lines:
        key = (filename or "", hash(tuple(lines)))
        classes = _file_classes.get(key)
        if classes is None:
            classes = _file_classes[key] = _classes_in(lines)
        found = classes.get(cls.__qualname__)
        if found is not None:
            return found
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _classes_in(lines: list[str]) -> dict[str, str]:
    """The source of every class defined in a file, by qualified name (first definition wins, as in inspect).

    The tree's nodes are freed by reference counting; the collector is paused meanwhile,
    since a full collection that their allocation would set off costs a process with
    torch loaded about 0.1 s, twenty times the parse itself.
    """
    with collector_paused():
        return _classes_of(lines)


def _classes_of(lines: list[str]) -> dict[str, str]:
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return {}
    found: dict[str, str] = {}
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in _statements_in(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                start = min([child.lineno] + [d.lineno for d in child.decorator_list]) - 1
                found.setdefault(name, "".join(lines[start : child.end_lineno]))
                stack.append((child, name + "."))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, f"{prefix}{child.name}.<locals>."))
            else:
                stack.append((child, prefix))
    return found


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _statements_in(node: ast.AST) -> list[ast.AST]:
    """The statements (and ``except``/``case`` clauses) directly in a node's blocks.

    A class is defined by a statement, and statements sit only in these blocks, never in
    an expression: the walk skips expressions, which are most of a file's nodes.
    """
    found: list[ast.AST] = []
    for field in _BLOCKS:
        block = getattr(node, field, None)
        if isinstance(block, list):
            found.extend(block)
    return found


def _tag(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("<Q", len(payload)) + payload


def _qualname(obj: Any) -> str:
    return (
        f"{getattr(obj, '__module__', None) or ''}.{getattr(obj, '__qualname__', None) or getattr(obj, '__name__', '')}"
    )


def tensor_content_digest(tensor: torch.Tensor, path: str) -> bytes:
    """The 16-byte digest of a tensor's dtype, shape, layout and exact content.

    Quantized tensors add their scheme, scales, zero points and axis; sparse tensors are
    coalesced; nested tensors are digested component by component.

    Raises:
        KeyingError: For a tensor without content (on the meta device).
    """
    data = tensor.detach()
    h = xxhash.xxh3_128(f"{data.dtype}|{data.layout}|{data.device.type == 'meta'}".encode())
    if data.device.type == "meta":
        raise KeyingError(f"{path}: a tensor on the meta device has no content to key by")
    if getattr(data, "is_nested", False):
        parts = data.unbind()
        h.update(str(len(parts)).encode())
        for i, part in enumerate(parts):
            h.update(tensor_content_digest(part, f"{path}[{i}]"))
        return h.digest()
    h.update(repr(tuple(data.shape)).encode())
    if data.is_quantized:
        scheme = data.qscheme()
        h.update(str(scheme).encode())
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            h.update(_pack_double(data.q_scale()) + str(data.q_zero_point()).encode())
        else:
            h.update(str(data.q_per_channel_axis()).encode())
            h.update(tensor_content_digest(data.q_per_channel_scales(), path))
            h.update(tensor_content_digest(data.q_per_channel_zero_points(), path))
        data = data.int_repr()
    elif data.layout == torch.sparse_coo:
        data = data.coalesce()
        h.update(tensor_content_digest(data.indices(), path) + tensor_content_digest(data.values(), path))
        return h.digest()
    elif data.layout != torch.strided:
        data = data.to_dense()
    flat = data.resolve_conj().resolve_neg().reshape(-1).cpu().contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]
    return h.digest()


class KeyEncoder:
    """Encodes values for one key, exactly or not at all.

    Length: one method per kind of value, sharing the traversal's state (depth,
    cycle guard, object budget, path for messages), so they stay one class.

    Args:
        remedy: What the refusal message suggests (which ways of giving the key apply);
            ``{name}`` stands for the name of the refused attribute.
        ignore: Attribute names, or dotted attribute paths below the root, to leave out.
        tensors: Encode tensors by content; ``False`` refuses them (call arguments, where
            a tensor is keyed per item and cannot hide inside another object).
        files: Encode ``pathlib`` paths and ``np.memmap`` arrays with the size and
            modification time of their file (dataset fingerprints).
        root: The path of the value being keyed; paths in ``ignore`` are relative to it
            (default: the path of the first value encoded).
    """

    def __init__(
        self,
        remedy: str,
        *,
        ignore: Collection[str] = (),
        tensors: bool = True,
        files: bool = False,
        root: str = "",
    ) -> None:
        self._remedy = remedy
        self._ignore = frozenset(ignore)
        self._tensors = tensors
        self._files = files
        self._active: dict[int, int] = {}
        self._memo: dict[int, bytes] = {}
        self._alive: list[object] = []  # keeps memoized objects alive, so their ids stay theirs
        self._nodes = 0
        self._root = root

    # -- the entry point ------------------------------------------------------------------
    def encode(self, value: object, path: str) -> bytes:
        """Encode ``value``, found at ``path`` (used in error messages and by ``ignore``).

        Raises:
            KeyingError: If the value, or anything inside it, cannot be encoded exactly.
        """
        if not self._root:
            self._root = path
        return self._encode(value, path, 0)

    def refuse(self, path: str, why: str) -> KeyingError:
        """The error for a value at ``path`` that cannot be encoded."""
        name = path.rsplit(".", 1)[-1].split("[", 1)[0].strip("<>()") or path
        return KeyingError(f"{path}: cannot be part of the cache key: {why}. {self._remedy.format(name=name)}")

    def ignored(self, path: str, name: str) -> bool:
        """Whether the attribute ``name`` at ``path`` is declared as not changing outputs."""
        if not self._ignore:
            return False
        full = f"{path}.{name}"
        relative = full[len(self._root) + 1 :] if full.startswith(self._root + ".") else full
        return name in self._ignore or relative in self._ignore

    # -- dispatch ---------------------------------------------------------------------------
    def _encode(self, value: object, path: str, depth: int) -> bytes:
        cls = type(value)
        scalar = _SCALARS.get(cls)
        if scalar is not None:
            return scalar(value)
        self._nodes += 1
        if self._nodes > _MAX_NODES:
            raise self.refuse(path, f"the value holds more than {_MAX_NODES:,} objects")
        if depth > _MAX_DEPTH:
            raise self.refuse(path, f"the value nests more than {_MAX_DEPTH} levels deep")
        ident = id(value)
        if cls is tuple or cls is list:  # the bulk of large values: no memo, a cycle check only
            if ident in self._active:
                return _tag(b"@", str(depth - self._active[ident]).encode())
            self._active[ident] = depth
            try:
                return self._encode_sequence(value, b"t" if cls is tuple else b"l", path, depth + 1)  # type: ignore[arg-type]
            finally:
                del self._active[ident]
        memo = self._memo.get(ident)
        if memo is not None:
            return memo
        if ident in self._active:  # a cycle: name the object it leads back to by its depth
            return _tag(b"@", str(depth - self._active[ident]).encode())
        self._active[ident] = depth
        try:
            encoded = self._encode_object(value, cls, path, depth)
        finally:
            del self._active[ident]
        self._memo[ident] = encoded
        self._alive.append(value)
        return encoded

    def _encode_sequence(self, value: list[Any] | tuple[Any, ...], kind: bytes, path: str, depth: int) -> bytes:
        """A tuple or list, item by item; a long one by the digest of its items' encodings (bounded memory)."""
        scalars = _SCALARS.get
        encode = self._encode
        self._nodes += len(value)
        if len(value) <= _LONG:
            parts = []
            for i, item in enumerate(value):
                scalar = scalars(type(item))
                parts.append(scalar(item) if scalar is not None else encode(item, f"{path}[{i}]", depth))
            return _tag(kind, b"".join(parts))
        h = xxhash.xxh3_128()
        for start in range(0, len(value), _CHUNK):
            chunk = value[start : start + _CHUNK]
            if set(map(type, chunk)) == {int}:  # labels and ids: the same bytes, without a Python loop
                few = len(set(chunk)) <= len(chunk) // 8  # labels: each encoded once
                h.update(b"".join(map(functools.lru_cache(maxsize=None)(_int) if few else _int, chunk)))
                continue
            for i, item in enumerate(chunk, start):
                scalar = scalars(type(item))
                h.update(scalar(item) if scalar is not None else encode(item, f"{path}[{i}]", depth))
        return _tag(kind.upper() + b"#", f"{len(value)}|".encode() + h.digest())

    def _encode_object(self, value: Any, cls: type, path: str, depth: int) -> bytes:
        child = depth + 1
        if isinstance(value, enum.Enum):
            return _tag(b"E", _qualname(cls).encode() + self._encode(value.value, f"{path}.value", child))
        if isinstance(value, torch.Tensor):
            if not self._tensors:
                raise KeyingError(
                    f"{path}: tensors are only supported as top-level arguments shaped (batch, ...) or inside "
                    "tuples, lists and dicts, not inside other objects; pass the tensor as an argument"
                )
            if value.device.type == "meta":
                raise self.refuse(path, "a tensor on the meta device has no content to key by")
            return _tag(b"X", _qualname(cls).encode() + tensor_content_digest(value, path))
        if isinstance(value, np.ndarray):
            return self._encode_array(value, path, child)
        if isinstance(value, torch.nn.Module):
            return self._encode_module(value, path, child)
        if cls is torch.Size:
            return _tag(b"Z", repr(tuple(value)).encode())
        if cls is dict or cls is collections.OrderedDict:
            return _tag(b"m" if cls is dict else b"o", self._items(value.items(), path, child))
        if cls is set or cls is frozenset:
            parts = sorted(self._encode(v, f"{path}{{...}}", child) for v in value)
            return _tag(b"S" if cls is set else b"z", b"".join(parts))
        if isinstance(value, tuple) and hasattr(cls, "_fields"):  # a namedtuple
            fields = {name: getattr(value, name) for name in cls._fields}
            return _tag(b"U", _qualname(cls).encode() + self._items(fields.items(), path, child, attributes=True))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
            return _tag(b"W", _qualname(cls).encode() + self._items(fields.items(), path, child, attributes=True))
        if isinstance(value, functools.partial):
            parts = [
                self._encode(value.func, f"{path}.func", child),
                self._encode(list(value.args), f"{path}.args", child),
                self._encode(dict(value.keywords), f"{path}.keywords", child),
            ]
            return _tag(b"P", b"".join(parts))
        if isinstance(value, types.FunctionType):
            return self._encode_function(value, path, child)
        if isinstance(value, types.MethodType):
            func = self._encode(value.__func__, f"{path}.__func__", child)
            return _tag(b"B", func + self._encode(value.__self__, f"{path}.__self__", child))
        if isinstance(value, _FUNCTION_TYPES):
            owner = getattr(value, "__self__", None)
            bound = (
                b""
                if owner is None or isinstance(owner, (types.ModuleType, type))
                else self._encode(owner, f"{path}.__self__", child)
            )
            return _tag(b"C", _qualname(value).encode() + bound)
        if isinstance(value, type):
            return _tag(b"K", f"{_qualname(value)}|{class_source(value)}".encode())
        if isinstance(value, types.ModuleType):
            return _tag(b"Y", value.__name__.encode())
        if isinstance(value, weakref.ref):
            return _tag(b"w", self._encode(value(), f"{path}()", child))
        if isinstance(value, PurePath):
            return self._encode_path(value, path)
        if isinstance(value, (bytearray, memoryview)):
            return _tag(b"y", _qualname(cls).encode() + b"|" + bytes(value))
        if isinstance(value, (range, slice)):
            return _tag(
                b"R", f"{cls.__name__}|".encode() + self._encode((value.start, value.stop, value.step), path, child)
            )
        if isinstance(value, np.generic):
            return _tag(b"g", f"{value.dtype.str}|".encode() + value.tobytes())
        if isinstance(value, np.dtype):
            return _tag(b"D", repr(value).encode())
        pandas = _pandas_digest(value)
        if pandas is not None:
            return _tag(b"H", _qualname(cls).encode() + pandas)
        return self._encode_state(value, cls, path, child)

    # -- containers and objects ---------------------------------------------------------------
    def _items(self, items: Iterable[tuple[Any, Any]], path: str, depth: int, attributes: bool = False) -> bytes:
        parts = []
        for key, item in items:
            if attributes:
                if self.ignored(path, str(key)):
                    continue
                where = f"{path}.{key}"
            else:
                where = f"{path}[{key!r}]"
            parts.append(self._encode(key, f"{path} key", depth) + self._encode(item, where, depth))
        return b"".join(parts)

    def _encode_state(self, value: Any, cls: type, path: str, depth: int) -> bytes:
        """Objects without a rule: a ``__torchcache_key__()``, a configuration's entries, or pickle's state."""
        own_key = getattr(value, "__torchcache_key__", None)
        if callable(own_key) and not isinstance(value, type):
            return _tag(b"J", _qualname(cls).encode() + self._encode(own_key(), f"{path}.__torchcache_key__()", depth))
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict) and hasattr(value, "__dict__"):
            try:
                entries = to_dict()
            except Exception:  # noqa: BLE001 - any object may have a to_dict; then pickle's state describes it
                entries = None
            if type(entries) is dict:
                entries = {k: v for k, v in entries.items() if k not in CONFIG_UNKEYED}
                return _tag(b"Q", _qualname(cls).encode() + self._items(entries.items(), path, depth, attributes=True))
        try:
            reduced = value.__reduce_ex__(4)
        except Exception as exc:  # noqa: BLE001 - whatever pickle's protocol raises, the value is refused
            raise self.refuse(path, f"a {_qualname(cls)} has no state that can be described ({exc})") from None
        if isinstance(reduced, str):  # a global singleton, by its name
            return _tag(b"G", f"{getattr(value, '__module__', '')}.{reduced}".encode())
        if not isinstance(reduced, tuple) or len(reduced) < 2:
            raise self.refuse(path, f"a {_qualname(cls)} describes its state in an unknown way")
        parts = [_qualname(cls).encode()]
        function, arguments = reduced[0], reduced[1]
        if getattr(function, "__name__", "") == "__newobj__":
            parts.append(self._encode(arguments[1:], f"{path}.__new__()", depth))
        else:
            parts.append(self._encode(function, f"{path}.__reduce__", depth))
            parts.append(self._encode(arguments, f"{path}.__reduce__()", depth))
        state = reduced[2] if len(reduced) > 2 else None
        slots: Any = None
        if type(state) is tuple and len(state) == 2 and (state[0] is None or type(state[0]) is dict):
            state, slots = state
        if type(state) is dict:
            parts.append(_tag(b"a", self._items(sorted(state.items(), key=_by_name), path, depth, attributes=True)))
        elif state is not None:
            parts.append(self._encode(state, f"{path}.__getstate__()", depth))
        if type(slots) is dict:
            parts.append(_tag(b"s", self._items(sorted(slots.items(), key=_by_name), path, depth, attributes=True)))
        for extra, name in ((3, "items"), (4, "entries")):
            if len(reduced) > extra and reduced[extra] is not None:
                parts.append(self._encode(list(reduced[extra]), f"{path}.{name}", depth))
        return _tag(b"O", b"".join(parts))

    def _encode_module(self, module: torch.nn.Module, path: str, depth: int) -> bytes:
        """A module held as a value: class, sources, attributes, weights and submodules."""
        parts = [_tag(b"c", f"{_qualname(c)}|{class_source(c)}".encode()) for c in own_classes(type(module))]
        parts.append(self.module_attributes(module, path, depth))
        for name, registry in (("p", module._parameters), ("b", module._buffers)):
            for key, tensor in registry.items():
                if not self.ignored(path, key):
                    digest = b"N" if tensor is None else tensor_content_digest(tensor, f"{path}.{key}")
                    parts.append(_tag(name.encode(), _tag(b"k", key.encode()) + digest))
        for key, sub in module._modules.items():
            parts.append(_tag(b"u", key.encode() + self._encode(sub, f"{path}.{key}", depth)))
        return _tag(b"M", _qualname(type(module)).encode() + b"".join(parts))

    def module_attributes(self, module: torch.nn.Module, path: str, depth: int = 0) -> bytes:
        """The attributes of one module that torch does not manage (its weights and submodules excluded)."""
        own_key = getattr(module, "__torchcache_key__", None)
        if callable(own_key):
            return _tag(b"J", self._encode(own_key(), f"{path}.__torchcache_key__()", depth))
        items = [(k, v) for k, v in sorted(vars(module).items()) if k not in MODULE_MANAGED]
        return _tag(b"A", self._items(items, path, depth, attributes=True))

    def _encode_function(self, fn: types.FunctionType, path: str, depth: int) -> bytes:
        parts = [_tag(b"q", _qualname(fn).encode()), _describe_code(fn.__code__)]
        parts.append(self._encode(fn.__defaults__ or (), f"{path}.__defaults__", depth))
        parts.append(self._encode(fn.__kwdefaults__ or {}, f"{path}.__kwdefaults__", depth))
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                captured = cell.cell_contents
            except ValueError:  # an empty cell
                parts.append(b"e")
                continue
            parts.append(self._encode(captured, f"{path}.<{name}>", depth))
        attributes = {k: v for k, v in sorted(vars(fn).items()) if k not in ("__doc__", "__annotations__")}
        if attributes:
            parts.append(self._items(attributes.items(), path, depth, attributes=True))
        return _tag(b"F", b"".join(parts))

    def _encode_array(self, array: np.ndarray[Any, Any], path: str, depth: int) -> bytes:
        head = f"{type(array).__name__}|{array.dtype.descr!r}|{array.shape}".encode()
        if array.dtype.hasobject:
            return _tag(b"a", head + self._encode(array.tolist(), path, depth))
        if self._files and isinstance(array, np.memmap) and isinstance(array.filename, str):
            # A memory-mapped file by name, place, size and modification time: its content stays unread.
            stat = os.stat(array.filename)
            return _tag(b"m", head + f"|{array.filename}|{array.offset}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        h = xxhash.xxh3_128(head)
        h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        return _tag(b"a", h.digest())

    def _encode_path(self, value: PurePath, path: str) -> bytes:
        text = f"{type(value).__name__}|{value}"
        if self._files:
            try:
                stat = os.stat(value)
            except OSError:
                text += "|missing"
            else:
                text += f"|{stat.st_size}|{stat.st_mtime_ns}"
        return _tag(b"p", text.encode("utf-8", "surrogatepass"))


def _by_name(item: tuple[Any, Any]) -> str:
    return str(item[0])


def _describe_code(code: types.CodeType, depth: int = 0) -> bytes:
    """The compiled body of a function: bytecode, constants (nested code too), names and arguments."""
    parts = [
        _tag(b"b", code.co_code),
        _tag(b"n", repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount)).encode()),
        _tag(b"f", str(code.co_flags).encode()),
    ]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if depth >= _MAX_DEPTH:
                raise KeyingError(f"{code.co_qualname}: functions nest more than {_MAX_DEPTH} levels deep")
            parts.append(_tag(b"k", _describe_code(const, depth + 1)))
        elif type(const) is float:
            parts.append(_tag(b"r", _pack_double(const)))
        else:
            parts.append(_tag(b"c", f"{type(const).__name__}:{const!r}".encode("utf-8", "surrogatepass")))
    return b"".join(parts)


def own_classes(cls: type) -> list[type]:
    """The class and its base classes that are not part of torch or the standard library."""
    return [c for c in cls.__mro__ if c is not object and not c.__module__.startswith(("torch.", "builtins", "typing"))]


def _pandas_digest(value: object) -> bytes | None:
    """A pandas object by every row (``hash_pandas_object``), its index, columns and dtypes; ``None`` otherwise."""
    pandas = sys.modules.get("pandas")
    if pandas is None or not isinstance(value, (pandas.DataFrame, pandas.Series, pandas.Index)):
        return None
    rows = pandas.util.hash_pandas_object(value, index=not isinstance(value, pandas.Index))
    h = xxhash.xxh3_128(np.ascontiguousarray(rows.to_numpy()).view(np.uint8).data)
    if isinstance(value, pandas.DataFrame):
        h.update(repr((list(value.columns), [str(t) for t in value.dtypes])).encode())
    else:
        h.update(repr((value.name, str(value.dtype))).encode())
    return h.digest()


def _float(value: float) -> bytes:
    return b"f" + _pack_double(value)


def _int(value: int) -> bytes:
    return _tag(b"i", str(value).encode())


#: Items of a long sequence encoded per chunk; a chunk of ints alone is encoded in one join.
_CHUNK = 4096


def _complex(value: complex) -> bytes:
    return b"x" + _pack_double(value.real) + _pack_double(value.imag)


_SCALARS: dict[type, Callable[[Any], bytes]] = {
    type(None): lambda value: b"N",
    bool: lambda value: b"T" if value else b"F",
    int: _int,
    float: _float,
    complex: _complex,
    str: lambda value: _tag(b"s", value.encode("utf-8", "surrogatepass")),
    bytes: lambda value: _tag(b"y", value),
    torch.dtype: lambda value: _tag(b"d", str(value).encode()),
    torch.device: lambda value: _tag(b"v", str(value).encode()),
    torch.memory_format: lambda value: _tag(b"h", str(value).encode()),
    torch.layout: lambda value: _tag(b"L", str(value).encode()),
    torch.qscheme: lambda value: _tag(b"Q", str(value).encode()),
    type(Ellipsis): lambda value: b"...",
    type(NotImplemented): lambda value: b"NI",
}


def encode_key_value(value: object, name: str = "argument") -> bytes:
    """Encode a non-tensor call argument canonically, type included (the per-call fast path).

    Args:
        value: Any value the canonical encoder takes, without tensors inside objects.
        name: The argument's name, for error messages.

    Raises:
        KeyingError: If the value cannot be encoded exactly.
    """
    scalar = _SCALARS.get(type(value))
    if scalar is not None:
        return scalar(value)
    encoder = KeyEncoder(
        "Pass a value torchcache can key (numbers, strings, containers, dataclasses, enums, objects with "
        "plain state), or give the object's class a __torchcache_key__() method",
        tensors=False,
    )
    return encoder.encode(value, name)
