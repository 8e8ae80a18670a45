"""Leave no trace of the item check's extra forwards: buffers and random generators restored."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["traceless"]


@contextlib.contextmanager
def traceless(module: torch.nn.Module | None) -> Iterator[None]:
    """Restore what the check's extra forwards change when the block ends: they leave no trace.

    The module's buffers (a forward in training mode updates batch norm's statistics),
    the random generators of torch (CPU, and the CUDA devices in use), of ``random`` and
    of numpy, and the generators the module's submodules hold as attributes (a dropout
    mask or a sample drawn by the check would shift every later draw of the program).
    """
    buffers = [b for b in module.buffers() if not b.is_inference()] if module is not None else []
    saved = [(b.detach().clone(), b._version) for b in buffers]
    held = [g for sub in (module.modules() if module is not None else ()) for g in vars(sub).values() if _rng(g)]
    states = [_rng(g).get() for g in held]  # type: ignore[union-attr]
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        for generator, state in zip(held, states):
            _rng(generator).set(state)  # type: ignore[union-attr]
        with torch.no_grad():
            for buffer, (value, version) in zip(buffers, saved):
                # torch.equal takes strided tensors only; a sparse buffer is restored if it was written
                strided = buffer.layout == torch.strided
                if (strided and not torch.equal(buffer, value)) or (not strided and buffer._version != version):
                    buffer.copy_(value)


class _State(NamedTuple):
    get: Callable[[], Any]
    set: Callable[[Any], Any]


def _rng(value: object) -> _State | None:
    """How to save and restore a random generator (torch, numpy or ``random``); ``None`` for anything else."""
    if isinstance(value, torch.Generator):
        return _State(value.get_state, value.set_state)
    if isinstance(value, np.random.Generator):
        bits = value.bit_generator
        return _State(lambda: bits.state, lambda state: setattr(bits, "state", state))
    if isinstance(value, random.Random):
        return _State(value.getstate, value.setstate)
    return None
