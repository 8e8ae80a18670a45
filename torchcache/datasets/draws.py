"""Datasets whose samples are random: a cache of them would serve one draw for good.

The first sample a process computes is read twice more: it must come back the same, byte
for byte, and reading it must not draw from a process-wide random generator (torch's,
numpy's legacy one, ``random``'s): a dataset that reseeds one per index
(``torch.manual_seed(index)``) leaves it where the last read of that index left it,
while one that draws from its stream moves it on at every read, also where two reads
happen to agree (a flip with probability 0.5). Then every batch computed is watched: if
computing it moved one of those generators, each of its samples is read once more from
other states of them, and a sample that then comes back otherwise drew from them (one
seeded by its index comes back the same).
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from ..dtypes import standard_strides
from ..errors import KeyingError
from .encode import check_sample

__all__ = ["Generators", "batch_draws", "checked_for_draws", "draw_mark", "random_reads", "same_sample"]


def same_sample(a: Any, b: Any) -> bool:
    """Whether two samples are equal, byte for byte where they are tensors or arrays (NaN equals NaN)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(_bytes_of(a), _bytes_of(b)))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_sample(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_sample(x, y) for x, y in zip(a, b, strict=True))
    try:
        return type(a) is type(b) and (bool(a == b) or bool(a != a and b != b))  # a NaN target is as it was
    except (TypeError, ValueError, RuntimeError):
        return False


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    resolved = tensor.detach().resolve_conj().resolve_neg()  # a conjugate or negative view has no bytes of its own
    return standard_strides(resolved.cpu().contiguous().reshape(-1)).view(torch.uint8)


class Generators(NamedTuple):
    """The states of the process-wide random generators a ``__getitem__`` may draw from."""

    torch: torch.Tensor
    numpy: Any
    python: Any

    @classmethod
    def now(cls) -> Generators:
        """Their states now (numpy's as a dict: the legacy tuple holds only an MT19937's)."""
        return cls(torch.get_rng_state(), np.random.get_state(legacy=False), random.getstate())

    def restore(self) -> None:
        """Put the generators back in these states."""
        torch.set_rng_state(self.torch)
        np.random.set_state(self.numpy)
        random.setstate(self.python)

    def same(self, other: Generators) -> bool:
        """Whether ``other`` holds the same states."""
        return (
            bool(torch.equal(self.torch, other.torch))
            and _equal(self.numpy, other.numpy)
            and self.python == other.python
        )


def _equal(a: Any, b: Any) -> bool:
    """Equality of nested dicts, tuples and arrays (a numpy generator's state)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


_MT19937_BYTES = 624 * 4 + 4  #: numpy's mt19937_state: 624 words of key, then the position in it


def draw_mark() -> tuple[bytes, object, object]:
    """A mark of the process-wide generators' states, a few microseconds to take: equal marks, no draw between.

    numpy's legacy generator is read as its MT19937 state's bytes (its normal kept for the
    next call is not: a draw that only uses it is not seen, the next one is).
    """
    get = getattr(np.random, "get_bit_generator", None)  # numpy 1.25 on
    bits = get() if get is not None else None
    if type(bits) is np.random.MT19937:
        numpy: object = ctypes.string_at(bits.ctypes.state_address, _MT19937_BYTES)
    else:
        numpy = repr(np.random.get_state(legacy=False))
    return torch.get_rng_state().numpy().tobytes(), numpy, random.getstate()


_ELSEWHERE = (0x5EED_F00D, 0x5EED_BEEF)  #: the seeds of the other states a moved batch is read again from


def batch_draws(
    read: Callable[[int], Any], indices: list[Any], samples: list[Any], moved: bool
) -> tuple[Any, str] | None:
    """The first random sample of a computed batch, and what it gave; ``None`` if none is found.

    Of a batch whose computing did not move a process-wide generator, the first sample is
    read twice more (:func:`random_reads`). Of one that did, every sample is read again
    from another state of them, and, if that read moved them, from a second one: a sample
    seeded by its index leaves them in one state from both, one drawn from their stream
    in two. The generators are left as they were.

    Raises:
        Exception: What a read again raised.
    """
    if not moved:
        why = random_reads(read, indices[0], samples[0])
        return None if why is None else (indices[0], why)
    before = Generators.now()
    try:
        for index, sample in zip(indices, samples, strict=True):
            marks = []  # (start, end) of each read
            for seed in _ELSEWHERE:
                torch.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed seeds CUDA too
                np.random.seed(seed)
                random.seed(seed)
                start = draw_mark()
                if not same_sample(sample, read(index)):
                    return index, "another sample when the process-wide generators stood elsewhere"
                marks.append((start, draw_mark()))
                if marks[-1][1] == start:  # it draws nothing from them
                    break
            if len(marks) == 2:  # a generator it moved, left in two states: drawn from, not seeded
                (first, end), (_, second_end) = marks
                if any(a != b and b != c for a, b, c in zip(first, end, second_end, strict=True)):
                    return index, "the same sample, but drew from a process-wide random generator"
        return None
    finally:
        before.restore()


def random_reads(read: Callable[[int], Any], index: int, sample: Any) -> str | None:
    """What makes sample ``index`` random, read twice more beside ``sample`` (read before); ``None`` if nothing.

    ``read`` gives a sample the way ``sample`` was read (``dataset.__getitem__``, or one
    index through ``__getitems__``). The process-wide generators are left as they were
    before these reads.
    """
    before = Generators.now()
    try:
        again = read(index)
        if not same_sample(sample, again):
            return "another sample"
        between = Generators.now()
        if not same_sample(sample, read(index)):
            return "another sample"
        if not between.same(Generators.now()):
            return "the same sample, but drew from a process-wide random generator"
        return None
    finally:
        before.restore()


def checked_for_draws(dataset: Any, batched: Any, indices: list[Any], samples: list[Any], moved: bool) -> bool:
    """Whether a computed batch was checked for random samples (:func:`batch_draws`) and none was found.

    ``False`` when it could not be: a sample that cannot be cached (refused for that when
    stored), or a read again that failed (a file away for a moment).

    Raises:
        KeyingError: If a sample is random.
    """
    if not _cacheable(samples[0]):
        return False
    read = (lambda i: batched([i])[0]) if batched else dataset.__getitem__  # as the batch was read (__getitems__)
    try:
        found = batch_draws(read, indices, samples, moved)
    except Exception:  # noqa: BLE001 - no verdict: the next batch is checked
        return False
    if found is not None:
        raise KeyingError(
            f"{type(dataset).__qualname__}[{found[0]}] is random (read again, it gave {found[1]}): a cache would "
            "serve its first draw at every epoch. Run the random part in transform= (applied after the cache, at "
            "every access), draw from a generator seeded by the index (np.random.default_rng(index)), or pass "
            "check_samples=False to cache its first draws"
        )
    return True


def _cacheable(sample: Any) -> bool:
    """Whether a sample can be cached (one that cannot is refused for that when it is stored)."""
    try:
        check_sample(sample)
    except KeyingError:
        return False
    return True
