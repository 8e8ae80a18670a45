"""The ``torchcache`` command on dataset caches: listed, described, verified as samples, cleared."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from torchcache import CachedDataset, SampleCache, extract_features, torchcache
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


def test_verify_fix_keeps_the_samples_of_a_dataset_cache_whose_metadata_is_damaged(
    dataset_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with PackedStore(dataset_dir, 1 << 30) as store:
        keys = sorted(store.keys())
    (dataset_dir / "torchcache.json").write_text("{not json")
    assert main(["info", str(dataset_dir)]) == 0
    assert "unreadable header" not in capsys.readouterr().out  # samples, not output frames with bad headers
    status, report = _json(capsys, "verify", str(dataset_dir.parent))
    assert status == 1 and [p["kind"] for p in report["problems"]] == ["metadata"]  # the samples are intact
    assert main(["verify", "--fix", str(dataset_dir.parent)]) == 0
    capsys.readouterr()
    with PackedStore(dataset_dir, 1 << 30) as store:
        assert sorted(store.keys()) == keys
    assert json.loads((dataset_dir / "torchcache.json").read_text())["kind"] == "dataset"


def test_clear_removes_a_dataset_cache(dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["clear", "--all", "--yes", "--root", str(dataset_dir.parent)]) == 0
    assert not dataset_dir.exists()
    assert "removed 1 dataset cache" in capsys.readouterr().out


def test_a_sample_cache_of_its_own_shows_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHCACHE_SHM_DIR", str(tmp_path))
    cache = SampleCache("squares", tmp_path / "root", max_memory_size=0, max_disk_size="1MB")
    assert cache.get(3, lambda key: torch.full((2,), key)).tolist() == [3, 3]
    cache.close()
    assert main(["ls", str(tmp_path / "root")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:4] == ["squares", "squares", "dataset", "1"]  # its name, not "?"
    assert "damaged metadata" not in out and out.splitlines()[-1].startswith("1 dataset cache, 1 entry, ")
    assert main(["info", "squares", "--root", str(tmp_path / "root")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^name +squares$", out, re.M) and re.search(r"^metadata +ok$", out, re.M)


class Worded(Squares):
    """Samples with a string beside the image: their features are kept whole, in a dataset cache."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:  # type: ignore[override]
        return torch.full((3, 4), float(i)), "word" * (i % 3)


