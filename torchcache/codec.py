"""Entries as self-describing frames: a fixed prefix, a JSON header, the payload.

A frame is read without pickle: the prefix is a :mod:`struct`, the header is JSON whose
dtype names are looked up in a fixed table, and the payload is raw bytes, so nothing
in a cache file can make the reader run code. Layout of a frame::

    magic "TCHE" | version u8 | codec u8 | word size u16 | header length u32
    | stored payload length u64 | raw payload length u64 | xxh3-64 checksum u64
    | header (UTF-8 JSON) | stored payload

The codec is raw (0), brotli (1) or zero elision (2: a bitmask of the non-zero words,
the words, then the tail; the word size, 2, 4 or 8, is in the prefix, and 0 for the other
codecs), laid out in ``docs/file-format.md``; :func:`encode_frame` says how one is chosen.
The checksum (xxh3-64) covers every prefix field before it, the header and the stored
payload, so a truncated, bit-flipped or foreign file is rejected.

The checksum is against accidents, not tampering: whoever can write a frame can give it
a valid checksum. What a frame cannot do is make its reader spend more than it declares:
the prefix alone gives the file's length (so a reader reads :data:`PREFIX_SIZE` bytes
first and refuses files of another size), a payload never declares more than
:data:`MAX_ITEM_BYTES`, decompression stops at the declared size, and a zero-elided
payload is checked (lengths, then the mask's bit count) before its output is allocated.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import brotli
import numpy as np
import xxhash

from .errors import CorruptEntryError

__all__ = [
    "BROTLI_MARGIN",
    "CODEC_BROTLI",
    "CODEC_RAW",
    "CODEC_ZERO",
    "DEFAULT_QUALITY",
    "MAGIC",
    "MAX_HEADER",
    "MAX_ITEM_BYTES",
    "PREFIX",
    "PREFIX_SIZE",
    "RAW_RATIO",
    "WORD_SIZES",
    "MIN_ELIDE_BYTES",
    "ZERO_MIN_FRACTION",
    "decode_frame",
    "decode_header",
    "encode_frame",
    "encode_raw_frames",
    "encode_zero_frames",
    "encode_header",
    "frame_length",
    "heads_alike",
    "inflate",
    "nested_deeper_than",
    "parse_header",
    "read_prefix",
    "seal",
    "split_frame",
    "unelide",
    "unelide_rows",
    "word_size",
]

MAGIC = b"TCHE"
VERSION = 1
CODEC_RAW = 0
CODEC_BROTLI = 1
CODEC_ZERO = 2
#: Word sizes a zero-elided payload may use.
WORD_SIZES = (2, 4, 8)
#: Default brotli quality: the best trade of write cost and size on float outputs
#: (ReLU float32 at quality 5 is 0.55x raw; higher qualities cost more for ~1% less).
DEFAULT_QUALITY = 5
#: Store raw unless brotli makes the payload at most this fraction of its size.
RAW_RATIO = 0.9
#: Try zero elision when at least this fraction of a payload's words are zero.
ZERO_MIN_FRACTION = 0.35
#: Prefer brotli to zero elision only when brotli is at most this fraction of its size.
BROTLI_MARGIN = 0.8
_MIN_COMPRESS = 64
#: Rows of at least this many bytes are zero-elided and rebuilt one by one, in chunks of
#: bounded memory; smaller rows in one vectorized pass per batch (:func:`encode_zero_frames`,
#: :func:`unelide_rows`), since per row the numpy calls would cost more than brotli's decode.
MIN_ELIDE_BYTES = 16384
_PREFIX = struct.Struct("<4sBBHIQQQ")
_U64 = struct.Struct("<Q")
#: The fixed prefix of a frame: magic, version, codec, word size, header, stored and raw lengths, checksum.
PREFIX = _PREFIX
PREFIX_SIZE = _PREFIX.size
#: The largest header a frame may have.
MAX_HEADER = 1 << 22
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


def encode_header(header: dict[str, Any]) -> bytes:
    """The canonical JSON bytes of a header (sorted keys, no spaces)."""
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def word_size(itemsizes: Sequence[int], nbytes: Sequence[int]) -> int:
    """The word size zero elision uses for a row of leaves.

    Args:
        itemsizes: The element size of each leaf's stored dtype.
        nbytes: The bytes each leaf takes in the row (its padded extent).

    Returns:
        The leaves' common item size when it is 2, 4 or 8 (8 for a common 16); else 4
        when every leaf's bytes are a multiple of 4; else 2.

    Example:
        >>> word_size([4, 4], [3072, 64]), word_size([8, 1], [64, 64]), word_size([1], [6])
        (4, 4, 2)
    """
    sizes = set(itemsizes)
    if len(sizes) == 1:
        (size,) = sizes
        if size in WORD_SIZES:
            return size
        if size > max(WORD_SIZES) and size % max(WORD_SIZES) == 0:
            return max(WORD_SIZES)
    return 4 if all(n % 4 == 0 for n in nbytes) else 2


_SCATTER_WORDS = 1 << 14  # a multiple of 8
_BATCH_WORDS = 1 << 20  # words per vectorized pass over many rows
_WORD_DTYPES: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elide_rows(rows: np.ndarray[Any, np.dtype[np.uint8]], word: int) -> list[bytes | None]:
    """The zero-elided payload of each row of a ``(n, raw_len)`` array, in vectorized passes.

    ``None`` for a row with fewer than :data:`ZERO_MIN_FRACTION` zero words, or whose
    elided payload would be larger than :data:`RAW_RATIO` of the raw one.
    """
    count_rows, raw_len = rows.shape
    n = raw_len // word
    if n == 0 or count_rows == 0:
        return [None] * count_rows
    step = max(1, _BATCH_WORDS // n)  # rows per pass: temporaries stay small
    if count_rows > step:
        passes = (_elide_rows(rows[at : at + step], word) for at in range(0, count_rows, step))
        return [payload for payloads in passes for payload in payloads]
    rows = np.ascontiguousarray(rows)
    words = rows[:, : n * word].view(_WORD_DTYPES[word])
    nonzero = words != 0
    counts = np.count_nonzero(nonzero, axis=1)
    tail = raw_len - n * word
    sizes = -(-n // 8) + counts * word + tail
    keep = (n - counts >= ZERO_MIN_FRACTION * n) & (sizes <= RAW_RATIO * raw_len)
    if not keep.any():
        return [None] * count_rows
    masks = np.packbits(nonzero, axis=1, bitorder="little")
    values = memoryview(words.reshape(-1)[np.flatnonzero(nonzero)].tobytes())
    tails = rows[:, n * word :]
    out: list[bytes | None] = []
    start = 0
    for i, (end, kept) in enumerate(zip(np.cumsum(counts * word).tolist(), keep.tolist())):
        out.append(b"".join((masks[i].tobytes(), values[start:end], tails[i].tobytes())) if kept else None)
        start = end
    return out


_BITS_OF_BYTE = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _row_bit_counts(masks: np.ndarray[Any, np.dtype[np.uint8]]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The number of set bits in each row of ``masks`` (``np.bitwise_count`` where numpy has it, numpy >= 2)."""
    if hasattr(np, "bitwise_count"):
        counts: np.ndarray[Any, np.dtype[np.int64]] = np.bitwise_count(masks).sum(axis=1, dtype=np.int64)
    else:  # pragma: no cover - numpy < 2
        counts = _BITS_OF_BYTE[masks].sum(axis=1, dtype=np.int64)
    return counts


