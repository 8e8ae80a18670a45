"""The bytes of the packed store's segment files: keys, records, checksums and safe file access.

A segment is an append-only file of records, each ``header | key | payload``. The
header holds a magic number, the key's length, the payload's length and an xxh3_64
checksum seeded by the key and the length, so a torn write, a flipped bit, or an index
that points at the wrong record (or at garbage) all fail :func:`check_record`. Files
are opened without blocking and only if they are regular files, and every length is
checked against the file size before anything is read: a FIFO, a directory or a giant
sparse file where a segment should be cannot hang the store or exhaust its memory.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator

import xxhash

from ...errors import KeyingError
from ..files import read_at

__all__ = [
    "Found",
    "HEADER",
    "MAGIC",
    "MAX_KEY_BYTES",
    "check_record",
    "decode_key",
    "encode_key",
    "encode_keys",
    "encode_record",
    "encode_records",
    "is_key",
    "parse_segment_name",
    "payload_of",
    "record_size",
    "scan_keys",
    "scan_records",
    "segment_name",
]

MAGIC = b"\xc7\x5e"
#: magic, key length, payload length, checksum; the key's bytes follow, then the payload.
HEADER = struct.Struct("<2sBIQ")
#: Encoded keys are at most 33 bytes (see :func:`encode_key`).
MAX_KEY_BYTES = 33
_KEY_RE = re.compile(r"[0-9a-f]{4,64}")
_SEGMENT_RE = re.compile(r"seg-([0-9a-f]{8})\.tcs")
_hash = xxhash.xxh3_64_intdigest


def segment_name(seg: int) -> str:
    """The file name of segment number ``seg``.

    Example:
        >>> segment_name(26), parse_segment_name("seg-0000001a.tcs"), parse_segment_name("x.tcs")
        ('seg-0000001a.tcs', 26, None)
    """
    return f"seg-{seg:08x}.tcs"


def parse_segment_name(name: str) -> int | None:
    """The segment number a file name stands for, or ``None`` if it is not a segment's name."""
    match = _SEGMENT_RE.fullmatch(name)
    return int(match.group(1), 16) if match else None


def encode_key(key: str) -> bytes:
    """The index form of a key of 4 to 64 lowercase hex digits.

    An even number of digits packs into half as many bytes (at most 32); an odd number
    is padded to 32 bytes and followed by its digit count, so no two keys share a form.

    Raises:
        KeyingError: If the key is not 4 to 64 lowercase hex digits.

    Example:
        >>> encode_key("00ff").hex(), decode_key(encode_key("abcde"))
        ('00ff', 'abcde')
    """
    if type(key) is not str or not _KEY_RE.fullmatch(key):
        raise KeyingError(f"a store key must be 4 to 64 lowercase hex digits, got {str(key)[:80]!r}")
    if len(key) % 2 == 0:
        return bytes.fromhex(key)
    return bytes.fromhex(key + "0").ljust(32, b"\0") + bytes((len(key),))


def is_key(key: str) -> bool:
    """Whether ``key`` is a store key (4 to 64 lowercase hex digits)."""
    try:
        encode_key(key)
    except KeyingError:
        return False
    return True


def encode_keys(keys: list[str] | tuple[str, ...]) -> list[bytes]:
    r""":func:`encode_key` for many keys, fast when all have one even number of digits.

    Raises:
        KeyingError: If a key is not 4 to 64 lowercase hex digits.

    Example:
        >>> encode_keys(["00ff", "abcd"]), encode_keys(["abcde"]) == [encode_key("abcde")]
        ([b'\x00\xff', b'\xab\xcd'], True)
    """
    width = len(keys[0]) if keys and type(keys[0]) is str else 0
    try:
        joined = "".join(keys)
        even = width % 2 == 0 and 4 <= width <= 64 and len(joined) == width * len(keys)
        raw = bytes.fromhex(joined) if even else b""
    except (TypeError, ValueError):
        raw = b""
    # Whitespace or capitals pass fromhex: only an exact round trip is lowercase hex.
    if raw and raw.hex() == joined and set(map(len, keys)) == {width}:
        size = width // 2
        return [raw[i : i + size] for i in range(0, len(raw), size)]
    return [encode_key(key) for key in keys]


def decode_key(kb: bytes | memoryview) -> str:
    """The key whose index form is ``kb`` (see :func:`encode_key`)."""
    if len(kb) == 33:
        return bytes(kb[:32]).hex()[: kb[32]]
    return bytes(kb).hex()


def record_size(kb: bytes, length: int) -> int:
    """Bytes a record takes in a segment: header, key and payload."""
    return HEADER.size + len(kb) + length


def _checksum(kb: bytes, payload: bytes | memoryview) -> int:
    return _hash(payload, _hash(kb, len(payload)))


