"""The sample codec: every supported type round-trips, others are refused clearly, hostile frames are errors."""

from __future__ import annotations

import contextlib
import json
import math
import struct
import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchcache.codec import PREFIX_SIZE, seal
from torchcache.datasets.decode import decode_sample, decode_samples
from torchcache.datasets.encode import MAX_INT_BITS, MAX_NODES, SampleTypeError, check_sample, encode_sample
from torchcache.dtypes import DTYPES as TORCH_DTYPES
from torchcache.dtypes import MAX_DEPTH, NUMPY_DTYPES
from torchcache.errors import CorruptEntryError, KeyingError


def frame_of(header: object, data: bytes = b"") -> bytes:
    """A raw frame of ``header`` (JSON-encoded) and ``data``, with a valid checksum."""
    return seal(json.dumps(header).encode(), [data])


def header_of(frame: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", frame, 8)
    return frame[PREFIX_SIZE : PREFIX_SIZE + length]


def assert_same(got: Any, want: Any, path: str = "sample") -> None:
    """Equal values of the same types: tensors bit for bit (dtype, shape), NaN equal to NaN."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.is_contiguous() and got.device.type == "cpu", path
        want = want.detach().resolve_conj().resolve_neg().contiguous()
        assert bytes(got.reshape(-1).view(torch.uint8).numpy()) == bytes(want.reshape(-1).view(torch.uint8).numpy())
        return
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (float, complex, np.generic)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), path  # bit for bit, NaN included
    else:
        assert got == want, path


def round_trip(sample: Any) -> Any:
    decoded = decode_sample(encode_sample(sample))
    assert_same(decoded, sample)
    return decoded


# -- every supported type -------------------------------------------------------------
def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (3, 16, 16)])
def test_tensors_of_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental", UserWarning)
        tensor = random_tensor(TORCH_DTYPES[name], shape)
        decoded = round_trip(tensor)
    assert decoded.data_ptr() != tensor.data_ptr() or tensor.numel() == 0


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 7)])
def test_batches_of_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental", UserWarning)
        wanted = [
            (random_tensor(TORCH_DTYPES[name], shape), i, [random_tensor(TORCH_DTYPES[name], shape)]) for i in range(5)
        ]
        got = decode_samples([encode_sample(sample) for sample in wanted])
    assert_same(got, wanted)


def test_the_dtype_tables_cover_the_usual_dtypes() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.bool, torch.complex64, torch.uint8, torch.float8_e4m3fn):
        assert dtype in TORCH_DTYPES.values()
    assert {"<f2", ">f8", "|b1", "|u1", "<c16", ">i8"} <= set(NUMPY_DTYPES)


def test_non_contiguous_conjugated_and_negated_tensors_are_stored_as_their_values() -> None:
    base = torch.randn(6, 8)
    for tensor in (base.t(), base[::2, 1::3], base.expand(2, 6, 8), torch.randn(3, dtype=torch.complex64).conj()):
        round_trip(tensor)
    negated = torch.randn(4, dtype=torch.complex64).conj().imag  # a tensor with the negative bit set
    assert_same(decode_sample(encode_sample(negated)), negated.clone())
    parameter = torch.nn.Parameter(torch.randn(3))
    decoded = decode_sample(encode_sample(parameter))
    assert type(decoded) is torch.Tensor and not decoded.requires_grad and torch.equal(decoded, parameter)


@pytest.mark.parametrize("code", sorted(NUMPY_DTYPES))
def test_numpy_arrays_and_scalars_of_every_dtype(code: str) -> None:
    dtype = NUMPY_DTYPES[code]
    raw = np.random.default_rng(0).integers(0, 256, 24 * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw = raw % 2
    array = raw.view(dtype).reshape(2, 3, 4)
    round_trip(array)
    round_trip(array[:, ::2, 1:])  # not contiguous
    round_trip(np.zeros((0, 5), dtype))
    round_trip(array.reshape(-1)[0])  # a numpy scalar of that dtype
    decoded = decode_sample(encode_sample(array))
    assert decoded.flags.writeable


@pytest.mark.parametrize("scalar", [np.int64(7), np.uint64(7), np.int32(7), np.int16(7)])  # np.longlong: as np.int64
def test_a_numpy_scalar_and_array_come_back_of_their_own_type(scalar: Any) -> None:
    decoded = decode_sample(encode_sample((scalar, np.arange(3, dtype=type(scalar)))))
    assert type(decoded[0]) is type(scalar) and decoded[0] == scalar  # np.int64 was np.longlong on Linux
    assert decoded[1].dtype.type is type(scalar)


def test_python_values_and_containers() -> None:
    sample = {
        "none": None,
        "flags": [True, False],
        "ints": (0, -1, 2**63 - 1, -(2**63), 2**63, -(2**200)),
        "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324],
        "complex": [1j, complex(-0.0, math.nan)],
        "text": ["", "ascii", "héllo wörld ✓", "\udc80 lone surrogate", "\0"],
        "bytes": [b"", b"\x00\xff" * 10],
        7: "an int key",
        -3: (),
        "nested": [[], {}, ((),), [{"a": [None]}]],
    }
    round_trip(sample)
    for scalar in (None, True, 3, 2.5, "s", b"b", 1 + 2j):
        round_trip(scalar)


def test_decoded_values_do_not_alias_the_frame_and_are_writable() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    frame = bytearray(encode_sample((tensor, np.arange(3))))
    decoded, array = decode_sample(frame)
    frame[-60:] = b"\xff" * 60  # the caller reuses its buffer
    decoded += 1  # writable, no warning
    array[0] = 7
    assert torch.equal(decoded, tensor + 1) and array.tolist() == [7, 1, 2]
    again, _ = decode_sample(encode_sample((tensor, np.arange(3))))
    assert torch.equal(again, tensor)


def test_decode_accepts_bytes_bytearray_and_memoryview() -> None:
    frame = encode_sample({"x": torch.ones(2)})
    for data in (frame, bytearray(frame), memoryview(frame), memoryview(b"pad" + frame)[3:]):
        assert torch.equal(decode_sample(data)["x"], torch.ones(2))


def test_samples_of_one_shape_share_a_header() -> None:
    frames = [encode_sample((torch.full((3, 4), i), i, float(i), f"n{i}")) for i in range(5, 9)]
    assert len({header_of(f) for f in frames}) == 1
    assert (
        header_of(frames[0]) == b'{"l":[["i8",[3,4]],["i8",[]],["f8",[]],["u1",[2]]],"t":["tuple",["T","i","f","s"]]}'
    )
    assert [decode_sample(f)[1] for f in frames] == [5, 6, 7, 8]


# -- property test: random nested samples ----------------------------------------------
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.complex_numbers(allow_nan=True),
    st.text(),
    st.binary(),
    st.builds(
        random_tensor,
        st.sampled_from([TORCH_DTYPES[n] for n in ("float32", "bfloat16", "bool", "int64", "uint8", "complex128")]),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
    ),
    st.builds(  # 0-d arrays too: they come back as arrays, not numpy scalars
        lambda code, shape: np.arange(math.prod(shape)).astype(NUMPY_DTYPES[code]).reshape(shape),
        st.sampled_from(sorted(NUMPY_DTYPES)),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
    ),
)
samples = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples)
def test_random_samples_round_trip(sample: Any) -> None:
    round_trip(sample)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), samples), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_a_batch_decodes_as_each_frame_does(batch: list[tuple[int, Any]], rng: Any) -> None:
    # several copies of each sample, so that frames of one structure meet in a batch
    wanted = [sample for copies, sample in batch for _ in range(copies + 1)]
    rng.shuffle(wanted)
    frames: list[Any] = [encode_sample(sample) for sample in wanted]
    damaged = {j for j in range(len(frames)) if rng.random() < 0.2}
    for j in damaged:  # cut short, or another frame's length: a CorruptEntryError in its place
        frames[j] = frames[j][: rng.randrange(len(frames[j]))]
    got = decode_samples([memoryview(f) for f in frames])
    assert len(got) == len(frames)
    for j, (frame, value) in enumerate(zip(frames, got)):
        if j in damaged:
            with pytest.raises(CorruptEntryError) as info:
                decode_sample(frame)
            assert isinstance(value, CorruptEntryError) and str(value) == str(info.value)
        else:
            assert_same(value, wanted[j], f"sample {j}")


def test_a_batch_gives_writable_samples_that_alias_neither_each_other_nor_the_frames() -> None:
    wanted = [
        (torch.full((2, 3), float(i)), np.full(4, i), torch.full((5,), i, dtype=torch.bfloat16), i) for i in range(6)
    ]
    frames = [bytearray(encode_sample(sample)) for sample in wanted]
    got = decode_samples(frames)
    for frame in frames:
        frame[:] = b"\xff" * len(frame)  # the caller reuses its buffers
    for sample in got:
        sample[0].add_(100)
        sample[1][:] = -1
        sample[2].zero_()
    for i, (tensor, array, half, label) in enumerate(got):
        assert torch.equal(tensor, torch.full((2, 3), i + 100.0)) and tensor.is_contiguous()
        assert array.tolist() == [-1] * 4 and half.dtype == torch.bfloat16 and not half.any() and label == i
    assert [s[3] for s in decode_samples(frames[:0] + [encode_sample(w) for w in wanted])] == list(range(6))


def test_a_batch_of_one_length_with_other_headers_and_odd_views() -> None:
    a, b = encode_sample({"a": torch.ones(3)}), encode_sample({"b": torch.zeros(3)})
    assert len(a) == len(b)  # one length, another header: not decoded as the first frame's structure
    broken = bytearray(a)
    broken[broken.index(b'"a"')] = ord("{")  # the header is no longer JSON
    two_d = memoryview(a).cast("B", (1, len(a)))  # a 2-D view of a frame
    got = decode_samples([a, b, bytes(broken), two_d, memoryview(b"..." + b)[3:]])
    assert torch.equal(got[0]["a"], torch.ones(3)) and torch.equal(got[1]["b"], torch.zeros(3))
    assert isinstance(got[2], CorruptEntryError)
    assert torch.equal(got[3]["a"], torch.ones(3)) and torch.equal(got[4]["b"], torch.zeros(3))


def test_a_batch_with_a_bad_string_decodes_the_others() -> None:
    good = [encode_sample(("ab", torch.ones(3))) for _ in range(3)]
    bad = bytearray(good[1])
    bad[bad.index(b"ab")] = 0xFF  # not UTF-8
    got = decode_samples([good[0], bytes(bad), good[2]])
    assert isinstance(got[1], CorruptEntryError) and "cannot decode" in str(got[1])
    assert got[0][0] == got[2][0] == "ab" and torch.equal(got[2][1], torch.ones(3))


plain_leaves = st.one_of(
    st.integers(-(2**64), 2**64),  # past int64: the general encoder's big integers
    st.floats(allow_nan=True),
    st.booleans(),  # a bool is not an int: the general encoder's
    st.builds(
        random_tensor,
        st.sampled_from(sorted(TORCH_DTYPES.values(), key=str)),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
    ),
    st.builds(lambda n: torch.randn(n, 3).t(), st.integers(0, 3)),  # not contiguous
    st.builds(lambda n: torch.nn.Parameter(torch.randn(n)), st.integers(0, 3)),  # a subclass
    st.builds(lambda n: torch.randn(n, dtype=torch.complex64).conj(), st.integers(0, 3)),
)
plain_samples = st.one_of(
    plain_leaves,
    st.lists(plain_leaves, max_size=18),
    st.lists(plain_leaves, max_size=18).map(tuple),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_samples)
def test_plain_samples_encode_as_the_general_encoder_does(sample: Any) -> None:
    import torchcache.datasets.encode as samples_module

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental", UserWarning)
        encode_sample(sample)  # the first sample of its structure makes the header the next ones reuse
        fast = encode_sample(sample)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(samples_module, "_plain_frame", lambda sample: None)
            general = encode_sample(sample)
        assert fast == general
        round_trip(sample)


def test_plain_samples_take_the_fast_path() -> None:
    import torchcache.datasets.encode as samples_module

    for sample in ((torch.zeros(3, 8, 8, dtype=torch.uint8), 7), [torch.ones(2), 1.5, -3], torch.arange(4)):
        assert samples_module._plain_frame(sample) == encode_sample(sample)
    for sample in ((torch.ones(2), "label"), {"x": torch.ones(2)}, (True,), (torch.ones(4)[::2],), 3):
        assert samples_module._plain_frame(sample) is None


# -- refused values ----------------------------------------------------------------
class FakeImage:
    """Stands in for a PIL image (its module is what the hint looks at)."""


FakeImage.__module__ = "PIL.Image"
Point = namedtuple("Point", "x y")


class Boxes(torch.Tensor):
    """A tensor subclass that holds more than its values (torchvision's ``BoundingBoxes`` holds a format)."""


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the nested tensor API is a prototype
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _with_attribute() -> torch.Tensor:
    tensor = torch.ones(2)
    tensor.format = "XYXY"  # type: ignore[attr-defined]
    return tensor


@pytest.mark.parametrize(
    ("sample", "path", "words"),
    [
        ((torch.ones(2), {"label": FakeImage()}), "sample[1]['label']", ["PIL.Image.FakeImage", "pil_to_tensor"]),
        ([object()], "sample[0]", ["object", "convert it"]),
        ({"s": {1, 2}}, "sample['s']", ["set"]),
        (Point(1, 2), "sample", ["Point", "_asdict"]),
        ({"a": np.array(["x", "y"])}, "sample['a']", ["numpy arrays of dtype <U1"]),
        ({"a": np.array([object()])}, "sample['a']", ["numpy arrays of dtype object"]),
        ((torch.empty(2, device="meta"),), "sample[0]", ["a tensor on meta", "CPU tensors"]),
        ((torch.ones(2).to_sparse(),), "sample[0]", ["to_dense()"]),
        ({(1, 2): 3}, "sample", ["dict keys must be str or int"]),
        ({True: 3}, "sample", ["dict keys must be str or int"]),
        (bytearray(b"x"), "sample", ["bytearray"]),
        (np.datetime64("2024-01-01"), "sample", ["datetime64"]),
        ((torch.ones(2).as_subclass(Boxes), 1), "sample[0]", ["Boxes, a subclass", "as_subclass", "ToPureTensor"]),
        ((_with_attribute(), 1), "sample[0]", ["attributes set on it (format)", "beside it"]),
        (_with_attribute(), "sample", ["attributes set on it (format)"]),
        ((_nested(),), "sample[0]", ["nested tensor", "pad it"]),
        ({"m": np.ma.masked_array([1, 2], mask=[0, 1])}, "sample['m']", ["MaskedArray", "np.asarray(x)", "mask"]),
    ],
)
def test_unsupported_values_name_their_type_path_and_fix(sample: Any, path: str, words: list[str]) -> None:
    with pytest.raises(SampleTypeError) as info:
        encode_sample(sample)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for word in words:
        assert word in message, message
    assert isinstance(info.value, KeyingError) and isinstance(info.value, TypeError)


@settings(max_examples=100, deadline=None)
@given(plain_samples)
def test_check_sample_accepts_what_encodes(sample: Any) -> None:
    encode_sample(sample)
    assert check_sample(sample) is None


@pytest.mark.parametrize(
    "sample",
    [
        (torch.ones(2).as_subclass(Boxes), 1),
        (_with_attribute(), 1),
        _with_attribute(),
        (torch.ones(2), {"label": FakeImage()}),
        (torch.ones(2), FakeImage()),
        [torch.ones(2), object()],
        (torch.ones(2).to_sparse(), 1),
        (torch.empty(2, device="meta"), 1),
        ({"a": np.array([object()])},),
    ],
)
def test_check_sample_refuses_what_encoding_refuses(sample: Any) -> None:
    with pytest.raises(SampleTypeError) as encoding:
        encode_sample(sample)
    with pytest.raises(SampleTypeError) as checking:
        check_sample(sample)
    assert str(checking.value) == str(encoding.value)


def test_nesting_deeper_than_the_limit_is_refused() -> None:
    sample: Any = 1
    for _ in range(MAX_DEPTH):
        sample = [sample]
    round_trip(sample)
    with pytest.raises(SampleTypeError, match="more than 32 deep"):
        encode_sample([sample])


def test_an_int_too_large_for_a_header_is_refused_naming_where_it_is() -> None:
    big = 2**MAX_INT_BITS
    round_trip({"id": big - 1, big - 2: "key"})
    for sample, where in (({"id": big}, r"sample\['id'\]"), ({big: 1}, "sample")):
        with pytest.raises(SampleTypeError, match=f"{where}: an int of {MAX_INT_BITS + 1} bits.*str"):
            encode_sample(sample)


# -- hostile frames ----------------------------------------------------------------
def test_damaged_frames_decode_or_raise_corrupt_entry_error() -> None:
    frame = encode_sample({"img": torch.arange(24).reshape(2, 3, 4), "label": 3, "name": "x"})
    rng = np.random.default_rng(1)
    for _ in range(400):
        data = bytearray(frame)
        for at in rng.integers(0, len(data), rng.integers(1, 4)):
            data[at] = int(rng.integers(0, 256))
        cut = int(rng.integers(0, len(data) + 1)) if rng.random() < 0.3 else len(data)
        with contextlib.suppress(CorruptEntryError):
            decode_sample(bytes(data[:cut]))
    for cut in range(len(frame)):
        with pytest.raises(CorruptEntryError):
            decode_sample(frame[:cut])
    with pytest.raises(CorruptEntryError):
        decode_sample(frame + b"\0" * 8)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    for candidate in (data, b"TCHE\x01\0\0\0" + data, frame_of({"l": [["f4", [2]]]})[:36] + data):
        with contextlib.suppress(CorruptEntryError):
            decode_sample(candidate)


def leaf(kind: str, dtype: str, shape: object) -> dict[str, Any]:
    return {"t": kind, "l": [[dtype, shape]]}


@pytest.mark.parametrize(
    ("header", "data"),
    [
        (leaf("T", "f4", [2**40, 2**40]), b""),  # a giant tensor the data does not hold
        (leaf("T", "f4", [0, 2**62, 2**62]), b""),  # zero elements, absurd dimensions
        (leaf("T", "f4", [-1]), b""),
        (leaf("T", "f4", [True]), b""),
        (leaf("T", "f4", [1.5]), b""),
        (leaf("T", "f4", [1] * 40), b"\0" * 8),
        (leaf("T", "object", [1]), b"\0" * 8),
        (leaf("T", "qint8", [1]), b"\0" * 8),
        (leaf("T", "<f4", [1]), b"\0" * 8),  # a numpy name for a tensor
        (leaf("A", "|O", [1]), b"\0" * 8),
        (leaf("A", "<U1", [1]), b"\0" * 8),
        (leaf("A", "f4", [1]), b"\0" * 8),  # a torch code for an array
        (leaf("S", "O", []), b"\0" * 8),
        (leaf("S", "<f4", [1]), b"\0" * 8),  # a scalar with a shape
        (leaf("y", "u1", [2**60]), b""),
        (leaf("s", "u1", [-1]), b""),
        (leaf("s", "u1", [2]), b"\xff\xfe" + b"\0" * 6),  # not UTF-8
        (leaf("s", "f4", [2]), b"\0" * 8),
        (leaf("s", "u1", [1, 1]), b"\0" * 8),
        (leaf("i", "i4", []), b"\0" * 8),
        (leaf("i", "i8", [1]), b"\0" * 8),
        (leaf("f", "f4", []), b"\0" * 8),
        (leaf("i", "i8", []), b"\0" * 7),  # too short for its int
        (leaf("i", "i8", []), b"\0" * 16),  # longer than its header needs
        ({"t": ["dict", [["a", "i"], ["a", "i"]]], "l": [["i8", []], ["i8", []]]}, b"\0" * 16),
        ({"t": ["dict", [[[1], "i"]]], "l": [["i8", []]]}, b"\0" * 8),
        ({"t": ["dict", [[True, "i"]]], "l": [["i8", []]]}, b"\0" * 8),
        ({"t": ["list", "i"], "l": [["i8", []]]}, b"\0" * 8),
        ({"t": ["tuple", ["T", "T"]], "l": [["f4", [2]]]}, b"\0" * 8),  # fewer leaves than the structure
        ({"t": "T", "l": [["f4", [2]], ["f4", [2]]]}, b"\0" * 16),  # more
        ({"t": ["namedtuple", "m:P", [["x", "i"]]], "l": [["i8", []]]}, b"\0" * 8),  # not a sample's node
        ({"l": [["f4", [2]]], "x": 1}, b"\0" * 8),
        ({"l": 3}, b""),
        ({"l": ["f4"]}, b"\0" * 8),
        ({"t": ["x", 1], "l": []}, b""),
        ({"t": "z", "l": []}, b""),
        ({"t": {"a": 1}, "l": []}, b""),
        ({"t": 1.5, "l": []}, b""),
        ({"t": [], "l": []}, b""),
        ({"t": ["I", "7"], "l": []}, b""),
        ({"t": ["I"], "l": []}, b""),
        (["l", []], b""),
        ("T", b""),
    ],
)
def test_hostile_headers_are_corrupt_entry_errors(header: object, data: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode_sample(frame_of(header, data))


def test_hostile_prefixes_and_nesting_are_corrupt_entry_errors() -> None:
    good = encode_sample(1)
    head = good[: PREFIX_SIZE - 8]
    cases = [
        b"",
        b"TCHE",
        b"XXXX" + good[4:],
        good[:4] + b"\x02" + good[5:],  # another version
        good[:5] + b"\x07" + good[6:],  # an unknown codec
        head[:8] + struct.pack("<I", 2**32 - 1) + head[12:] + good[PREFIX_SIZE - 8 :],  # a header longer than the frame
        seal(b"\xff\xfe\xfd", [b""]),  # not JSON
        seal(b"[" * 50_000 + b"]" * 50_000, [b""]),
        seal(b'{"l":[],"t":' + b"[" * 50_000 + b"]" * 50_000 + b"}", [b""]),
        b"TCSM\x01\0\0\0\x03\0\0\0" + b'"i"' + b"\0" * 8,  # a frame of torchcache 1.2
    ]
    nested: Any = "N"
    for _ in range(MAX_DEPTH + 2):
        nested = ["list", [nested]]
    cases.append(frame_of({"t": nested, "l": []}))
    cases.append(frame_of({"t": ["list", ["N"] * 1_100_000], "l": []}))  # a header past 4 MiB
    for case in cases:
        with pytest.raises(CorruptEntryError):
            decode_sample(case)


def test_a_sample_of_nearly_max_nodes_numbers_round_trips() -> None:
    sample = list(range(MAX_NODES - 2))  # its header is about 1.4 MB: within a frame's 4 MiB
    assert decode_sample(encode_sample(sample)) == sample
    with pytest.raises(SampleTypeError, match="more than 100000 values"):
        encode_sample(list(range(MAX_NODES)))


def test_a_sample_header_too_large_to_keep_is_parsed_again_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchcache.datasets import decode

    monkeypatch.setattr(decode, "_plans", {})
    monkeypatch.setattr(decode, "_plan_bytes", 0)
    monkeypatch.setattr(decode, "_PLAN_HEADER_BYTES", 1 << 16)
    small, big = (torch.zeros(2), 1), tuple(float(i) for i in range(20_000))  # a header of 20,000 leaves
    for sample in (small, big, big):
        got = decode.decode_sample(encode_sample(sample))
        assert got[1] == 1 if sample is small else got == big
    assert len(decode._plans) == 1  # the small one's plan; the big one's would hold 20,000 leaves
    large = tuple(float(i) for i in range(2_000))  # a header of over a tenth of the bytes kept: kept
    assert decode.decode_sample(encode_sample(large)) == large and len(decode._plans) == 2
    for n in range(3_000, 12_000, 1_000):  # more of them: the oldest go, the bytes kept stay bounded
        decode.decode_sample(encode_sample(tuple(float(i) for i in range(n))))
        assert decode._plan_bytes <= decode._PLAN_HEADER_BYTES


def test_libraries_bookkeeping_flags_on_a_tensor_are_no_loss_but_an_attribute_of_yours_is() -> None:
    flagged = torch.ones(2)
    flagged._is_hf_initialized = True  # type: ignore[attr-defined]
    flagged._dynamo_dynamic_indices = {0}  # type: ignore[attr-defined]  # torch._dynamo.mark_dynamic
    assert_same(decode_sample(encode_sample((flagged, 1))), (torch.ones(2), 1))
    flagged.scale = 2.0  # type: ignore[attr-defined]
    with pytest.raises(SampleTypeError, match=r"attributes set on it \(scale\)") as info:
        check_sample((flagged, 1))
    assert "ToPureTensor" not in str(info.value)  # it unwraps subclasses, not attributes


def test_a_memmap_is_stored_as_its_values_and_comes_back_as_an_array(tmp_path: Path) -> None:
    rows = np.lib.format.open_memmap(tmp_path / "rows.npy", "w+", np.float32, (4, 3))
    rows[:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    rows.flush()
    sample = (np.load(tmp_path / "rows.npy", mmap_mode="r")[2], 2)
    assert type(sample[0]) is np.memmap
    check_sample(sample)
    image, label = decode_sample(encode_sample(sample))
    assert type(image) is np.ndarray and image.tolist() == [6.0, 7.0, 8.0] and label == 2
