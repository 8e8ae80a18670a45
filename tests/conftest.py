"""Shared fixtures: every test gets its own cache root, never the user's cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_cache_root(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.mktemp("torchcache-root")
    monkeypatch.setenv("TORCHCACHE_DIR", str(root))
    return root


@pytest.fixture
def cache_root(_isolated_cache_root: Path) -> Path:
    """The cache root that ``TORCHCACHE_DIR`` points to for this test."""
    return _isolated_cache_root


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
