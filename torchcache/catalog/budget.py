"""The cache root's budget: claims on the caches in use, and whole caches removed least recently used first.

The root as a whole has a budget (:func:`root_budget`: :func:`set_root_budget`, else
``$TORCHCACHE_MAX_SIZE``, else :data:`~torchcache.config.DEFAULT_ROOT_BUDGET`), kept by
:func:`enforce_root_budget` whenever a cache opens (:func:`claim_module_cache`): whole
module caches go, least recently used first, like ``torchcache prune``. A process that
opens a cache holds a shared ``flock`` on its directory (:class:`CacheClaim`), no file is
added; a cache is removed only under an exclusive one, taken without waiting, and only if
no writer holds one of its segments either (what a process that took no claim, such as a
dataset cache, holds while it writes), so a cache in use by a live process is never
removed. Where a directory cannot be locked (some network file systems), nothing is
removed automatically.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
import weakref
from pathlib import Path

from .._log import logger
from ..config import resolve_root_budget
from ..faults import Fault, Report
from ..meta import is_disk_wide
from ..policy import format_size, parse_size
from ..stores.files import open_regular
from ..stores.packed.format import parse_segment_name
from ..stores.remote import local_copy_dir
from .inspect import (
    CacheUsage,
    read_usage,
)
from .removal import remove_cache, select_for_prune

__all__ = [
    "CacheClaim",
    "cache_in_use",
    "claim_directory",
    "claim_module_cache",
    "enforce_root_budget",
    "keep_root_budget",
    "remove_unused_cache",
    "root_budget",
    "scan_root",
    "set_root_budget",
]


_O_DIR = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


#: Seconds a claim waits for a removal of its directory in progress in another process.
_CLAIM_WAIT = 30.0


_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN)


# -- the budget of a cache root ---------------------------------------------------------------
_budget_override: tuple[int | None] | None = None


_warned: set[tuple[str, str]] = set()


_warned_lock = threading.Lock()


class CacheClaim:
    """This process's shared ``flock`` on a module directory: while it is held, no budget or prune removes the cache.

    The lock is given back by :meth:`release`, or when the claim is garbage-collected.
    A forked child shares its parent's lock until both have let it go.
    """

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._release = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Give the lock back (again is fine)."""
        self._release()

    def __repr__(self) -> str:
        return f"<CacheClaim of {self.directory} ({'held' if self._release.alive else 'released'})>"


def _same_directory(fd: int, directory: Path) -> bool:
    """Whether ``directory`` (not followed if it is a link) is still the directory open as ``fd``."""
    try:
        st, held = os.lstat(directory), os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def claim_directory(directory: Path, wait: float = _CLAIM_WAIT, create: bool = True) -> CacheClaim | None:
    """Make ``directory`` if it is missing and take a shared lock on it, so that no budget or prune removes it.

    A removal of the directory in progress in another process is waited for (at most
    ``wait`` seconds), then the directory is made anew (without ``create``, a missing
    directory is left missing).

    Returns:
        The claim, or ``None`` if the directory cannot be made, opened or locked (a
        read-only or network file system; the cache still works, unclaimed).
    """
    deadline = time.monotonic() + wait
    for _ in range(8):
        try:
            if create:
                directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory, _O_DIR)
        except FileNotFoundError:  # removed between the two: make it again
            if not create:
                return None
            continue
        except OSError:
            return None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # being removed: no more than a few files to unlink
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            if os.path.islink(directory) or _same_directory(fd, directory):
                return CacheClaim(directory, fd)  # a linked module directory is never removed: nothing to check
        except OSError:
            os.close(fd)
            return None
        os.close(fd)  # removed while we waited: make it again
        if not create:
            return None
    return None


