"""Fresh locks and state in a forked child.

A child made by ``fork`` (a DataLoader worker on Linux) has only the thread that forked:
a lock another thread held at that moment is never released, and a queue or pool that
counts on the parent's threads waits forever. Objects register the locks to renew and
modules the state to reset; both run in the child right after ``fork``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["after_fork", "renew_lock_after_fork"]

_locks: weakref.WeakKeyDictionary[object, list[str]] = weakref.WeakKeyDictionary()


def after_fork(reset: Callable[[], None]) -> None:
    """Run ``reset`` in every child forked from now on (no-op where there is no fork)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=reset)


def renew_lock_after_fork(owner: object, attribute: str) -> None:
    """Give ``owner.<attribute>`` a new ``RLock`` in every forked child while ``owner`` lives."""
    _locks.setdefault(owner, []).append(attribute)


def _renew_locks() -> None:
    for owner, attributes in list(_locks.items()):
        for attribute in attributes:
            setattr(owner, attribute, threading.RLock())


after_fork(_renew_locks)
