"""Dataset samples to frames.

A sample is what a dataset's ``__getitem__`` returns: CPU tensors of any dtype and
shape, numpy arrays and scalars of numbers, ``bool``, ``int``, ``float``, ``complex``,
``str``, ``bytes``, ``None``, and tuples, lists and dicts (``str`` or ``int`` keys) of
these, nested up to :data:`~torchcache.dtypes.MAX_DEPTH` containers. Its frame is the
one every cached value has (:mod:`torchcache.codec`): a checked prefix, a header that is
the sample's layout (:mod:`torchcache.tree`: its structure, and a dtype and shape per
leaf) and a payload that is its packed row (each leaf's bytes, padded to a multiple of 8
bytes; a number or a string is a leaf too). The header holds no values that vary between
samples of one shape, so the samples of a dataset share a few headers. Samples are
stored raw: what they hold is mostly already compressed (images) or read once per epoch.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..codec import MAX_HEADER, encode_header, seal
from ..dtypes import ALIGN, CODE_OF, MAX_DEPTH, NAME_OF, NUMPY_DTYPES, standard_strides
from ..errors import KeyingError
from ..output_types import unplain_tensor

__all__ = ["MAGIC_1_2", "MAX_NODES", "SampleTypeError", "check_sample", "encode_sample", "is_sample_1_2"]

#: At most this many values (leaves and containers) in one sample.
MAX_NODES = 100_000

I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
C128 = struct.Struct("<dd")
BOOL = struct.Struct("<?")
INT64_RANGE = (-(2**63), 2**63 - 1)


#: The first bytes of a sample frame of torchcache 1.2 (read only by ``torchcache migrate``).
MAGIC_1_2 = b"TCSM"


def is_sample_1_2(frame: bytes | bytearray | memoryview) -> bool:
    """Whether ``frame`` starts as a sample frame of torchcache 1.2 does."""
    return bytes(memoryview(frame)[: len(MAGIC_1_2)]) == MAGIC_1_2


class SampleTypeError(KeyingError):
    """A sample holds a value that cannot be cached (the message names it and its path)."""


_HEADER_CACHE_SIZE = 1024


_HINT = (
    "a cached sample holds CPU tensors, numpy arrays and scalars of numbers, bool, int, float, complex, str, "
    "bytes, None, and tuples, lists and dicts (str or int keys) of these; convert it in __getitem__, or produce "
    "it in transform= (applied after the cache)"
)


#: Bits of the largest int a sample holds outside int64 (written in its header as decimal text).
MAX_INT_BITS = 8192


def _header_int(value: int, path: str) -> int:
    if value.bit_length() > MAX_INT_BITS:
        raise SampleTypeError(
            f"{path}: an int of {value.bit_length()} bits is larger than a cached sample holds ({MAX_INT_BITS}); "
            "keep it as a str or as bytes"
        )
    return value


def _refuse(value: object, path: str) -> SampleTypeError:
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__qualname__
    if cls.__module__.startswith("PIL."):
        hint = "convert PIL images with torchvision.transforms.functional.pil_to_tensor or numpy.asarray"
    elif isinstance(value, tuple) or hasattr(value, "__dataclass_fields__"):
        hint = "convert it to a plain tuple or dict (namedtuple._asdict(), dataclasses.asdict())"
    elif isinstance(value, np.ndarray):  # a masked array, np.matrix...: what the subclass adds would be lost
        hint = "convert it with np.asarray(x) and keep what its type adds (a mask) as fields of their own"
    elif isinstance(value, (int, float, str, dict, list)):
        hint = "convert it to the plain builtin type (int(x), float(x), str(x), dict(x), list(x))"
    else:
        hint = _HINT
    return SampleTypeError(f"{path}: cannot cache a value of type {name}; {hint}")


# -- encoding ---------------------------------------------------------------------
class _Encoder:
    """Walks a sample: its structure (:mod:`torchcache.tree`'s nodes), its leaves, and their bytes."""

    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self.leaves: list[list[Any]] = []
        self.nodes = 0

    def put(self, leaf: list[Any], data: bytes | memoryview) -> None:
        """Append a leaf (``[dtype, shape]``) and its bytes, padded to a multiple of :data:`ALIGN`."""
        self.leaves.append(leaf)
        self.chunks.append(data)
        pad = -len(data) % ALIGN
        if pad:
            self.chunks.append(_ZEROS[:pad])

    def node(self, value: object, path: str, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SampleTypeError(f"{path}: a sample holds more than {MAX_NODES} values; cache fewer, larger arrays")
        cls = type(value)
        if value is None:
            return "N"
        if cls is bool:
            return value
        if cls is int:
            if INT64_RANGE[0] <= value <= INT64_RANGE[1]:  # type: ignore[operator]
                self.put(["i8", []], I64.pack(value))
                return "i"
            return ["I", _header_int(value, path)]  # type: ignore[arg-type]
        if cls is float:
            self.put(["f8", []], F64.pack(value))
            return "f"
        if cls is complex:
            self.put(["c16", []], C128.pack(value.real, value.imag))  # type: ignore[attr-defined]
            return "c"
        if cls is str:
            data = value.encode("utf-8", "surrogatepass")  # type: ignore[attr-defined]
            self.put(["u1", [len(data)]], data)
            return "s"
        if cls is bytes:
            self.put(["u1", [len(value)]], value)  # type: ignore[arg-type]
            return "y"
        if isinstance(value, torch.Tensor):
            self.tensor(value, path)
            return "T"
        if cls is np.ndarray or cls is np.memmap:  # a memmap's values (np.load(mmap_mode=...)): an ndarray on hits
            self.array(value, path)  # type: ignore[arg-type]
            return "A"
        if isinstance(value, np.generic) and value.dtype.str in NUMPY_DTYPES:
            self.put([value.dtype.str, []], np.asarray(value).tobytes())
            return "S"
        if cls in (tuple, list, dict) and depth >= MAX_DEPTH:
            raise SampleTypeError(f"{path}: the sample nests containers more than {MAX_DEPTH} deep")
        if cls is tuple or cls is list:
            seq: list[object] | tuple[object, ...] = value  # type: ignore[assignment]
            items = [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(seq)]
            return ["tuple" if cls is tuple else "list", items]
        if cls is dict:
            mapping: dict[object, object] = value  # type: ignore[assignment]
            for key in mapping:
                if type(key) is not str and type(key) is not int:
                    raise SampleTypeError(f"{path}: dict keys must be str or int to be cached, got {key!r}")
                if type(key) is int:
                    _header_int(key, path)
            return ["dict", [[k, self.node(v, f"{path}[{k!r}]", depth + 1)] for k, v in mapping.items()]]
        raise _refuse(value, path)

    def tensor(self, value: torch.Tensor, path: str) -> None:
        lost = unplain_tensor(value, parameters=True)
        if lost:
            subclass = type(value) is not torch.Tensor
            unwrap = "; torchvision's v2.ToPureTensor() does, last in the dataset's own transforms" * subclass
            raise SampleTypeError(f"{path}: {lost}{unwrap}")
        if value.device.type != "cpu":
            raise SampleTypeError(
                f"{path}: a tensor on {value.device}; a cached sample holds CPU tensors: return CPU tensors from "
                "__getitem__ and move batches to the device in the training loop (DataLoader(pin_memory=True) helps)"
            )
        if value.layout != torch.strided:
            raise SampleTypeError(f"{path}: a {value.layout} tensor cannot be cached; convert it with .to_dense()")
        name = CODE_OF.get(value.dtype) or NAME_OF.get(value.dtype)
        if name is None:
            raise SampleTypeError(f"{path}: tensors of dtype {value.dtype} cannot be cached; convert with .to(...)")
        flat = standard_strides(value.detach().resolve_conj().resolve_neg().contiguous().reshape(-1))
        self.put([name, list(value.shape)], flat.view(torch.uint8).numpy().data)

    def array(self, value: np.ndarray[Any, Any], path: str) -> None:
        if value.dtype.str not in NUMPY_DTYPES:
            raise SampleTypeError(
                f"{path}: numpy arrays of dtype {value.dtype} cannot be cached (numbers and bool only); "
                "convert object or string arrays to a list or tensor"
            )
        self.put([value.dtype.str, list(value.shape)], np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)


_ZEROS = bytes(ALIGN)


_PLAIN_ITEMS = 16


_plain_headers: dict[tuple[Any, ...], bytes] = {}  # signature -> header


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
                and tensor.dtype in NAME_OF
                and tensor.is_contiguous()
                and not tensor.is_conj()
                and not tensor.is_neg()
                and not tensor.is_nested
                and not tensor.__dict__  # attributes set on it: the encoder refuses them (libraries' flags pass)
            ):
                return None
        elif kind is int:
            if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:  # type: ignore[operator]
                return None
        elif kind is not float:
            return None
    return items


def _plain_frame(sample: object) -> bytes | None:
    """The frame of the most common samples, built without walking a tree; ``None`` for the others.

    A plain sample is one contiguous CPU tensor, or a tuple or list of at most
    :data:`_PLAIN_ITEMS` such tensors, ``int`` (within int64) and ``float`` values, as a
    dataset of ``(image, label)`` returns. Its header depends only on its structure,
    dtypes and shapes, so it is taken from the first sample of each structure that
    :func:`_encode_tree` encodes; the frame is the one it would make.
    """
    items = _plain_items(sample)
    if items is None:
        return None
    signature: list[object] = [type(sample)]
    chunks: list[bytes | memoryview | ctypes.Array[ctypes.c_ubyte]] = []
    for value in items:
        data: bytes | memoryview | ctypes.Array[ctypes.c_ubyte]
        if type(value) is torch.Tensor:
            tensor: torch.Tensor = value  # type: ignore[assignment]
            data = _bytes_in_place(tensor)
            signature.append((tensor.dtype, tensor.shape))
        elif type(value) is int:
            data = I64.pack(value)
            signature.append(int)
        else:
            data = F64.pack(value)  # type: ignore[arg-type]
            signature.append(float)
        chunks.append(data)
        pad = -len(data) % ALIGN
        if pad:
            chunks.append(_ZEROS[:pad])
    key = tuple(signature)
    header = _plain_headers.get(key)
    if header is None:  # a new structure: the general encoder makes its header, which is kept
        header, _ = _encode_tree(sample, "sample")
        if len(_plain_headers) >= _HEADER_CACHE_SIZE:
            _plain_headers.clear()
        _plain_headers[key] = header
    return seal(header, chunks)


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
        >>> from torchcache.datasets.decode import decode_sample
        >>> frame = encode_sample((torch.arange(3), {"label": 7}))
        >>> decode_sample(frame)
        (tensor([0, 1, 2]), {'label': 7})
    """
    frame = _plain_frame(sample)
    return frame if frame is not None else seal(*_encode_tree(sample, name))


def check_sample(sample: object, name: str = "sample") -> None:
    """Check that a sample can be cached, as :func:`encode_sample` would, without keeping a frame.

    For a plain sample (a tensor, or a short tuple or list of tensors and numbers) this
    only looks at types, about a microsecond; any other sample is encoded.

    Raises:
        SampleTypeError: As :func:`encode_sample`.
    """
    if _plain_items(sample) is None:
        _encode_tree(sample, name)


def _encode_tree(sample: object, name: str) -> tuple[bytes, list[bytes | memoryview]]:
    """The header and payload chunks of any sample, by walking its structure."""
    encoder = _Encoder()
    tree = encoder.node(sample, name, 0)
    header = encode_header({"l": encoder.leaves} if tree == "T" else {"l": encoder.leaves, "t": tree})
    if len(header) > MAX_HEADER:
        raise SampleTypeError(f"{name}: the sample's structure is too large to cache ({len(header)} bytes)")
    return header, encoder.chunks
