"""Frames back to dataset samples, one at a time or many alike at once (the format is :mod:`.format`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from ..dtypes import ALIGN, DTYPES, MAX_DEPTH, NUMPY_DTYPES, NUMPY_OF
from ..errors import CorruptEntryError
from .format import (
    C128,
    F64,
    I64,
    MAGIC,
    MAX_DIMS,
    MAX_ELEMENT_BYTES,
    MAX_HEADER,
    MAX_NODES,
    PREFIX,
    VERSION,
)

__all__ = ["Buffer", "Build", "decode_rows", "decode_sample", "decode_samples", "frame_head"]


_PLAN_CACHE_SIZE = 1024


# -- decoding ---------------------------------------------------------------------
# A builder takes its parameters, then the data buffer, where this sample's data starts
# in it, and the tensors and arrays already made for this sample (its leaves, in order).
#: The buffer samples are views of: a ``bytearray``, or a ``memoryview`` of uninitialised
#: memory (``RowsFile.read`` gathers rows into one without zeroing it first).
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
        offset = self.size + (-self.size % ALIGN)
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
        if tag == "t" and len(args) == 2 and isinstance(args[0], str) and args[0] in DTYPES:
            return self.tensor(DTYPES[args[0]], _shape(args[1], DTYPES[args[0]].itemsize))
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
        npdt = NUMPY_OF.get(dtype)
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
_NUMBERS = {"i": I64, "f": F64, "c": C128}


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
    return type(value) is int and 0 <= value <= MAX_ELEMENT_BYTES


def _shape(value: object, itemsize: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS or not all(_count(d) for d in value):
        raise ValueError(f"invalid shape {str(value)[:40]}")
    bound = itemsize
    for dim in value:
        bound *= max(dim, 1)
        if bound > MAX_ELEMENT_BYTES:
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
    if len(view) < PREFIX.size:
        raise CorruptEntryError(f"a sample frame of {len(view)} bytes is too short")
    magic, version, header_len = PREFIX.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError(f"not a sample frame of version {VERSION} (magic {bytes(magic)!r}, version {version})")
    start = PREFIX.size + header_len
    if header_len > MAX_HEADER or start > len(view):
        raise CorruptEntryError(f"a sample header of {header_len} bytes does not fit the frame")
    plan = _plan(bytes(view[PREFIX.size : start]))
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
        >>> from torchcache.datasets.encode import encode_sample
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
