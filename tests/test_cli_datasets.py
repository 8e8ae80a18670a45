"""The ``torchcache`` command on dataset caches: listed, described, verified as samples, cleared."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from torchcache import CachedDataset
from torchcache.cli.main import main
from torchcache.datasets.encode import encode_sample
from torchcache.stores.packed.store import PackedStore


class Squares(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 4), i * i, dtype=torch.uint8), i


@pytest.fixture
def dataset_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHCACHE_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    data = CachedDataset(Squares(), tmp_path / "root", max_memory_size=0)
    for i in range(len(data)):
        data[i]
    data.close()
    (cache,) = [p for p in (tmp_path / "root").iterdir() if p.is_dir()]
    return cache


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    status = main([*argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_a_dataset_cache_is_listed_and_described(dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, listed = _json(capsys, "ls", str(dataset_dir.parent))
    assert status == 0 and [c["key"] for c in listed["caches"]] == [dataset_dir.name]
    assert listed["caches"][0]["entries"] == 12
    assert main(["info", str(dataset_dir)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^kind +dataset$", out, re.M) and re.search(r"^dataset length +12$", out, re.M)
    assert "layouts" not in out  # samples have no output layouts to sample


def test_verify_checks_samples_and_fix_removes_only_the_damaged_one(
    dataset_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report = _json(capsys, "verify", str(dataset_dir.parent))
    assert status == 0 and report["ok"] and report["problems"] == []  # samples are not output frames
    with PackedStore(dataset_dir, 1 << 30) as store:
        keys = sorted(store.keys())
        good = bytes(store.get(keys[0]) or b"")
        store.put_many([(keys[1], good[: len(good) // 2])])  # a valid record holding half a sample
    status, report = _json(capsys, "verify", str(dataset_dir.parent))
    assert status == 1 and [Path(p["path"]).name for p in report["problems"]] == [keys[1]]
    assert main(["verify", "--fix", str(dataset_dir.parent)]) == 0
    capsys.readouterr()
    with PackedStore(dataset_dir, 1 << 30) as store:
        assert sorted(store.keys()) == [k for k in keys if k != keys[1]]
    assert encode_sample(Squares()[0]) == good  # what stayed is what the dataset gives


def test_clear_removes_a_dataset_cache(dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clear", "--all", "--yes", "--root", str(dataset_dir.parent)]) == 0
    assert not dataset_dir.exists()
    assert "removed 1 module cache" in capsys.readouterr().out
