"""Which entries of a local copy no eviction may drop: those its files of unsent keys name.

A process whose shared store refused a write names the keys in a file of the copy's
directory (:mod:`~torchcache.stores.unsent`); the copy's entries of those keys are then
its only copies. Every packed store keeps them (:func:`named_pins`, read at each
eviction), whichever process evicts and whatever its budget.

Files are only appended to until they are rewritten under a new name, so each is read
once and then from where the last read ended: an eviction while many processes append
reads only what they added.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from collections.abc import Collection, Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .._fork import after_fork
from .files import open_regular, read_at
from .packed.format import encode_key, is_key

__all__ = ["MAX_FILE_BYTES", "MAX_KEYS", "SLACK", "Pins", "is_unsent_file", "keys_in", "named_pins"]

#: Keys a process holds at most (past them, a long outage's entries stay on this machine only).
MAX_KEYS = 1 << 18
#: Lines a process's file names beyond twice the keys it holds before it is rewritten.
SLACK = 4096
#: Bytes of a file read at most: it names at most twice :data:`MAX_KEYS` and the slack.
MAX_FILE_BYTES = (2 * MAX_KEYS + SLACK) * 65
_NAME = re.compile(r"unsent-[0-9]+-[0-9a-f]{8}\.keys(?:\.tmp)?")


def is_unsent_file(name: str) -> bool:
    """Whether ``name`` is that of a file of unsent keys (or of one being written).

    Example:
        >>> is_unsent_file("unsent-4242-0a1b2c3d.keys"), is_unsent_file("unsent.txt")
        (True, False)
    """
    return _NAME.fullmatch(name) is not None


def keys_in(data: bytes) -> Iterator[str]:
    """The keys ``data`` (lines of a file of unsent keys) names; a line that is not a key is skipped."""
    for line in io.BytesIO(data):
        key = line.strip().decode("ascii", "replace")
        if is_key(key):
            yield key


class Pins:
    """Keys in the index's form, from several collections: a key is pinned if any holds it.

    Example:
        >>> b"ab" in Pins({b"ab"}, {}), b"cd" in Pins({b"ab"})
        (True, False)
    """

    def __init__(self, *parts: Container[bytes]) -> None:
        self._parts = parts

    def __contains__(self, kb: object) -> bool:
        return any(kb in part for part in self._parts)


@dataclass
class _Read:
    """What was read of one file: its inode, how far (whole lines), and the keys found."""

    inode: int
    offset: int = 0
    keys: set[bytes] = field(default_factory=set)


_read: dict[Path, dict[Path, _Read]] = {}  # by directory, by file
_lock = threading.Lock()


def _renew() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent's may have held it


after_fork(_renew)


def named_pins(directory: Path, skip: Collection[Path] = ()) -> Pins:
    """The keys the files of unsent keys in ``directory`` name (but those at ``skip``), as :class:`Pins`.

    Each file is read from where the last call ended (a file rewritten in place, which
    torchcache never does, is read again whole), whatever ``skip``. A file claimed
    (renamed) between the listing and its read is looked for again, up to three times. A
    directory that cannot be listed names none (and what was read of it is let go).
    """
    with _lock:
        for _ in range(3):
            try:
                with os.scandir(directory) as items:
                    listing = [
                        (Path(item.path), item.inode())
                        for item in items
                        if is_unsent_file(item.name) and not item.name.endswith(".tmp")
                    ]
            except OSError:
                _read.pop(directory, None)
                return Pins()
            known = _read.get(directory, {})
            now = {path: _more(path, known.get(path), inode) for path, inode in listing}
            _read[directory] = {path: read for path, read in now.items() if read is not None}
            if None not in now.values():
                break
        files = _read[directory] if _read[directory] else _read.pop(directory)
        return Pins(*(read.keys for path, read in files.items() if path not in skip))


def _more(path: Path, read: _Read | None, inode: int) -> _Read | None:
    """``read`` with what ``path`` holds past it (a fresh read for another file); ``None`` if it is gone."""
    if read is None or read.inode != inode:
        read = _Read(inode)
    try:
        opened = open_regular(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError:
        return read
    if opened is None:
        return read
    fd, st = opened
    try:
        if st.st_ino != read.inode or st.st_size < read.offset:  # replaced since it was listed: read whole
            read = _Read(st.st_ino)
        with contextlib.suppress(OSError):
            data = read_at(fd, max(0, min(st.st_size, MAX_FILE_BYTES) - read.offset), read.offset)
            whole = data[: data.rfind(b"\n") + 1]  # a line being appended is read with the rest of it
            read.keys.update(encode_key(key) for key in keys_in(whole))
            read.offset += len(whole)
    finally:
        os.close(fd)
    return read
