"""Where RAM tiers live, and how their directories are shared, kept and removed.

A RAM tier is a packed store on a RAM-backed file system, one directory per job and
dataset: ``<root>/torchcache-<uid>/<job id>/<dataset>/``. The root is
``$TORCHCACHE_SHM_DIR``, else ``/dev/shm``, else (with a one-time note) the temporary
directory. A *job* is the process that creates a cached dataset, its DataLoader
workers (the path travels with the dataset when it is pickled to spawned workers) and,
under ``torchrun``, every rank on the machine: the job id is ``$TORCHCACHE_JOB_ID``,
else ``$TORCHELASTIC_RUN_ID`` with the pid of the ranks' parent (torchrun's agent),
else the creating process's pid and start time.

Liveness is a lock, not a timeout: every process that uses a job directory holds a
shared ``flock`` on its ``job.lock`` for as long as it uses it, on its own open file
(a forked child drops the one it inherited). A directory whose lock can be taken
exclusively has no live user: it is renamed away and removed. That happens when a
process lets go of its last hold (at exit, after multiprocessing has joined its
DataLoader workers, or at ``close()``), and to every sibling job directory when a job
starts, so the leftovers of a job killed with ``kill -9`` go at the next start.
A dataset's directory in a job directory is held the same way, with a lock of its own:
closing the last cache of a dataset in a job removes its RAM tier while the job goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import multiprocessing.util
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import xxhash

from .._cgroup import memory_limit
from .._fork import after_fork
from .._log import logger
from ..errors import StoreError

__all__ = [
    "LOCK_NAME",
    "MemoryHold",
    "default_memory_size",
    "hold",
    "hold_in",
    "job_id",
    "new_job_dir",
    "ram_root",
    "release",
    "sweep",
    "usable_bytes",
]

LOCK_NAME = "job.lock"
_TRASH = ".trash-"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MAX_DEFAULT = 32 * 10**9
_lock = threading.Lock()
_held: dict[Path, tuple[int, int]] = {}  # job directory -> (descriptor with the shared lock, holds)
_let_go_later: list[tuple[Path, str]] = []  # holds of caches collected, to release outside a collection
_swept: set[Path] = set()
_noted = False
_job: str | None = None
_exit_hook: list[int] = []  # the pid that registered the exit hook
_again_at_exit: set[Path] = set()  # let go of here (others may use them, or make them again): tried again at exit


def _reset_after_fork() -> None:
    """A forked child holds nothing: close the descriptors it inherited, forget the holds."""
    global _lock
    _lock = threading.Lock()
    for fd, _ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _let_go_later.clear()
    _exit_hook.clear()
    _again_at_exit.clear()


after_fork(_reset_after_fork)


def ram_root() -> Path:
    """This user's directory of RAM tiers (``<root>/torchcache-<uid>``), created if missing.

    Raises:
        StoreError: If it cannot be created, or exists and is not a directory of this user.
    """
    global _noted
    base = os.environ.get("TORCHCACHE_SHM_DIR")
    if not base:
        base = "/dev/shm"
        if not (os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK)):
            base = tempfile.gettempdir()
            if not _noted:
                _noted = True
                logger.warning("no writable /dev/shm: RAM tiers of datasets are kept in %s", base)
    elif not os.path.isdir(base):  # a typo would make a RAM tier on disk, where the path was made
        raise StoreError(f"TORCHCACHE_SHM_DIR is {base}, which is not a directory; point it to a RAM-backed one")
    root = Path(base) / f"torchcache-{os.getuid()}"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, mode=0o700)
        st = os.lstat(root)
    except OSError as exc:
        raise StoreError(f"cannot create the RAM tier directory {root}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise StoreError(
            f"{root} is not a directory of this user; remove it or point TORCHCACHE_SHM_DIR to another directory"
        )
    return root


def _start_time() -> str:
    """This process's start time in clock ticks since boot (Linux), else a random token."""
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
        return fields[19].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return secrets.token_hex(6)


def _safe(text: str) -> str:
    return text if _SAFE.match(text) and text not in (".", "..") else xxhash.xxh3_64_hexdigest(text.encode())


