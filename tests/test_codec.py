"""Entry frames: round trips, compression, and rejection of corrupt or foreign data."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import gigabyte_of_zeros, traced_memory
from torchcache.codec import (
    CODEC_BROTLI,
    CODEC_RAW,
    CODEC_ZERO,
    MAGIC,
    MAX_ITEM_BYTES,
    PREFIX_SIZE,
    decode_frame,
    decode_header,
    encode_frame,
    encode_header,
    encode_zero_frames,
    frame_length,
    nested_deeper_than,
    split_frame,
    unelide,
    unelide_rows,
    word_size,
)
from torchcache.errors import CorruptEntryError

HEADER = {"tree": "T", "leaves": [{"dtype": "float32", "shape": [3, 4], "offset": 0}], "note": "ünïcode"}

_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
_headers = st.dictionaries(st.text(max_size=12), _json_values, max_size=6)
_qualities = st.one_of(st.none(), st.integers(0, 11))
_payloads = st.one_of(
    st.binary(max_size=2000),
    st.builds(lambda chunk, n: chunk * n, st.binary(min_size=1, max_size=16), st.integers(1, 500)),
)


def _compact_json(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def _fields(frame: bytes) -> tuple[Any, ...]:
    """``(magic, version, codec, reserved, header_len, stored_len, raw_len, checksum)``."""
    return struct.unpack_from("<4sBBHIQQQ", frame)


def _reseal(frame: bytearray) -> bytes:
    """Recompute the checksum of a frame whose fields were edited on purpose."""
    header_len = _fields(bytes(frame))[4]
    h = xxhash.xxh3_64(bytes(frame[: PREFIX_SIZE - 8]))
    h.update(bytes(frame[PREFIX_SIZE:]))
    assert PREFIX_SIZE + header_len <= len(frame)
    struct.pack_into("<Q", frame, PREFIX_SIZE - 8, h.intdigest())
    return bytes(frame)


# -- round trips ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(_headers, _payloads, _qualities)
def test_round_trip(header: dict[str, Any], payload: bytes, quality: int | None) -> None:
    frame = encode_frame(header, payload, quality)
    assert frame[:4] == MAGIC
    decoded_header, decoded_payload = decode_frame(frame)
    assert decoded_header == header
    assert bytes(decoded_payload) == payload
    assert decode_header(frame) == header
    header_bytes, split_payload = split_frame(frame)
    assert json.loads(header_bytes) == header
    assert bytes(split_payload) == payload


@settings(max_examples=30, deadline=None)
@given(_headers, _payloads, _qualities)
def test_round_trip_from_a_memoryview(header: dict[str, Any], payload: bytes, quality: int | None) -> None:
    frame = encode_frame(header, memoryview(payload), quality)
    assert frame == encode_frame(header, payload, quality)
    decoded_header, decoded_payload = decode_frame(memoryview(bytearray(frame)))
    assert decoded_header == header
    assert bytes(decoded_payload) == payload


def test_equal_inputs_give_equal_frames() -> None:
    payload = torch.relu(torch.randn(256)).numpy().tobytes()
    reordered = dict(reversed(list(HEADER.items())))
    assert encode_frame(HEADER, payload, 5) == encode_frame(reordered, payload, 5)


def test_float_tensor_payload_round_trips_bit_exactly() -> None:
    values = torch.relu(torch.randn(64, 33))
    values[0, 0] = float("nan")
    values[0, 1] = -0.0
    frame = encode_frame(HEADER, values.numpy().tobytes(), 5)
    _, payload = decode_frame(frame)
    restored = torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(64, 33)
    assert torch.equal(restored.view(torch.int32), values.view(torch.int32))


# -- sizes ----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=8), st.integers(200, 2000), st.integers(0, 11))
def test_compressible_payloads_get_smaller(chunk: bytes, repeats: int, quality: int) -> None:
    payload = chunk * repeats
    frame = encode_frame(HEADER, payload, quality)
    assert len(frame) < len(payload)
    assert _fields(frame)[2] == CODEC_BROTLI
    assert bytes(decode_frame(frame)[1]) == payload


def test_relu_outputs_are_compressed() -> None:
    payload = torch.relu(torch.randn(4096)).numpy().tobytes()
    frame = encode_frame(HEADER, payload, 5)
    assert len(frame) < 0.9 * len(payload)


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 1000, 100_000])
@pytest.mark.parametrize("quality", [None, 0, 5, 11])
def test_incompressible_payloads_are_stored_raw(size: int, quality: int | None) -> None:
    payload = os.urandom(size)
    frame = encode_frame(HEADER, payload, quality)
    assert len(frame) <= size + len(_compact_json(HEADER)) + PREFIX_SIZE
    assert _fields(frame)[2] == CODEC_RAW
    assert frame.endswith(payload)
    assert bytes(decode_frame(frame)[1]) == payload


def test_quality_none_never_compresses() -> None:
    payload = b"\x00" * 10_000
    frame = encode_frame(HEADER, payload, None)
    assert _fields(frame)[2] == CODEC_RAW
    assert len(frame) == PREFIX_SIZE + len(_compact_json(HEADER)) + len(payload)


# -- corruption -----------------------------------------------------------------------------


def _sample_positions(frame: bytes) -> list[int]:
    header_len = _fields(frame)[4]
    payload_start = PREFIX_SIZE + header_len
    positions = set(range(min(len(frame), payload_start)))  # every prefix and header byte
    positions.update(range(payload_start, len(frame), max(1, (len(frame) - payload_start) // 50)))
    positions.update(range(max(payload_start, len(frame) - 8), len(frame)))
    return sorted(positions)


_FRAMES = {
    "raw": lambda: encode_frame(HEADER, os.urandom(3000), 5),
    "brotli": lambda: encode_frame(HEADER, torch.relu(torch.randn(1000)).numpy().tobytes(), 5),
    "empty-payload": lambda: encode_frame(HEADER, b"", 5),
    "empty-header": lambda: encode_frame({}, b"\x01\x02" * 100, None),
}


@pytest.mark.parametrize("kind", list(_FRAMES))
def test_every_single_byte_flip_is_rejected(kind: str) -> None:
    frame = _FRAMES[kind]()
    assert decode_frame(frame)
    positions = _sample_positions(frame)
    assert positions[0] == 0 and positions[-1] == len(frame) - 1
    for pos in positions:
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(frame)
            damaged[pos] ^= mask
            with pytest.raises(CorruptEntryError):
                decode_frame(bytes(damaged))


@pytest.mark.parametrize("kind", list(_FRAMES))
def test_every_truncation_is_rejected(kind: str) -> None:
    frame = _FRAMES[kind]()
    for length in [*range(0, PREFIX_SIZE + 40), *range(PREFIX_SIZE + 40, len(frame), 7), len(frame) - 1]:
        if length >= len(frame):
            continue
        with pytest.raises(CorruptEntryError):
            decode_frame(frame[:length])


@pytest.mark.parametrize("extra", [b"\x00", b"junk", random.Random(0).randbytes(100)], ids=["nul", "junk", "random"])
def test_trailing_bytes_are_rejected(extra: bytes) -> None:
    frame = encode_frame(HEADER, os.urandom(100), 5)
    with pytest.raises(CorruptEntryError):
        decode_frame(frame + extra)


def test_bad_magic_is_rejected() -> None:
    frame = bytearray(encode_frame(HEADER, b"abc" * 100, 5))
    frame[:4] = b"TCHX"
    with pytest.raises(CorruptEntryError, match="magic"):
        decode_frame(_reseal(frame))
    with pytest.raises(CorruptEntryError, match="magic"):
        decode_header(bytes(frame))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_unknown_version_is_rejected(version: int) -> None:
    frame = bytearray(encode_frame(HEADER, b"abc" * 100, 5))
    assert frame[4] == 1
    frame[4] = version
    sealed = _reseal(frame)
    with pytest.raises(CorruptEntryError, match="version"):
        decode_frame(sealed)
    with pytest.raises(CorruptEntryError, match="version"):
        decode_header(sealed)


def test_unknown_codec_is_rejected_even_with_a_valid_checksum() -> None:
    frame = bytearray(encode_frame(HEADER, b"abc" * 100, None))
    frame[5] = 7
    with pytest.raises(CorruptEntryError):
        decode_frame(_reseal(frame))


def test_undecodable_brotli_payload_is_rejected_even_with_a_valid_checksum() -> None:
    frame = bytearray(encode_frame(HEADER, b"\xff" * 200, None))
    frame[5] = CODEC_BROTLI
    with pytest.raises(CorruptEntryError):
        decode_frame(_reseal(frame))


def test_wrong_raw_length_is_rejected_even_with_a_valid_checksum() -> None:
    for quality in (None, 5):
        frame = bytearray(encode_frame(HEADER, b"\x00" * 500, quality))
        struct.pack_into("<Q", frame, 20, 499)
        with pytest.raises(CorruptEntryError):
            decode_frame(_reseal(frame))


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe", b"null"])
def test_header_that_is_not_a_json_object_is_rejected(header: bytes) -> None:
    frame = bytearray(encode_frame({}, b"payload", None))
    header_len = _fields(bytes(frame))[4]
    rebuilt = bytearray(frame[:PREFIX_SIZE] + header + frame[PREFIX_SIZE + header_len :])
    struct.pack_into("<I", rebuilt, 8, len(header))
    sealed = _reseal(rebuilt)
    with pytest.raises(CorruptEntryError):
        decode_frame(sealed)
    with pytest.raises(CorruptEntryError):
        decode_header(sealed)


@pytest.mark.parametrize("data", [b"", b"TCHE", b"\x00" * PREFIX_SIZE, os.urandom(500)])
def test_foreign_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode_frame(data)


# -- no code runs on read -------------------------------------------------------------------

_RAN: dict[str, bool] = {"flag": False}


def _set_flag() -> None:
    _RAN["flag"] = True


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_set_flag, ())


class _ShellExploit:
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (os.system, ("false",))


@pytest.fixture
def armed_pickle() -> bytes:
    payload = pickle.dumps(_Exploit())
    _RAN["flag"] = False
    pickle.loads(payload)  # the payload is live: loading it runs code
    assert _RAN["flag"]
    _RAN["flag"] = False
    return payload


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_where_a_frame_is_expected_is_rejected_without_running(armed_pickle: bytes, protocol: int) -> None:
    for data in (armed_pickle, pickle.dumps(_Exploit(), protocol=protocol), pickle.dumps(_ShellExploit())):
        with pytest.raises(CorruptEntryError):
            decode_frame(data)
        with pytest.raises(CorruptEntryError):
            decode_header(data)
    assert not _RAN["flag"]


def test_torch_save_file_where_a_frame_is_expected_is_rejected(armed_pickle: bytes) -> None:
    buffer = io.BytesIO()
    torch.save({"x": torch.zeros(3), "evil": _Exploit()}, buffer)
    _RAN["flag"] = False
    with pytest.raises(CorruptEntryError):
        decode_frame(buffer.getvalue())
    assert not _RAN["flag"]


def test_pickle_inside_a_valid_frame_is_returned_as_bytes(armed_pickle: bytes) -> None:
    for quality in (None, 5):
        header, payload = decode_frame(encode_frame({"p": 1}, armed_pickle, quality))
        assert header == {"p": 1}
        assert bytes(payload) == armed_pickle
    assert not _RAN["flag"]


def test_pickle_prefixed_with_magic_is_rejected(armed_pickle: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode_frame(MAGIC + armed_pickle)
    with pytest.raises(CorruptEntryError):
        decode_frame(MAGIC + b"\x01\x00\x00\x00" + armed_pickle)
    assert not _RAN["flag"]


# -- frames that cost more than they declare ------------------------------------------------


@functools.lru_cache(maxsize=1)
def _sealed(codec: int, header: bytes, stored: bytes, raw_len: int) -> bytes:
    """A frame with any field values and a valid checksum."""
    head = struct.pack("<4sBBHIQQ", MAGIC, 1, codec, 0, len(header), len(stored), raw_len)
    digest = xxhash.xxh3_64(head)
    digest.update(header)
    digest.update(stored)
    return head + struct.pack("<Q", digest.intdigest()) + header + stored


def _peak_bytes(fn: Callable[[], object]) -> int:
    with traced_memory() as traced, contextlib.suppress(CorruptEntryError):
        fn()
    return traced()[1]


def test_a_decompression_bomb_stops_at_its_declared_size() -> None:
    bomb = _sealed(CODEC_BROTLI, _compact_json(HEADER), gigabyte_of_zeros(), 4096)
    with pytest.raises(CorruptEntryError, match="inflates past its declared 4096 bytes"):
        decode_frame(bomb)
    assert _peak_bytes(lambda: decode_frame(bomb)) < 4 << 20


def test_a_declared_size_that_disagrees_with_the_header_is_refused_before_decompressing() -> None:
    declared = MAX_ITEM_BYTES - 1
    bomb = _sealed(CODEC_BROTLI, _compact_json(HEADER), gigabyte_of_zeros(), declared)
    with pytest.raises(CorruptEntryError, match=f"payload is {declared} bytes, its header describes 48"):
        split_frame(bomb, raw_size=lambda header: 48)
    assert _peak_bytes(lambda: split_frame(bomb, raw_size=lambda header: 48)) < 1 << 20


@pytest.mark.parametrize(
    ("codec", "stored_len", "raw_len", "match"),
    [
        (CODEC_BROTLI, 10, MAX_ITEM_BYTES + 1, "more than"),
        (CODEC_BROTLI, 100, 10, "do not agree"),
        (CODEC_RAW, 100, 99, "do not agree"),
    ],
)
def test_inconsistent_or_oversized_lengths_are_refused_from_the_prefix(
    codec: int, stored_len: int, raw_len: int, match: str
) -> None:
    prefix = struct.pack("<4sBBHIQQQ", MAGIC, 1, codec, 0, 2, stored_len, raw_len, 0)
    with pytest.raises(CorruptEntryError, match=match):
        frame_length(prefix)


def test_frame_length_reads_the_prefix_only() -> None:
    frame = encode_frame(HEADER, os.urandom(500), None)
    assert frame_length(frame[:PREFIX_SIZE]) == len(frame)
    with pytest.raises(CorruptEntryError, match="truncated"):
        frame_length(frame[: PREFIX_SIZE - 1])


@pytest.mark.parametrize("header", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000])
def test_a_deeply_nested_header_is_corrupt_not_a_recursion_error(header: bytes) -> None:
    frame = _sealed(CODEC_RAW, header, b"", 0)
    with pytest.raises(CorruptEntryError, match=r"nested too deeply|not a JSON object"):
        decode_frame(frame)
    with pytest.raises(CorruptEntryError):
        decode_header(frame)


def test_nesting_below_the_limit_parses() -> None:
    header = {"tree": "T", "deep": functools.reduce(lambda inner, _: [inner], range(50), [])}
    assert decode_frame(encode_frame(header, b"", None))[0] == header
    assert nested_deeper_than({"a": [[[]]]}, 3) and not nested_deeper_than({"a": [[[]]]}, 4)


# -- zero elision ---------------------------------------------------------------------------

_NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]


def _sparse_payload(dtype: type[np.generic], length: int, zero_fraction: float, extra: int, seed: int) -> bytes:
    """``length`` values of ``dtype`` of which about ``zero_fraction`` are zero, then ``extra`` odd bytes."""
    rng = np.random.default_rng(seed)
    values = (
        rng.integers(-(2**7), 2**7, length).astype(dtype)
        if np.dtype(dtype).kind in "iu"
        else rng.standard_normal(length).astype(dtype)
    )
    values[rng.random(length) < zero_fraction] = 0
    return values.tobytes() + rng.integers(0, 256, extra, dtype=np.uint8).tobytes()


def _zero_frame(payload: bytes, word: int, header: bytes = b"{}") -> bytes:
    """A zero-elided frame, built by hand so that any payload (even a dense one) can be elided."""
    raw = np.frombuffer(payload, dtype=np.uint8)
    n = len(raw) // word
    words = raw[: n * word].view({2: np.uint16, 4: np.uint32, 8: np.uint64}[word])
    mask = np.packbits(words != 0, bitorder="little")
    stored = mask.tobytes() + words[words != 0].tobytes() + raw[n * word :].tobytes()
    return _sealed_word(CODEC_ZERO, word, header, stored, len(payload))


def _sealed_word(codec: int, word: int, header: bytes, stored: bytes, raw_len: int) -> bytes:
    """A frame with any field values (the word size included) and a valid checksum."""
    head = struct.pack("<4sBBHIQQ", MAGIC, 1, codec, word, len(header), len(stored), raw_len)
    digest = xxhash.xxh3_64(head)
    digest.update(header)
    digest.update(stored)
    return head + struct.pack("<Q", digest.intdigest()) + header + stored


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(_NUMPY_DTYPES),
    st.integers(0, 3000),
    st.floats(0, 1),
    st.integers(0, 7),
    st.sampled_from([2, 4, 8]),
    _qualities,
    st.integers(0, 2**32 - 1),
)
def test_zero_elision_round_trips(
    dtype: type[np.generic], length: int, zero_fraction: float, extra: int, word: int, quality: int | None, seed: int
) -> None:
    payload = _sparse_payload(dtype, length, zero_fraction, extra, seed)
    frame = encode_frame(HEADER, payload, quality, word)
    assert bytes(decode_frame(frame)[1]) == payload
    assert len(frame) <= PREFIX_SIZE + len(_compact_json(HEADER)) + len(payload)
    forced = _zero_frame(payload, word)  # elided whatever its sparsity
    if _fields(forced)[5] <= len(payload):
        assert bytes(decode_frame(forced)[1]) == payload
    else:  # a stored payload is never longer than the raw one
        with pytest.raises(CorruptEntryError, match="do not agree"):
            decode_frame(forced)


@pytest.mark.parametrize("word", [2, 4, 8])
@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 1003, 70_001])
def test_zero_elision_keeps_a_tail_that_is_not_a_whole_word(word: int, size: int) -> None:
    payload = bytearray(size)
    payload[-(size % word or 1) :] = os.urandom(size % word or 1) if size else b""
    payload[: size // 3] = os.urandom(size // 3)
    frame = _zero_frame(bytes(payload), word)
    if _fields(frame)[5] <= size:  # (tiny payloads can grow: those are never elided)
        assert bytes(decode_frame(frame)[1]) == payload
    if size >= 64:
        chosen = encode_frame(HEADER, bytes(payload), None, word)
        assert _fields(chosen)[2:4] == (CODEC_ZERO, word)
        assert bytes(decode_frame(chosen)[1]) == payload


def test_the_word_size_follows_the_layout() -> None:
    assert word_size([4], [3072]) == 4
    assert word_size([2, 2], [16, 8]) == 2
    assert word_size([8], [64]) == 8
    assert word_size([16], [64]) == 8
    assert word_size([4, 8], [16, 24]) == 4
    assert word_size([1], [64]) == 4
    assert word_size([1, 2], [6, 8]) == 2
    with pytest.raises(ValueError, match="word size"):
        encode_frame(HEADER, b"", None, 3)


def test_relu_floats_are_zero_elided() -> None:
    payload = torch.relu(torch.randn(197, 768)).numpy().tobytes()
    frame = encode_frame(HEADER, payload, 5, 4)
    assert _fields(frame)[2:4] == (CODEC_ZERO, 4)
    assert len(frame) < 0.56 * len(payload)
    assert bytes(decode_frame(frame)[1]) == payload


def test_dense_floats_stay_raw() -> None:
    payload = torch.nn.functional.gelu(torch.randn(197, 768)).numpy().tobytes()
    frame = encode_frame(HEADER, payload, 5, 4)
    assert _fields(frame)[2:4] == (CODEC_RAW, 0)
    assert frame.endswith(payload)


def test_small_integers_get_brotli() -> None:
    payload = torch.randint(0, 32000, (512,), dtype=torch.int64).numpy().tobytes()
    frame = encode_frame(HEADER, payload, 5, 8)
    assert _fields(frame)[2:4] == (CODEC_BROTLI, 0)
    assert len(frame) < 0.5 * len(payload)
    assert bytes(decode_frame(frame)[1]) == payload


def test_brotli_must_beat_zero_elision_by_a_margin() -> None:
    # Mostly zeros and a repeating pattern: both shrink it, brotli far more.
    payload = (b"\x00" * 12 + b"\x01\x02\x03\x04") * 1000
    assert _fields(encode_frame(HEADER, payload, 5, 4))[2] == CODEC_BROTLI
    assert _fields(encode_frame(HEADER, payload, None, 4))[2] == CODEC_ZERO
    # ReLU floats: brotli is about as small as zero elision, so zero elision wins.
    relu = torch.relu(torch.randn(8192)).numpy().tobytes()
    assert _fields(encode_frame(HEADER, relu, 11, 4))[2] == CODEC_ZERO


def test_too_few_zeros_are_not_elided() -> None:
    values = torch.randn(4096)
    values[: int(0.3 * 4096)] = 0
    assert _fields(encode_frame(HEADER, values.numpy().tobytes(), None, 4))[2] == CODEC_RAW
    values[: int(0.4 * 4096)] = 0
    assert _fields(encode_frame(HEADER, values.numpy().tobytes(), None, 4))[2] == CODEC_ZERO


def _relu_zero_frame(word: int = 4) -> tuple[bytes, bytes]:
    payload = torch.relu(torch.randn(1001)).numpy().tobytes() + b"xyz"
    return payload, _zero_frame(payload, word, _compact_json(HEADER))


def _zero_parts(frame: bytes) -> tuple[bytes, bytes, int, int]:
    """``(header, stored, raw_len, word)`` of a frame."""
    _, _, _, word, header_len, _, raw_len, _ = _fields(frame)
    return frame[PREFIX_SIZE : PREFIX_SIZE + header_len], frame[PREFIX_SIZE + header_len :], raw_len, word


def test_a_zero_elision_frame_survives_every_damage_as_corrupt() -> None:
    payload, frame = _relu_zero_frame()
    assert bytes(decode_frame(frame)[1]) == payload
    for position in _sample_positions(frame):
        for flip in (0x01, 0x80):
            damaged = bytearray(frame)
            damaged[position] ^= flip
            with contextlib.suppress(CorruptEntryError):
                assert bytes(decode_frame(bytes(damaged))[1]) == payload  # only if the flip is a no-op
                raise AssertionError(f"a flip at {position} decoded")
    for length in range(0, len(frame), 97):
        with pytest.raises(CorruptEntryError):
            decode_frame(frame[:length])


def _edited(change: Callable[[bytes, bytes, int, int], tuple[bytes, int, int]]) -> bytes:
    """A resealed copy of a ReLU zero-elided frame whose stored payload, raw length or word ``change`` rewrites."""
    _, frame = _relu_zero_frame()
    header, stored, raw_len, word = _zero_parts(frame)
    stored, raw_len, word = change(header, stored, raw_len, word)
    return _sealed_word(CODEC_ZERO, word, header, stored, raw_len)


def _flip_mask_bit(stored: bytes, bit: int) -> bytes:
    out = bytearray(stored)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


_MASK_LEN = -(-1001 // 8)  # 1001 float32 words (and a 3-byte tail): 7 unused mask bits


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # a mask bit cleared or set: the bit count no longer matches the stored words
        (
            lambda h, s, r, w: (_flip_mask_bit(s, next(i for i in range(1000) if s[i // 8] >> (i % 8) & 1)), r, w),
            "count",
        ),
        (
            lambda h, s, r, w: (_flip_mask_bit(s, next(i for i in range(1000) if not s[i // 8] >> (i % 8) & 1)), r, w),
            "count",
        ),
        # truncated values: the stored length is no longer a whole number of words
        (lambda h, s, r, w: (s[:-4], r, w), "count|length"),
        (lambda h, s, r, w: (s[:-5], r, w), "length"),
        (lambda h, s, r, w: (s[: _MASK_LEN - 1], r, w), "length"),
        (lambda h, s, r, w: (b"", r, w), "length"),
        # a mask claiming more words than the raw length holds
        (lambda h, s, r, w: (s[:_MASK_LEN] + b"\xff" * 8 + s[_MASK_LEN:], r, w), "count|length"),
        (
            lambda h, s, r, w: (
                s[: _MASK_LEN - 1] + bytes([s[_MASK_LEN - 1] | 0x80]) + s[_MASK_LEN:] + b"\x01\x00\x00\x00",
                r,
                w,
            ),
            "past",
        ),
        (lambda h, s, r, w: (s, r - 8, w), "count|length|past"),
        # the wrong word size for the stored payload
        (lambda h, s, r, w: (s, r, 8), "count|length"),
        (lambda h, s, r, w: (s, r, 2), "count|length"),
        (lambda h, s, r, w: (s, r, 3), "word size"),
        (lambda h, s, r, w: (s, r, 0), "word size"),
    ],
)
def test_inconsistent_zero_elision_frames_are_corrupt(
    change: Callable[[bytes, bytes, int, int], tuple[bytes, int, int]], match: str
) -> None:
    frame = _edited(change)
    with pytest.raises(CorruptEntryError, match=match):
        decode_frame(frame)


def test_a_zero_elision_frame_declaring_a_huge_payload_allocates_nothing() -> None:
    header = _compact_json(HEADER)
    # 1 GiB of words behind a small mask: lengths disagree before anything is allocated
    for raw_len, stored in [(1 << 30, b"\xff" * 64), (MAX_ITEM_BYTES, b"\x00" * 1000)]:
        frame = _sealed_word(CODEC_ZERO, 4, header, stored, raw_len)
        with pytest.raises(CorruptEntryError):
            decode_frame(frame)
        assert _peak_bytes(lambda f=frame: decode_frame(f)) < 1 << 20
    with pytest.raises(CorruptEntryError, match="payload is"):
        split_frame(_sealed_word(CODEC_ZERO, 4, header, b"\x00" * 1000, MAX_ITEM_BYTES), raw_size=lambda h: 48)


def test_a_valid_zero_elision_frame_allocates_about_its_raw_length() -> None:
    payload = torch.relu(torch.randn(1 << 20)).numpy().tobytes()  # 4 MiB
    frame = encode_frame(HEADER, payload, None, 4)
    assert _fields(frame)[2] == CODEC_ZERO
    assert _peak_bytes(lambda: decode_frame(frame)) < len(payload) + (1 << 20)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5000), st.floats(0, 1), st.integers(0, 7), st.sampled_from([2, 4, 8]), st.integers(0, 2**32 - 1))
def test_unelide_writes_into_a_given_row_or_allocates_its_own(
    length: int, zero_fraction: float, extra: int, word: int, seed: int
) -> None:
    payload = _sparse_payload(np.float32, length, zero_fraction, extra, seed)
    stored = _zero_frame(payload, word)[PREFIX_SIZE + 2 :]  # the header is b"{}"
    row = np.full(len(payload), 0xAB, dtype=np.uint8)  # garbage first: every byte is written
    got = unelide(stored, len(payload), word, out=row)
    assert bytes(got) == payload and row.tobytes() == payload
    assert len(payload) == 0 or np.frombuffer(got, dtype=np.uint8).ctypes.data == row.ctypes.data
    for unusable in (np.zeros(len(payload) + 1, dtype=np.uint8), np.zeros(len(payload), dtype=np.int8)):
        before = unusable.copy()
        assert bytes(unelide(stored, len(payload), word, out=unusable)) == payload
        assert np.array_equal(unusable, before)  # a row of another size or dtype is left alone
    frozen = np.zeros(len(payload), dtype=np.uint8)
    frozen.flags.writeable = False
    assert bytes(unelide(stored, len(payload), word, out=frozen)) == payload


def test_unelide_checks_its_arguments() -> None:
    with pytest.raises(CorruptEntryError, match="word size"):
        unelide(b"", 0, 5)
    assert bytes(unelide(b"", 0, 4)) == b""
    assert bytes(unelide(b"\x00", 8, 4)) == bytes(8)


def _sparse_rows(rows: int, length: int, word: int, seed: int) -> np.ndarray:
    """``rows`` payloads of ``length`` bytes, each with its own fraction of zero words (0 to 1)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 256, (rows, length), dtype=np.uint8)
    n = length // word
    words = out[:, : n * word].view({2: np.uint16, 4: np.uint32, 8: np.uint64}[word])
    words[rng.random((rows, n)) < rng.random((rows, 1))] = 0
    return out


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 24), st.integers(0, 600), st.sampled_from([2, 4, 8]), st.integers(0, 2**32 - 1))
def test_zero_frames_of_a_batch_are_the_frames_of_each_row(rows: int, length: int, word: int, seed: int) -> None:
    payloads = _sparse_rows(rows, length, word, seed)
    header = encode_header(HEADER)
    frames = encode_zero_frames(header, payloads, word)
    assert len(frames) == rows
    for frame, payload in zip(frames, payloads):
        alone = encode_frame(header, memoryview(payload), None, word)
        if frame is None:  # elision did not pay: the one-row encoder stores it raw too
            assert alone[5] == CODEC_RAW
        else:
            assert frame == alone and bytes(decode_frame(frame)[1]) == payload.tobytes()