def encode_record(kb: bytes, payload: bytes | memoryview) -> bytes:
    """The header and key of a record (the payload follows them in the segment)."""
    return HEADER.pack(MAGIC, len(kb), len(payload), _checksum(kb, payload)) + kb


def encode_records(kbs: list[bytes], payloads: list[bytes | memoryview]) -> list[tuple[bytes, bytes | memoryview]]:
    """:func:`encode_record` for a batch: ``(header and key, payload)`` pairs."""
    pack, digest = HEADER.pack, _hash
    out = []
    for kb, payload in zip(kbs, payloads):
        length = len(payload)
        out.append((pack(MAGIC, len(kb), length, digest(payload, digest(kb, length))) + kb, payload))
    return out


def check_record(data: bytes, kb: bytes | None, length: int | None) -> tuple[bytes, memoryview] | None:
    """Validate a whole record; return its key and payload, or ``None`` if it is not intact.

    Args:
        data: The record's bytes (exactly as long as the record should be).
        kb: The key it must hold, or ``None`` to accept any.
        length: The payload length it must hold, or ``None`` to accept any.
    """
    if len(data) < HEADER.size:
        return None
    magic, klen, plen, check = HEADER.unpack_from(data)
    start = HEADER.size + klen
    if magic != MAGIC or len(data) != start + plen or (length is not None and plen != length):
        return None
    found = data[HEADER.size : start]
    if (kb is not None and found != kb) or klen > MAX_KEY_BYTES:
        return None
    payload = memoryview(data)[start:]
    if _checksum(found, payload) != check:
        return None
    return found, payload


def payload_of(data: bytes, kb: bytes, length: int) -> memoryview | None:
    """The payload of a record read for key ``kb`` and ``length`` payload bytes, or ``None`` if it is not intact.

    The fast form of :func:`check_record`, for a record whose size the index gave.
    """
    start = HEADER.size + len(kb)
    if len(data) != start + length:
        return None
    magic, klen, plen, check = HEADER.unpack_from(data)
    if magic != MAGIC or plen != length or klen != len(kb) or data[HEADER.size : start] != kb:
        return None
    payload = memoryview(data)[start:]
    return payload if _hash(payload, _hash(kb, length)) == check else None


def scan_keys(fd: int, end: int) -> list[bytes]:
    """The keys of the records from the start of a segment to ``end``, reading only their headers.

    Stops at the first header that is not a record's (checksums are not checked: the
    keys only say which index rows to look at).

    Raises:
        OSError: If the file cannot be read.
    """
    keys: list[bytes] = []
    offset, span = 0, HEADER.size + MAX_KEY_BYTES
    while offset + HEADER.size <= end:
        head = os.pread(fd, span, offset)
        if len(head) < HEADER.size:
            break
        magic, klen, plen, _ = HEADER.unpack_from(head)
        if magic != MAGIC or klen > MAX_KEY_BYTES or len(head) < HEADER.size + klen:
            break
        keys.append(head[HEADER.size : HEADER.size + klen])
        offset += HEADER.size + klen + plen
    return keys


def scan_records(fd: int, start: int, end: int, chunk: int = 1 << 20) -> Iterator[tuple[int, bytes, memoryview]]:
    """Yield ``(offset, key, payload)`` of the intact records between ``start`` and ``end``.

    The file is read ``chunk`` bytes at a time (a record larger than that alone). The
    scan stops at the first record that is torn, damaged or runs past ``end``: records
    carry no resynchronisation marks, and what follows a damaged one cannot be trusted.
    Memory stays within one record plus ``chunk`` bytes.

    Raises:
        OSError: If the file cannot be read.
    """
    offset = start
    while offset + HEADER.size <= end:
        buf = read_at(fd, min(chunk, end - offset), offset)
        pos = 0
        while pos + HEADER.size <= len(buf):
            magic, klen, plen, _ = HEADER.unpack_from(buf, pos)
            size = HEADER.size + klen + plen
            if magic != MAGIC or klen > MAX_KEY_BYTES or offset + pos + size > end:
                return
            if pos + size > len(buf):
                if pos == 0:  # one record larger than the chunk
                    buf = read_at(fd, size, offset)
                    if len(buf) < size:
                        return
                else:
                    break
            checked = check_record(buf[pos : pos + size], None, None)
            if checked is None:
                return
            yield offset + pos, checked[0], checked[1]
            pos += size
        if pos == 0:
            return
        offset += pos


#: An entry located in the index: (segment, offset, payload length, position in the batch,
#: index row). A plain tuple, made once per key read (a NamedTuple costs 6x more to make);
#: sorted, entries come in file order.
Found = tuple[int, int, int, int, bytes]
