"""Entries as self-describing frames: a fixed prefix, a JSON header, the payload.

A frame is read without pickle: the prefix is a :mod:`struct`, the header is JSON whose
dtype names are looked up in a fixed table, and the payload is raw bytes, so nothing
in a cache file can make the reader run code. Layout of a frame::

    magic "TCHE" | version u8 | codec u8 | reserved u16 | header length u32
    | stored payload length u64 | raw payload length u64 | xxh3-64 checksum u64
    | header (UTF-8 JSON) | payload (raw, or brotli-compressed)

The checksum covers the prefix fields before it, the header and the stored payload, so
a truncated, bit-flipped or foreign file is rejected. The payload is compressed only
when brotli shrinks it below ``RAW_RATIO`` of its size; otherwise it is stored raw and
read back with a single copy.

The checksum is against accidents, not tampering: whoever can write a frame can give it
a valid checksum. What a frame cannot do is make its reader spend more than it declares:
the prefix alone gives the file's length (so a reader reads :data:`PREFIX_SIZE` bytes
first and refuses files of another size), a payload never declares more than
:data:`MAX_ITEM_BYTES`, and decompression stops at the declared size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import brotli
import xxhash

from .errors import CorruptEntryError

__all__ = [
    "DEFAULT_QUALITY",
    "MAGIC",
    "MAX_ITEM_BYTES",
    "PREFIX_SIZE",
    "RAW_RATIO",
    "decode_frame",
    "decode_header",
    "encode_frame",
    "encode_header",
    "frame_length",
    "inflate",
    "nested_deeper_than",
    "parse_header",
    "read_prefix",
    "split_frame",
]

MAGIC = b"TCHE"
VERSION = 1
CODEC_RAW = 0
CODEC_BROTLI = 1
#: Default brotli quality: the best trade of write cost and size on float outputs
#: (ReLU float32 at quality 5 is 0.55x raw; higher qualities cost more for ~1% less).
DEFAULT_QUALITY = 5
#: Store raw unless brotli makes the payload at most this fraction of its size.
RAW_RATIO = 0.9
_MIN_COMPRESS = 64
_PREFIX = struct.Struct("<4sBBHIQQQ")
PREFIX_SIZE = _PREFIX.size
_MAX_HEADER = 1 << 20
_MAX_HEADER_DEPTH = 100
#: The largest raw payload (one item) a frame may declare; larger items are not written.
MAX_ITEM_BYTES = 1 << 28
_INFLATE_STEP = 1 << 12
# brotli >= 1.2 can stop decompressing at an output size; older versions get the input in steps.
_BOUNDED_BROTLI = hasattr(brotli.Decompressor(), "can_accept_more_data")


def _checksum(prefix: bytes | memoryview, header: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(prefix)
    h.update(header)
    h.update(payload)
    return h.intdigest()


def window_bits(size: int) -> int:
    """A brotli window just large enough for ``size`` bytes (small windows are faster)."""
    return max(10, min(24, size.bit_length() + 1))


def encode_header(header: dict[str, Any]) -> bytes:
    """The canonical JSON bytes of a header (sorted keys, no spaces)."""
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def encode_frame(header: dict[str, Any] | bytes, payload: bytes | memoryview, quality: int | None) -> bytes:
    r"""Build a frame.

    Args:
        header: JSON-able metadata (the entry's layout), or its :func:`encode_header`
            bytes (callers that write many entries of one layout encode it once).
        payload: The raw payload bytes.
        quality: brotli quality 0-11, or ``None`` to store raw without trying.

    Returns:
        The frame bytes.

    Example:
        >>> frame = encode_frame({"a": 1}, b"\\x00" * 1000, quality=5)
        >>> len(frame) < 200, decode_frame(frame) == ({"a": 1}, b"\\x00" * 1000)
        (True, True)
    """
    header_bytes = header if isinstance(header, bytes) else encode_header(header)
    raw_len = len(payload)
    stored: bytes | memoryview = payload
    codec = CODEC_RAW
    if quality is not None and raw_len >= _MIN_COMPRESS:
        packed = brotli.compress(bytes(payload), quality=quality, lgwin=window_bits(raw_len))
        if len(packed) <= RAW_RATIO * raw_len:
            stored, codec = packed, CODEC_BROTLI
    fields = (MAGIC, VERSION, codec, 0, len(header_bytes), len(stored), raw_len)
    head = _PREFIX.pack(*fields, 0)[: PREFIX_SIZE - 8]
    checksum = _checksum(head, header_bytes, stored)
    return b"".join((head, struct.pack("<Q", checksum), header_bytes, stored))


def read_prefix(data: bytes | memoryview) -> tuple[int, int, int, int, int]:
    """Validate a frame's fixed prefix.

    Returns:
        ``(codec, header_len, stored_len, raw_len, checksum)``.

    Raises:
        CorruptEntryError: If the prefix is not a torchcache frame of a known version.
    """
    if len(data) < PREFIX_SIZE:
        raise CorruptEntryError("truncated frame: shorter than its fixed prefix")
    magic, version, codec, _, header_len, stored_len, raw_len, checksum = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("not a torchcache entry (bad magic)")
    if version != VERSION:
        raise CorruptEntryError(f"unsupported entry version {version} (expected {VERSION})")
    if codec not in (CODEC_RAW, CODEC_BROTLI) or header_len > _MAX_HEADER:
        raise CorruptEntryError("invalid frame prefix")
    if raw_len > MAX_ITEM_BYTES:
        raise CorruptEntryError(f"the frame declares a {raw_len}-byte payload, more than {MAX_ITEM_BYTES}")
    if stored_len > raw_len or (codec == CODEC_RAW and stored_len != raw_len):
        raise CorruptEntryError("the stored and raw payload lengths of the frame do not agree")
    return codec, header_len, stored_len, raw_len, checksum


def frame_length(prefix: bytes | memoryview) -> int:
    """The whole length of a frame, from its first :data:`PREFIX_SIZE` bytes.

    Raises:
        CorruptEntryError: If the prefix is not a torchcache frame of a known version.

    Example:
        >>> frame = encode_frame({"a": 1}, b"xyz", quality=None)
        >>> frame_length(frame[:PREFIX_SIZE]) == len(frame)
        True
    """
    _, header_len, stored_len, _, _ = read_prefix(prefix)
    return PREFIX_SIZE + header_len + stored_len


def inflate(stored: bytes | memoryview, raw_len: int) -> bytes:
    """Decompress a brotli payload that must inflate to exactly ``raw_len`` bytes.

    Decompression stops once the output passes ``raw_len`` (give or take brotli's
    output block), so a small payload that would inflate to gigabytes costs nothing.

    Raises:
        CorruptEntryError: If the payload does not decode, or not to ``raw_len`` bytes.
    """
    decompressor = brotli.Decompressor()
    out: bytes
    try:
        if _BOUNDED_BROTLI:
            out = decompressor.process(bytes(stored), output_buffer_limit=raw_len + 1)
        else:  # pragma: no cover - brotli < 1.2
            parts, size, view = [], 0, memoryview(stored)
            for start in range(0, len(view), _INFLATE_STEP):
                part = decompressor.process(bytes(view[start : start + _INFLATE_STEP]))
                parts.append(part)
                size += len(part)
                if size > raw_len:
                    break
            out = b"".join(parts)
    except brotli.error as exc:
        raise CorruptEntryError(f"brotli payload does not decode: {exc}") from None
    if len(out) > raw_len:
        raise CorruptEntryError(f"brotli payload inflates past its declared {raw_len} bytes")
    if len(out) != raw_len or not decompressor.is_finished():
        raise CorruptEntryError("payload length does not match the header")
    return out


def decode_frame(data: bytes | memoryview, verify: bool = True) -> tuple[dict[str, Any], bytes | memoryview]:
    """Parse and check a frame.

    Args:
        data: The whole frame.
        verify: Check the checksum.

    Returns:
        The header and the raw payload (a view into ``data`` when stored raw).

    Raises:
        CorruptEntryError: If the frame is truncated, altered or not a torchcache entry.
    """
    header_bytes, payload = split_frame(data, verify)
    return parse_header(header_bytes), payload


def parse_header(header_bytes: bytes) -> dict[str, Any]:
    """Parse a frame's JSON header.

    Raises:
        CorruptEntryError: If it is not a JSON object.
    """
    try:
        header = json.loads(header_bytes)
    except ValueError as exc:
        raise CorruptEntryError(f"invalid header: {exc}") from None
    except RecursionError:
        raise CorruptEntryError("invalid header: nested too deeply") from None
    if not isinstance(header, dict):
        raise CorruptEntryError("invalid header: not a JSON object")
    if nested_deeper_than(header, _MAX_HEADER_DEPTH):
        raise CorruptEntryError("invalid header: nested too deeply")
    return header


def nested_deeper_than(value: object, limit: int) -> bool:
    """Whether parsed JSON nests lists and objects more than ``limit`` levels deep.

    Walked without recursion, so that a hostile file cannot exhaust the stack of what
    later walks it recursively.

    Example:
        >>> nested_deeper_than({"a": [1, [2]]}, 3), nested_deeper_than({"a": [1, [2]]}, 2)
        (False, True)
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def split_frame(
    data: bytes | memoryview, verify: bool = True, raw_size: Callable[[bytes], int] | None = None
) -> tuple[bytes, bytes | memoryview]:
    """Check a frame and return its header bytes and its decompressed payload.

    Args:
        data: The whole frame.
        verify: Check the checksum.
        raw_size: Called with the header bytes, returns the payload size the header
            describes; a frame that declares another size is rejected before its payload
            is decompressed. It may raise :class:`CorruptEntryError`.

    Raises:
        CorruptEntryError: If the frame is truncated, altered or not a torchcache entry.
    """
    codec, header_len, stored_len, raw_len, checksum = read_prefix(data)
    end = PREFIX_SIZE + header_len + stored_len
    if len(data) != end:
        raise CorruptEntryError(f"frame length {len(data)} does not match its prefix ({end})")
    view = memoryview(data)
    header_bytes = view[PREFIX_SIZE : PREFIX_SIZE + header_len]
    stored = view[PREFIX_SIZE + header_len : end]
    if verify and _checksum(view[: PREFIX_SIZE - 8], header_bytes, stored) != checksum:
        raise CorruptEntryError("checksum mismatch")
    header = bytes(header_bytes)
    if raw_size is not None:
        expected = raw_size(header)
        if expected != raw_len:
            raise CorruptEntryError(f"payload is {raw_len} bytes, its header describes {expected}")
    payload = stored if codec == CODEC_RAW else inflate(stored, raw_len)
    return header, payload


def decode_header(data: bytes | memoryview) -> dict[str, Any]:
    """Return only the header of a frame (no checksum check, no decompression)."""
    _, header_len, _, _, _ = read_prefix(data)
    return parse_header(bytes(memoryview(data)[PREFIX_SIZE : PREFIX_SIZE + header_len]))
