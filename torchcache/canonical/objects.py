"""Objects for a key: tensors, arrays, paths, and any object by its class and the state pickle would save.

Nothing is unpickled: :func:`encode_state` asks an object for the state that
:meth:`object.__reduce_ex__` gives, and hashes it. An object with a
``__torchcache_key__()`` method is keyed by what it returns; a configuration object by
its ``to_dict()``.
"""

from __future__ import annotations

import contextlib
import copyreg
import os
import struct
from collections.abc import Collection, Iterable, Mapping
from pathlib import PurePath
from stat import S_ISDIR
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import xxhash

from ..dtypes import channels_last_format, standard_strides
from ..errors import KeyingError
from ..output_types import LIBRARY_FLAGS
from .notes import FOUND as _found
from .tags import Tag, raw, tagged, text

if TYPE_CHECKING:
    from .values import KeyEncoder as Encoder

__all__ = [
    "CONFIG_UNKEYED",
    "Binding",
    "collect",
    "collecting",
    "encode_array",
    "encode_fields",
    "encode_set",
    "encode_path",
    "encode_plain",
    "encode_state",
    "encode_tensor",
    "extra_state",
    "slot_values",
    "tensor_content_digest",
]

#: Keys of a configuration's ``to_dict()`` that say where it was loaded from, not what it computes.
CONFIG_UNKEYED = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})
_pack_double = struct.Struct("<d").pack
_LONG_SET = 256  # sets larger than this are keyed by the sorted digests of their items


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
    flat = standard_strides(data.resolve_conj().resolve_neg().reshape(-1).cpu().contiguous())
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.numel():
        h.update(host_bytes(flat.view(torch.uint8)))
    return h.digest()


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 ``tensor``, read-only; the view keeps the tensor alive.

    Not through ``Tensor.numpy()``, which makes the tensor's storage unresizable for
    good: a module's buffer that its ``forward`` resizes would then fail after a key.
    """
    return memoryview(np.asarray(_Exposed(tensor)))  # type: ignore[arg-type]


class _Exposed:
    """A contiguous CPU uint8 tensor as numpy reads it (``__array_interface__``); an array of it holds it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "version": 3,
            "shape": (tensor.numel(),),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), True),
        }


def _told(entries: dict[str, Any], name: str, value: Any) -> bool:
    """Whether a ``to_dict()`` entry gives the attribute ``name`` as it is (a copy equal to it)."""
    if name not in entries or entries[name] is value:
        return name in entries
    try:
        return type(entries[name]) is type(value) and (entries[name] == value) is True
    except Exception:  # noqa: BLE001 - values that cannot be compared (tensors within) are keyed themselves
        return False


def encode_plain(encoder: Encoder, value: Any, cls_encoding: bytes, path: str, depth: int) -> bytes:
    """An object that is its class and its ``__dict__``."""
    state = sorted(vars(value).items(), key=_by_name)
    return tagged(Tag.OBJECT, cls_encoding + tagged(Tag.TUPLE, b"") + encoder.attributes(state, path, depth))


def _lookup(value: Any, name: str) -> Any:
    """``getattr(value, name, None)``, or ``None`` where ``__getattr__`` raises (``dict.__getitem__``: KeyError)."""
    try:
        return getattr(value, name, None)
    except LookupError:  # an attribute dict's __getattr__ (dict.__getitem__): then its state describes it
        return None


