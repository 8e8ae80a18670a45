"""Shared fixtures: every test gets its own cache root, never the user's cache directory."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_LOG_VARIABLES = ("TORCHCACHE_LOG_LEVEL", "TORCHCACHE_LOG_FMT", "TORCHCACHE_LOG_DATEFMT", "TORCHCACHE_LOG_FILE")


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


@pytest.fixture
def torchcache_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The ``torchcache`` logger, restored to its state before the test, without log variables."""
    for name in _LOG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    log = logging.getLogger("torchcache")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield log
    for handler in list(log.handlers):
        if handler not in handlers:
            log.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in log.handlers:
            log.addHandler(handler)
    log.setLevel(level)
    log.propagate = propagate