def job_id() -> str:
    """The id of this job (see the module documentation); fixed once computed in a process."""
    global _job
    explicit = os.environ.get("TORCHCACHE_JOB_ID")
    if explicit:
        return "job-" + _safe(explicit)
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return f"elastic-{_safe(run)}-{os.getppid()}"
    if _job is None:
        _job = f"{os.getpid()}-{_start_time()}"
    return _job


def new_job_dir() -> Path:
    """This job's directory, held by this process; sibling directories nobody uses are removed.

    Raises:
        StoreError: If the directory cannot be created or locked.
    """
    root = ram_root()
    job = root / job_id()
    hold(job)
    if root not in _swept:
        _swept.add(root)
        removed = sweep(root, keep=job)
        if removed:
            logger.info("removed %d RAM tier directories of jobs that ended in %s", removed, root)
    return job


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_lock(job: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(job / LOCK_NAME, flags, 0o600)


def hold(job: Path) -> None:
    """Take (or count once more) this process's shared lock on a job directory, creating it.

    Raises:
        StoreError: If the directory cannot be created or locked.
    """
    _release_collected()
    with _lock:
        if job in _held:
            fd, count = _held[job]
            _held[job] = (fd, count + 1)
            return
        for _ in range(100):  # each retry means a remover took the directory away meanwhile
            try:
                os.makedirs(job.parent, mode=0o700, exist_ok=True)  # the user's root, if a remover took it
                os.makedirs(job, mode=0o700, exist_ok=True)
                fd = _open_lock(job)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreError(f"cannot create the RAM tier directory {job}: {exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as exc:
                os.close(fd)
                raise StoreError(f"cannot lock {job / LOCK_NAME}: {exc}") from exc
            if _same_file(fd, job / LOCK_NAME):
                _held[job] = (fd, 1)
                _register_exit_hook()
                return
            os.close(fd)
        raise StoreError(f"cannot hold the RAM tier directory {job}: it keeps being removed")


class MemoryHold:
    """One process's hold on a cache's RAM tier directory and its job's (see :func:`hold`).

    Let go of by :meth:`release`, or when the hold is collected (a cache dropped without
    ``close()``: its descriptors would stay open until the process ends); then at the next
    hold or release of this process, since a collection may run where this module's lock
    is held. A forked child or an unpickled copy holds nothing until it :meth:`take` s its own.

    Args:
        job: The job directory.
        name: The cache's RAM tier directory in it.
        taken: Whether this process has just taken the hold (:func:`hold` on both).
    """

    def __init__(self, job: Path, name: str, taken: bool = False) -> None:
        self.job, self.name = job, name
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if taken:
            self._track()

    def _track(self) -> None:
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _let_go, self.job, self.name, self._pid)

    @property
    def here(self) -> bool:
        """Whether this process holds it."""
        return self._finalizer is not None and self._finalizer.alive and self._pid == os.getpid()

    def take(self) -> None:
        """Hold both directories in this process.

        Raises:
            StoreError: If either cannot be created or locked (then neither is held).
        """
        hold(self.job)
        hold_in(self.job, self.name)
        self._track()

    def release(self) -> None:
        """Let go of both (each removed once no process uses it), if this process holds them."""
        if self.here:
            assert self._finalizer is not None
            self._finalizer.detach()
            release(self.job / self.name)
            release(self.job)

    def __getstate__(self) -> dict[str, Any]:
        return {"job": self.job, "name": self.name, "_finalizer": None}


def hold_in(job: Path, name: str) -> None:
    """Hold a cache's directory in a job directory this process holds; on failure, let go of the job.

    Raises:
        StoreError: If it cannot be created or locked.
    """
    try:
        hold(job / name)
    except StoreError:
        release(job)
        raise


def _let_go(job: Path, name: str, pid: int) -> None:
    """A collected hold: released at the next hold or release (a collection may run inside ``_lock``)."""
    if os.getpid() == pid:  # a forked child's copy of the hold is its parent's
        _let_go_later.append((job, name))  # no lock taken here: list.append is atomic


def _release_collected() -> None:
    while _let_go_later:
        job, name = _let_go_later.pop()
        release(job / name, collected=False)
        release(job, collected=False)


def release(job: Path, collected: bool = True) -> bool:
    """Let go of one hold on a job directory; after the last, remove it if nobody else uses it.

    Args:
        job: The directory.
        collected: Let go of the holds of caches collected since first.

    Returns:
        Whether the directory was removed.
    """
    if collected:
        _release_collected()
    with _lock:
        if job not in _held:
            return False
        fd, count = _held[job]
        if count > 1:
            _held[job] = (fd, count - 1)
            return False
        del _held[job]
        os.close(fd)
        _again_at_exit.add(job)  # used by others now, or made again by DataLoader workers of a closed cache
        return _remove_if_unused(job)


def _remove_if_unused(job: Path) -> bool:
    """Remove a job directory if its lock can be taken exclusively (no live process uses it)."""
    try:
        fd = _open_lock(job)
    except OSError:
        return False  # gone, or not a directory we can use
    trash = job.with_name(f"{_TRASH}{secrets.token_hex(8)}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same_file(fd, job / LOCK_NAME):
            return False
        os.rename(job, trash)  # a process waiting for the lock finds it gone and starts afresh
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            logger.debug("cannot remove the RAM tier directory %s: %s", job, exc)
        return False
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    with contextlib.suppress(OSError):  # the user's root too, once no job is left in it
        os.rmdir(job.parent)
    return True


def sweep(root: Path, keep: Path | None = None) -> int:
    """Remove the job directories under ``root`` that no live process uses (and leftover trash).

    Returns:
        How many job directories were removed.
    """
    removed = 0
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in list(entries):
            path = Path(entry.path)
            if path == keep or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.name.startswith(_TRASH):
                shutil.rmtree(path, ignore_errors=True)
            elif path not in _held and _remove_if_unused(path):
                removed += 1
    return removed


def _release_all() -> None:
    """At exit: let go of every hold of this process and remove what nobody else uses.

    Directories let go of earlier are tried again: a cache closed while its DataLoader
    workers ran, or before they started and made its directory again, which
    multiprocessing has stopped by now (a daemonic worker terminated at exit lets go of
    nothing itself).
    """
    if _exit_hook != [os.getpid()]:
        return  # a child that inherited the registration
    with _lock:
        jobs = list(_held)
    for job in jobs:
        with _lock:
            if job in _held:
                _held[job] = (_held[job][0], 1)
        release(job)
    for job in sorted(_again_at_exit, key=lambda path: len(path.parts), reverse=True):  # a cache's before its job's
        if job not in _held and job.is_dir():
            _remove_if_unused(job)


def _register_exit_hook() -> None:
    # A finalizer with a negative priority runs at exit after multiprocessing has stopped
    # and joined the daemonic children (DataLoader workers), which hold the lock until then.
    if _exit_hook != [os.getpid()]:
        _exit_hook[:] = [os.getpid()]
        multiprocessing.util.Finalize(None, _release_all, exitpriority=-10)


def usable_bytes(vfs: os.statvfs_result) -> int:
    """The bytes of a file system this user can have: used plus available (blocks reserved for root never are)."""
    return (vfs.f_blocks - vfs.f_bfree + vfs.f_bavail) * vfs.f_frsize


def default_memory_size(directory: Path | None = None) -> int:
    """The default RAM tier budget: a quarter of the RAM, at most half the RAM file system, at most 32 GB.

    In a container (a cgroup with a memory limit) the RAM is that limit: the RAM file
    system's files count against it.

    Args:
        directory: A directory on the file system that holds RAM tiers (the default root if ``None``).

    Returns:
        Bytes.
    """
    candidates = [_MAX_DEFAULT]
    if (memory := memory_limit()) is not None:
        candidates.append(memory // 4)
    with contextlib.suppress(OSError, StoreError):
        vfs = os.statvfs(directory if directory is not None else ram_root())
        if vfs.f_blocks:  # none: a file system without a size (ramfs, tmpfs with size=0)
            candidates.append(usable_bytes(vfs) // 2)
    return max(min(candidates), 0)
