"""Dataset samples <-> bytes, without pickle.

A sample is what a dataset's ``__getitem__`` returns: CPU tensors of any dtype and
shape, numpy arrays and scalars of numbers, ``bool``, ``int``, ``float``, ``complex``,
``str``, ``bytes``, ``None``, and tuples, lists and dicts (``str`` or ``int`` keys) of
these, nested up to :data:`MAX_DEPTH` containers. Each sample carries its own shapes,
so they may vary from sample to sample. Layout of a frame::

    magic "TCSM" | version u8 | 3 reserved bytes | header length u32
    | header (ASCII JSON: the tree, dtypes and shapes) | data (the leaves' bytes)

The header holds no values that vary between samples of one shape (numbers and
strings are in the data, each leaf at the next multiple of 8 bytes), so the samples of
a dataset share a few headers, and the decoder keeps the *plan* it compiled from each
header (validated once: known tags and dtypes, bounded depth, node count and
dimensions). Decoding checks that the data is exactly as long as the plan needs, copies
it once into a new ``bytearray`` and builds every leaf as a view of that copy: the
tensors it returns never alias the caller's buffer, and a hostile frame raises
:class:`~torchcache.errors.CorruptEntryError`, never allocates more than it holds.
Integrity (checksums) is the store's job.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from ..errors import CorruptEntryError, KeyingError

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "SampleTypeError",
    "check_sample",
    "decode_rows",
    "decode_sample",
    "decode_samples",
    "encode_sample",
    "frame_head",
]

#: Containers nested deeper than this are refused (encoding) or rejected (decoding).
MAX_DEPTH = 32
#: At most this many values (leaves and containers) in one sample.
MAX_NODES = 100_000
_MAX_HEADER = 1 << 22
_MAX_DIMS = 32
_MAX_ELEMENT_BYTES = 1 << 62
_MAGIC = b"TCSM"
_VERSION = 1
_PREFIX = struct.Struct("<4sBxxxI")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_ALIGN = 8
_PLAN_CACHE_SIZE = 1024
_INT64 = (-(2**63), 2**63 - 1)

_TORCH_NAMES = (
    *("float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128"),
    *("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"),
    *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"),
)
#: Tensor dtypes that can be cached, by name. Decoding only looks names up here.
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _TORCH_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_TORCH_NAME = {dt: name for name, dt in TORCH_DTYPES.items()}
# Built with numpy (faster); the others (bfloat16, float8...) with torch.frombuffer.
# Names numpy has as dtypes (``hasattr(np, "bool")`` would warn under numpy 1.x).
_NUMPY_NAMES = frozenset(("float64", "float32", "float16", "complex64", "complex128", "bool"))
_NUMPY_OF: dict[torch.dtype, np.dtype[Any]] = {
    TORCH_DTYPES[name]: np.dtype(name)
    for name in TORCH_DTYPES
    if name in _NUMPY_NAMES or name.startswith(("int", "uint"))
}
#: Numpy dtypes that can be cached, by ``dtype.str`` (both byte orders).
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    dt.str: dt
    for code in "?bBhHiIlLqQefdFD"
    for dt in (np.dtype(code).newbyteorder("<"), np.dtype(code).newbyteorder(">"))
}

_HINT = (
    "a cached sample holds CPU tensors, numpy arrays and scalars of numbers, bool, int, float, complex, str, "
    "bytes, None, and tuples, lists and dicts (str or int keys) of these; convert it in __getitem__, or produce "
    "it in transform= (applied after the cache)"
)


class SampleTypeError(KeyingError):
    """A sample holds a value that cannot be cached (the message names it and its path)."""


def _refuse(value: object, path: str) -> SampleTypeError:
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__qualname__
    if cls.__module__.startswith("PIL."):
        hint = "convert PIL images with torchvision.transforms.functional.pil_to_tensor or numpy.asarray"
    elif isinstance(value, tuple) or hasattr(value, "__dataclass_fields__"):
        hint = "convert it to a plain tuple or dict (namedtuple._asdict(), dataclasses.asdict())"
    elif isinstance(value, (int, float, str, dict, list)):
        hint = "convert it to the plain builtin type (int(x), float(x), str(x), dict(x), list(x))"
    else:
        hint = _HINT
    return SampleTypeError(f"{path}: cannot cache a value of type {name}; {hint}")


# -- encoding ---------------------------------------------------------------------
class _Encoder:
    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self.size = 0
        self.nodes = 0

    def put(self, data: bytes | memoryview) -> None:
        pad = -self.size % _ALIGN
        if pad:
            self.chunks.append(b"\0" * pad)
        self.chunks.append(data)
        self.size += pad + len(data)

    def node(self, value: object, path: str, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SampleTypeError(f"{path}: a sample holds more than {MAX_NODES} values; cache fewer, larger arrays")
        cls = type(value)
        if value is None or cls is bool:
            return value
        if cls is int:
            if _INT64[0] <= value <= _INT64[1]:  # type: ignore[operator]
                self.put(_I64.pack(value))
                return "i"
            return ["I", value]
        if cls is float:
            self.put(_F64.pack(value))
            return "f"
        if cls is complex:
            self.put(_C128.pack(value.real, value.imag))  # type: ignore[attr-defined]
            return "c"
        if cls is str:
            data = value.encode("utf-8", "surrogatepass")  # type: ignore[attr-defined]
            self.put(data)
            return ["s", len(data)]
        if cls is bytes:
            self.put(value)  # type: ignore[arg-type]
            return ["b", len(value)]  # type: ignore[arg-type]
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, np.ndarray) and cls is np.ndarray:
            return ["a", self.array(value, path), list(value.shape)]
        if isinstance(value, np.generic) and value.dtype.str in NUMPY_DTYPES:
            self.put(np.asarray(value).tobytes())
            return ["n", value.dtype.str]
        if cls in (tuple, list, dict) and depth >= MAX_DEPTH:
            raise SampleTypeError(f"{path}: the sample nests containers more than {MAX_DEPTH} deep")
        if cls is tuple or cls is list:
            seq: list[object] | tuple[object, ...] = value  # type: ignore[assignment]
            return ["u" if cls is tuple else "l", [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(seq)]]
        if cls is dict:
            mapping: dict[object, object] = value  # type: ignore[assignment]
            for key in mapping:
                if type(key) is not str and type(key) is not int:
                    raise SampleTypeError(f"{path}: dict keys must be str or int to be cached, got {key!r}")
            values = [self.node(v, f"{path}[{k!r}]", depth + 1) for k, v in mapping.items()]
            return ["d", list(mapping), values]
        raise _refuse(value, path)

    def tensor(self, value: torch.Tensor, path: str) -> Any:
        if value.device.type != "cpu":
            raise SampleTypeError(
                f"{path}: a tensor on {value.device}; a cached sample holds CPU tensors: return CPU tensors from "
                "__getitem__ and move batches to the device in the training loop (DataLoader(pin_memory=True) helps)"
            )
        if value.layout != torch.strided:
            raise SampleTypeError(f"{path}: a {value.layout} tensor cannot be cached; convert it with .to_dense()")
        name = _TORCH_NAME.get(value.dtype)
        if name is None:
            raise SampleTypeError(f"{path}: tensors of dtype {value.dtype} cannot be cached; convert with .to(...)")
        flat = value.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        self.put(flat.view(torch.uint8).numpy().data)
        return ["t", name, list(value.shape)]

    def array(self, value: np.ndarray[Any, Any], path: str) -> str:
        if value.dtype.str not in NUMPY_DTYPES:
            raise SampleTypeError(
                f"{path}: numpy arrays of dtype {value.dtype} cannot be cached (numbers and bool only); "
                "convert object or string arrays to a list or tensor"
            )
        self.put(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        return str(value.dtype.str)


_PLAIN_ITEMS = 16
_plain_headers: dict[tuple[Any, ...], bytes] = {}


def _plain_items(sample: object) -> Sequence[object] | None:
    """The values of a plain sample (see :func:`_plain_frame`); ``None`` for any other sample.

    Only types and flags are looked at: about 0.6 us for an ``(image, label)`` pair.
    """
    cls = type(sample)
    items: Sequence[object]
    if cls is torch.Tensor:
        items = (sample,)
    elif (cls is tuple or cls is list) and len(sample) <= _PLAIN_ITEMS:  # type: ignore[arg-type]
        items = sample  # type: ignore[assignment]
    else:
        return None
    for value in items:
        kind = type(value)
        if kind is torch.Tensor:
            tensor: torch.Tensor = value  # type: ignore[assignment]
            if not (
                tensor.is_cpu  # tensor.device.type costs 0.6 us, this 0.1
                and tensor.layout == torch.strided
                and tensor.dtype in _TORCH_NAME
                and tensor.is_contiguous()
                and not tensor.is_conj()
                and not tensor.is_neg()
            ):
                return None
        elif kind is int:
            if not _INT64[0] <= value <= _INT64[1]:  # type: ignore[operator]
                return None
        elif kind is not float:
            return None
    return items


def _plain_frame(sample: object) -> bytes | None:
    """The frame of the most common samples, built without walking a tree; ``None`` for the others.

    A plain sample is one contiguous CPU tensor, or a tuple or list of at most
    :data:`_PLAIN_ITEMS` such tensors, ``int`` (within int64) and ``float`` values, as a
    dataset of ``(image, label)`` returns. Its prefix and header depend only on its
    structure, dtypes and shapes, so they are taken from the first frame of each
    structure that :func:`_encode_tree` makes; the frame is the one it would make (its
    leaves at multiples of 8 bytes).
    """
    items = _plain_items(sample)
    if items is None:
        return None
    signature: list[object] = [type(sample)]
    chunks: list[bytes | memoryview | ctypes.Array[ctypes.c_ubyte]] = []
    size = 0
    for value in items:
        data: bytes | memoryview | ctypes.Array[ctypes.c_ubyte]
        if type(value) is torch.Tensor:
            tensor: torch.Tensor = value  # type: ignore[assignment]
            data = _bytes_in_place(tensor)
            signature.append((tensor.dtype, tensor.shape))
        elif type(value) is int:
            data = _I64.pack(value)
            signature.append(int)
        else:
            data = _F64.pack(value)  # type: ignore[arg-type]
            signature.append(float)
        pad = -size % _ALIGN
        if pad:
            chunks.append(b"\0" * pad)
        chunks.append(data)
        size += pad + len(data)
    key = tuple(signature)
    head = _plain_headers.get(key)
    if head is None:  # a new structure: the general encoder makes its frame, and its header is kept
        frame = _encode_tree(sample, "sample")
        if len(_plain_headers) >= _PLAN_CACHE_SIZE:
            _plain_headers.clear()
        _plain_headers[key] = frame[: _PREFIX.size + _PREFIX.unpack_from(frame)[2]]
        return frame
    return b"".join([head, *chunks])


def _bytes_in_place(tensor: torch.Tensor) -> ctypes.Array[ctypes.c_ubyte]:
    """The bytes of a contiguous CPU tensor, read where they lie (no copy).

    About 1 us, where ``tensor.detach().reshape(-1).view(torch.uint8).numpy()`` takes
    about 6. The view does not keep the tensor alive: it is used only while the tensor
    is (the sample holds it until its frame is joined).
    """
    return (ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())


def encode_sample(sample: object, name: str = "sample") -> bytes:
    """Encode a sample into a frame.

    Args:
        sample: What a dataset's ``__getitem__`` returned.
        name: The name of the sample in error messages (``sample[1]['label']``).

    Returns:
        The frame.

    Raises:
        SampleTypeError: If the sample holds a value that cannot be cached (the message
            names its type and its path, and says how to convert it).

    Example:
        >>> frame = encode_sample((torch.arange(3), {"label": 7}))
        >>> decode_sample(frame)
        (tensor([0, 1, 2]), {'label': 7})
    """
    frame = _plain_frame(sample)
    return frame if frame is not None else _encode_tree(sample, name)


def check_sample(sample: object, name: str = "sample") -> None:
    """Check that a sample can be cached, as :func:`encode_sample` would, without keeping a frame.

    For a plain sample (a tensor, or a short tuple or list of tensors and numbers) this
    only looks at types, about a microsecond; any other sample is encoded.

    Raises:
        SampleTypeError: As :func:`encode_sample`.
    """
    if _plain_items(sample) is None:
        _encode_tree(sample, name)


def _encode_tree(sample: object, name: str) -> bytes:
    """:func:`encode_sample` for any sample, by walking its structure."""
    encoder = _Encoder()
    tree = encoder.node(sample, name, 0)
    header = json.dumps(tree, separators=(",", ":")).encode("ascii")
    if len(header) > _MAX_HEADER:
        raise SampleTypeError(f"{name}: the sample's structure is too large to cache ({len(header)} bytes)")
    return b"".join([_PREFIX.pack(_MAGIC, _VERSION, len(header)), header, *encoder.chunks])


# -- decoding ---------------------------------------------------------------------
# A builder takes its parameters, then the data buffer, where this sample's data starts
# in it, and the tensors and arrays already made for this sample (its leaves, in order).
#: The buffer samples are views of: a ``bytearray``, or a ``memoryview`` of uninitialised
#: memory (``SlotStore.read`` fills one without zeroing it first).
Buffer = bytearray | memoryview
Build = Callable[[Buffer, int, list[Any]], Any]
_Leaf = tuple[str, Any, int, int, tuple[int, ...]]  # kind, dtype, element count, offset, shape
_STRIDE_ALIGN = 16  # samples of a batch start this far apart: a multiple of every item size


class _Plan:
    """What a header describes: the data size it needs, and how to build samples from it."""

    def __init__(self, tree: object) -> None:
        self.size = 0
        self.nodes = 0
        self.leaves: list[_Leaf] = []
        self.build = self.compile(tree, 0)
        #: "leaf", "tuple" or "list" when the sample is its leaves alone, in order: then a
        #: batch of samples is made by zipping the leaves' values.
        self.flat = _flat(self.build, len(self.leaves))

    def take(self, nbytes: int) -> int:
        offset = self.size + (-self.size % _ALIGN)
        self.size = offset + nbytes
        return offset

    def compile(self, node: object, depth: int) -> Build:
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise ValueError("too many values or nested too deeply")
        if node is None or node is True or node is False:
            return partial(_constant, node)
        if isinstance(node, str) and node in _NUMBERS:
            form = _NUMBERS[node]
            return self.leaf((node, form, 1, self.take(form.size), ()))
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise ValueError(f"unknown node {str(node)[:40]}")
        tag, args = node[0], node[1:]
        if tag == "I" and len(args) == 1 and type(args[0]) is int:
            return partial(_constant, args[0])
        if tag in ("s", "b") and len(args) == 1 and _count(args[0]):
            return partial(_bytes if tag == "b" else _str, self.take(args[0]), args[0])
        if tag == "t" and len(args) == 2 and isinstance(args[0], str) and args[0] in TORCH_DTYPES:
            return self.tensor(TORCH_DTYPES[args[0]], _shape(args[1], TORCH_DTYPES[args[0]].itemsize))
        if tag == "a" and len(args) == 2 and isinstance(args[0], str) and args[0] in NUMPY_DTYPES:
            return self.array(NUMPY_DTYPES[args[0]], _shape(args[1], NUMPY_DTYPES[args[0]].itemsize))
        if tag == "n" and len(args) == 1 and isinstance(args[0], str) and args[0] in NUMPY_DTYPES:
            dtype = NUMPY_DTYPES[args[0]]
            return partial(_numpy_scalar, dtype, self.take(dtype.itemsize))
        if tag in ("l", "u") and len(args) == 1 and isinstance(args[0], list):
            parts = [self.compile(child, depth + 1) for child in args[0]]
            return partial(_tuple if tag == "u" else _list, parts)
        if tag == "d" and len(args) == 2 and isinstance(args[0], list) and isinstance(args[1], list):
            keys, children = args
            if len(keys) != len(children) or not all(type(k) is str or type(k) is int for k in keys):
                raise ValueError("malformed dict node")
            return partial(_dict, [(key, self.compile(child, depth + 1)) for key, child in zip(keys, children)])
        raise ValueError(f"unknown node {str(node)[:40]}")

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Build:
        count = _numel(shape)
        at = self.take(count * dtype.itemsize)
        if count == 0:
            return partial(_empty_tensor, dtype, shape)
        npdt = _NUMPY_OF.get(dtype)
        return self.leaf(("n", npdt, count, at, shape) if npdt is not None else ("t", dtype, count, at, shape))

    def array(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Build:
        count = _numel(shape)
        at = self.take(count * dtype.itemsize)
        if count == 0:
            return partial(_empty_array, dtype, shape)
        return self.leaf(("a", dtype, count, at, shape))

    def leaf(self, spec: _Leaf) -> Build:
        self.leaves.append(spec)
        return partial(_leaf, len(self.leaves) - 1)

    def build_many(self, datas: list[memoryview]) -> list[Any]:
        """Build one sample from each data section (each exactly :attr:`size` bytes).

        The sections are copied once, into one buffer: the tensors and arrays of the
        samples are views of it, as a ``TensorDataset``'s samples are views of its
        tensors.
        """
        if len(datas) == 1:
            buf = bytearray(datas[0])
            leaves = [_one_leaf(spec, buf) for spec in self.leaves]
            return [self.build(buf, 0, leaves)]
        buf, stride = _padded(datas, self.size, 0)
        return self.build_rows(buf, 0, len(datas), stride)

    def build_rows(self, buf: Buffer, base: int, n: int, stride: int) -> list[Any]:
        """Build ``n`` samples whose data sections start at ``base``, ``stride`` bytes apart in ``buf``.

        ``base`` and ``stride`` are multiples of 16, so every leaf is aligned.
        """
        per_leaf = [_batch_leaf(spec, buf, n, stride, base) for spec in self.leaves]
        if self.flat == "tuple":
            return list(zip(*per_leaf))
        if self.flat == "list":
            return [list(values) for values in zip(*per_leaf)]
        if self.flat == "leaf":
            return list(per_leaf[0])
        build = self.build
        return [build(buf, base + j * stride, [views[j] for views in per_leaf]) for j in range(n)]


def _padded(chunks: Sequence[bytes | bytearray | memoryview], size: int, lead: int) -> tuple[bytearray, int]:
    """Chunks of ``size`` bytes joined ``stride`` bytes apart (a multiple of 16), the first at ``lead``."""
    stride = size + (-size % _STRIDE_ALIGN)
    pad = bytes(stride - size)
    parts: list[bytes | bytearray | memoryview] = [bytes(lead)]
    for chunk in chunks:
        parts += (chunk, pad)
    return bytearray().join(parts), stride


def _flat(build: Build, leaves: int) -> str | None:
    """What a sample is when it is its leaves alone, in order (see :attr:`_Plan.flat`)."""
    if not isinstance(build, partial) or leaves == 0:
        return None
    if build.func is _leaf:
        return "leaf"
    if build.func in (_tuple, _list):
        parts = build.args[0]
        if len(parts) == leaves and all(
            isinstance(part, partial) and part.func is _leaf and part.args == (k,) for k, part in enumerate(parts)
        ):
            return "tuple" if build.func is _tuple else "list"
    return None


def _one_leaf(spec: _Leaf, buf: Buffer) -> Any:
    """The value of one sample's leaf."""
    kind, dtype, count, at, shape = spec
    if kind in _NUMBERS:
        values = dtype.unpack_from(buf, at)
        return values[0] if len(values) == 1 else complex(*values)
    if kind == "n":
        return torch.from_numpy(np.frombuffer(buf, dtype, count, at).reshape(shape))
    if kind == "t":
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=at).view(shape)
    return np.frombuffer(buf, dtype, count, at).reshape(shape)


