"""Pausing Python's cyclic garbage collector around bursts of short-lived objects.

In a process that has imported torch, the first full collection walks a few hundred
thousand objects (about 0.1 s); a burst of allocations, such as parsing a source file or
checking every row of a file, is enough to set it off. Code that frees what it makes by
reference counting (no cycles) runs with the collector paused, and leaves the
collector's state as it found it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block, if it is enabled (objects are freed as usual)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