def test_ls_names_each_kind_of_cache(dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = dataset_dir.parent
    module = torchcache(persistent=True, persistent_cache_dir=root)(torch.nn.Linear(4, 2).requires_grad_(False))
    module(torch.randn(5, 4))
    module.cache_instance.flush()
    flat = torch.nn.Flatten().eval()
    extract_features(flat, torch.utils.data.TensorDataset(torch.randn(6, 2, 2)), cache_dir=root, progress=False)
    extract_features(flat, Worded(), cache_dir=root, progress=False)  # features kept whole
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("1 module cache, 1 dataset cache and 2 feature caches, 35 entries, ")
    kinds = sorted(re.split(r"\s{2,}", line)[2] for line in out.splitlines()[1:5])
    assert kinds == ["dataset", "features", "features", "module"]  # features kept whole (in a dataset cache) too
    assert main(["clear", dataset_dir.name, "--root", str(root)]) == 1  # stdin is not a terminal
    assert f"refusing to remove dataset cache {dataset_dir.name} (" in capsys.readouterr().err
    assert main(["clear", "--all", "--yes", "--root", str(root)]) == 0
    assert capsys.readouterr().out.startswith("removed 1 module cache, 1 dataset cache and 2 feature caches (")


def _six_features(tmp_path: Path) -> Path:
    """A root holding one features cache of six rows."""
    root = tmp_path / "root"
    flat = torch.nn.Flatten().requires_grad_(False)
    extract_features(flat, torch.utils.data.TensorDataset(torch.randn(6, 2, 2)), cache_dir=root, progress=False)
    return root


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_features_cache_with_damaged_metadata_is_listed_verified_and_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    root = _six_features(tmp_path)
    (meta,) = root.glob("features-*/torchcache.json")
    meta.write_text("not json{") if damage == "garbage" else meta.unlink()
    code, listed = _json(capsys, "ls", str(root))
    (cache,) = listed["caches"]
    assert code == 0 and (cache["kind"], cache["entries"]) == ("features", 6) and cache["metadata_problem"]
    assert main(["verify", str(root)]) == 1
    assert main(["verify", "--fix", str(root)]) == 0 and main(["verify", str(root)]) == 0
    assert json.loads(meta.read_text())["kind"] == "features"


@pytest.mark.parametrize("damage", ["a link", "cut short", "valid"])
def test_verify_reports_an_input_digests_file_that_is_not_valid_and_fix_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    root = _six_features(tmp_path)
    (digests,) = root.glob("features-*/inputs.tcdig")
    if damage == "a link":
        digests.unlink()
        digests.symlink_to("/etc/passwd")
    elif damage == "cut short":
        os.truncate(digests, 100)
    status, report = _json(capsys, "verify", str(root))
    if damage == "valid":
        assert status == 0 and report["problems"] == [] and digests.exists()
        return
    assert status == 1 and [Path(p["path"]).name for p in report["problems"]] == ["inputs.tcdig"]
    assert main(["verify", "--fix", str(root)]) == 0 and not os.path.lexists(digests)
    assert main(["verify", str(root)]) == 0


def test_verify_reports_an_index_lmdb_refused_and_rebuilt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    data = CachedDataset(Squares(), root, max_memory_size=0)
    for i in range(len(data)):
        data[i]
    data.close()
    (index,) = root.glob("*/index.lmdb")
    index.write_bytes(b"\xff" * 8192)
    capsys.readouterr()
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "the index is damaged" in out and "--fix rebuilds it from the segment files" in out
    assert main(["verify", str(root)]) == 1  # reported, left as it is
    assert main(["verify", str(root), "--fix"]) == 0
    assert "rebuilt from the segment files" in capsys.readouterr().out
    assert main(["verify", str(root)]) == 0  # rebuilt: every sample is there again
    again = CachedDataset(None, root, max_memory_size=0)
    assert [int(again[i][1]) for i in range(12)] == list(range(12))


def test_verify_checks_the_samples_of_features_kept_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    extract_features(torch.nn.Flatten().eval(), Worded(), cache_dir=root, progress=False)  # features kept whole
    (cache,) = [p for p in root.iterdir() if p.is_dir()]
    status, report = _json(capsys, "verify", str(root))
    assert status == 0 and report["ok"]
    with PackedStore(cache, 1 << 30) as store:
        keys = sorted(store.keys())
        good = bytes(store.get(keys[0]) or b"")
        store.put_many([(keys[1], good[: len(good) // 2])])  # a valid record holding half a sample
    status, report = _json(capsys, "verify", str(root))
    assert status == 1 and [Path(p["path"]).name for p in report["problems"]] == [keys[1]]
    assert main(["verify", "--fix", str(root)]) == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="plants a FIFO")
def test_verify_fix_removes_planted_non_files_and_leaves_a_directory_holding_something_in_features_caches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    plants = {"a" * 32: "link", "b" * 32: "full directory", "c" * 32: "fifo", "d" * 32: "empty directory"}
    for name, plant in plants.items():
        (root / name).mkdir(parents=True)
        (root / name / "torchcache.json").write_text(json.dumps({"torchcache_version": "1.3.0", "kind": "features"}))
        path = root / name / "features.tcrows"
        if plant == "link":
            path.symlink_to("/dev/zero")
        elif plant == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
            if plant == "full directory":
                (path / "notes.txt").write_text("someone's")
    assert main(["verify", "--fix", str(root)]) == 1  # the full directory is left, named; the run goes on
    captured = capsys.readouterr()
    assert "cannot fix" in captured.err and "verify --fix` to fix" not in captured.err
    left = {name for name in plants if os.path.lexists(root / name / "features.tcrows")}
    assert left == {"b" * 32} and (root / ("b" * 32) / "features.tcrows" / "notes.txt").exists()
    assert main(["verify", "--fix", str(root)]) == 1 and "cannot fix" in capsys.readouterr().err
