"""Module directory metadata (``torchcache.json``): bounded reads, validation, atomic writes.

The library and the ``torchcache`` command agree on one rule for valid metadata: a JSON
object with a ``torchcache_version`` string and, where present, a ``created`` time and a
``max_bytes`` count in range, at most :data:`MAX_META_BYTES` long and shallowly nested.
The file is read only when it is a regular file, without blocking, and written through
an exclusively created temporary file, so a planted file or link is never followed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

from .codec import nested_deeper_than
from .policy import MAX_SIZE
from .stores.files import read_bounded

__all__ = [
    "MAX_META_BYTES",
    "META_NAME",
    "FULL_OR_READ_ONLY",
    "is_disk_wide",
    "load_meta",
    "meta_size",
    "meta_time",
    "read_meta",
    "write_json_atomic",
]

META_NAME = "torchcache.json"
#: A metadata file larger than this is damaged (a real one is well under a kilobyte).
MAX_META_BYTES = 1 << 16
_MAX_META_DEPTH = 8
_LAST_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC, the last time a date can show
#: Errors of a full or read-only disk.
FULL_OR_READ_ONLY = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS) if code)
_DISK_WIDE = FULL_OR_READ_ONLY | {errno.EACCES, errno.EPERM, errno.EIO}
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def meta_time(value: object) -> float | None:
    """A metadata time (Unix seconds) as a float, or ``None`` if it is not one a date can show."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int of hundreds of digits
        return None
    return seconds if math.isfinite(seconds) and 0 <= seconds <= _LAST_TIME else None


def meta_size(value: object) -> int | None:
    """A metadata byte count as an int, or ``None`` if it is not a whole number of bytes up to 2**64."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if 0 <= value <= MAX_SIZE else None


def _meta_problem(meta: object) -> str | None:
    if not isinstance(meta, dict):
        return "not a JSON object"
    if nested_deeper_than(meta, _MAX_META_DEPTH):
        return "nested too deeply"
    version = meta.get("torchcache_version")
    if not isinstance(version, str) or not version:
        return "no torchcache_version"
    for field, check in (("created", meta_time), ("max_bytes", meta_size)):
        if meta.get(field) is not None and check(meta[field]) is None:
            return f"invalid {field} {str(meta[field])[:40]}"
    return None


def load_meta(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """Read a module directory's metadata and say what is wrong with it.

    The file is opened without blocking, only if it is a regular file, and read only up
    to :data:`MAX_META_BYTES`. Valid metadata is a JSON object with a
    ``torchcache_version`` string and, where present, a ``created`` time and a
    ``max_bytes`` count in range; the library and ``torchcache`` agree on this.

    Returns:
        ``(meta, None)`` if it is valid; ``(None, None)`` if there is no metadata file;
        ``(object or None, reason)`` if it is damaged (the object, when it is one, is
        what could be parsed).
    """
    path = directory / META_NAME
    try:
        data = read_bounded(path, MAX_META_BYTES)
    except ValueError as exc:
        return None, f"{META_NAME} is too large ({exc})"
    except OSError as exc:  # permissions or I/O: the file may be read again later; else it is damage
        head = UNREADABLE if exc.errno in (errno.EACCES, errno.EPERM, errno.EIO) else "cannot open"
        return None, f"{head} {META_NAME}: {exc.strerror or exc}"
    if data is None:
        return None, f"{META_NAME} is not a regular file" if os.path.lexists(path) else None
    try:
        meta = json.loads(data)
    except ValueError:
        return None, f"{META_NAME} is not valid JSON"
    except RecursionError:
        return None, f"{META_NAME} is nested too deeply"
    problem = _meta_problem(meta)
    if problem is not None:
        shown = meta if isinstance(meta, dict) and not nested_deeper_than(meta, _MAX_META_DEPTH) else None
        return shown, f"{META_NAME}: {problem}"
    return meta, None


#: How a problem of :func:`load_meta` starts when the file could not be read (permissions, I/O): not damage.
UNREADABLE = "cannot read"


def unreadable(problem: str | None) -> bool:
    """Whether a problem of :func:`load_meta` is a file that could not be read, which is left as it is."""
    return problem is not None and problem.startswith(UNREADABLE)


def read_meta(directory: Path) -> dict[str, Any] | None:
    """The metadata of a module directory, or ``None`` if it has none or it is damaged."""
    meta, problem = load_meta(directory)
    return meta if problem is None else None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to a new temporary file beside ``path`` and rename it into place.

    The temporary name is random and created exclusively (never through a planted file
    or link); it is removed if anything fails.

    Raises:
        OSError: If it cannot be written.
    """
    text = (json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, _O_CREATE, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_disk_wide(exc: BaseException) -> bool:
    """Whether an error (or its cause) concerns the disk as a whole rather than one path."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_WIDE:
            return True
        seen = seen.__cause__
    return False
