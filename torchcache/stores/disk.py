"""One file per entry under a module directory, with a byte budget that spans runs.

Files live at ``<directory>/<first 3 hex digits>/<key>.tce``: 4,096 subdirectories keep
every directory to a few thousand files up to about ten million entries. Writes go to
a temporary file in the same subdirectory and are renamed into place, so a reader in
any process sees a whole entry or none, and a killed writer leaves at most a temporary
file (removed by the next scan once it is an hour old, or by ``torchcache verify --fix``).

The budget counts every entry in the directory, including those earlier runs left: the
first write (or size query) scans the directory once, ordering entries by modification
time. Several processes may share a directory; each enforces the budget on what it has
seen, so together they can pass it briefly by what the others wrote since their scan.

Anyone who can write into the directory can plant anything at an entry path, so a read
opens without blocking and takes only regular files (a FIFO, a device or a directory is
a miss), and with a ``frame_length`` it reads a fixed prefix of a large file first and
refuses the file if its size disagrees with it. A file that was rejected and could not
be removed (a read-only directory) is remembered by its identity, so this process does
not read it again until it changes.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from .._fork import renew_lock_after_fork
from ..errors import CorruptEntryError, StoreError
from ..policy import MruPolicy
from .base import Store
from .files import open_regular, read_at

__all__ = ["ENTRY_SUFFIX", "TMP_SUFFIX", "DiskStore"]

ENTRY_SUFFIX = ".tce"
TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 3600.0
_O_BINARY = getattr(os, "O_BINARY", 0)
_MAX_REJECTED = 1 << 16
_SMALL_FILE = 1 << 16

# Files rejected and not removable, by path: (device, inode, size, mtime in ns) when rejected.
_rejected: dict[str, tuple[int, int, int, int]] = {}
_rejected_lock = threading.Lock()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_tmp_counter = itertools.count()
_token: tuple[int, str] = (-1, "")


def _writer_token() -> str:
    """``<pid>-<random hex>`` of this process (taken again after a fork)."""
    global _token
    pid = os.getpid()
    if _token[0] != pid:
        _token = (pid, f"{pid}-{uuid.uuid4().hex[:8]}")
    return _token[1]


def _is_key(name: str) -> bool:
    return len(name) >= 4 and all(c in "0123456789abcdef" for c in name)


class DiskStore(Store):
    """A directory of entry files with a byte budget and an eviction policy.

    Length: it reads, budgets and migrates the one-file-per-entry layout of
    torchcache 1.0 behind the whole batched contract.

    Args:
        directory: The module directory (created on first write).
        max_bytes: The budget for the sum of entry file sizes.
        policy: Eviction order; MRU by default.
        frame_length: Given the first ``prefix_size`` bytes of a file, the length the
            whole file must have (it may raise :class:`CorruptEntryError`). Files larger
            than 64 KiB are read only if it agrees; smaller ones, and all files without
            it, are read whole (their reader checks them).
        prefix_size: How many bytes ``frame_length`` needs.

    Example:
        >>> import tempfile
        >>> store = DiskStore(Path(tempfile.mkdtemp()), max_bytes=100)
        >>> store.put("abcd01", b"x" * 60), store.put("abcd02", b"y" * 60)
        (True, True)
        >>> len(store), store.nbytes, store.get("abcd01")
        (1, 60, None)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        policy: MruPolicy[str] | None = None,
        *,
        frame_length: Callable[[bytes], int] | None = None,
        prefix_size: int = 0,
    ) -> None:
        self.directory = Path(directory)
        self._frame_length = frame_length
        self._prefix_size = prefix_size
        self._root = os.fspath(self.directory)
        self.max_bytes = int(max_bytes)
        self._policy: MruPolicy[str] = policy if policy is not None else MruPolicy()
        self._sizes: dict[str, int] = {}
        self._used = 0
        self._scanned = False
        self._lock = threading.RLock()
        self._made_dirs: set[str] = set()
        renew_lock_after_fork(self, "_lock")

    def __repr__(self) -> str:
        return f"DiskStore({str(self.directory)!r}, max_bytes={self.max_bytes}, nbytes={self.nbytes})"

    def path(self, key: str) -> Path:
        """Where the entry of ``key`` lives."""
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        # A plain string: pathlib costs more than reading a small entry.
        return f"{self._root}/{key[:3]}/{key}{ENTRY_SUFFIX}"

    # -- index -------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the entries already on disk (oldest first) and drop stale temporaries."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        try:
            subdirs = list(os.scandir(self.directory))
        except FileNotFoundError:
            subdirs = []
        except OSError as exc:
            raise StoreError(f"cannot list cache directory {self.directory}: {exc}") from exc
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in entries:
                name = entry.name
                try:
                    if name.endswith(ENTRY_SUFFIX) and _is_key(name[: -len(ENTRY_SUFFIX)]):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):  # not ours to count otherwise
                            found.append((st.st_mtime, name[: -len(ENTRY_SUFFIX)], st.st_size))
                    elif (
                        name.endswith(TMP_SUFFIX)
                        and name.startswith(".")
                        and now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS
                    ):
                        os.unlink(entry.path)
                except OSError:
                    continue
        found.sort()
        for _, key, size in found:
            if key not in self._sizes:
                self._sizes[key] = size
                self._used += size
                self._policy.add(key)
        self._scanned = True

    def _ensure_scanned(self) -> None:
        if not self._scanned:
            with self._lock:
                if not self._scanned:
                    self._scan()

    def _forget(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size
            self._policy.discard(key)

    # -- primitives ----------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """Read an entry's bytes, or ``None`` if there is no such regular file.

        Raises:
            StoreError: If the file exists and cannot be read.
            CorruptEntryError: If its size disagrees with its prefix (with a ``frame_length``).
        """
        # os-level calls: a buffered file costs more than the read of a small entry.
        path = self._file(key)
        try:
            opened = open_regular(path)
        except OSError as exc:
            raise StoreError(f"cannot read cache entry {path}: {exc}") from exc
        if opened is None:
            return None
        fd, st = opened
        try:
            if _rejected and _rejected.get(path) == _identity(st):
                return None  # rejected before and not removable: a miss, without reading it again
            size = st.st_size
            # A small file is read whole (its reader checks it); a large one only once its prefix agrees.
            if self._frame_length is not None and size > _SMALL_FILE:
                expected = self._frame_length(read_at(fd, self._prefix_size))
                if expected != size:
                    raise CorruptEntryError(f"the file is {size:,} bytes, its prefix declares {expected:,}")
            data = read_at(fd, size)
        except OSError as exc:
            raise StoreError(f"cannot read cache entry {path}: {exc}") from exc
        finally:
            os.close(fd)
        with self._lock:
            if key in self._sizes:
                self._policy.touch(key)
            elif self._scanned:
                self._sizes[key] = len(data)
                self._used += len(data)
                self._policy.add(key)
        return data

    def reject(self, key: str) -> bool:
        """Remove an entry that failed validation; return whether it is gone.

        A file that cannot be removed (a read-only directory, a directory at the entry
        path) is remembered, so that :meth:`get` treats it as a miss until it changes.
        """
        with self._lock:
            self._forget(key)
        path = self._file(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return True
        except OSError:
            with contextlib.suppress(OSError), _rejected_lock:
                if len(_rejected) >= _MAX_REJECTED:
                    _rejected.pop(next(iter(_rejected)))
                _rejected[path] = _identity(os.stat(path))
            return False
        return True

    def put(self, key: str, data: bytes) -> bool:
        """Write an entry atomically (temporary file, then rename), evicting as needed."""
        size = len(data)
        if size > self.max_bytes:
            return False
        self._ensure_scanned()
        with self._lock:
            # Reserve the bytes first (evicting as needed), write outside the lock so that
            # several writer threads overlap, then index the key once its file exists.
            self._forget(key)
            while self._used + size > self.max_bytes and len(self._policy):
                with contextlib.suppress(StoreError):  # a file we cannot remove is not ours to count
                    self._remove_file(self._policy.victim())
            self._used += size
        try:
            self._write(key, data)
        except BaseException:
            with self._lock:
                self._used -= size
            raise
        with self._lock:
            self._forget(key)
            self._sizes[key] = size
            self._policy.add(key)
        return True

    def _remove_file(self, key: str) -> None:
        self._used -= self._sizes.pop(key, 0)
        self._unlink(key)

    def _unlink(self, key: str) -> bool:
        path = self._file(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot remove cache entry {path}: {exc}") from exc
        return True

    def _write(self, key: str, data: bytes) -> None:
        sub = key[:3]
        final = self._file(key)
        folder = os.path.dirname(final)
        if sub not in self._made_dirs:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create cache directory {folder}: {exc}") from exc
            self._made_dirs.add(sub)
        # Unique per process (pid and a random token) and per write (a counter), so that
        # threads and processes writing the same key never share a temporary file.
        tmp = f"{folder}/.{key}.{_writer_token()}.{next(_tmp_counter)}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o644)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    if written <= 0:  # no progress: the file system has no room (never loop on it)
                        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a write made no progress)")
                    view = view[written:]
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, FileNotFoundError):
                self._made_dirs.discard(sub)
            raise StoreError(f"cannot write cache entry {final}: {exc}") from exc

    def delete(self, key: str) -> bool:
        """Remove an entry's file; return whether it existed."""
        with self._lock:
            self._forget(key)
            return self._unlink(key)

    def keys(self) -> Iterator[str]:
        """Iterate over the indexed keys (the directory is scanned first if needed)."""
        self._ensure_scanned()
        with self._lock:
            return iter(list(self._sizes))

    def clear(self) -> None:
        """Remove every entry file (other files in the directory are kept)."""
        self._ensure_scanned()
        with self._lock:
            for key in list(self._sizes):
                self._remove_file(key)
            self._policy.clear()
            self._scanned = False
            self._made_dirs.clear()
            self._scan()
            for key in list(self._sizes):
                self._remove_file(key)
            self._policy.clear()

    @property
    def nbytes(self) -> int:
        """Sum of the sizes of the indexed entry files."""
        self._ensure_scanned()
        return self._used

    def __len__(self) -> int:
        self._ensure_scanned()
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and os.path.isfile(self._file(key))
