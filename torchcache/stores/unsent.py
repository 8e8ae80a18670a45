"""Keys a local copy holds that its shared store did not take: sent up once the store takes writes again.

A write to a Redis server or a bucket that fails (the server away, full or refusing)
while the local copy takes it leaves the entry on this machine only: its hits are served
by the copy, so nothing computes it again, and other machines would miss it for good.
:class:`Unsent` keeps those keys: in RAM while the process runs, and in a file of the
copy's directory (``unsent-<pid>-<token>.keys``, one key a line, locked by the process
while it lives), appended to as keys come and rewritten at each flush (and once it
names twice the keys held). The copy evicts none of them: a packed store keeps what the
files in its directory name (:mod:`~torchcache.stores.pins`), and a layered store's copy this
process's keys too, those on their way to the server included (:meth:`Unsent.pinned`).
The layered store sends them from the copy after a write the server took, at each flush,
and as the process ends; the next process to open the copy claims the files that no live
process holds and sends their keys, one process each (a killed process's file may name
keys it had sent already: sent again, the same bytes). A key the copy no longer holds (removed
by ``clear``) is dropped and counted. The file is ASCII text whose lines are checked as
keys: nothing in it runs, and a line that is not a key is skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import os
import secrets
import stat
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from .._fork import at_process_end
from ..errors import StoreError
from .files import open_regular, read_at
from .packed.format import encode_key
from .pins import MAX_FILE_BYTES, MAX_KEYS, SLACK, Pins, is_unsent_file, keys_in, named_pins

__all__ = ["MAX_KEYS", "Unsent", "count_unsent", "is_unsent_file"]

#: Seconds before keys whose sending failed are tried again (a flush tries at once).
RETRY_SECONDS = 10.0
_CHUNK = 256
#: Seconds a file being written (``.tmp``) is left alone, before it counts as a save its process did not finish.
_TMP_GRACE = 60.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_live: weakref.WeakSet[Unsent] = weakref.WeakSet()  # holding keys: saved when the process ends

Read = Callable[[list[str]], Sequence[bytes | memoryview | None]]
Write = Callable[[list[tuple[str, bytes | memoryview]]], int]


def count_unsent(paths: Iterable[Path]) -> int:
    """How many keys the unsent files at ``paths`` name, up to :data:`MAX_KEYS` (read only: nothing is claimed).

    Names that are not those of unsent files, and saves in progress, are skipped. (A file
    names the keys its process sent too, until it is rewritten: an upper bound.)

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "unsent-7-0a1b2c3d.keys"
        >>> _ = path.write_text(chr(10).join(["ab12", "not a key", "ab12", "cd34"]))
        >>> count_unsent([path])
        2
    """
    keys: set[str] = set()
    for path in paths:
        if is_unsent_file(path.name) and not path.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                opened = open_regular(path, follow_symlinks=False)
                if opened is None:
                    continue
                try:
                    keys.update(keys_in(read_at(opened[0], MAX_FILE_BYTES)))
                finally:
                    os.close(opened[0])
        if len(keys) >= MAX_KEYS:  # no process holds more
            return MAX_KEYS
    return len(keys)


class Unsent:
    """The keys of a local copy that its shared store lacks, held by one process.

    Args:
        directory: The local copy's directory (``None``: kept in RAM only). The files that
            processes which ended left there are claimed (renamed to a name of this
            process's, so that no other process sends their keys too) and their keys held.

    Whose a file is, is told by a lock, not a process id (ids are reused, and a job in a
    container is often process 1): the process that saves or claims a file holds a
    ``flock`` on it for as long as it lives, and a file no one holds a lock on is free to
    claim. A forked child starts with none: what its parent held is its parent's to send.
    """

    def __init__(self, directory: Path | None) -> None:
        self._dir = directory
        #: Sends what is held (set by the layered store): tried once more as the process ends.
        self.sender: Callable[[], None] | None = None
        self._start()
        if directory is not None:
            with contextlib.suppress(OSError):
                for path in sorted(directory.glob("unsent-*.keys*")):
                    self._take_over(path)

    def _start(self) -> None:
        self._pid = os.getpid()
        self._keys: dict[str, None] = {}
        #: Keys that could not be held (past :data:`MAX_KEYS`) or were gone from the copy when sent.
        self.dropped = 0
        #: The files this process holds (locked), its own and those it claimed, by path.
        self._held: dict[Path, int] = {}
        self._own: int | None = None  # the descriptor of the file its new keys are appended to
        self._lines = 0  # the keys that file names, sent ones too
        self._encoded: set[bytes] = set()  # the keys held, in the index's form
        self._flying: Counter[bytes] = Counter()  # keys on their way to the shared store, in the index's form
        self._retry_at = float("-inf")
        self._lock = threading.RLock()
        self._sending = threading.Lock()  # one send at a time: a key is never sent twice

    def _mine(self) -> None:
        if self._pid != os.getpid():  # the parent's files stay locked by the descriptors it keeps
            for fd in self._held.values():  # a child's copies would keep its lock once the parent ends
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._start()

    def __del__(self) -> None:
        if self._pid == os.getpid():  # no longer held here: the files are free to claim
            for fd in self._held.values():
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __len__(self) -> int:
        self._mine()
        return len(self._keys)

    def _take_over(self, path: Path) -> None:
        """Claim a file that no process holds and hold its keys (a regular file only: a FIFO would block)."""
        if not is_unsent_file(path.name):
            return
        with contextlib.suppress(OSError):
            opened = open_regular(path, follow_symlinks=False)
            if opened is None:
                return
            fd = opened[0]
            try:
                if not stat.S_ISREG(opened[1].st_mode):
                    raise BlockingIOError
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its process lives, and sends them itself
                if path.name.endswith(".tmp"):  # a save its process did not finish, or one about to lock it
                    if time.time() - opened[1].st_mtime > _TMP_GRACE:
                        path.unlink()
                    raise BlockingIOError
                claimed = path.with_name(f"unsent-{self._pid}-{secrets.token_hex(4)}.keys")
                os.rename(path, claimed)  # claimed first by another process: FileNotFoundError
                keys = list(keys_in(read_at(fd, MAX_FILE_BYTES)))
            except OSError:
                os.close(fd)
                return
            self.add(keys[::-1])  # newest first: those it had sent (the oldest) go past MAX_KEYS, if any
            self._held[claimed] = fd  # locked until its keys are sent or saved in this process's file

    def add(self, keys: Sequence[str]) -> None:
        """Hold ``keys`` (past :data:`MAX_KEYS`, the rest are not held), and name them in this process's file."""
        self._mine()
        with self._lock:
            new = []
            for key in keys:
                if key in self._keys:
                    continue
                if len(self._keys) >= MAX_KEYS:
                    self.dropped += 1
                else:
                    self._keys[key] = None
                    self._encoded.add(encode_key(key))
                    new.append(key)
            if new and self._dir is not None:
                with contextlib.suppress(OSError):  # then named at the next save
                    if self._own is not None:
                        try:
                            _append(self._own, new)
                            self._lines += len(new)
                        except OSError:  # cut back to whole lines: a new file names every key held
                            self._own = None
                    if self._own is None:  # every key held: some may have missed a file that failed
                        path, self._own = self._create(self._dir, list(self._keys))
                        self._held[path], self._lines = self._own, len(self._keys)
        if self._keys and self._dir is not None:
            _live.add(self)

    @contextlib.contextmanager
    def flying(self, keys: Sequence[str]) -> Iterator[None]:
        """Pin ``keys`` while they are written to the shared store (this process's eviction keeps them)."""
        self._mine()
        encoded = [encode_key(key) for key in keys]
        with self._lock:
            self._flying.update(encoded)
        try:
            yield
        finally:
            with self._lock:
                for kb in encoded:
                    self._flying[kb] -= 1
                    if self._flying[kb] <= 0:
                        del self._flying[kb]

    def _create(self, directory: Path, keys: Sequence[str]) -> tuple[Path, int]:
        """A new file of this process's naming ``keys``, and its descriptor: locked, open to append.

        Raises:
            OSError: If it cannot be written.
        """
        path = directory / f"unsent-{self._pid}-{secrets.token_hex(4)}.keys"
        partial = path.with_name(path.name + ".tmp")  # a save in progress: never claimed, never read
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process lives: no other claims the file
            _append(fd, keys)
            os.rename(partial, path)
        except OSError:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise
        return path, fd

    def pinned(self) -> Pins:
        """The keys (in the index's form) the copy must not evict: this process's, and those other files name."""
        self._mine()
        with self._lock:
            held = list(self._held)
        others = named_pins(self._dir, held) if self._dir is not None else Pins()
        return Pins(self._encoded, self._flying, others)

    def send(self, read: Read, write: Write, limit: int | None = None, now: bool = False) -> int:
        """Send up to ``limit`` keys (all: ``None``), read from the copy with ``read``, stored with ``write``.

        After a failure, nothing is sent for :data:`RETRY_SECONDS` unless ``now``; while
        another thread sends, nothing.

        Returns:
            How many were sent.

        Raises:
            StoreError: As ``write``; the keys not sent are still held.
        """
        self._mine()
        if not self._keys or (not now and time.monotonic() < self._retry_at):
            return 0
        if not self._sending.acquire(blocking=False):
            return 0
        try:
            with self._lock:
                keys = list(itertools.islice(self._keys, limit))
            sent = 0
            for start in range(0, len(keys), _CHUNK):
                chunk = keys[start : start + _CHUNK]
                items = [(key, data) for key, data in zip(chunk, read(chunk)) if data is not None]
                if items:
                    write(items)
                sent += len(items)
                with self._lock:
                    self.dropped += len(chunk) - len(items)  # removed from the copy before it was sent
                    for key in chunk:  # sent, or no longer in the copy: nothing to send
                        self._keys.pop(key, None)
                        self._encoded.discard(encode_key(key))
            return sent
        except StoreError:
            self._retry_at = time.monotonic() + RETRY_SECONDS
            raise
        finally:
            self._sending.release()
            if self._lines > 2 * len(self._keys) + SLACK or (self._held and not self._keys):
                self.save()  # a file naming mostly sent keys is rewritten (a send that failed too); none left: gone

    def save(self) -> None:
        """Leave the keys not sent in a new file of this process's, locked, in place of those it held (none: no file).

        Each save writes a file of a new name, never one replaced in place: a name then
        names one file for good, and a process that opened it to claim it (its owner
        alive, then gone) cannot rename a newer file of its owner's instead.
        """
        self._mine()
        if self._dir is None:
            return
        with self._lock:
            keys = list(self._keys)
            with contextlib.suppress(OSError):
                newer: dict[Path, int] = {}
                own = None
                if keys:
                    path, own = self._create(self._dir, keys)
                    newer = {path: own}
                older, self._held, self._own, self._lines = self._held, newer, own, len(keys)
                for held, old in older.items():  # the older files: their keys are in the new one
                    held.unlink(missing_ok=True)
                    os.close(old)


def _append(fd: int, keys: Sequence[str]) -> None:
    """Name ``keys`` at the end of the file open at ``fd`` (opened to append), a line each.

    Raises:
        OSError: If it cannot be written.
    """
    data = memoryview(("\n".join(keys) + "\n").encode("ascii"))
    size = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)  # no half line: the next keys would run into it
        raise


def _save_all() -> None:
    """Send what each copy holds, and leave the rest in its file (at exit, and as a multiprocessing child ends)."""
    for unsent in list(_live):
        if unsent.sender is not None and len(unsent):
            with contextlib.suppress(Exception):  # the server's faults were its store's to report
                unsent.sender()
        unsent.save()


atexit.register(_save_all)
at_process_end(_save_all)  # DataLoader workers end with os._exit, after multiprocessing's finalizers
