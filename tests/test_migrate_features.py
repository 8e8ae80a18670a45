"""A features cache written by torchcache 1.2 (``features.tcfeat``): refused with the way out, then migrated.

The 1.2 file is built from a real extraction: its rows file is read back and written in
the 1.2 layout (a checked header, a page-aligned table of row checks, then the rows at a
fixed stride), and the rows file removed, as a 1.2 cache directory would hold it.
"""

from __future__ import annotations

import gc
import io
import json
import shutil
import struct
import warnings
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from torch.utils.data import Dataset

from torchcache import ConfigError, FeatureDataset, extract_features
from torchcache.cli import migrate as migrate_module
from torchcache.cli.main import main
from torchcache.errors import CorruptEntryError
from torchcache.stores.features.file import (
    FEATURES_NAME,
    LEGACY_FEATURES_NAME,
    layout_of,
    open_features,
)
from torchcache.stores.rows.file import RowsFile

_LEGACY_HEAD = struct.Struct("<8sIIQQQQQ")
_PAGE = 4096
LENGTH = 23


class Vectors(Dataset[Any]):
    def __init__(self, n: int = LENGTH) -> None:
        self.x = torch.randn(n, 6, generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(4)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@dataclass(frozen=True)
class Legacy:
    directory: Path
    want: torch.Tensor
    rows: np.ndarray[Any, np.dtype[np.uint8]]


def _up(value: int) -> int:
    return -(-value // _PAGE) * _PAGE


def write_legacy(path: Path, header: dict[str, Any], rows: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """Write ``rows`` (one per index, every index written) as a torchcache 1.2 features file."""
    length, stride = rows.shape
    text = json.dumps(header).encode()
    checks_at = _up(_LEGACY_HEAD.size + len(text) + 8)
    rows_at = checks_at + _up(8 * length)
    head = _LEGACY_HEAD.pack(b"TCFEATS1", 1, len(text), length, stride, checks_at, rows_at, rows_at + length * stride)
    checks = np.array([xxhash.xxh3_64_intdigest(rows[i].tobytes(), i) | 1 for i in range(length)], "<u8")
    data = bytearray(rows_at + length * stride)
    data[: len(head) + len(text) + 8] = head + text + xxhash.xxh3_64_intdigest(head + text).to_bytes(8, "little")
    data[checks_at : checks_at + 8 * length] = checks.tobytes()
    data[rows_at:] = rows.tobytes()
    path.write_bytes(bytes(data))


def as_1_2(directory: Path) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Replace the rows file of a features cache with the features file torchcache 1.2 wrote for it.

    1.2 put the features first in a row and each other field at the next multiple of its
    item size (at most 16), in the sample's order, and wrote the layout as a list of fields.
    """
    file = open_features(directory / FEATURES_NAME)
    try:
        got = file.read(np.arange(LENGTH))
        assert got.found.tolist() == list(range(LENGTH))
        row_at = file.geometry.row_at
        rows = np.ascontiguousarray(got.rows[:, row_at : row_at + file.row_size])
        header = dict(file.header)
        layout = layout_of(file)
    finally:
        file.close()
    fields, at = [], 0
    for f in layout.fields:  # the features first
        at = -(-at // min(f.itemsize, 16)) * min(f.itemsize, 16)
        fields.append({"name": f.name, "kind": f.kind, "dtype": f.dtype, "shape": list(f.shape), "offset": at})
        at += f.nbytes
    stride = -(-max(at, 1) // 16) * 16
    old_rows = np.zeros((LENGTH, stride), np.uint8)
    for f, old in zip(layout.fields, fields):
        old_rows[:, old["offset"] : old["offset"] + f.nbytes] = rows[:, f.offset : f.offset + f.nbytes]
    old_layout = {"container": layout.container, "names": list(layout.names), "input": layout.input}
    header["layout"] = {**old_layout, "stride": stride, "fields": fields}
    write_legacy(directory / LEGACY_FEATURES_NAME, header, old_rows)
    (directory / FEATURES_NAME).unlink()
    return old_rows


@pytest.fixture
def legacy(cache_root: Path) -> Iterator[Legacy]:
    features = extract_features(Scale(), Vectors(), batch_size=8, progress=False)
    want = torch.stack([features[i] for i in range(LENGTH)])
    assert features.path is not None
    directory = features.path.parent
    del features
    gc.collect()
    rows = as_1_2(directory)
    yield Legacy(directory, want, rows)
    gc.collect()


class Labelled(Vectors):
    """Samples whose features are not their first field: ``(label, vector, weight)``."""

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return i % 3, self.x[i], np.float32(i / 4)


def test_migrate_moves_the_fields_of_a_1_2_row_where_rows_now_put_them(cache_root: Path) -> None:
    features = extract_features(Scale(), Labelled(), batch_size=8, progress=False, input=1)
    want = [features[i] for i in range(LENGTH)]
    assert features.path is not None
    directory = features.path.parent
    new_stride = features.file.row_size
    del features
    gc.collect()
    old_rows = as_1_2(directory)
    assert old_rows.shape[1] == new_stride == 48  # the same size; in 1.2 the features came first, at 0
    code, out, err = cli("migrate", str(cache_root))
    assert code == 0, err
    assert f"moved {LENGTH} rows" in out
    opened = FeatureDataset.open(directory)
    got = [opened[i] for i in range(LENGTH)]
    for g, w in zip(got, want):
        assert g[0] == w[0] and type(g[0]) is int
        assert torch.equal(g[1], w[1])
        assert g[2] == w[2] and type(g[2]) is np.float32
    assert opened.layout is not None and [f.offset for f in opened.layout.fields] == [8, 0, 32]


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_opening_a_1_2_features_cache_names_migrate(legacy: Legacy) -> None:
    with pytest.raises(ConfigError, match="torchcache migrate"):
        FeatureDataset.open(legacy.directory)


def test_extracting_over_a_1_2_features_cache_warns_once_and_computes(legacy: Legacy) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        features = extract_features(Scale(), Vectors(), batch_size=8, progress=False)
    said = [str(w.message) for w in caught if "torchcache migrate" in str(w.message)]
    assert len(said) == 1 and "1.2" in said[0]
    assert torch.equal(torch.stack([features[i] for i in range(LENGTH)]), legacy.want)


def test_migrate_turns_a_1_2_features_file_into_a_rows_file(legacy: Legacy, cache_root: Path) -> None:
    code, out, err = cli("migrate", str(cache_root))
    assert code == 0, err
    assert f"moved {LENGTH} rows" in out
    assert not (legacy.directory / LEGACY_FEATURES_NAME).exists()
    features = FeatureDataset.open(legacy.directory)
    assert torch.equal(torch.stack([features[i] for i in range(LENGTH)]), legacy.want)
    assert cli("migrate", str(cache_root))[1].startswith("nothing to migrate")


def test_a_migrate_interrupted_and_run_again_moves_the_rows_it_had_not_moved(
    legacy: Legacy, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate_module, "_MIGRATE_BATCH", 1)  # rows move 16 at a time
    real, writes = RowsFile.write, []

    def write(self: RowsFile, *args: Any, **kwargs: Any) -> int:
        writes.append(True)
        if len(writes) == 2:
            raise KeyboardInterrupt  # killed after the first 16 rows
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RowsFile, "write", write)
    with pytest.raises(KeyboardInterrupt):
        migrate_module.migrate_features(legacy.directory)
    assert (legacy.directory / LEGACY_FEATURES_NAME).exists()
    monkeypatch.setattr(RowsFile, "write", real)
    code, out, err = cli("migrate", str(cache_root))
    assert code == 0, err
    assert f"moved {LENGTH - 16} rows" in out
    assert not (legacy.directory / LEGACY_FEATURES_NAME).exists()
    features = FeatureDataset.open(legacy.directory)
    assert torch.equal(torch.stack([features[i] for i in range(LENGTH)]), legacy.want)


def test_a_rows_file_made_for_other_keys_beside_a_1_2_file_is_replaced_by_its_rows(
    legacy: Legacy, cache_root: Path
) -> None:
    other = extract_features(Scale(), Vectors(5), batch_size=8, progress=False, cache_dir=cache_root / "other")
    assert other.path is not None
    shutil.copyfile(other.path, legacy.directory / FEATURES_NAME)  # another cache's rows
    del other
    gc.collect()
    code, out, err = cli("migrate", str(cache_root))
    assert code == 0, err
    assert f"moved {LENGTH} rows" in out
    features = FeatureDataset.open(legacy.directory)
    assert torch.equal(torch.stack([features[i] for i in range(LENGTH)]), legacy.want)


def test_migrate_leaves_out_a_damaged_1_2_row_and_extraction_computes_it(legacy: Legacy, cache_root: Path) -> None:
    old = legacy.directory / LEGACY_FEATURES_NAME
    data = bytearray(old.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last row
    old.write_bytes(bytes(data))
    code, out, err = cli("migrate", str(cache_root))
    assert code == 0, err
    assert f"moved {LENGTH - 1} rows" in out and "1 damaged row" in out
    file = open_features(legacy.directory / FEATURES_NAME)
    try:
        assert file.missing().tolist() == [LENGTH - 1]
    finally:
        file.close()
    features = extract_features(Scale(), Vectors(), batch_size=8, progress=False)
    assert torch.equal(torch.stack([features[i] for i in range(LENGTH)]), legacy.want)


def test_migrate_removes_a_1_2_file_that_is_not_whole_and_says_so(legacy: Legacy, cache_root: Path) -> None:
    old = legacy.directory / LEGACY_FEATURES_NAME
    old.write_bytes(old.read_bytes()[:100])
    code, _, err = cli("migrate", str(cache_root))
    assert code == 1
    assert f"removed {legacy.directory.name}/{LEGACY_FEATURES_NAME}" in err and "not usable" in err
    assert not old.exists() and not (legacy.directory / FEATURES_NAME).exists()
    features = extract_features(Scale(), Vectors(), batch_size=8, progress=False)
    assert torch.equal(torch.stack([features[i] for i in range(LENGTH)]), legacy.want)


_GOOD_1_2 = {
    "container": "tensor",
    "names": ["0"],
    "input": "0",
    "stride": 32,
    "fields": [{"name": "0", "kind": "features", "dtype": "float32", "shape": [6], "offset": 0}],
}


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "os.system"},
        {"kind": "int"},  # the features are not first
        {"dtype": "object"},
        {"shape": [-1]},
        {"shape": [1 << 40]},
        {"offset": 1 << 20},
        {"offset": 16},  # 24 bytes from 16 pass the 32-byte row
        {"offset": "0"},
        {"name": "1"},
    ],
)
def test_a_1_2_layout_that_is_not_valid_is_refused(change: dict[str, Any]) -> None:
    from torchcache.cli.migrate import _layout_12

    layout, moves = _layout_12(_GOOD_1_2, 32)
    assert layout.to_json() == {"l": [["f4", [6]]], "input": 0, "stride": 32} and moves == [(0, 0, 24)]
    bad = {**_GOOD_1_2, "fields": [{**_GOOD_1_2["fields"][0], **change}]}  # type: ignore[dict-item]
    with pytest.raises(CorruptEntryError):
        _layout_12(bad, 32)
    for other in ({**_GOOD_1_2, "fields": []}, {**_GOOD_1_2, "container": "set"}, {**_GOOD_1_2, "input": "1"}, []):
        with pytest.raises(CorruptEntryError):
            _layout_12(other, 32)
