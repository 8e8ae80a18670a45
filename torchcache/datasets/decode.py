"""Frames back to dataset samples, one at a time or many alike at once (frames: :mod:`.encode`).

The decoder keeps the *plan* it compiled from each header (validated once: known node
kinds and dtypes, bounded depth and dimensions, as many leaves as the structure has).
Decoding checks that the payload is exactly as long as the plan needs, copies it once
into a new ``bytearray`` and builds every leaf as a view of that copy: the tensors it
returns never alias the caller's buffer, and a hostile frame raises
:class:`~torchcache.errors.CorruptEntryError`, never allocates more than it holds. The
frame's checksum is the store's to check (every store checks what it returns); ``torchcache
verify`` checks it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from .. import codec
from ..codec import MAX_ITEM_BYTES, PREFIX_SIZE, heads_alike, parse_header, split_frame
from ..dtypes import ALIGN, NUMPY_DTYPES, NUMPY_OF, dtype_named
from ..errors import CorruptEntryError
from ..tree import leaf_kinds
from .encode import BOOL, C128, F64, I64

__all__ = ["Buffer", "Build", "decode_rows", "decode_sample", "decode_samples", "frame_head"]

_PLAN_CACHE_SIZE = 1024

# A builder takes its parameters, then the data buffer, where this sample's data starts
# in it, and the tensors and arrays already made for this sample (its leaves, in order).
#: The buffer samples are views of: a ``bytearray``, or a ``memoryview`` of uninitialised
#: memory (``RowsFile.read`` gathers rows into one without zeroing it first).
Buffer = bytearray | memoryview

Build = Callable[[Buffer, int, list[Any]], Any]

_Leaf = tuple[str, Any, int, int, tuple[int, ...]]  # kind, dtype, element count, offset, shape

_MAX_DIMS = 32

_RAW_FRAME = (codec.MAGIC, codec.VERSION, codec.CODEC_RAW)


_STRIDE_ALIGN = 16  # samples of a batch start this far apart: a multiple of every item size


class _Plan:
    """What a header describes: the payload size it needs, and how to build samples from it."""

    def __init__(self, header: dict[str, Any]) -> None:
        if not set(header) <= {"l", "t"} or not isinstance(header.get("l"), list):
            raise ValueError("not a sample layout")
        tree = header.get("t", "T")
        kinds = leaf_kinds(tree, values=True)
        if len(kinds) != len(header["l"]):
            raise ValueError("the structure does not match the number of leaves")
        self.size = 0
        self.leaves: list[_Leaf] = []
        self._items = iter(header["l"])
        self.build = self.compile(tree)
        #: "leaf", "tuple" or "list" when the sample is its leaves alone, in order: then a
        #: batch of samples is made by zipping the leaves' values.
        self.flat = _flat(self.build, len(self.leaves))

    def take(self, nbytes: int) -> int:
        offset = self.size
        self.size += nbytes + (-nbytes % ALIGN)
        return offset

    def compile(self, node: Any) -> Build:
        if node == "N" or node is True or node is False:
            return partial(_constant, None if node == "N" else node)
        if isinstance(node, str):  # a leaf: leaf_kinds checked its kind
            item = next(self._items)
            if type(item) is not list or len(item) != 2 or not isinstance(item[0], str):
                raise ValueError(f"invalid leaf {str(item)[:40]}")
            name, shape = item
            if node in _NUMBERS:
                if item != _NUMBER_LEAVES[node]:
                    raise ValueError(f"invalid {node} leaf {str(item)[:40]}")
                form = _NUMBERS[node]
                return self.leaf((node, form, 1, self.take(form.size), ()))
            if node in ("s", "y"):
                if name != "u1" or not isinstance(shape, list) or len(shape) != 1 or not _count(shape[0]):
                    raise ValueError(f"invalid {node} leaf {str(item)[:40]}")
                return partial(_bytes if node == "y" else _str, self.take(shape[0]), shape[0])
            if node == "T":
                dtype = dtype_named(name)
                if dtype is None:
                    raise ValueError(f"invalid dtype {name[:40]}")
                return self.tensor(dtype, _shape(shape, dtype.itemsize))
            np_dtype = NUMPY_DTYPES.get(name)
            if np_dtype is None:
                raise ValueError(f"invalid numpy dtype {name[:40]}")
            if node == "S":
                if shape != []:
                    raise ValueError("a numpy scalar with a shape")
                return partial(_numpy_scalar, np_dtype, self.take(np_dtype.itemsize))
            return self.array(np_dtype, _shape(shape, np_dtype.itemsize))
        if node[0] == "I":
            return partial(_constant, node[1])
        if node[0] in ("tuple", "list"):
            parts = [self.compile(child) for child in node[1]]
            return partial(_tuple if node[0] == "tuple" else _list, parts)
        if node[0] == "dict":
            return partial(_dict, [(key, self.compile(child)) for key, child in node[1]])
        raise ValueError(f"a {node[0]} node in a sample")

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Build:
        count = math.prod(shape)
        at = self.take(count * dtype.itemsize)
        if count == 0:
            return partial(_call, partial(torch.empty, shape, dtype=dtype))
        npdt = NUMPY_OF.get(dtype)
        return self.leaf(("n", npdt, count, at, shape) if npdt is not None else ("t", dtype, count, at, shape))

    def array(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Build:
        count = math.prod(shape)
        at = self.take(count * dtype.itemsize)
        if count == 0:
            return partial(_call, partial(np.empty, shape, dtype))
        return self.leaf(("a", dtype, count, at, shape))

    def leaf(self, spec: _Leaf) -> Build:
        self.leaves.append(spec)
        return partial(_leaf, len(self.leaves) - 1)

    def build_many(self, datas: Sequence[bytes | memoryview]) -> list[Any]:
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
    if kind == "n":
        return torch.from_numpy(rows).unbind(0)
    return list(rows) if shape else [rows[j, ...] for j in range(n)]  # 0-d arrays, not numpy scalars


# The builders of a plan: each takes its parameters, then the buffer, this sample's
# start in it and its leaves.
_NUMBERS = {"i": I64, "f": F64, "c": C128, "b": BOOL}
_NUMBER_LEAVES = {"i": ["i8", []], "f": ["f8", []], "c": ["c16", []], "b": ["b1", []]}
_NUMBER_DTYPES = {"i": np.dtype("<i8"), "f": np.dtype("<f8"), "c": np.dtype("<c16"), "b": np.dtype("?")}


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


def _call(make: Callable[[], Any], buf: Buffer, base: int, leaves: list[Any]) -> Any:
    return make()


def _leaf(k: int, buf: Buffer, base: int, leaves: list[Any]) -> Any:
    return leaves[k]


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_ITEM_BYTES


def _shape(value: object, itemsize: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS or not all(_count(d) for d in value):
        raise ValueError(f"invalid shape {str(value)[:40]}")
    bound = itemsize
    for dim in value:
        bound *= max(dim, 1)
        if bound > MAX_ITEM_BYTES:
            raise ValueError(f"shape {str(value)[:40]} is too large")
    return tuple(value)


_plans: dict[bytes, _Plan] = {}
_PLAN_HEADER_BYTES = 1 << 20  # bytes of the headers of the plans kept (a plan takes about 40 times its header's)
_plan_bytes = 0


def _plan(header: bytes) -> _Plan:
    global _plan_bytes
    plan = _plans.get(header)
    if plan is None:
        try:
            plan = _Plan(parse_header(header))
        except (ValueError, TypeError, RecursionError) as exc:  # CorruptEntryError is a ValueError
            raise CorruptEntryError(f"invalid sample header: {str(exc)[:200]}") from None
        if len(header) <= _PLAN_HEADER_BYTES:  # one larger than all kept (a planted one): parsed again
            if len(_plans) >= _PLAN_CACHE_SIZE or _plan_bytes + len(header) > _PLAN_HEADER_BYTES:
                _plans.clear()  # the oldest all go at once
                _plan_bytes = 0
            _plans[header] = plan
            _plan_bytes += len(header)
    return plan


def _split(frame: bytes | bytearray | memoryview) -> tuple[_Plan, bytes | memoryview]:
    """The plan of a sample frame and its payload.

    A raw frame (how samples are written) is read here; any other goes through
    :func:`~torchcache.codec.split_frame`, which also says what is wrong with a bad one.

    Raises:
        CorruptEntryError: If the frame is not a valid sample frame.
    """
    view = memoryview(frame)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    payload: bytes | memoryview
    head = codec.PREFIX.unpack_from(view) if len(view) >= PREFIX_SIZE else (None,) * 8
    start = PREFIX_SIZE + (head[4] or 0)
    if head[:3] == _RAW_FRAME and head[4] <= codec.MAX_HEADER and head[5] == head[6] == len(view) - start:
        header, payload = bytes(view[PREFIX_SIZE:start]), view[start:]
    else:
        header, payload = split_frame(view, verify=False)
    plan = _plan(header)
    if len(payload) != plan.size:
        raise CorruptEntryError(f"a sample frame holds {len(payload)} payload bytes, its header needs {plan.size}")
    return plan, payload


def _raw(frame: bytes | bytearray | memoryview) -> bool:
    """Whether a frame's payload is stored raw (so that it lies in the frame as it is decoded)."""
    return len(frame) > PREFIX_SIZE and frame[5] == codec.CODEC_RAW  # byte 5: the codec


