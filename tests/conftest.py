"""Shared fixtures: every test gets its own cache root, never the user's cache directory."""

from __future__ import annotations

import gc
import logging
import multiprocessing.popen_fork
import multiprocessing.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torchcache  # noqa: F401 - the logger's state at import, below, is the one it leaves
from tests import zygote
from torchcache.canonical import KeyEncoder
from torchcache.keys import numerics
from torchcache.module.independence import forget_checks

# gcsfs probes a bucket's type over gRPC at its first use, which waits 60 s against the GCS
# emulator of the tests: off, before anything imports gcsfs (tests/object_servers.py).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_LOG_VARIABLES = ("TORCHCACHE_LOG_LEVEL", "TORCHCACHE_LOG_FMT", "TORCHCACHE_LOG_DATEFMT", "TORCHCACHE_LOG_FILE")
_log = logging.getLogger("torchcache")
_LOG_AT_IMPORT = (list(_log.handlers), _log.level, _log.propagate)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, and one more.

    About half of the suite's CPU time is child processes (Python and torch start in
    about 1.5 s each) while the worker that started one waits for it: one more worker
    keeps the cores busier (on 2 cores, five runs each: 196-245 s, median 227 s, with
    three workers against 220-248 s, median 239 s, with two; 212 s once with four).
    """
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what collection made (modules, torch and its compiler, the test items) out of later collections.

    They live for the whole session; without this, each full collection a test starts
    (``gc.collect()`` before its directory goes, or one the allocator sets off) walks
    them again: about 0.6 s in a worker that collected the suite, 10 ms after.
    """
    import torch._dynamo  # noqa: F401 - imported by the compile tests anyway: kept out of collections too

    gc.collect()
    gc.freeze()
    _modules_frozen[0] = len(sys.modules)


_modules_frozen = [0]  # how many modules were loaded at the last freeze


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Keep modules a test imported (transformers, a model zoo: 300,000 objects) out of later collections.

    As after collection, above: without it every later ``gc.collect()`` in that worker
    walks them again, 0.5-0.9 s each where the suite's own collections take 10 ms.
    """
    result = yield
    if len(sys.modules) > _modules_frozen[0]:
        gc.collect()
        gc.freeze()
        _modules_frozen[0] = len(sys.modules)
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Every test starts with the ``torchcache`` logger as the import left it.

    A test or doctest that configured it (``set_logger_config`` stops propagation) would
    otherwise change the next one, whatever the order: pytest also attaches its capture
    handlers to non-propagating loggers when a test starts, before any fixture runs.
    """
    handlers, level, propagate = _LOG_AT_IMPORT
    for handler in list(_log.handlers):
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            _log.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in _log.handlers:
            _log.addHandler(handler)
    _log.setLevel(level)
    _log.propagate = propagate
    return (yield)


def _numerics() -> tuple[object, ...]:
    autocast = [torch.is_autocast_enabled(device) for device in ("cpu", "cuda")]
    classes = KeyEncoder("").encode([torch.nn.Linear, torch.nn.ReLU, torch.nn.Sequential], "classes")
    return numerics(("cpu", "cuda")), autocast, classes


@pytest.fixture(autouse=True)
def _any_test_leaves_the_numerics_as_found() -> Iterator[None]:
    """A test leaves what every key of the process depends on as it found it (other tests' keys would differ).

    Its name sorts first, so that it is set up before the other fixtures and looks after their teardown.
    """
    before = _numerics()
    yield
    assert _numerics() == before, "the test changed torch's global numerics (or torch's classes) and left them so"


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


@pytest.fixture(autouse=True)
def _items_checked_afresh() -> None:
    """Every test checks its modules' items at their first call, whatever ran before in its process."""
    forget_checks()


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


class _Starts:
    """Processes started while a test runs: forks, multiprocessing children, and subprocesses."""

    count = 0

    @classmethod
    def wrap(cls, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            cls.count += 1
            return real(*args, **kwargs)

        return counted


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test that starts a process (a fork, a DataLoader worker, a server, a Python child) carries the ``slow`` mark.

    ``pytest -m "not slow"`` then runs the tests that stay in this process, in a fraction
    of the time; the README's test command runs them all.
    """
    patched = [
        (os, "fork"),
        (subprocess.Popen, "_execute_child"),
        (multiprocessing.util, "spawnv_passfds"),
        (multiprocessing.popen_fork.Popen, "_launch"),
        (zygote, "start"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    before = _Starts.count
    for owner, name, real in saved:
        setattr(owner, name, _Starts.wrap(real))
    try:
        result = yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)
    if _Starts.count > before and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} starts processes: give it @pytest.mark.slow (or its module pytestmark)", False)
    return result


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket on a local S3 server, ``s3://name``, reached through the environment (tests/object_servers.py)."""
    from tests.object_servers import new_bucket

    return new_bucket(monkeypatch)


@pytest.fixture
def s3fs_of(bucket: str) -> Any:
    """An s3fs filesystem on the server of ``bucket``."""
    from tests.object_servers import filesystem

    return filesystem()


@pytest.fixture
def gcs_bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket on a local GCS emulator, ``gs://name``, reached through the environment."""
    from tests.object_servers import new_gcs_bucket

    return new_gcs_bucket(monkeypatch)


@pytest.fixture
def modules() -> Iterator[list[str]]:
    """Names of modules a test loads from files: removed from ``sys.modules`` afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def reads_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CachedDataset``'s ``check_samples`` off by default: a test that counts a dataset's reads counts its own.

    The check's two extra reads of a process's first computed sample are tested in
    ``test_dataset_draws``; a child process (spawned worker, second run) passes it itself.
    """
    from torchcache import CachedDataset

    defaults = CachedDataset.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "check_samples", False)