def encode_state(encoder: Encoder, value: Any, cls: type, path: str, depth: int) -> bytes:
    """Objects without a rule: a ``__torchcache_key__()``, a config's entries (and what they omit), or pickle state."""
    own_key = _lookup(value, "__torchcache_key__")
    if callable(own_key):
        named = text(f"{cls.__module__}.{cls.__qualname__}")
        return tagged(Tag.OWN_KEY, named + encoder.child(own_key(), f"{path}.__torchcache_key__()", depth))
    cls_encoding = encoder.child(cls, f"{path}.<class>", depth)
    to_dict = _lookup(value, "to_dict")
    if callable(to_dict) and hasattr(value, "__dict__"):
        try:
            entries = to_dict()
        except Exception:  # noqa: BLE001 - any object may have a to_dict; then pickle's state describes it
            entries = None
        if type(entries) is dict:
            entries = {k: v for k, v in entries.items() if k not in CONFIG_UNKEYED}
            encoded = cls_encoding + encoder.attributes(entries.items(), path, depth)
            # and what it leaves out or describes otherwise (a config's _attn_implementation_internal; a
            # logging-minded to_dict that gives a tensor's shape)
            others = sorted(
                (k, v) for k, v in vars(value).items() if k not in CONFIG_UNKEYED and not _told(entries, k, v)
            )
            return tagged(Tag.CONFIG, encoded + (encoder.attributes(others, path, depth) if others else b""))
    if _is_plain(cls) and isinstance(getattr(value, "__dict__", None), dict):
        encoder.remember_plain(cls, cls_encoding)  # later instances skip the checks above
        return encode_plain(encoder, value, cls_encoding, path, depth)
    try:  # as pickle would describe it: copyreg's reducers first (a compiled re.Pattern by pattern and flags)
        reducer = _REDUCERS.get(cls) or copyreg.dispatch_table.get(cls)
        reduced = reducer(value) if reducer is not None else value.__reduce_ex__(4)
    except Exception as exc:  # noqa: BLE001 - whatever pickle's protocol raises, the value is refused
        if isinstance(value, torch._C.ScriptModule):  # leaving its graph out of the key would be unsafe
            raise KeyingError(
                f"{path}: a TorchScript module's compiled graph cannot be part of the cache key; use the Python "
                "module instead (extract_features and CachedDataset need it), or, with the decorator, wrap the "
                "scripted one in a Python module that calls it and name its key with persistent_module_hash "
                "(changed whenever the scripted file changes)"
            ) from None
        raise encoder.refuse(path, f"a {_qualname(cls)} has no state that can be described ({exc})") from None
    if isinstance(value, torch.ScriptObject):  # quantized packed parameters: no autograd through them, and what
        with _found.block(active=False):  # they unpack is a copy: keyed, neither watched nor frozen
            return _encode_reduced(encoder, value, cls_encoding, reduced, path, depth)
    return _encode_reduced(encoder, value, cls_encoding, reduced, path, depth)


def _encode_reduced(encoder: Encoder, value: Any, cls_encoding: bytes, reduced: Any, path: str, depth: int) -> bytes:
    """An object by what ``__reduce_ex__`` gave: a singleton's name, or its constructor, arguments and state."""
    cls = type(value)
    if isinstance(reduced, str):  # a global singleton, by its name
        named = text(f"{getattr(value, '__module__', '')}.{reduced}")
        wrapped = getattr(value, "__wrapped__", None)  # a functools.lru_cache of a function: by its code too
        return tagged(
            Tag.SINGLETON, named + (b"" if wrapped is None else encoder.child(wrapped, f"{path}.__wrapped__", depth))
        )
    if not isinstance(reduced, tuple) or len(reduced) < 2:
        raise encoder.refuse(path, f"a {_qualname(cls)} describes its state in an unknown way")
    parts = [cls_encoding]
    function, arguments = reduced[0], reduced[1]
    if getattr(function, "__name__", "") == "__newobj__":
        parts.append(encoder.child(tuple(arguments[1:]), f"{path}.__new__()", depth))
    else:
        parts.append(encoder.child(function, f"{path}.__reduce__", depth))
        parts.append(encoder.child(arguments, f"{path}.__reduce__()", depth))
    state = reduced[2] if len(reduced) > 2 else None
    slots: Any = None
    if type(state) is tuple and len(state) == 2 and (state[0] is None or type(state[0]) is dict):
        state, slots = state
    if type(state) is dict:
        parts.append(encoder.attributes(sorted(state.items(), key=_by_name), path, depth))
    elif state is not None:
        parts.append(encoder.child(state, f"{path}.__getstate__()", depth))
    if type(slots) is dict:
        parts.append(tagged(Tag.SLOTS, encoder.items(sorted(slots.items(), key=_by_name), path, depth, True)))
    for extra, name in ((3, "items"), (4, "entries")):
        if len(reduced) > extra and reduced[extra] is not None:
            parts.append(encoder.child(list(reduced[extra]), f"{path}.{name}", depth))
    return tagged(Tag.OBJECT, b"".join(parts))


def collecting() -> contextlib.AbstractContextManager[list[Any]]:
    """Collect the tensors and numpy arrays encoded by content, and modules held as values, in the block (this thread).

    A key covers them as they were; whoever holds the key watches them for in-place writes.
    """
    return _found.block()


def collect(value: object) -> None:
    """Note a tensor or array keyed by content, a module held as a value or a :class:`Binding` (:func:`collecting`)."""
    _found.add(value)


#: How objects that pickle cannot describe are described (a struct.Struct by its format).
_REDUCERS: dict[type, Any] = {struct.Struct: lambda packer: (struct.Struct, (packer.format,))}