_DECODE_ERRORS = (ValueError, TypeError, RuntimeError, UnicodeDecodeError)


def decode_sample(frame: bytes | bytearray | memoryview) -> Any:
    """Decode a frame made by :func:`encode_sample`.

    The data is copied once; the tensors and arrays returned are writable views of that
    copy, never of ``frame``.

    Raises:
        CorruptEntryError: If the frame is not a valid sample frame.
    """
    return _build_one(*_split(frame))


def _build_one(plan: _Plan, data: bytes | memoryview) -> Any:
    """The sample of one payload; :class:`CorruptEntryError` if it does not build (a str that is not UTF-8)."""
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

    Returns:
        For each frame its sample, or the :class:`~torchcache.errors.CorruptEntryError`
        that :func:`decode_sample` would raise for it (returned, not raised).
    """
    out: list[Any] = [None] * len(frames)
    rest = _decode_alike(frames, out) if len(frames) > 1 else range(len(frames))
    groups: dict[int, tuple[_Plan, list[int], list[bytes | memoryview]]] = {}
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

    (Checksums aside: the stores checked them.) The common case, a batch of samples of one
    structure, costs one join and one comparison of the headers, no work per frame in Python.

    Returns:
        The positions of the frames left for the general path (all of them when any
        frame of that length differs in its header, or a sample fails to build).
    """
    everything = range(len(frames))
    if not _flat_bytes(frames[0]) or not _raw(frames[0]):
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
    if not heads_alike(heads, np.frombuffer(first, np.uint8, head)):
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
    """The bytes of a sample frame before its payload; ``None`` if it is not a valid frame stored raw.

    Example:
        >>> from torchcache.datasets.encode import encode_sample
        >>> frame = encode_sample((torch.zeros(2, dtype=torch.uint8), 3))
        >>> 0 < frame_head(frame) < len(frame), frame_head(b"junk")
        (True, None)
    """
    if not _raw(frame):
        return None
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
    first = memoryview(buf)[at : at + size]
    if not _raw(first):
        return None
    try:
        plan, data = _split(first)
    except CorruptEntryError:
        return None
    head = size - len(data)
    if (at + head) % _STRIDE_ALIGN or stride % _STRIDE_ALIGN or at + (n - 1) * stride + size > len(buf):
        return None
    heads = np.ndarray((n, head), np.uint8, buffer=buf, offset=at, strides=(stride, 1))
    if n > 1 and not heads_alike(heads[1:], heads[0]):
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
