"""Fresh locks and state in a forked child.

A child made by ``fork`` (a DataLoader worker on Linux) has only the thread that forked:
a lock another thread held at that moment is never released, and a queue or pool that
counts on the parent's threads waits forever. Objects register the locks to renew and
modules the state to reset; both run in the child right after ``fork``.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.sharedctypes
import multiprocessing.util
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["ForkGate", "SharedArray", "after_fork", "at_process_end", "renew_lock_after_fork"]

_locks: weakref.WeakKeyDictionary[object, list[str]] = weakref.WeakKeyDictionary()
_finalizers: list[_Finalizer] = []


def after_fork(reset: Callable[[], None]) -> None:
    """Run ``reset`` in every child forked from now on (no-op where there is no fork)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=reset)


class SharedArray:
    """A small array in shared memory (``typecode``, ``size``: a subclass's): the processes of a job share it.

    Inherited by forked children and handed to spawned ones as they are made; a copy made
    otherwise (a pickle) has an array of its own.
    """

    typecode = "q"
    size = 1

    def __init__(self) -> None:
        self.array: Any = multiprocessing.sharedctypes.RawArray(self.typecode, self.size)

    def __getstate__(self) -> dict[str, Any]:
        return {"array": self.array if multiprocessing.context.get_spawning_popen() is not None else None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.array = state["array"] if state["array"] is not None else type(self)().array


def at_process_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` as a multiprocessing child ends, in this process and every child forked from it.

    A forked child (a DataLoader worker on Linux) ends with ``os._exit``, which skips
    ``atexit``, but runs multiprocessing's exit finalizers first; it starts with none of
    its parent's, so the finalizer is registered again in each child. (``atexit`` is the
    caller's to register for the main process, in the order it needs.)
    """
    finalizer = _Finalizer(fn)
    _finalizers.append(finalizer)  # multiprocessing keeps a weak reference only
    finalizer.register()


class _Finalizer:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        multiprocessing.util.register_after_fork(self, _Finalizer.register)

    def register(self) -> None:
        multiprocessing.util.Finalize(None, self.fn, exitpriority=0)


class ForkGate:
    """Work that a fork must not cut in half, such as an LMDB transaction of another thread.

    Each piece runs between :meth:`enter` and :meth:`leave`. A fork waits until none is in
    flight (at most ``timeout`` seconds) and holds new ones back until it is done: a child
    never inherits a transaction that no thread of its own will end.
    """

    def __init__(self, timeout: float = 10.0) -> None:
        self._timeout = timeout
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._before, after_in_parent=self._after, after_in_child=self._reset)

    def enter(self) -> None:
        """Begin a piece of work (waits while a fork is being made)."""
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._busy += 1

    def leave(self) -> None:
        """End a piece of work begun with :meth:`enter`."""
        with self._cond:
            self._busy -= 1
            if not self._busy:
                self._cond.notify_all()

    def _before(self) -> None:
        self._cond.acquire()
        self._forking = True
        self._cond.wait_for(lambda: self._busy <= 0, self._timeout)

    def _after(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0
        self._forking = False


def renew_lock_after_fork(owner: object, attribute: str) -> None:
    """Give ``owner.<attribute>`` a new ``RLock`` in every forked child while ``owner`` lives."""
    _locks.setdefault(owner, []).append(attribute)


def _renew_locks() -> None:
    for owner, attributes in list(_locks.items()):
        for attribute in attributes:
            setattr(owner, attribute, threading.RLock())


after_fork(_renew_locks)
