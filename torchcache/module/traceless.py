"""Leave no trace of the item check's extra forwards: buffers and random generators restored."""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["traceless"]


@contextlib.contextmanager
def traceless(module: torch.nn.Module | None, fn: Callable[..., Any] | None = None) -> Iterator[None]:
    """Restore what the check's extra forwards change when the block ends: they leave no trace.

    The module's buffers (a forward in training mode updates batch norm's statistics),
    the random generators of torch (CPU, and the CUDA devices in use), of ``random`` and
    of numpy, and the generators the module's submodules hold as attributes (directly,
    or in a list, tuple or dict) and that ``fn`` captures or reads as globals: a dropout
    mask or a sample drawn by the check would shift every later draw of the program.
    """
    buffers = [b for b in module.buffers() if not b.is_inference()] if module is not None else []
    saved = [(b.detach().clone(), b._version) for b in buffers]
    held = list({id(g): g for g in _generators(module, fn)}.values())
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
    if isinstance(value, np.random.RandomState):
        return _State(value.get_state, value.set_state)
    return None


def _generators(module: torch.nn.Module | None, fn: Callable[..., Any] | None) -> Iterator[Any]:
    """The generators the submodules hold and ``fn`` reaches (its closure, bound object, globals), one level in."""
    values: list[Any] = [v for sub in (module.modules() if module is not None else ()) for v in vars(sub).values()]
    while isinstance(fn, functools.partial):
        values += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        values += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _full(cell)]
        values += [fn.__globals__.get(name) for name in code.co_names]  # type: ignore[union-attr]
    values.append(getattr(fn, "__self__", None))
    for value in values:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        yield from (g for g in inner if _rng(g) is not None)


def _full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
