"""Item keys: canonical encodings of arguments and 128-bit digests of each batch item.

An item key is a 128-bit xxh3 digest of a *context* (the module fingerprint, the
argument names, each tensor argument's per-item shape and dtype, the non-tensor
arguments and the training flag) followed by the 128-bit xxh3 digest of the exact bytes
of every tensor argument's row for that item. Nothing is reduced arithmetically before hashing, so two items that
differ in any hashed byte, shape or dtype get different keys up to a 2**-128 chance.

Hashing is batched, with no per-item torch call. On the CPU each tensor argument is
made contiguous and its rows are hashed by xxh3 from one flat buffer. On an accelerator
every byte of every row is hashed on the device by a universal hash in torch operations
(:mod:`torchcache.device_digest`), and only 32 bytes per item are copied to the host, in
one copy per batch; the two digests differ, so an item keyed on the device and the same
item keyed on the CPU have different keys. With ``subsample_count`` set, items on an
accelerator with more elements are instead keyed by 64 evenly spread contiguous runs of
them (an opt-in that accepts the risk of two items differing only elsewhere sharing a
key); the count is part of the key.

Non-tensor arguments are encoded canonically with a type tag by
:mod:`torchcache.canonical`, so ``True``, ``1``, ``1.0``, ``"1"`` and ``None`` are five
different keys. Quantized inputs add their scheme, scale and zero point to the context.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils._device import DeviceContext as _DeviceContext

from .canonical import encode_key_value, tensor_content_digest
from .canonical.objects import host_bytes
from .device_digest import device_row_digests
from .dtypes import channels_last_format, standard_strides

__all__ = ["FORMAT_VERSION", "Context", "encode_value", "hash_items", "numerics", "tag", "tensor_digest"]

#: Version of the key derivation and of the entry format; part of every module key.
FORMAT_VERSION = 4

_SUBSAMPLE_RUNS = 64
_index_cache: dict[tuple[int, int, str], torch.Tensor] = {}


def tag(kind: bytes, payload: bytes) -> bytes:
    """A type tag, the payload's length and the payload: an unambiguous field."""
    return kind + struct.pack("<Q", len(payload)) + payload


def encode_value(value: object, name: str = "argument") -> bytes:
    """Encode a non-tensor argument canonically, type included.

    Args:
        value: Anything :mod:`torchcache.canonical` encodes exactly (numbers, strings,
            bytes, enums, torch dtypes and devices, tuples, lists, dicts in order, sets,
            dataclasses, functions, objects with plain state), with no tensor inside.
        name: The argument's name, for error messages.

    Returns:
        Bytes that are equal for equal values of equal types, and different otherwise.

    Raises:
        KeyingError: If the value (or something inside it) cannot be encoded exactly.

    Example:
        >>> len({encode_value(v) for v in (True, 1, 1.0, "1", None)})
        5
    """
    return encode_key_value(value, name)


class Context:
    """The per-batch part of every item key, hashed once into 16 bytes."""

    __slots__ = ("_hasher",)

    def __init__(self, module_key: str) -> None:
        self._hasher = xxhash.xxh3_128(module_key.encode())

    def add(self, data: bytes) -> None:
        """Append a length-prefixed field."""
        self._hasher.update(struct.pack("<Q", len(data)))
        self._hasher.update(data)

    def digest(self) -> bytes:
        """The 16-byte digest of everything added."""
        return self._hasher.digest()


def _subsample_index(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """Indices of ``count`` elements in evenly spread contiguous runs (cached per device)."""
    cache_key = (numel, count, str(device))
    index = _index_cache.get(cache_key)
    if index is None:
        runs = min(_SUBSAMPLE_RUNS, count)
        run_len = count // runs
        starts = torch.linspace(0, numel - run_len, runs).long()
        index = (starts[:, None] + torch.arange(run_len)[None, :]).reshape(-1).to(device)
        _index_cache[cache_key] = index
    return index


_WHOLE, _SUBSAMPLED, _ON_DEVICE, _WHOLE_FROM_DEVICE = 0, 1, 2, 3


def _item_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A ``(batch, nbytes)`` uint8 view of each item's bytes, where the tensor lives."""
    data = tensor.detach()
    flat = (data.int_repr() if data.is_quantized else data).reshape(tensor.shape[0], -1)
    flat = flat.resolve_conj().resolve_neg().contiguous()
    if flat.shape[1] and flat.stride(1) != 1:  # items of one element may hold any stride
        flat = standard_strides(flat)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8) if flat.shape[1] else flat.to(torch.uint8)


