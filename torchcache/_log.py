"""The ``torchcache`` logger and its configuration from the environment.

Importing torchcache only ever touches the ``torchcache`` logger: the root logger and
every other logger are left alone. Without any ``TORCHCACHE_LOG_*`` variable the logger
has a :class:`logging.NullHandler`, so messages propagate to whatever the application
configured (with nothing configured, nothing is printed: the faults of a cache still
reach the user as :class:`~torchcache.CacheWarning` warnings). Setting a
variable, or calling :func:`set_logger_config`, gives the logger its own handlers and
stops propagation so that messages are not printed twice.

As in torchcache 0.6, messages go to a stream (stderr unless told otherwise) and, when a
file is named, to that file too; and :func:`set_logger_config` takes every argument it is
not given from its ``TORCHCACHE_LOG_*`` variable, read at each call.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

__all__ = ["DEFAULT_DATEFMT", "DEFAULT_FMT", "logger", "set_logger_config"]

logger = logging.getLogger("torchcache")

DEFAULT_FMT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_DATEFMT = "%Y-%m-%d %H:%M:%S"
DEFAULT_LEVEL = logging.WARNING
_ENV_VARS = ("TORCHCACHE_LOG_LEVEL", "TORCHCACHE_LOG_FMT", "TORCHCACHE_LOG_DATEFMT", "TORCHCACHE_LOG_FILE")
_OWN_HANDLER_ATTR = "_torchcache_handler"
_SAMPLE_RECORD = logging.LogRecord("torchcache", logging.INFO, "", 0, "a message", None, None)


def _parse_level(level: int | str | None, source: str = "level") -> int:
    """Turn a level name or number into a logging level; warn once and use WARNING if invalid."""
    if level is None:
        return DEFAULT_LEVEL
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str):
        text = level.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        value = logging.getLevelName(text.upper())
        if isinstance(value, int):
            return value
    warnings.warn(
        f"torchcache: invalid log level {source}={level!r}; expected one of DEBUG, INFO, WARNING, ERROR, "
        "CRITICAL or a number. Using WARNING.",
        RuntimeWarning,
        stacklevel=_user_stacklevel(),
    )
    return DEFAULT_LEVEL


def set_logger_config(
    level: int | str | None = None,
    fmt: str | None = None,
    datefmt: str | None = None,
    stream: TextIO | None = None,
    filename: str | os.PathLike[str] | None = None,
) -> logging.Logger:
    r"""Configure the ``torchcache`` logger (and only that logger).

    Replaces the handlers a previous call installed. Messages go to ``stream`` (stderr if
    not given) and, with a ``filename``, to that file as well. An argument left out takes
    the value of its environment variable (``TORCHCACHE_LOG_LEVEL``, ``_FMT``,
    ``_DATEFMT``, ``_FILE``), read now, and the default without one.

    Args:
        level: A level name (``"INFO"``) or number. Invalid values warn and use WARNING.
        fmt: A :mod:`logging` format string (``%``-style); one that cannot format a record raises ``ValueError``.
        datefmt: A :func:`time.strftime` format for ``%(asctime)s``.
        stream: The text stream to write to (``TypeError`` if it has no ``write``).
        filename: A file to append to, besides the stream.

    Returns:
        The configured ``torchcache`` logger.

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> log = set_logger_config(level="INFO", fmt="%(levelname)s %(message)s", stream=buf)
        >>> log.info("hello")
        >>> buf.getvalue()
        'INFO hello\n'
        >>> _ = set_logger_config()
    """
    env = _read_env()
    source = "level" if level is not None else "TORCHCACHE_LOG_LEVEL"
    level = level if level is not None else env.get("TORCHCACHE_LOG_LEVEL")
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"stream must be a text stream with a write() method, got {stream!r}")
    if fmt is not None:
        try:
            logging.Formatter(fmt, validate=True).format(_SAMPLE_RECORD)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"fmt must be a logging format string, got {fmt!r} ({exc})") from None
    formatter = logging.Formatter(fmt or DEFAULT_FMT, datefmt or env.get("TORCHCACHE_LOG_DATEFMT") or DEFAULT_DATEFMT)
    if fmt is None and "TORCHCACHE_LOG_FMT" in env:
        try:  # a bad variable warns, where a bad argument raises
            formatter = logging.Formatter(env["TORCHCACHE_LOG_FMT"], formatter.datefmt, validate=True)
            formatter.format(_SAMPLE_RECORD)
        except (ValueError, TypeError, KeyError) as exc:
            _bad_variable("TORCHCACHE_LOG_FMT", exc)
            formatter = logging.Formatter(DEFAULT_FMT, formatter.datefmt)
    filename = filename if filename is not None else env.get("TORCHCACHE_LOG_FILE")
    for handler in list(logger.handlers):
        if getattr(handler, _OWN_HANDLER_ATTR, False) or isinstance(handler, logging.NullHandler):
            logger.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(stream if stream is not None else sys.stderr)]
    if filename is not None:
        try:
            handlers.append(logging.FileHandler(os.fspath(filename), encoding="utf-8"))
        except OSError as exc:
            if "TORCHCACHE_LOG_FILE" not in env or filename != env["TORCHCACHE_LOG_FILE"]:
                raise
            _bad_variable("TORCHCACHE_LOG_FILE", exc)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _OWN_HANDLER_ATTR, True)
        logger.addHandler(handler)
    logger.setLevel(_parse_level(level, source))
    logger.propagate = False
    return logger


def _bad_variable(name: str, exc: Exception) -> None:
    warnings.warn(
        f"torchcache: {name}={os.environ.get(name)!r} cannot be used ({type(exc).__name__}: {exc}); it is ignored",
        RuntimeWarning,
        stacklevel=_user_stacklevel(),
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the user's line for a warning raised by the caller: outside torchcache and imports."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith((_PACKAGE, "<frozen importlib")):
        frame = frame.f_back
        level += not frame.f_code.co_filename.startswith("<frozen importlib")  # warnings skips those frames
    return level


def _read_env() -> dict[str, str]:
    """The ``TORCHCACHE_LOG_*`` variables that are set and not empty."""
    return {name: value for name in _ENV_VARS if (value := os.environ.get(name))}


def configure_from_env() -> None:
    """Apply the ``TORCHCACHE_LOG_*`` environment variables, if any is set."""
    if not _read_env():
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
        return
    set_logger_config()