def unelide(
    stored: bytes | memoryview, raw_len: int, word: int, out: np.ndarray[Any, np.dtype[np.uint8]] | None = None
) -> memoryview:
    """Rebuild the payload of a zero-elided frame.

    Every length is checked before the output is allocated: the mask's length follows
    from ``raw_len`` and ``word``, the stored words from the rest, and the mask must set
    exactly as many bits (none past the last word). The output is the only allocation
    that grows with ``raw_len``: the words are scattered in chunks of bounded size.

    Args:
        stored: The stored payload.
        raw_len: The payload size the frame declares.
        word: The frame's word size (2, 4 or 8).
        out: Where to write the payload, if it is a writable uint8 array of ``raw_len``
            bytes (a row of the caller's batch: no buffer is allocated, nothing copied).

    Returns:
        The ``raw_len`` payload bytes (a view of the one buffer written).

    Raises:
        CorruptEntryError: If the stored payload does not describe ``raw_len`` bytes.

    Example:
        >>> frame = encode_frame({}, bytes(4000) + b"abcd" + b"xy", quality=None, word=4)
        >>> frame[5] == CODEC_ZERO, decode_frame(frame)[1] == bytes(4000) + b"abcdxy"
        (True, True)
    """
    if word not in _WORD_DTYPES:
        raise CorruptEntryError(f"invalid zero-elision word size {word}")
    n = raw_len // word
    tail = raw_len - n * word
    mask_len = -(-n // 8)
    values_len = len(stored) - mask_len - tail
    if values_len < 0 or values_len % word or values_len // word > n:
        raise CorruptEntryError("the zero-elided payload's length does not match its declared size")
    count = values_len // word
    view = memoryview(stored)
    mask = np.frombuffer(view[:mask_len], dtype=np.uint8)
    if int(_row_bit_counts(mask[None])[0]) != count:
        raise CorruptEntryError("the zero-elision mask does not count the stored words")
    if n % 8 and mask_len and mask[-1] >> (n % 8):
        raise CorruptEntryError("the zero-elision mask marks words past the payload")
    if out is not None and out.shape == (raw_len,) and out.dtype == np.uint8 and out.flags.writeable:
        out.fill(0)
    else:
        out = np.zeros(raw_len, dtype=np.uint8)
    if count:
        words = out[: n * word].view(_WORD_DTYPES[word])
        values = np.frombuffer(view[mask_len : mask_len + values_len], dtype=_WORD_DTYPES[word])
        done = 0
        for start in range(0, n, _SCATTER_WORDS):  # in chunks: temporaries stay small
            bits = mask[start // 8 : (start + _SCATTER_WORDS) // 8]
            nonzero = np.unpackbits(bits, count=min(_SCATTER_WORDS, n - start), bitorder="little")
            index = np.flatnonzero(nonzero.view(np.bool_))
            chunk = values[done : done + len(index)]
            if not chunk.flags.aligned:  # scattering unaligned words is several times slower
                chunk = chunk.copy()
            words[start : start + _SCATTER_WORDS][index] = chunk
            done += len(index)
    if tail:
        out[n * word :] = np.frombuffer(view[mask_len + values_len :], dtype=np.uint8)
    return memoryview(out.data)


def encode_frame(
    header: dict[str, Any] | bytes, payload: bytes | memoryview, quality: int | None, word: int | None = None
) -> bytes:
    r"""Build a frame, choosing its codec for this payload.

    Zero elision is tried first (when ``word`` is given and at least
    :data:`ZERO_MIN_FRACTION` of the words are zero), then brotli (when ``quality`` is
    given), which is kept only when it beats the better of the two by a margin: at most
    :data:`RAW_RATIO` of the raw size, and at most :data:`BROTLI_MARGIN` of the
    zero-elided size.

    Args:
        header: JSON-able metadata (the entry's layout), or its :func:`encode_header`
            bytes (callers that write many entries of one layout encode it once).
        payload: The raw payload bytes.
        quality: brotli quality 0-11, or ``None`` not to try brotli.
        word: Zero-elision word size (2, 4 or 8, see :func:`word_size`), or ``None``
            not to try zero elision.

    Raises:
        ValueError: If ``word`` is not a supported word size.

    Example:
        >>> frame = encode_frame({"a": 1}, b"\\x00" * 1000, quality=5)
        >>> len(frame) < 200, decode_frame(frame) == ({"a": 1}, b"\\x00" * 1000)
        (True, True)
    """
    if word is not None and word not in _WORD_DTYPES:
        raise ValueError(f"word size must be one of {WORD_SIZES}, not {word}")
    header_bytes = header if isinstance(header, bytes) else encode_header(header)
    raw_len = len(payload)
    stored: bytes | memoryview = payload
    codec, param = CODEC_RAW, 0
    if word is not None and raw_len >= _MIN_COMPRESS:
        elided = _elide_rows(np.frombuffer(payload, dtype=np.uint8)[None], word)[0]
        if elided is not None:
            stored, codec, param = elided, CODEC_ZERO, word
    if quality is not None and raw_len >= _MIN_COMPRESS:
        window = max(10, min(24, raw_len.bit_length() + 1))  # just large enough: small windows are faster
        packed = brotli.compress(bytes(payload), quality=quality, lgwin=window)
        limit = RAW_RATIO * raw_len if codec == CODEC_RAW else BROTLI_MARGIN * len(stored)
        if len(packed) <= limit:
            stored, codec, param = packed, CODEC_BROTLI, 0
    return seal(header_bytes, [stored], codec, param, raw_len)


def seal(
    header_bytes: bytes, chunks: Sequence[Any], codec: int = CODEC_RAW, word: int = 0, raw_len: int | None = None
) -> bytes:
    """The frame of a payload stored in pieces (joined once); ``raw_len``, its decoded length, defaults to its own.

    Example:
        >>> frame = seal(b'{"l":[["u1",[3]]]}', [b"ab", b"c"])
        >>> decode_frame(frame) == ({"l": [["u1", [3]]]}, b"abc")
        True
    """
    stored_len = sum(memoryview(chunk).nbytes for chunk in chunks)
    raw_len = stored_len if raw_len is None else raw_len
    head = _PREFIX.pack(MAGIC, VERSION, codec, word, len(header_bytes), stored_len, raw_len, 0)[: PREFIX_SIZE - 8]
    h = xxhash.xxh3_64(head)
    h.update(header_bytes)
    for chunk in chunks:
        h.update(chunk)
    return b"".join((head, _U64.pack(h.intdigest()), header_bytes, *chunks))


def encode_zero_frames(header_bytes: bytes, rows: np.ndarray[Any, np.dtype[np.uint8]], word: int) -> list[bytes | None]:
    """Zero-elided frames of many payloads of one layout, elided in one vectorized pass.

    The rule is :func:`encode_frame`'s (at least :data:`ZERO_MIN_FRACTION` of the words
    zero, the stored payload at most :data:`RAW_RATIO` of the raw one), the frames the
    same bytes; only the Python work per row is gone, which dominates for small rows.

    Args:
        header_bytes: The :func:`encode_header` bytes shared by every row.
        rows: A ``(n, raw_len)`` uint8 array, one payload per row.
        word: The word size (2, 4 or 8).

    Returns:
        One frame per row, ``None`` for rows that zero elision does not shrink enough.

    Raises:
        ValueError: If ``word`` is not a supported word size.

    Example:
        >>> rows = np.zeros((2, 64), dtype=np.uint8); rows[0, :4] = 1; rows[1] = 7
        >>> frames = encode_zero_frames(encode_header({}), rows, 4)
        >>> decode_frame(frames[0])[1] == rows[0].tobytes(), frames[1] is None
        (True, True)
    """
    if word not in _WORD_DTYPES:
        raise ValueError(f"word size must be one of {WORD_SIZES}, not {word}")
    raw_len = rows.shape[1]
    if raw_len < _MIN_COMPRESS:
        return [None] * rows.shape[0]
    return [None if p is None else seal(header_bytes, [p], CODEC_ZERO, word, raw_len) for p in _elide_rows(rows, word)]


def unelide_rows(
    stored: Sequence[bytes | memoryview], word: int, out: np.ndarray[Any, np.dtype[np.uint8]]
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Rebuild many zero-elided payloads of one size into the rows of ``out``, vectorized.

    Each stored payload is checked as :func:`unelide` checks one (its length, then the
    mask's bit count, and no bit past the last word); a payload that fails is left
    alone, and its row is not written.

    Args:
        stored: The stored payloads.
        word: Their word size (2, 4 or 8).
        out: A writable ``(len(stored), raw_len)`` uint8 array whose rows are contiguous.

    Returns:
        For each payload, whether it was rebuilt into its row.

    Raises:
        ValueError: If ``word`` is not a supported word size or ``out`` has another shape.

    Example:
        >>> rows = np.zeros((2, 64), dtype=np.uint8); rows[0, :4] = 1; rows[1, 60] = 9
        >>> frames = encode_zero_frames(encode_header({}), rows, 4)
        >>> stored = [memoryview(f)[PREFIX_SIZE + 2 :] for f in frames]  # after the header "{}"
        >>> out = np.ones_like(rows)
        >>> unelide_rows(stored, 4, out).tolist(), bool((out == rows).all())
        ([True, True], True)
    """
    if word not in _WORD_DTYPES:
        raise ValueError(f"word size must be one of {WORD_SIZES}, not {word}")
    if out.ndim != 2 or out.shape[0] != len(stored) or out.dtype != np.uint8 or out.strides[1] != 1:
        raise ValueError(f"out must be a ({len(stored)}, raw_len) uint8 array with contiguous rows")
    raw_len = out.shape[1]
    n = raw_len // word
    if n == 0:
        return np.zeros(len(stored), dtype=np.bool_)
    step = max(1, _BATCH_WORDS // n)  # rows per pass: temporaries stay small
    if len(stored) > step:
        parts = [unelide_rows(stored[at : at + step], word, out[at : at + step]) for at in range(0, len(stored), step)]
        return np.concatenate(parts)
    tail = raw_len - n * word
    mask_len = -(-n // 8)
    values_len = np.fromiter(map(len, stored), dtype=np.int64, count=len(stored)) - mask_len - tail
    ok: np.ndarray[Any, np.dtype[np.bool_]] = (values_len >= 0) & (values_len % word == 0) & (values_len <= n * word)
    if not ok.any():
        return ok
    good = np.flatnonzero(ok)
    masks = np.frombuffer(b"".join([stored[i][:mask_len] for i in good.tolist()]), dtype=np.uint8)
    masks = masks.reshape(len(good), mask_len)
    fits = _row_bit_counts(masks) == values_len[good] // word
    if n % 8:
        fits &= (masks[:, -1] >> (n % 8)) == 0
    if not fits.all():
        ok[good[~fits]] = False
        good, masks = good[fits], masks[fits]
    if not len(good):
        return ok
    lengths = values_len[good].tolist()
    values = np.frombuffer(
        b"".join([stored[i][mask_len : mask_len + size] for i, size in zip(good.tolist(), lengths)]),
        dtype=_WORD_DTYPES[word],
    )
    bits = np.unpackbits(masks, axis=1, count=n, bitorder="little").view(np.bool_)
    where = np.flatnonzero(bits)
    if len(good) == len(stored) and not tail and out.flags.c_contiguous:
        out.fill(0)
        out.reshape(-1).view(_WORD_DTYPES[word])[where] = values
    else:
        out[good] = 0
        words = out[:, : n * word].view(_WORD_DTYPES[word])
        row, col = np.divmod(where, n)
        words[good[row], col] = values
    if tail:
        tails = b"".join([stored[i][mask_len + size :] for i, size in zip(good.tolist(), lengths)])
        out[good, n * word :] = np.frombuffer(tails, dtype=np.uint8).reshape(len(good), tail)
    return ok


def encode_raw_frames(header_bytes: bytes, rows: np.ndarray[Any, np.dtype[np.uint8]]) -> np.ndarray[Any, Any]:
    """Raw frames of many payloads of one layout at once: what :func:`encode_frame` builds, without brotli.

    Args:
        header_bytes: The :func:`encode_header` bytes shared by every row.
        rows: A ``(n, raw_len)`` uint8 array, one payload per row.

    Returns:
        A ``(n, frame_len)`` uint8 array, one frame per row.

    Example:
        >>> rows = np.arange(12, dtype=np.uint8).reshape(2, 6)
        >>> frames = encode_raw_frames(encode_header({"a": 1}), rows)
        >>> decode_frame(frames[1].tobytes()) == ({"a": 1}, bytes(rows[1]))
        True
    """
    n, raw_len = rows.shape
    head = _PREFIX.pack(MAGIC, VERSION, CODEC_RAW, 0, len(header_bytes), raw_len, raw_len, 0)[: PREFIX_SIZE - 8]
    start = PREFIX_SIZE + len(header_bytes)
    frames = np.empty((n, start + raw_len), dtype=np.uint8)
    frames[:, : PREFIX_SIZE - 8] = np.frombuffer(head, dtype=np.uint8)
    frames[:, PREFIX_SIZE:start] = np.frombuffer(header_bytes, dtype=np.uint8)
    frames[:, start:] = rows
    seed = xxhash.xxh3_64(head)
    seed.update(header_bytes)
    checksums = np.empty(n, dtype="<u8")
    for i, row in enumerate(rows):
        h = seed.copy()
        h.update(row)
        checksums[i] = h.intdigest()
    frames[:, PREFIX_SIZE - 8 : PREFIX_SIZE] = checksums.view(np.uint8).reshape(n, 8)
    return frames


def read_prefix(data: bytes | memoryview) -> tuple[int, int, int, int, int, int]:
    """Validate a frame's fixed prefix.

    Returns:
        ``(codec, word_size, header_len, stored_len, raw_len, checksum)``.

    Raises:
        CorruptEntryError: If the prefix is not a torchcache frame of a known version.
    """
    if len(data) < PREFIX_SIZE:
        raise CorruptEntryError("truncated frame: shorter than its fixed prefix")
    magic, version, codec, word, header_len, stored_len, raw_len, checksum = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("not a torchcache entry (bad magic)")
    if version != VERSION:
        raise CorruptEntryError(f"unsupported entry version {version} (expected {VERSION})")
    if codec not in (CODEC_RAW, CODEC_BROTLI, CODEC_ZERO) or header_len > MAX_HEADER:
        raise CorruptEntryError("invalid frame prefix")
    if codec == CODEC_ZERO and word not in WORD_SIZES:
        raise CorruptEntryError(f"invalid zero-elision word size {word}")
    if raw_len > MAX_ITEM_BYTES:
        raise CorruptEntryError(f"the frame declares a {raw_len}-byte payload, more than {MAX_ITEM_BYTES}")
    if stored_len > raw_len or (codec == CODEC_RAW and stored_len != raw_len):
        raise CorruptEntryError("the stored and raw payload lengths of the frame do not agree")
    return codec, word, header_len, stored_len, raw_len, checksum


def frame_length(prefix: bytes | memoryview) -> int:
    """The whole length of a frame, from its first :data:`PREFIX_SIZE` bytes.

    Raises:
        CorruptEntryError: If the prefix is not a torchcache frame of a known version.

    Example:
        >>> frame = encode_frame({"a": 1}, b"xyz", quality=None)
        >>> frame_length(frame[:PREFIX_SIZE]) == len(frame)
        True
    """
    _, _, header_len, stored_len, _, _ = read_prefix(prefix)
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


def heads_alike(heads: np.ndarray[Any, Any], first: np.ndarray[Any, Any]) -> bool:
    """Whether every row of ``heads`` (heads of frames a store checked, uint8) is ``first``, checksums aside."""
    mask = _HEAD_MASKS.get(len(first))
    if mask is None:
        at = np.arange(len(first))
        mask = _HEAD_MASKS[len(first)] = (at < PREFIX_SIZE - 8) | (at >= PREFIX_SIZE)
    return not ((heads != first) & mask).any()


_HEAD_MASKS: dict[int, np.ndarray[Any, Any]] = {}  # by head length: every byte but the checksum's


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
    data: bytes | memoryview,
    verify: bool = True,
    raw_size: Callable[[bytes], int] | None = None,
    out: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
) -> tuple[bytes, bytes | memoryview]:
    """Check a frame and return its header bytes and its decompressed payload.

    Args:
        data: The whole frame.
        verify: Check the checksum.
        raw_size: Called with the header bytes, returns the payload size the header
            describes; a frame that declares another size is rejected before its payload
            is decompressed. It may raise :class:`CorruptEntryError`.
        out: Where a zero-elided payload may be written (see :func:`unelide`).

    Raises:
        CorruptEntryError: If the frame is truncated, altered or not a torchcache entry.
    """
    codec, word, header_len, stored_len, raw_len, checksum = read_prefix(data)
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
    payload: bytes | memoryview
    if codec == CODEC_RAW:
        payload = stored
    elif codec == CODEC_ZERO:
        payload = unelide(stored, raw_len, word, out)
    else:
        payload = inflate(stored, raw_len)
    return header, payload


def decode_header(data: bytes | memoryview) -> dict[str, Any]:
    """Return only the header of a frame (no checksum check, no decompression)."""
    _, _, header_len, _, _, _ = read_prefix(data)
    return parse_header(bytes(memoryview(data)[PREFIX_SIZE : PREFIX_SIZE + header_len]))
