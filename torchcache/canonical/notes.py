"""What a block of key-taking code notes on the side, per thread: values it keyed by content, names it missed.

Encoding a key is a deep walk; what the caller must learn from it besides the key's bytes
(the tensors to watch for in-place writes, the globals not defined yet, a read of inference
mode) is noted on a :class:`Notes` while a :meth:`Notes.block` is open in the thread, and
dropped otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FOUND", "INFERENCE_MODE_READ", "Notes", "note_mode_read"]


class Notes(threading.local):
    """A per-thread list that :meth:`add` appends to while a :meth:`block` is open.

    Example:
        >>> seen = Notes()
        >>> with seen.block() as noted:
        ...     seen.add(1)
        >>> seen.add(2)  # no block open: dropped
        >>> noted
        [1]
    """

    noted: list[Any] | None = None

    @contextlib.contextmanager
    def block(self, active: bool = True) -> Iterator[list[Any]]:
        """Note what :meth:`add` gets in the block (if ``active``); an outer block's list comes back after it."""
        previous, noted = self.noted, list[Any]()
        self.noted = noted if active else None
        try:
            yield noted
        finally:
            self.noted = previous

    def add(self, value: Any) -> None:
        """Note ``value`` in the open block, if any."""
        if self.noted is not None:
            self.noted.append(value)


#: What the key being taken in each thread notes (:func:`~torchcache.canonical.objects.collecting`).
FOUND = Notes()

#: Noted where the code a key covers reads ``torch.is_inference_mode_enabled``: a forward that
#: branches on it has its calls keyed by inference mode (others share entries between it and ``no_grad``).
INFERENCE_MODE_READ = object()


def note_mode_read(value: object) -> None:
    """Note :data:`INFERENCE_MODE_READ` if ``value`` is the function that reads inference mode."""
    if value is torch.is_inference_mode_enabled:
        FOUND.add(INFERENCE_MODE_READ)