def _stored_payloads(payloads: np.ndarray, word: int) -> list[bytes]:
    """The stored zero-elided payload of every row, elided whatever its sparsity."""
    return [_zero_frame(payload.tobytes(), word)[PREFIX_SIZE + 2 :] for payload in payloads]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 16),
    st.integers(1, 400),
    st.sampled_from([2, 4, 8]),
    st.lists(st.tuples(st.integers(0, 15), st.integers(0, 10**6), st.sampled_from(["flip", "cut", "grow"]))),
    st.integers(0, 2**32 - 1),
)
def test_rows_rebuilt_together_match_one_by_one_and_damage_is_left_alone(
    rows: int, length: int, word: int, damage: list[tuple[int, int, str]], seed: int
) -> None:
    payloads = _sparse_rows(rows, length, word, seed)
    stored = [bytearray(s) for s in _stored_payloads(payloads, word)]
    for row, at, how in damage:
        target = stored[row % rows]
        if how == "flip" and target:
            target[at % len(target)] ^= 1 << (at % 8)
        elif how == "cut" and target:
            del target[at % len(target) :]
        elif how == "grow":
            target += bytes([at % 256]) * (1 + at % 9)
    out = np.full((rows, length), 0xAB, dtype=np.uint8)
    done = unelide_rows([bytes(s) for s in stored], word, out)
    for i, data in enumerate(stored):
        try:
            expected: bytes | None = bytes(unelide(bytes(data), length, word))
        except CorruptEntryError:
            expected = None
        if length < word:  # no whole word: left to the one-by-one decoder
            assert not done[i]
        else:
            assert done[i] == (expected is not None)
        if done[i]:
            assert out[i].tobytes() == expected
        else:
            assert (out[i] == 0xAB).all()  # a row that was not rebuilt is not touched