def _writer_holds_segment(directory: Path) -> bool:
    """Whether a live writer holds the lock on one of the directory's segment files (see the segment files)."""
    try:
        with os.scandir(directory) as items:
            names = [item.name for item in items if parse_segment_name(item.name) is not None]
    except OSError:
        return False
    for name in names:
        try:
            opened = open_regular(directory / name)
        except OSError:
            continue
        if opened is None:
            continue
        try:
            fcntl.flock(opened[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                return True
        finally:
            os.close(opened[0])  # and with it the lock
    return False


def _lock_unused(directory: Path, strict: bool) -> int | None:
    """A descriptor of ``directory`` holding an exclusive lock, if no process has the cache open, else ``None``.

    ``None`` too for a directory that cannot be opened (a link) or was replaced
    meanwhile. One that cannot be locked (some network file systems) counts as in use
    if ``strict``, else the descriptor comes back unlocked.
    """
    try:
        fd = os.open(directory, _O_DIR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if strict or exc.errno in _BUSY:
            os.close(fd)
            return None
    if _same_directory(fd, directory) and not _writer_holds_segment(directory):
        return fd
    os.close(fd)  # and with it the lock
    return None


def cache_in_use(directory: Path, strict: bool = True) -> bool:
    """Whether a process has the module cache in ``directory`` open, as far as can be told.

    A process has it open while it holds a :class:`CacheClaim` on it, or while it writes
    to one of its segments.

    Args:
        directory: The module directory.
        strict: Count a cache whose directory cannot be locked (some network file
            systems) as in use.
    """
    fd = _lock_unused(directory, strict)
    if fd is None:
        return True
    os.close(fd)
    return False


def remove_unused_cache(directory: Path, strict: bool = True) -> tuple[int, Path | None] | None:
    """Remove a module cache as :func:`remove_cache` does, unless a process has it open.

    It is removed under an exclusive lock on its directory, which a process that opens
    it meanwhile waits for (and then makes the directory anew).

    Args:
        directory: The module directory.
        strict: Keep a cache whose directory cannot be locked (some network file
            systems); else remove it unless a writer holds one of its segments.

    Returns:
        ``None`` if it is in use (nothing is removed), else what :func:`remove_cache` returns.

    Raises:
        OSError: If a file cannot be removed.
    """
    fd = _lock_unused(directory, strict)
    if fd is None:
        return None
    try:
        return remove_cache(directory)
    finally:
        os.close(fd)


def set_root_budget(max_size: int | float | str | None) -> None:
    """Set the budget of every cache root this process uses, which ``$TORCHCACHE_MAX_SIZE`` sets otherwise.

    Whenever a persistent cache opens, the module caches under its root are removed,
    least recently used first, until they take no more than this, as ``torchcache prune
    --max-size`` does; a cache that a live process has open is never removed. Processes
    started from this one (spawned DataLoader workers, ``torchrun`` ranks) read
    ``$TORCHCACHE_MAX_SIZE``, not this setting.

    Args:
        max_size: Bytes, as an int or float (``20e9``) or a string such as ``"20GB"`` or
            ``"500GiB"``; ``0`` for no budget; ``None`` to go back to
            ``$TORCHCACHE_MAX_SIZE``, else the default (50 GB).

    Raises:
        ConfigError: If ``max_size`` is not a byte count.

    Example:
        >>> import torchcache
        >>> torchcache.set_root_budget("20GB")
        >>> torchcache.set_root_budget(None)
    """
    global _budget_override
    _budget_override = None if max_size is None else (parse_size(max_size, "max_size") or None,)


def root_budget() -> tuple[int | None, str]:
    """The budget of a cache root in this process, and where it comes from.

    Returns:
        The bytes (``None``: no budget), and ``"set_root_budget()"``,
        ``"TORCHCACHE_MAX_SIZE"`` or ``"default"``.

    Raises:
        ConfigError: If ``$TORCHCACHE_MAX_SIZE`` decides it and is not a byte count.
    """
    override = _budget_override
    if override is not None:
        return override[0], "set_root_budget()"
    return resolve_root_budget()


def scan_root(root: Path) -> list[CacheUsage]:
    """The module caches under a root, with their last use and size, without opening any store.

    A missing root holds none; a directory under it that cannot be listed is left out.

    Raises:
        OSError: If the root cannot be listed.
    """
    try:
        children = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for child in children:
        try:
            usage = read_usage(Path(child.path)) if child.is_dir(follow_symlinks=False) else None
        except OSError:
            continue
        if usage is not None:
            found.append(usage)
    return found


def enforce_root_budget(root: Path, max_bytes: int | None = None) -> list[CacheUsage]:
    """Remove module caches under ``root``, least recently used first, until they fit its budget.

    A cache that a live process has open is never removed (see :func:`cache_in_use`),
    nor a local copy holding entries its server did not take (their only copy); when
    those alone take more than the budget, the root stays over it. Only one process
    at a time enforces the budget of a root: if another is doing it, this returns at once,
    and so it does where the root cannot be opened or locked (missing, not a directory,
    some network file systems).

    Args:
        root: The cache root.
        max_bytes: The budget (default: :func:`root_budget`; ``None`` there: no budget).

    Returns:
        The module caches removed.

    Raises:
        ConfigError: If ``$TORCHCACHE_MAX_SIZE`` decides the budget and is not a byte count.
        OSError: If the root cannot be listed, or a cache cannot be removed (the first
            such error, once the others are removed).
    """
    if max_bytes is None:
        max_bytes = root_budget()[0]
        if max_bytes is None:
            return []
    try:
        fd = os.open(root, _O_DIR)
    except OSError:  # missing, or not a directory: no cache to remove (opening one reports why)
        return []
    removed: list[CacheUsage] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process is enforcing it now, or directories cannot be locked here
            return removed
        caches = scan_root(root)
        if sum(c.nbytes for c in caches) <= max_bytes:
            return removed
        victims = select_for_prune(
            caches, time.time(), max_bytes=max_bytes, in_use=lambda c: c.unsent or cache_in_use(c.directory)
        )
        failure: OSError | None = None
        for victim in victims:
            try:
                if remove_unused_cache(victim.directory) is not None:
                    removed.append(victim)
            except OSError as exc:  # that cache's fault (another user's, say), which no store of this one reports
                failure = failure or _RemovalError(exc.errno, f"cannot remove {victim.directory}: {exc}")
        if failure is not None:
            raise failure
        return removed
    finally:
        os.close(fd)


class _RemovalError(OSError):
    """A cache of the root could not be removed (a fault of its own directory, not of this cache's disk)."""


def _warn_once(root: Path, kind: str, message: str, warn: Report) -> None:
    with _warned_lock:
        if (str(root), kind) in _warned:
            return
        _warned.add((str(root), kind))
    warn(Fault.BUDGET, message)


def claim_module_cache(
    location: Path | str, key: str, warn: Report, local: Path | None = None, create: bool = True, keep: bool = True
) -> CacheClaim | None:
    """Claim a module cache's directory as this process opens it, then keep its root under budget.

    Called once whenever a persistent cache opens its disk tier; cheap (a listing of the
    root, and of each module directory). Nothing it meets reaches the caller: a budget
    that cannot be kept is one warning per root and problem in this process.

    Args:
        location: The cache root, or a Redis URL (then ``local`` is the root, if any).
        key: The module key (the directory under the root; with a URL, its local copy's).
        warn: Called with a kind and a message to warn about (a cache's
            :meth:`~torchcache.faults.FaultLog.warn`).
        local: With a Redis URL, the root of the local copies of its entries.
        create: Make the directory if it is missing (``False``: it was made with the
            cache, and a missing one was removed while in use).
        keep: Keep the root's budget (``False``: a process that only reads removes nothing).

    Returns:
        The claim, to keep while the cache is used (``None`` if there is no local
        directory or it cannot be claimed).
    """
    root = local if isinstance(location, str) else location
    if root is None:
        return None
    directory = local_copy_dir(root, key, location) if isinstance(location, str) else root / key
    claim = claim_directory(directory, create=create)
    if keep:
        keep_root_budget(root, warn)
    return claim


def keep_root_budget(root: Path, warn: Report) -> None:
    """Remove least recently used caches nobody holds until ``root`` fits its budget; never raises.

    Called when a cache opens (:func:`claim_module_cache`) and when it has grown (a flush).
    """
    try:
        removed = enforce_root_budget(root)
    except OSError as exc:  # a read-only or full disk as a whole: the store reports it
        if isinstance(exc, _RemovalError) or not is_disk_wide(exc):
            _warn_once(root, "remove", f"cannot keep the cache root {root} under its budget: {exc}", warn)
    except Exception as exc:  # noqa: BLE001 - never into the forward pass
        _warn_once(root, type(exc).__name__, f"{exc}; the cache root {root} is not kept under a budget", warn)
    else:
        if removed:
            freed = format_size(sum(c.nbytes for c in removed))
            logger.info("removed %d module cache(s) (%s) from %s to keep its budget", len(removed), freed, root)