class Binding(NamedTuple):
    """A global that a key read: the namespace, the name and the value it was bound to (``SCALE = 2``)."""

    namespace: Mapping[str, Any]  #: a module's globals, or a class's ``__dict__``
    name: str
    value: object


def encode_tensor(encoder: Encoder, value: torch.Tensor, path: str, depth: int) -> bytes:
    """A tensor held as a value: its type, a digest of its content, a channels-last layout and its attributes."""
    if not encoder.tensors:
        raise KeyingError(
            f"{path}: tensors are only supported as top-level arguments shaped (batch, ...) or inside "
            "tuples, lists and dicts, not inside other objects; pass the tensor as an argument"
        )
    if value.device.type == "meta":
        raise encoder.refuse(path, "a tensor on the meta device has no content to key by")
    collect(value)
    head = text(_qualname(type(value))) + raw(tensor_content_digest(value, path))
    if value.layout == torch.strided and channels_last_format(value) is not None:
        head += text("channels_last")
    attributes = {k: v for k, v in vars(value).items() if k not in LIBRARY_FLAGS}  # mask.scale = 2
    return tagged(
        Tag.TENSOR, head + (encoder.child(dict(attributes), f"{path}.__dict__", depth) if attributes else b"")
    )


def encode_array(encoder: Encoder, array: np.ndarray[Any, Any], path: str, depth: int) -> bytes:
    """An array by its type, dtype, shape and content (a memory-mapped file, for datasets, by its file)."""
    head = text(f"{type(array).__name__}|{array.dtype.descr!r}|{array.shape}")
    if array.dtype.hasobject:
        return tagged(Tag.ARRAY, head + encoder.child(array.tolist(), path, depth))
    view = _place_in_mapping(array) if encoder.files and isinstance(array, np.memmap) else None
    if isinstance(array, np.memmap) and view is not None:
        # A memory-mapped file by name, place, size and modification time (and where in the
        # mapping this view starts, with its strides): its content stays unread. A file
        # removed (or renamed) since it was mapped is keyed by the content it still maps.
        filename = os.fspath(array.filename)  # type: ignore[arg-type]
        with contextlib.suppress(OSError):
            stat = os.stat(filename)
            where = f"{filename}|{array.offset}|{stat.st_size}|{stat.st_mtime_ns}|{view}"
            return tagged(Tag.MEMMAP, head + text(where))
    collect(array)
    h = xxhash.xxh3_128()
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    if isinstance(array, np.ma.MaskedArray):  # which values are masked, and what fills them
        h.update(np.ascontiguousarray(np.ma.getmaskarray(array)).view(np.uint8).data)
        h.update(repr(array.fill_value).encode())
    return tagged(Tag.ARRAY, head + raw(h.digest()))


def _place_in_mapping(array: np.memmap[Any, Any]) -> str | None:
    """Where a memmap view starts in its file's mapping, and its strides (``None``: not a view of a file)."""
    mapping = getattr(array, "_mmap", None)
    if not isinstance(array.filename, (str, os.PathLike)) or mapping is None or array.size == 0:
        return None
    try:
        base = np.frombuffer(mapping, np.uint8).ctypes.data
    except (TypeError, ValueError):  # a closed mapping
        return None
    return f"{array.ctypes.data - base}|{array.strides}"


#: Entries (files and folders) of the directories one dataset key may walk: more are refused.
DIRECTORY_ENTRIES = 20_000
_META = "torchcache.json"  # in each cache's folder (torchcache.meta.META_NAME)


