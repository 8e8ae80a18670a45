"""Files that are not torchcache's, and files a command is only asked to describe, are left as they are."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import Counting, cached
from torchcache.cli.main import main
from torchcache.stores.packed.format import parse_segment_name


def _contents(directory: Path) -> dict[str, bytes]:
    """Names and contents; an LMDB lock file's contents aside (its reader table records every reader)."""
    return {p.name: b"" if p.name.endswith("-lock") else p.read_bytes() for p in sorted(directory.iterdir())}


def _users_directory(root: Path) -> Path:
    """A directory of the user's under the cache root, with files at the names of torchcache's."""
    mine = root / "my-project"
    mine.mkdir(parents=True)
    (mine / "index.lmdb").write_bytes(b"my own index of the lab notebook\n" * 100)
    (mine / ".draft.tmp").write_text("a draft")
    (mine / "notes.txt").write_text("notes")
    return mine


def test_a_users_directory_with_an_index_lmdb_is_never_listed_changed_or_removed(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = _users_directory(cache_root)
    before = _contents(mine)
    root = str(cache_root)
    for command in (["ls", root], ["info", str(mine)], ["verify", root], ["verify", root, "--fix"]):
        main(command)
        assert _contents(mine) == before, command
    main(["prune", root, "--max-size", "0"])
    assert "no caches" in capsys.readouterr().out
    main(["clear", "--all", "--yes", "--root", str(cache_root)])
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "1KB")  # the root budget, kept when a cache opens
    model = cached(Counting, persistent=True)(4, 64)
    model(torch.randn(4, 4))
    model.cache_instance.flush()
    assert _contents(mine) == before


def test_describing_a_cache_leaves_a_segment_file_the_index_does_not_know(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = cached(Counting, persistent=True)(4, 64)
    model(torch.randn(8, 4))
    model.cache_instance.flush()
    directory = model.cache_instance.cache_dir
    assert directory is not None
    del model
    gc.collect()
    (segment,) = [p for p in directory.iterdir() if parse_segment_name(p.name) is not None]
    orphan = segment.with_name(segment.name.replace("0001", "0009"))
    orphan.write_bytes(segment.read_bytes())
    before = _contents(directory)
    for command in (["ls", str(cache_root)], ["info", str(directory)]):
        assert main(command) == 0
        assert _contents(directory) == before, command
    capsys.readouterr()
    assert main(["verify", str(cache_root)]) == 1
    assert orphan.name in capsys.readouterr().out and orphan.exists()
    assert main(["verify", str(cache_root), "--fix"]) == 0
    assert not orphan.exists() and main(["verify", str(cache_root)]) == 0
    assert os.listdir(directory)