def _batch_leaf(spec: _Leaf, buf: Buffer, n: int, stride: int, base: int) -> Sequence[Any]:
    """The values of one leaf for ``n`` samples laid ``stride`` bytes apart in ``buf`` from ``base``."""
    kind, dtype, count, at, shape = spec
    at += base
    if kind in _NUMBERS:  # Python numbers, bit for bit (NaN payloads included)
        values: list[Any] = np.ndarray((n,), _NUMBER_DTYPES[kind], buffer=buf, offset=at, strides=(stride,)).tolist()
        return values
    if kind == "t":  # a dtype numpy lacks: view the bytes, then reinterpret them
        raw = torch.frombuffer(buf, dtype=torch.uint8).as_strided((n, count * dtype.itemsize), (stride, 1), at)
        return raw.view(dtype).view((n, *shape)).unbind(0)
    strides = [dtype.itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    rows = np.ndarray((n, *shape), dtype, buffer=buf, offset=at, strides=(stride, *strides))
    return torch.from_numpy(rows).unbind(0) if kind == "n" else list(rows)


# The builders of a plan: each takes its parameters, then the buffer, this sample's
# start in it and its leaves.
_NUMBERS = {"i": _I64, "f": _F64, "c": _C128}
_NUMBER_DTYPES = {"i": np.dtype("<i8"), "f": np.dtype("<f8"), "c": np.dtype("<c16")}


def _constant(value: object, buf: Buffer, base: int, leaves: list[Any]) -> object:
    return value


def _bytes(at: int, n: int, buf: Buffer, base: int, leaves: list[Any]) -> bytes:
    return bytes(buf[base + at : base + at + n])


def _str(at: int, n: int, buf: Buffer, base: int, leaves: list[Any]) -> str:
    return str(buf[base + at : base + at + n], "utf-8", "surrogatepass")


def _numpy_scalar(dtype: np.dtype[Any], at: int, buf: Buffer, base: int, leaves: list[Any]) -> object:
    return np.frombuffer(buf, dtype, 1, base + at)[0]


def _tuple(parts: list[Build], buf: Buffer, base: int, leaves: list[Any]) -> tuple[Any, ...]:
    return tuple([part(buf, base, leaves) for part in parts])


def _list(parts: list[Build], buf: Buffer, base: int, leaves: list[Any]) -> list[Any]:
    return [part(buf, base, leaves) for part in parts]


def _dict(pairs: list[tuple[str | int, Build]], buf: Buffer, base: int, leaves: list[Any]) -> dict[str | int, Any]:
    return {key: part(buf, base, leaves) for key, part in pairs}


def _empty_tensor(
    dtype: torch.dtype, shape: tuple[int, ...], buf: Buffer, base: int, leaves: list[Any]
) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _empty_array(
    dtype: np.dtype[Any], shape: tuple[int, ...], buf: Buffer, base: int, leaves: list[Any]
) -> np.ndarray[Any, Any]:
    return np.empty(shape, dtype)


def _leaf(k: int, buf: Buffer, base: int, leaves: list[Any]) -> Any:
    return leaves[k]


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= _MAX_ELEMENT_BYTES


def _shape(value: object, itemsize: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS or not all(_count(d) for d in value):
        raise ValueError(f"invalid shape {str(value)[:40]}")
    bound = itemsize
    for dim in value:
        bound *= max(dim, 1)
        if bound > _MAX_ELEMENT_BYTES:
            raise ValueError(f"shape {str(value)[:40]} is too large")
    return tuple(value)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


_plans: dict[bytes, _Plan] = {}


def _plan(header: bytes) -> _Plan:
    plan = _plans.get(header)
    if plan is None:
        if len(_plans) >= _PLAN_CACHE_SIZE:
            _plans.clear()
        try:
            plan = _Plan(json.loads(header))
        except (ValueError, RecursionError) as exc:
            raise CorruptEntryError(f"invalid sample header: {str(exc)[:200]}") from None
        _plans[header] = plan
    return plan


def _split(frame: bytes | bytearray | memoryview) -> tuple[_Plan, memoryview]:
    """The plan of a sample frame and its data section.

    Raises:
        CorruptEntryError: If the frame is not a valid sample frame.
    """
    view = memoryview(frame)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptEntryError(f"a sample frame of {len(view)} bytes is too short")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptEntryError(f"not a sample frame of version {_VERSION} (magic {bytes(magic)!r}, version {version})")
    start = _PREFIX.size + header_len
    if header_len > _MAX_HEADER or start > len(view):
        raise CorruptEntryError(f"a sample header of {header_len} bytes does not fit the frame")
    plan = _plan(bytes(view[_PREFIX.size : start]))
    if len(view) - start != plan.size:
        raise CorruptEntryError(f"a sample frame holds {len(view) - start} data bytes, its header needs {plan.size}")
    return plan, view[start:]


_DECODE_ERRORS = (ValueError, TypeError, RuntimeError, UnicodeDecodeError)


def decode_sample(frame: bytes | bytearray | memoryview) -> Any:
    """Decode a frame made by :func:`encode_sample`.

    The data is copied once; the tensors and arrays returned are writable views of that
    copy, never of ``frame``.

    Args:
        frame: The frame.

    Returns:
        The sample.

    Raises:
        CorruptEntryError: If the frame is not a valid sample frame.
    """
    return _build_one(*_split(frame))


def _build_one(plan: _Plan, data: memoryview) -> Any:
    """The sample of one data section.

    Raises:
        CorruptEntryError: If the data does not build (a string that is not UTF-8).
    """
    try:
        return plan.build_many([data])[0]
    except _DECODE_ERRORS as exc:
        raise CorruptEntryError(f"cannot decode a sample: {str(exc)[:200]}") from None


def decode_samples(frames: Sequence[bytes | bytearray | memoryview]) -> list[Any]:
    """Decode many frames made by :func:`encode_sample`; what :func:`decode_sample` gives for each.

    Frames of one structure are copied into one buffer, and their tensors and arrays are
    made as one strided view, then split: the samples' tensors and arrays are writable
    views of that buffer (as a ``TensorDataset``'s samples are views of its tensors),
    never of ``frames``.

    Args:
        frames: The frames.

    Returns:
        For each frame its sample, or the :class:`~torchcache.errors.CorruptEntryError`
        that :func:`decode_sample` would raise for it (returned, not raised).
    """
    out: list[Any] = [None] * len(frames)
    rest = _decode_alike(frames, out) if len(frames) > 1 else range(len(frames))
    groups: dict[int, tuple[_Plan, list[int], list[memoryview]]] = {}
    for j in rest:
        try:
            plan, data = _split(frames[j])
        except CorruptEntryError as exc:
            out[j] = exc
            continue
        group = groups.get(id(plan))
        if group is None:
            group = groups[id(plan)] = (plan, [], [])
        group[1].append(j)
        group[2].append(data)
    for plan, members, datas in groups.values():
        try:
            built = plan.build_many(datas)
        except _DECODE_ERRORS:  # one bad sample (a string that is not UTF-8): one by one
            built = []
            for data in datas:
                try:
                    built.append(_build_one(plan, data))
                except CorruptEntryError as exc:
                    built.append(exc)
        for j, sample in zip(members, built):
            out[j] = sample
    return out


def _decode_alike(frames: Sequence[bytes | bytearray | memoryview], out: list[Any]) -> Sequence[int]:
    """Decode into ``out`` the frames that are byte for byte the first one's length, prefix and header.

    The common case, a batch of samples of one structure, costs one join and one
    vectorized comparison of the headers, with no work per frame in Python.

    Returns:
        The positions of the frames left for the general path (all of them when any
        frame of that length differs in its header, or a sample fails to build).
    """
    everything = range(len(frames))
    if not _flat_bytes(frames[0]):
        return everything
    first = memoryview(frames[0])
    try:
        plan, data = _split(first)
    except CorruptEntryError:
        return everything
    size = len(first)
    head = size - len(data)
    alike = [j for j, frame in enumerate(frames) if len(frame) == size and _flat_bytes(frame)]
    if len(alike) < 2:
        return everything
    lead = -head % _STRIDE_ALIGN  # so that each data section starts 16-byte aligned
    buf, stride = _padded([frames[j] for j in alike], size, lead)
    heads = np.ndarray((len(alike), head), np.uint8, buffer=buf, offset=lead, strides=(stride, 1))
    if not (heads == np.frombuffer(first, np.uint8, head)).all():
        return everything
    try:
        samples = plan.build_rows(buf, lead + head, len(alike), stride)
    except _DECODE_ERRORS:
        return everything
    for j, sample in zip(alike, samples):
        out[j] = sample
    if len(alike) == len(frames):
        return []
    done = set(alike)
    return [j for j in everything if j not in done]


def frame_head(frame: bytes | bytearray | memoryview) -> int | None:
    """The bytes of a sample frame before its data section; ``None`` if it is not a valid frame.

    Example:
        >>> frame = encode_sample((torch.zeros(2, dtype=torch.uint8), 3))
        >>> 0 < frame_head(frame) < len(frame), frame_head(b"junk")
        (True, None)
    """
    try:
        _, data = _split(frame)
    except CorruptEntryError:
        return None
    return len(frame) - len(data)


def decode_rows(buf: Buffer, n: int, stride: int, at: int, size: int) -> list[Any] | None:
    """Decode ``n`` frames of ``size`` bytes laid ``stride`` bytes apart in ``buf``, the first at ``at``.

    The samples are views of ``buf``, as :func:`decode_samples` makes them of its own
    copy: a batch of frames already side by side (a gathered block of slots) is decoded
    without another copy and without work per frame in Python.

    Returns:
        The samples, or ``None`` when the frames are not alike (their headers differ), their
        data sections are not 16-byte aligned, or one fails to build: decode them one by one
        then (:func:`decode_samples` on views of the rows).
    """
    if n == 0:
        return []
    try:
        plan, data = _split(memoryview(buf)[at : at + size])
    except CorruptEntryError:
        return None
    head = size - len(data)
    if (at + head) % _STRIDE_ALIGN or stride % _STRIDE_ALIGN or at + (n - 1) * stride + size > len(buf):
        return None
    heads = np.ndarray((n, head), np.uint8, buffer=buf, offset=at, strides=(stride, 1))
    if n > 1 and not (heads[1:] == heads[0]).all():
        return None
    try:
        return plan.build_rows(buf, at + head, n, stride)
    except _DECODE_ERRORS:
        return None


def _flat_bytes(frame: bytes | bytearray | memoryview) -> bool:
    """Whether ``frame`` is bytes, or a one-dimensional contiguous view of bytes (its length is its size)."""
    kind = type(frame)
    if kind is bytes:
        return True
    view = frame if kind is memoryview else memoryview(frame)
    return view.ndim == 1 and view.itemsize == 1 and view.c_contiguous  # type: ignore[union-attr]