def item_rows(tensor: torch.Tensor, subsample_count: int | None) -> tuple[np.ndarray, bool]:
    """Return a ``(batch, nbytes)`` host uint8 array of each item's hashed bytes.

    Returns:
        The array, and whether the rows are a subsample.
    """
    rows, subsampled = _row_bytes(tensor, subsample_count)
    return rows.numpy(), subsampled


def _row_bytes(tensor: torch.Tensor, subsample_count: int | None) -> tuple[torch.Tensor, bool]:
    """:func:`item_rows` as a contiguous CPU uint8 tensor."""
    batch = tensor.shape[0]
    data = tensor.detach()
    flat = (data.int_repr() if data.is_quantized else data).reshape(batch, -1)
    subsampled = False
    if flat.device.type != "cpu":
        numel = flat.shape[1]
        if subsample_count is not None and numel > subsample_count:
            flat = flat.index_select(1, _subsample_index(numel, subsample_count, flat.device))
            subsampled = True
        flat = flat.cpu()
    flat = flat.resolve_conj().resolve_neg().contiguous()
    if flat.shape[1] and flat.stride(1) != 1:  # items of one element may hold any stride
        flat = standard_strides(flat)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.shape[1] else flat.to(torch.uint8)
    return flat, subsampled


def hash_items(context: bytes, tensors: Sequence[torch.Tensor], subsample_count: int | None = None) -> list[bytes]:
    """Compute the 16-byte key of every item of a batch.

    Args:
        context: The per-batch context digest (see :class:`Context`).
        tensors: Tensor arguments, each shaped ``(batch, ...)`` with the same batch size.
        subsample_count: Subsample items with more elements on accelerators; ``None``
            hashes every element.

    Returns:
        One key per item, in batch order.

    Example:
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> keys = hash_items(b"ctx", [x])
        >>> len(keys), len(set(keys)), keys == hash_items(b"ctx", [x.clone()])
        (3, 3, True)
    """
    batch = tensors[0].shape[0]
    if batch == 0:
        return []
    # One C call per row and one per item: a hasher object per row costs more in
    # Python than hashing a 3 KB row. Row digests have a fixed size per flag, so their
    # concatenation is unambiguous.
    digest = xxhash.xxh3_128_digest
    flags = bytearray()
    row_digests: list[list[bytes]] = []
    for tensor in tensors:
        if tensor.device.type != "cpu" and subsample_count is None:
            rows, flag = device_row_digests(_item_bytes(tensor)), _ON_DEVICE
        else:
            rows, subsampled = item_rows(tensor, subsample_count)
            flag = _SUBSAMPLED if subsampled else _WHOLE if tensor.device.type == "cpu" else _WHOLE_FROM_DEVICE
        flat, width = memoryview(rows.reshape(-1)), rows.shape[1]  # type: ignore[arg-type]
        items = [flat[at : at + width] for at in range(0, batch * width, width)] if width else [flat] * batch
        row_digests.append(list(map(bytes, items)) if flag == _ON_DEVICE else list(map(digest, items)))
        flags.append(flag)  # on a device: 32 bytes per item, already a digest
    prefix = context + bytes(flags)
    if len(row_digests) == 1:
        return list(map(digest, map(prefix.__add__, row_digests[0])))
    return [digest(prefix + b"".join(parts)) for parts in zip(*row_digests)]