def encode_path(encoder: Encoder, value: PurePath, path: str) -> bytes:
    """A path by its text; for datasets, with its file's size and modification time, a directory's of every file.

    Raises:
        KeyingError: If directories of more than :data:`DIRECTORY_ENTRIES` entries in all are to be walked.
    """
    where = f"{type(value).__name__}|{value}"
    if not encoder.files:
        return tagged(Tag.PATH, text(where))
    target = os.fspath(value)
    try:
        stat = os.stat(target)
    except OSError:  # "~/x" or "$DATA/x": the file a dataset reads once it expands them
        target = os.path.expandvars(os.path.expanduser(target))
        try:
            stat = os.stat(target)
        except OSError:
            return tagged(Tag.PATH, text(where + "|missing"))
    if not S_ISDIR(stat.st_mode):
        return tagged(Tag.PATH, text(where + f"|{stat.st_size}|{stat.st_mtime_ns}"))
    # A file rewritten in place changes neither the directory's size nor its time: its own do.
    # Folders of torchcache's own caches are left out (their files change as they are used).
    entries: list[str] = []
    seen: set[tuple[int, int]] = set()  # folders linked in are followed, each once
    walk = os.walk(target, onerror=lambda exc: entries.append(f"|unreadable {exc.errno}"), followlinks=True)
    for folder, dirs, files in walk:
        st = os.stat(folder)
        if (_META in files and folder != target) or (st.st_dev, st.st_ino) in seen:
            dirs.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()
        if not dirs and not files and folder != target:  # an empty folder too (a class with no images yet)
            entries.append(f"|{os.path.relpath(folder, target)}/")
        encoder.walked += len(dirs) + len(files)
        if encoder.walked > DIRECTORY_ENTRIES:
            raise encoder.refuse(
                path,
                f"the directory {str(value)[:200]!r} (with the others of this key) holds more than "
                f"{DIRECTORY_ENTRIES:,} files and folders: too many to key each by its size and modification "
                "time, and its own entry does not change when a file in it is rewritten",
            )
        for name in sorted(files):
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                entries.append(f"|{os.path.relpath(folder, target)}/{name}|missing")
            else:
                entries.append(f"|{os.path.relpath(folder, target)}/{name}|{st.st_size}|{st.st_mtime_ns}")
    return tagged(Tag.PATH, text(where + "|dir" + "".join(entries)))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _by_name(item: tuple[Any, Any]) -> str:
    return str(item[0])


def encode_set(encoder: Encoder, value: Collection[Any], is_set: bool, path: str, depth: int) -> bytes:
    """A set by its items' encodings in sorted order (a long one by their sorted digests)."""
    encoded = (encoder.child(v, f"{path}{{...}}", depth) for v in value)
    if len(value) <= _LONG_SET:
        payload = b"".join(sorted(encoded))
    else:
        digests = np.frombuffer(b"".join(map(xxhash.xxh3_128_digest, encoded)), dtype="V16")
        payload = f"{len(value)}|".encode() + xxhash.xxh3_128_digest(np.sort(digests).tobytes())
    return tagged(Tag.SET if is_set else Tag.FROZENSET, payload)


def encode_fields(
    encoder: Encoder, fields: list[tuple[str, Any]], extra: list[tuple[str, Any]], path: str, depth: int
) -> bytes:
    """A record's fields, then the attributes it holds outside them (``cfg.scale = 3.0``).

    Where a configuration was loaded from (``_name_or_path``) is left out, as it is of a
    configuration's ``to_dict()``.
    """
    fields = [(k, v) for k, v in fields if k not in CONFIG_UNKEYED]
    extra = [(k, v) for k, v in extra if k not in CONFIG_UNKEYED]
    encoded = encoder.attributes(fields, path, depth)
    return encoded + (encoder.attributes(extra, path, depth) if extra else b"")


def slot_values(obj: object) -> list[tuple[str, Any]]:
    """The ``__slots__`` attributes an object has set, by name, in the order of its classes."""
    found = []
    for klass in type(obj).__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            private = name.startswith("__") and not name.endswith("__")
            attribute = f"_{klass.__name__.lstrip('_')}{name}" if private else name
            try:
                found.append((attribute, object.__getattribute__(obj, attribute)))
            except AttributeError:
                continue
    return found


def extra_state(value: object, fields: Iterable[str]) -> list[tuple[str, Any]]:
    """What an instance of a record class holds outside its fields: ``__dict__`` entries and slots."""
    names = set(fields)
    state = getattr(value, "__dict__", None)
    extra = [(k, v) for k, v in sorted(state.items()) if k not in names] if isinstance(state, dict) else []
    extra += [(k, v) for k, v in slot_values(value) if k not in names]
    return extra


_OBJECT_PROTOCOL = [getattr(object, name, None) for name in ("__reduce_ex__", "__reduce__", "__getstate__", "__new__")]


def _is_plain(cls: type) -> bool:
    """Whether an instance is described by its class and its ``__dict__`` alone (what pickle would save).

    So it is for a class that neither changes how pickle saves it nor derives from a
    built-in type whose instances hold more than their ``__dict__`` (a dict's items).
    """
    protocol = [getattr(cls, name, None) for name in ("__reduce_ex__", "__reduce__", "__getstate__", "__new__")]
    if protocol != _OBJECT_PROTOCOL:
        return False
    return not (
        hasattr(cls, "__getnewargs__")
        or hasattr(cls, "__getnewargs_ex__")
        or any("__slots__" in vars(klass) for klass in cls.__mro__)
    )