def test_rows_rebuilt_together_into_rows_of_a_wider_array() -> None:
    payloads = _sparse_rows(6, 1002, 4, seed=3)  # a 2-byte tail after the last whole word
    wide = np.full((6, 1100), 0xCD, dtype=np.uint8)
    stored = _stored_payloads(payloads, 4)
    stored[2] = stored[2][:-1]  # damaged: the others still land
    done = unelide_rows(stored, 4, wide[:, :1002])
    assert done.tolist() == [True, True, False, True, True, True]
    assert np.array_equal(wide[done, :1002], payloads[done])
    assert (wide[2] == 0xCD).all() and (wide[:, 1002:] == 0xCD).all()


def test_batch_elision_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="word size"):
        encode_zero_frames(b"{}", np.zeros((2, 64), dtype=np.uint8), 3)
    with pytest.raises(ValueError, match="word size"):
        unelide_rows([b""], 5, np.zeros((1, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="out must be"):
        unelide_rows([b"", b""], 4, np.zeros((1, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="out must be"):
        unelide_rows([b""], 4, np.zeros((1, 8), dtype=np.uint8)[:, ::2])


@pytest.mark.parametrize(
    ("make", "codec"),
    [
        (lambda n: torch.relu(torch.randn(n, 197, 768)), CODEC_ZERO),
        (lambda n: torch.nn.functional.gelu(torch.randn(n, 64, 96)), CODEC_RAW),
        (lambda n: torch.randint(0, 32000, (n, 512)), CODEC_BROTLI),
        (lambda n: torch.relu(torch.randn(n, 64, 256)).half(), CODEC_ZERO),
        (lambda n: torch.relu(torch.randn(n, 768)), CODEC_ZERO),  # small rows, elided as one array
        (lambda n: torch.relu(torch.randn(n, 100)).bfloat16(), CODEC_ZERO),
        (lambda n: torch.randint(0, 32000, (n, 16)), CODEC_BROTLI),
    ],
)
@pytest.mark.parametrize("n", [4, 40])  # decoded on the calling thread, and in chunks on the pool
def test_the_disk_tier_stores_each_kind_of_output_with_its_codec(
    tmp_path: Path, make: Callable[[int], torch.Tensor], codec: int, n: int
) -> None:
    from torchcache.tiers.local import open_local_tier
    from torchcache.tree import Layout, flatten

    reports: list[tuple[str, str]] = []
    tier = open_local_tier(tmp_path / "module", 10**9, 5, {"torchcache_version": "test"}, lambda *r: reports.append(r))
    outputs = make(n)
    spec, leaves = flatten(outputs)
    layout = Layout.of(spec, leaves, None)
    keys = [f"{i:032x}" for i in range(n)]
    tier.write(keys, layout, [leaf.contiguous() for leaf in leaves])
    tier.flush()
    frames = tier.store.get_many(keys)  # from the store itself, not the tier's write queue
    for frame in frames:
        assert frame is not None
        fields = _fields(bytes(frame))
        assert fields[2] == codec  # the codec byte, at offset 5
        if codec == CODEC_ZERO:
            assert fields[3] == outputs.dtype.itemsize
    positions, got_layout, got = tier.read(keys)
    assert positions == list(range(n)) and got_layout == layout
    assert torch.equal(got[0].view(torch.uint8), outputs.view(torch.uint8))
    assert reports == []


def test_small_zero_elided_rows_read_together_next_to_other_frames_and_damage(tmp_path: Path) -> None:
    from torchcache.tiers.local import open_local_tier
    from torchcache.tree import Layout, flatten

    reports: list[tuple[str, str]] = []
    tier = open_local_tier(tmp_path / "module", 10**9, 5, {"torchcache_version": "test"}, lambda *r: reports.append(r))
    outputs = torch.relu(torch.randn(40, 768))
    spec, leaves = flatten(outputs)
    layout = Layout.of(spec, leaves, None)
    keys = [f"{i:032x}" for i in range(40)]
    tier.write(keys, layout, [outputs])
    tier.flush()
    header = tier.codec.header_of(layout)
    payload = [outputs[i].numpy().tobytes() for i in range(40)]
    _, stored, raw_len, word = _zero_parts(bytes(tier.store.get_many([keys[7]])[0]))
    other = Layout.of(*flatten(outputs.view(torch.int32)), None)
    planted = {
        3: _sealed_word(CODEC_ZERO, 2, header, _zero_frame(payload[3], 2)[PREFIX_SIZE + 2 :], raw_len),  # other word
        5: encode_frame(header, payload[5], 11),  # brotli
        7: _sealed_word(CODEC_ZERO, word, header, _flip_mask_bit(stored, 0), raw_len),  # bit count wrong
        9: encode_frame(header, payload[9], None),  # raw
        11: encode_frame(tier.codec.header_of(other), payload[11], None, word),  # another layout
    }
    tier.store.put_many([(keys[i], frame) for i, frame in planted.items()])
    positions, got_layout, got = tier.read(keys)
    assert got_layout == layout
    assert positions == [i for i in range(40) if i not in (7, 11)]
    assert torch.equal(got[0], outputs[positions])
    assert [kind for kind, _ in reports] == ["corrupt"] and "1 corrupt" in reports[0][1]
    assert keys[7] not in tier.store and keys[11] in tier.store


def test_batches_of_many_rows_are_elided_and_rebuilt_in_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchcache.codec as codec

    payloads = _sparse_rows(50, 400, 4, seed=9)
    whole = encode_zero_frames(b"{}", payloads, 4)
    stored = _stored_payloads(payloads, 4)
    stored[31] = stored[31][:-4]
    expected = np.full((50, 400), 0xAB, dtype=np.uint8)
    done = unelide_rows(stored, 4, expected)
    monkeypatch.setattr(codec, "_BATCH_WORDS", 300)  # three rows of 100 words per pass
    assert encode_zero_frames(b"{}", payloads, 4) == whole
    out = np.full((50, 400), 0xAB, dtype=np.uint8)
    assert np.array_equal(unelide_rows(stored, 4, out), done) and not done[31] and done.sum() == 49
    assert np.array_equal(out, expected)


def test_zero_elision_is_tried_now_and_then_once_a_layout_is_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchcache.tiers.frames as frames_module
    from torchcache.tiers.frames import FrameCodec
    from torchcache.tree import Layout, flatten

    calls: list[int] = []
    real = frames_module.encode_zero_frames

    def counting(header: bytes, rows: np.ndarray, word: int) -> list[bytes | None]:
        calls.append(len(rows))
        return real(header, rows, word)

    monkeypatch.setattr(frames_module, "encode_zero_frames", counting)
    codec = FrameCodec(quality=5)
    dense = torch.randn(64, 768) + 10  # no zeros
    layout = Layout.of(*flatten(dense), None)
    packed = dense.view(torch.uint8).numpy()
    for _ in range(40):
        frames = codec.encode(layout, packed)
        assert all(decode_frame(bytes(f))[1] == packed[i].tobytes() for i, f in enumerate(frames))
    assert len(calls) == 8 + 2  # the first 8 jobs, then jobs 16 and 32
    sparse = torch.relu(torch.randn(64, 768))
    packed = sparse.view(torch.uint8).numpy()
    kinds = [{bytes(f)[5] for f in codec.encode(layout, packed)} for _ in range(16)]
    assert not any(CODEC_ZERO in k for k in kinds[:8])  # jobs 40-47 do not try
    assert all(CODEC_ZERO in k for k in kinds[8:])  # job 48 tries, and from then on every job


@pytest.mark.parametrize("make", [lambda: torch.randn(12, 768), lambda: torch.relu(torch.randn(12, 768))])
def test_a_batch_mixing_long_and_short_headers_of_one_layout_is_read_whole(
    tmp_path: Path, make: Callable[[], torch.Tensor]
) -> None:
    from torchcache.tiers.local import open_local_tier
    from torchcache.tree import Layout, flatten

    reports: list[tuple[str, str]] = []
    tier = open_local_tier(tmp_path / "module", 10**9, 5, {"torchcache_version": "test"}, lambda *r: reports.append(r))
    outputs = make()
    layout = Layout.of(*flatten(outputs), None)
    keys = [f"{i:032x}" for i in range(12)]
    tier.write(keys[6:], layout, [outputs[6:]])  # short headers
    tier.flush()
    long = b'{"leaves":[{"dtype":"float32","offset":0,"shape":[768]}],"tree":"T"}'  # as torchcache 1.0 wrote
    tier.store.put_many([(keys[i], encode_frame(long, outputs[i].numpy().tobytes(), None, 4)) for i in range(6)])
    header_lengths = {int.from_bytes(bytes(f)[8:12], "little") for f in tier.store.get_many(keys) if f is not None}
    assert header_lengths == {len(long), len(tier.codec.header_of(layout))}  # both forms in the store
    positions, got_layout, got = tier.read(keys[3:9])
    assert positions == list(range(6)) and got_layout == layout
    assert torch.equal(got[0], outputs[3:9])
    assert reports == []


def test_raw_rows_of_one_layout_are_one_contiguous_array_and_others_are_refused() -> None:
    from torchcache.stores.batched import rows_of
    from torchcache.tiers.frames import FrameCodec
    from torchcache.tree import Layout, flatten

    codec = FrameCodec(quality=5)
    noise = np.random.default_rng(0).integers(0, 256, (8, 768 * 4), dtype=np.uint8)
    dense = torch.from_numpy(noise).view(torch.float32)  # incompressible: raw frames
    layout = Layout.of(*flatten(dense), None)
    frames = [bytes(f) for f in codec.encode(layout, dense.view(torch.uint8).numpy())]
    assert {f[5] for f in frames} == {CODEC_RAW}
    found = rows_of([memoryview(b"." + f)[1:] for f in frames], codec.raw_head)  # views at odd addresses
    assert found is not None and found.positions.tolist() == list(range(8))
    assert codec.raw_layout(found.heads) == layout
    rows = found.rest
    assert rows.shape == (8, 768 * 4) and rows.flags.c_contiguous
    assert np.array_equal(rows, dense.view(torch.uint8).numpy())
    other = bytearray(frames[3])
    other[PREFIX_SIZE + 5] ^= 1  # another header of the same length
    mixed = rows_of([*frames[:3], bytes(other), *frames[4:]], codec.raw_head)
    assert mixed is not None and codec.raw_layout(mixed.heads) is None
    assert rows_of([*frames[:3], frames[3][:-4], *frames[4:]], codec.raw_head) is None  # another length


def test_the_headers_a_codec_keeps_parsed_are_bounded_in_number_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchcache.tiers.frames as frames_module
    from torchcache.tiers.frames import FrameCodec
    from torchcache.tree import Layout, flatten

    monkeypatch.setattr(frames_module, "_LAYOUTS_KEPT", 4)
    monkeypatch.setattr(frames_module, "_LAYOUT_HEADER_BYTES", 1 << 16)
    codec = FrameCodec(quality=5)

    def written(value: Any) -> bytes:
        return encode_header(Layout.of(*flatten(value), None).to_header())  # as another process wrote it

    headers = [written(torch.zeros(1, width)) for width in range(1, 8)]
    for header in headers:
        codec.layout_of(header)
        assert len(codec._layouts) <= 4  # the oldest go once it holds four
    big = written(tuple(torch.zeros(1, 1) for _ in range(5000)))
    assert len(big) > frames_module._LAYOUT_HEADER_BYTES  # a header of thousands of leaves (a planted one)
    assert len(codec.layout_of(big).leaves) == 5000 and big not in codec._layouts  # parsed, not kept
    large = written(tuple(torch.zeros(1, 1) for _ in range(900)))  # over a quarter of the bytes kept
    for _ in range(5):
        codec.layout_of(large)
        codec.layout_of(written(torch.zeros(1, 9)))
    assert large in codec._layouts and codec._kept <= frames_module._LAYOUT_HEADER_BYTES  # kept, and bounded
    codec.layout_of(written(tuple(torch.zeros(1, 1) for _ in range(2000))))
    codec.layout_of(written(tuple(torch.zeros(1, 1) for _ in range(2200))))
    assert codec._kept <= frames_module._LAYOUT_HEADER_BYTES and large not in codec._layouts  # went to make room