def tensor_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A 128-bit digest of named tensors: names, dtypes, shapes, a channels-last layout and exact contents."""
    h = xxhash.xxh3_128()
    for name, tensor in tensors:
        h.update(tag(b"n", name.encode()))
        if tensor.is_quantized or tensor.device.type == "meta" or getattr(tensor, "is_nested", False):
            h.update(tag(b"q", tensor_content_digest(tensor, name)))
            continue
        h.update(tag(b"d", str(tensor.dtype).encode()))
        h.update(tag(b"s", repr(tuple(tensor.shape)).encode()))
        data = tensor.detach()
        if data.is_sparse or data.layout != torch.strided:
            data = data.to_dense()
        elif channels_last_format(data) is not None:
            h.update(tag(b"m", b"channels_last"))  # weights in that layout run other kernels (last bits differ)
        if data.numel():  # not through numpy: Tensor.numpy() would make a buffer's storage unresizable
            h.update(host_bytes(_row_bytes(data.reshape(1, -1), None)[0].reshape(-1)))
    return h.hexdigest()


#: The float32 precision of each backend and operation (``torch.backends.*.fp32_precision``), at torch's defaults.
_FP32_DEFAULTS = {
    ("generic", "all"): "none",
    ("cuda", "all"): "none",
    ("cuda", "matmul"): "none",
    ("cuda", "conv"): "tf32",
    ("cuda", "rnn"): "tf32",
    ("mkldnn", "all"): "none",
    ("mkldnn", "matmul"): "none",
    ("mkldnn", "conv"): "none",
    ("mkldnn", "rnn"): "none",
}
_FP32_BACKENDS = tuple(backend for backend, _ in _FP32_DEFAULTS)
_FP32_OPS = tuple(op for _, op in _FP32_DEFAULTS)
_FP32_AT_DEFAULTS = tuple(_FP32_DEFAULTS.values())
_fp32_getter = getattr(torch._C, "_get_fp32_precision_getter", None)
_cudnn_tf32 = getattr(torch._C, "_get_cudnn_allow_tf32", lambda: True)
#: A subnormal double and one: their product is 0 on a thread that flushes subnormals to zero, as
#: ``torch.set_flush_denormal(True)`` makes the calling thread do (the CPU's flag serves every float).
_SUBNORMAL, _ONE = float("1e-310"), 1.0


def _fp32_precisions() -> list[bytes]:
    """The float32 precisions that differ from torch's defaults, and cuDNN's TF32 switch when it is off."""
    if _fp32_getter is None:  # a torch without the per-backend settings
        try:
            matmul = torch.get_float32_matmul_precision()
        except RuntimeError as exc:
            matmul = f"unknown ({exc})"
        return [] if matmul == "highest" else [f"matmul:{matmul}".encode()]
    try:
        values = tuple(map(_fp32_getter, _FP32_BACKENDS, _FP32_OPS))
    except (RuntimeError, ValueError) as exc:
        values = (f"unknown ({type(exc).__name__})",) * len(_FP32_OPS)
    found = []
    if values != _FP32_AT_DEFAULTS:  # "ieee" (set explicitly, or "highest" again) computes as "none" does
        found = [
            f"fp32:{backend}:{op}:{value}".encode()
            for backend, op, value, default in zip(_FP32_BACKENDS, _FP32_OPS, values, _FP32_AT_DEFAULTS)
            if value != default and not (value == "ieee" and default == "none")
        ]
    if not _cudnn_tf32():
        found.append(b"cudnn_allow_tf32:False")
    return found


#: Whether matrix products in half precision may reduce in it: cuBLAS float16, cuBLAS bfloat16, CPU float16.
_REDUCED_PRECISION = tuple(
    getter
    for name in ("cublas_allow_fp16", "cublas_allow_bf16", "cpu_allow_fp16")
    if (getter := getattr(torch._C, f"_get_{name}_reduced_precision_reduction", None)) is not None
)
_REDUCED_AT_DEFAULTS = ((True, True), (True, True), False)[: len(_REDUCED_PRECISION)]
#: Backend switches that choose other kernels (``torch.backends.mkldnn.enabled``, cuDNN's, the
#: attention backends): the values differ in their last bits. Each with torch's default.
_SWITCHES = tuple(
    (name, getter, default)
    for name, default in (
        ("mkldnn_enabled", True),
        ("mkldnn_deterministic", False),
        ("nnpack_enabled", True),
        ("cudnn_enabled", True),
        ("cudnn_deterministic", False),
        ("flash_sdp_enabled", True),
        ("mem_efficient_sdp_enabled", True),
        ("math_sdp_enabled", True),
        ("cudnn_sdp_enabled", True),
        ("overrideable_sdp_enabled", True),
        ("math_sdp_allow_fp16_bf16_reduction", False),
        ("fa3_sdp_enabled", False),
        ("cublas_allow_fp16_accumulation", False),  # float16 products summed in float16
        ("blas_preferred_backend", getattr(getattr(torch._C, "_BlasBackend", None), "Cublas", None)),
        ("linalg_preferred_backend", getattr(getattr(torch._C, "_LinalgBackend", None), "Default", None)),
    )
    if (getter := getattr(torch._C, f"_get_{name}", None)) is not None
)
_SWITCH_GETTERS = tuple(getter for _, getter, _ in _SWITCHES)
_OPT_EINSUM: Any = torch.backends.opt_einsum  # installed, it is on with "auto" by default
_OPT_EINSUM_INSTALLED = bool(_OPT_EINSUM.is_available())
_SWITCHES_AT_DEFAULTS = tuple(default for _, _, default in _SWITCHES)
#: The quantized engine torch starts with (x86 where fbgemm runs, else oneDNN where it is built, else none), as
#: torch chooses it, not as it is at import: quantized operations pack and round their weights per engine.
_QENGINES = torch.backends.quantized.supported_engines
_QENGINE_AT_DEFAULT = torch.backends.quantized._get_qengine_id(
    next((name for name in ("x86", "onednn") if name in _QENGINES), "none")
)


def numerics(device_types: Iterable[str]) -> list[bytes]:
    """What changes the values a forward computes beside its inputs and code: one line each, none at the defaults.

    Each autocast that is on among ``device_types`` (its dtype), torch's default dtype
    (tensors made without one, such as ``torch.arange`` in a position encoding), the
    float32 precision of each backend and operation (``torch.set_float32_matmul_precision``
    and ``torch.backends.*.fp32_precision``), whether this thread flushes subnormal
    numbers to zero (``torch.set_flush_denormal``), deterministic algorithms
    (``torch.use_deterministic_algorithms``) and whether half-precision matrix products
    may reduce in half precision (``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``
    and its bfloat16 and CPU counterparts), and the backend switches that choose other kernels
    (``torch.backends.mkldnn.enabled``, ``torch.backends.cudnn.enabled`` and ``.deterministic``,
    ``torch.backends.quantized.engine``,
    the attention backends, ``torch.backends.mha.set_fastpath_enabled``, the preferred BLAS and
    linear algebra libraries, float16 accumulation in cuBLAS), ``opt_einsum`` turned off or given another
    strategy where it is installed, and the default device new tensors are made on, where they differ from
    torch's defaults.
    """
    found = [
        f"autocast:{device_type}:{torch.get_autocast_dtype(device_type)}".encode()
        for device_type in sorted(set(device_types))
        if torch.is_autocast_enabled(device_type)
    ]
    if torch.get_default_dtype() is not torch.float32:
        found.append(f"default_dtype:{torch.get_default_dtype()}".encode())
    found += _fp32_precisions()
    if _SUBNORMAL * _ONE == 0.0:
        found.append(b"flush_denormal:True")
    if torch.are_deterministic_algorithms_enabled():  # other kernels (scatter, index_add, some convolutions)
        found.append(b"deterministic:True")
    reduced = tuple(getter() for getter in _REDUCED_PRECISION)  # C getters: the properties cost a microsecond
    if reduced != _REDUCED_AT_DEFAULTS:
        found.append(f"reduced_precision_reduction:{reduced}".encode())
    switches = tuple(getter() for getter in _SWITCH_GETTERS)
    if switches != _SWITCHES_AT_DEFAULTS:
        found += [f"{name}:{now}".encode() for (name, _, was), now in zip(_SWITCHES, switches) if now != was]
    if torch._C._get_qengine() != _QENGINE_AT_DEFAULT:  # torch.backends.quantized.engine set to another
        found.append(f"qengine:{torch.backends.quantized.engine}".encode())
    if not getattr(torch.backends.mha, "_is_fastpath_enabled", True):  # the fused encoder and attention kernels
        found.append(b"mha_fastpath:False")
    if _OPT_EINSUM_INSTALLED and (_OPT_EINSUM.enabled, _OPT_EINSUM.strategy) != (True, "auto"):  # einsum's order
        found.append(f"opt_einsum:{_OPT_EINSUM.enabled}:{_OPT_EINSUM.strategy}".encode())
    if torch._C._len_torch_function_stack():  # `with torch.device(...)`, set_default_device: where tensors are made
        modes = _function_modes()  # type: ignore[no-untyped-call]
        device = next((mode.device for mode in reversed(modes) if isinstance(mode, _DeviceContext)), None)
        if device is not None and torch.device(device).type != "cpu":
            found.append(f"default_device:{device}".encode())
    return found
