"""Dataset caches written by torchcache 1.2 (``TCSM`` sample frames): a warned miss, then migrated.

The 1.2 frames are made by :func:`legacy_frame`, the 1.2 encoder as it was: a 12-byte
prefix, the sample's tree in JSON, then every number, string and array at the next
multiple of 8 bytes.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.redis_servers import shared
from tests.test_samples import assert_same, samples
from torchcache import CachedDataset
from torchcache.cli.main import main
from torchcache.cli.samples12 import convert_sample
from torchcache.cli.verify import check_sample
from torchcache.datasets.decode import decode_sample
from torchcache.datasets.encode import encode_sample
from torchcache.dtypes import NAME_OF
from torchcache.errors import CorruptEntryError
from torchcache.stores.packed.store import PackedStore

pytestmark = pytest.mark.usefixtures("reads_counted")  # the tests here count the dataset's reads

_PREFIX = struct.Struct("<4sBxxxI")
_INT64 = (-(2**63), 2**63 - 1)


def legacy_frame(sample: object) -> bytes:
    """The frame torchcache 1.2 wrote for ``sample``."""
    chunks: list[bytes] = []
    size = 0

    def put(data: bytes) -> None:
        nonlocal size
        pad = -size % 8
        chunks.append(b"\0" * pad + data)
        size += pad + len(data)

    def node(value: Any) -> Any:
        if value is None or type(value) is bool:
            return value
        if type(value) is int:
            if not _INT64[0] <= value <= _INT64[1]:
                return ["I", value]
            put(struct.pack("<q", value))
            return "i"
        if type(value) is float:
            put(struct.pack("<d", value))
            return "f"
        if type(value) is complex:
            put(struct.pack("<dd", value.real, value.imag))
            return "c"
        if type(value) is str:
            data = value.encode("utf-8", "surrogatepass")
            put(data)
            return ["s", len(data)]
        if type(value) is bytes:
            put(value)
            return ["b", len(value)]
        if isinstance(value, torch.Tensor):
            put(bytes(value.contiguous().reshape(-1).view(torch.uint8).numpy()))
            return ["t", NAME_OF[value.dtype], list(value.shape)]
        if type(value) is np.ndarray:
            put(np.ascontiguousarray(value).tobytes())
            return ["a", value.dtype.str, list(value.shape)]
        if isinstance(value, np.generic):
            put(np.asarray(value).tobytes())
            return ["n", value.dtype.str]
        if type(value) in (tuple, list):
            return ["u" if type(value) is tuple else "l", [node(v) for v in value]]
        return ["d", list(value), [node(v) for v in value.values()]]

    header = json.dumps(node(sample), separators=(",", ":")).encode()
    return _PREFIX.pack(b"TCSM", 1, len(header)) + header + b"".join(chunks)


@settings(max_examples=150, deadline=None)
@given(samples)
def test_a_converted_sample_is_the_frame_this_version_writes(sample: Any) -> None:
    converted = convert_sample(legacy_frame(sample))
    assert converted == encode_sample(sample)
    assert_same(decode_sample(converted), sample)


def test_a_frame_that_is_not_a_whole_1_2_sample_is_refused() -> None:
    good = legacy_frame((torch.arange(3), "x"))
    bad = [
        b"",
        good[:8],
        b"TCSX" + good[4:],
        good[:4] + b"\x02" + good[5:],
        good[:-1],  # data cut short
        good + b"\0" * 9,  # more data than its tree holds
        _PREFIX.pack(b"TCSM", 1, 3) + b"[1]",
        _PREFIX.pack(b"TCSM", 1, 3) + b"\xff\xfe\xfd",
        _PREFIX.pack(b"TCSM", 1, 9) + b'["q", 1]' + b" ",
        _PREFIX.pack(b"TCSM", 1, 2**20) + b"[]",
        _PREFIX.pack(b"TCSM", 1, 20_000) + b"[" * 10_000 + b"]" * 10_000,
        encode_sample(1),  # a frame of this version
    ]
    for frame in bad:
        with pytest.raises(CorruptEntryError):
            convert_sample(frame)
    assert check_sample(good) is None  # intact: verify leaves it to migrate
    assert check_sample(good[:-1]) is not None


class Squares(torch.utils.data.Dataset[Any]):
    def __init__(self, n: int = 40) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, Any]]:
        self.calls += 1
        return torch.full((3, 4), float(i * i)), {"label": i, "name": f"s{i}"}


def _dataset(root: Path) -> CachedDataset[Any]:
    return CachedDataset(Squares(), cache_dir=root, max_memory_size=0, version=1)


def _as_1_2(directory: Path) -> int:
    """Rewrite every sample of a dataset cache's packed store as torchcache 1.2 wrote it."""
    with PackedStore(directory, 1 << 30, report=lambda kind, message: None) as store:
        keys = list(store.keys())
        frames = store.get_many(keys)
        store.put_many([(key, legacy_frame(decode_sample(frame))) for key, frame in zip(keys, frames)])
    return len(keys)


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue() + err.getvalue()


def test_a_1_2_dataset_cache_is_a_warned_miss_until_migrated(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    want = [data[i] for i in range(len(data))]
    data.close()
    assert _as_1_2(data.cache.directory) == 40

    stale = _dataset(tmp_path)
    with pytest.warns(UserWarning, match=r"torchcache 1\.2.*torchcache migrate"):
        got = stale[3]
    assert_same(got, want[3])  # computed again, right
    assert stale.dataset.calls == 1
    stale.close()

    code, text = _cli("migrate", str(tmp_path))
    assert code == 0, text
    assert "converted 39 samples" in text  # the one read above was written again in this version's format
    code, text = _cli("verify", str(tmp_path))
    assert code == 0, text

    fresh = _dataset(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(len(fresh)):
            assert_same(fresh[i], want[i])
    assert fresh.dataset.calls == 0  # every sample a hit
    fresh.close()
    code, text = _cli("migrate", str(tmp_path))
    assert code == 0 and text.startswith("nothing to migrate"), text  # every sample in today's format


@pytest.mark.slow  # the worker's Redis server may start here
def test_migrate_by_url_converts_the_samples_on_a_redis_server() -> None:
    server = shared("redis")
    server.flush()
    try:
        client = server.client()
        samples_ = [(torch.arange(i, i + 3), {"i": i}) for i in range(5)]
        from torchcache.cli.remote import open_remote

        with open_remote(server.url, "ds") as store:
            store.put_many([(f"{i:016x}", legacy_frame(s)) for i, s in enumerate(samples_)])
            store.put_many([("ffffffffffffffff", b"TCSM junk")])
        code, text = _cli("migrate", server.url)
        assert code == 1 and "converted 5 samples" in text and "1 damaged sample" in text, text
        with open_remote(server.url, "ds") as store:
            frames = store.get_many([f"{i:016x}" for i in range(5)] + ["ffffffffffffffff"])
        assert frames[-1] is None
        for frame, sample in zip(frames, samples_):
            assert frame is not None
            assert_same(decode_sample(frame), sample)
        assert client.ping()
    finally:
        server.flush()
