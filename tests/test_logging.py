"""The "torchcache" logger: environment variables at import, set_logger_config, no side effects."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import Counting, cached, run_python
from torchcache import set_logger_config, torchcache
from torchcache._log import DEFAULT_FMT

ENV_VARS = ("TORCHCACHE_LOG_LEVEL", "TORCHCACHE_LOG_FMT", "TORCHCACHE_LOG_DATEFMT", "TORCHCACHE_LOG_FILE")


def clean_env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(values)
    return env


@pytest.fixture
def logger(torchcache_logger: logging.Logger) -> logging.Logger:
    """The torchcache logger, restored after the test; no TORCHCACHE_LOG_* set (see conftest.py)."""
    return torchcache_logger


def module_key_message() -> None:
    """Make the library log its INFO message about a new module key."""

    @torchcache()
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double(torch.ones(2, 1))


# -- at import, in a fresh interpreter ------------------------------------------------------
ENV_SCRIPT = textwrap.dedent(
    """
    import json, logging, torch
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    import torchcache
    after = (root.level, list(root.handlers))

    @torchcache.torchcache()
    def double(x):
        return x * 2

    double(torch.ones(2, 1))
    log = logging.getLogger("torchcache")
    log.debug("a debug line")
    print(json.dumps({"root_same": before == after, "level": log.level}))
    """
)


@pytest.mark.slow
def test_environment_variables_configure_the_logger_at_import(tmp_path: Path) -> None:
    log_file = tmp_path / "torchcache.log"
    env = clean_env(
        TORCHCACHE_LOG_LEVEL="info",
        TORCHCACHE_LOG_FMT="%(levelname)s|%(name)s|%(asctime)s|%(message)s",
        TORCHCACHE_LOG_DATEFMT="%Y",
        TORCHCACHE_LOG_FILE=str(log_file),
    )
    result = run_python(ENV_SCRIPT, env=env)
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert state["root_same"] is True
    assert state["level"] == logging.INFO
    lines = log_file.read_text().splitlines()
    assert any(re.fullmatch(r"INFO\|torchcache\|\d{4}\|.*module key.*", line) for line in lines), lines
    assert not any("a debug line" in line for line in lines)
    # as in torchcache 0.6: to the file and to the stream, in the same format
    streamed = result.stderr.splitlines()
    assert any(re.fullmatch(r"INFO\|torchcache\|\d{4}\|.*module key.*", line) for line in streamed), streamed
    assert len([line for line in streamed if "module key" in line]) == 1


@pytest.mark.slow
def test_environment_level_without_a_file_logs_to_stderr() -> None:
    result = run_python(ENV_SCRIPT, env=clean_env(TORCHCACHE_LOG_LEVEL="DEBUG", TORCHCACHE_LOG_FMT="%(message)s"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["level"] == logging.DEBUG
    lines = result.stderr.splitlines()
    assert "a debug line" in lines
    assert len([line for line in lines if "module key" in line]) == 1


NO_SIDE_EFFECTS_SCRIPT = textwrap.dedent(
    """
    import io, json, logging, torch, numpy
    logging.getLogger("app").setLevel(logging.ERROR)

    def snapshot():
        loggers = {
            name: (log.level, list(log.handlers), log.propagate, log.disabled)
            for name, log in logging.Logger.manager.loggerDict.items()
            if isinstance(log, logging.Logger) and not name.startswith("torchcache")
        }
        root = logging.getLogger()
        return (root.level, list(root.handlers), root.disabled), loggers

    root_before, before = snapshot()
    import torchcache
    root_after, after = snapshot()
    changed = [name for name in before if before[name] != after[name]]
    new_with_handlers = [name for name in after if name not in before and after[name][1]]

    # the application configures logging after the import: torchcache messages reach it once
    buffer = io.StringIO()
    logging.basicConfig(stream=buffer, level=logging.INFO, format="%(name)s:%(message)s")

    @torchcache.torchcache()
    def double(x):
        return x * 2

    double(torch.ones(2, 1))
    print(json.dumps({
        "root_same": root_before == root_after,
        "changed": changed,
        "new_with_handlers": new_with_handlers,
        "lines": buffer.getvalue().splitlines(),
    }))
    """
)


@pytest.mark.slow
def test_import_changes_no_other_logger_and_messages_propagate_once() -> None:
    result = run_python(NO_SIDE_EFFECTS_SCRIPT, env=clean_env())
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert state["root_same"] is True
    assert state["changed"] == []
    assert state["new_with_handlers"] == []
    assert len([line for line in state["lines"] if "module key" in line]) == 1, state["lines"]
    assert all(line.startswith("torchcache") for line in state["lines"] if "module key" in line)


INVALID_LEVEL_SCRIPT = textwrap.dedent(
    """
    import json, logging, warnings, torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torchcache
    print(json.dumps({
        "warnings": [str(w.message) for w in caught if "LOUD" in str(w.message)],
        "where": [w.filename for w in caught if "LOUD" in str(w.message)],
        "level": logging.getLogger("torchcache").getEffectiveLevel(),
    }))
    """
)


@pytest.mark.slow
def test_invalid_level_in_the_environment_warns_once_and_uses_the_default() -> None:
    result = run_python(INVALID_LEVEL_SCRIPT, env=clean_env(TORCHCACHE_LOG_LEVEL="LOUD"))
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert len(state["warnings"]) == 1, state["warnings"]
    assert state["where"] == ["<string>"]  # the user's import line, not torchcache's
    assert state["level"] == logging.WARNING


# -- set_logger_config, in this process ----------------------------------------------------
def test_set_logger_config_to_a_stream(logger: logging.Logger) -> None:
    root = logging.getLogger()
    root_state = (root.level, list(root.handlers))
    buffer = io.StringIO()
    returned = set_logger_config(level="INFO", fmt="%(levelname)s %(asctime)s %(message)s", datefmt="%Y", stream=buffer)
    assert returned is logger
    module_key_message()
    lines = buffer.getvalue().splitlines()
    assert any(re.fullmatch(r"INFO \d{4} .*module key.*", line) for line in lines), lines
    assert (root.level, list(root.handlers)) == root_state


def test_set_logger_config_replaces_its_previous_handler(logger: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    set_logger_config(level="WARNING", fmt="%(message)s", stream=first)
    set_logger_config(level="WARNING", fmt="%(message)s", stream=second)
    cached(Counting, persistent_module_hash="fixed-key")()
    assert first.getvalue() == ""
    assert len([line for line in second.getvalue().splitlines() if "fixed-key" in line]) == 1


def test_set_logger_config_to_a_file_and_level_filtering(logger: logging.Logger, tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    set_logger_config(level=logging.ERROR, fmt="%(levelname)s:%(message)s", filename=path)
    cached(Counting, persistent_module_hash="quiet-key")()  # a WARNING, below ERROR
    set_logger_config(level="warning", fmt="%(levelname)s:%(message)s", filename=path)
    cached(Counting, persistent_module_hash="loud-key")()
    module_key_message()  # INFO, below WARNING
    for handler in logger.handlers:
        handler.flush()
    text = path.read_text()
    assert "quiet-key" not in text
    assert re.search(r"^WARNING:.*loud-key", text, re.MULTILINE)
    assert "module key" not in text


def test_set_logger_config_with_an_invalid_level_warns_once_and_uses_the_default(logger: logging.Logger) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_logger_config(level="LOUD", stream=io.StringIO())
    assert len([w for w in caught if "level='LOUD'" in str(w.message)]) == 1
    assert logger.level == logging.WARNING


@pytest.mark.slow
def test_import_with_environment_variables_changes_no_other_logger(tmp_path: Path) -> None:
    env = clean_env(TORCHCACHE_LOG_LEVEL="DEBUG", TORCHCACHE_LOG_FILE=str(tmp_path / "log.txt"))
    result = run_python(NO_SIDE_EFFECTS_SCRIPT, env=env)
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert state["root_same"] is True
    assert state["changed"] == []
    assert state["new_with_handlers"] == []
    assert not any("module key" in line for line in state["lines"])  # no propagation: not printed twice
    assert "module key" in (tmp_path / "log.txt").read_text()


def test_set_logger_config_takes_unset_arguments_from_the_environment(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "env.log"
    monkeypatch.setenv("TORCHCACHE_LOG_LEVEL", "info")
    monkeypatch.setenv("TORCHCACHE_LOG_FMT", "%(levelname)s<%(asctime)s>%(message)s")
    monkeypatch.setenv("TORCHCACHE_LOG_DATEFMT", "%Y")
    monkeypatch.setenv("TORCHCACHE_LOG_FILE", str(path))
    buffer = io.StringIO()
    set_logger_config(stream=buffer)
    assert logger.level == logging.INFO
    module_key_message()
    for handler in logger.handlers:
        handler.flush()
    pattern = r"INFO<\d{4}>.*module key.*"
    assert any(re.fullmatch(pattern, line) for line in buffer.getvalue().splitlines()), buffer.getvalue()
    assert any(re.fullmatch(pattern, line) for line in path.read_text().splitlines())


def test_set_logger_config_arguments_win_over_the_environment(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHCACHE_LOG_LEVEL", "ERROR")
    monkeypatch.setenv("TORCHCACHE_LOG_FMT", "env %(message)s")
    buffer = io.StringIO()
    set_logger_config(level="INFO", fmt="arg %(message)s", stream=buffer)
    assert logger.level == logging.INFO
    module_key_message()
    lines = buffer.getvalue().splitlines()
    assert any(line.startswith("arg ") and "module key" in line for line in lines), lines
    assert not any(line.startswith("env ") for line in lines)


def test_set_logger_config_without_arguments_or_environment_uses_the_defaults(logger: logging.Logger) -> None:
    set_logger_config(level="DEBUG")
    set_logger_config()
    assert logger.level == logging.WARNING
    handlers = [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    assert [type(h) for h in handlers] == [logging.StreamHandler]
    assert handlers[0].formatter is not None and handlers[0].formatter._fmt == DEFAULT_FMT


def test_set_logger_config_with_a_file_logs_to_the_stream_too(logger: logging.Logger, tmp_path: Path) -> None:
    path = tmp_path / "both.log"
    buffer = io.StringIO()
    set_logger_config(level="WARNING", fmt="%(message)s", stream=buffer, filename=path)
    cached(Counting, persistent_module_hash="both-key")()
    for handler in logger.handlers:
        handler.flush()
    assert len([line for line in buffer.getvalue().splitlines() if "both-key" in line]) == 1
    assert len([line for line in path.read_text().splitlines() if "both-key" in line]) == 1
    set_logger_config(level="WARNING", stream=io.StringIO())  # replaces both handlers
    assert not any(isinstance(h, logging.FileHandler) for h in logger.handlers)


@pytest.mark.parametrize(
    ("name", "value"),
    [("TORCHCACHE_LOG_FMT", "%(message"), ("TORCHCACHE_LOG_FMT", "%(bogus)s"), ("TORCHCACHE_LOG_FILE", "/proc/no/log")],
)
def test_an_unusable_variable_warns_naming_it_and_logging_goes_on(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    stream = io.StringIO()
    with pytest.warns(RuntimeWarning, match=name) as caught:
        set_logger_config(stream=stream)
    assert caught[0].filename == __file__  # the caller's line, not torchcache's
    logger.warning("still logged")
    assert "still logged" in stream.getvalue()


@pytest.mark.parametrize("fmt", ["%(message", "%(bogus)s", "%(message)d"])
def test_an_unusable_format_passed_as_an_argument_raises_naming_it(logger: logging.Logger, fmt: str) -> None:
    with pytest.raises(ValueError, match=r"^fmt must be a logging format string"):
        set_logger_config(fmt=fmt)


def test_a_stream_that_cannot_be_written_is_refused_naming_it(logger: logging.Logger) -> None:
    with pytest.raises(TypeError, match=r"^stream must be a text stream"):
        set_logger_config(stream=5)  # type: ignore[arg-type]
