"""One call once split: its per-item tensors, the rows a partial batch computes, and writes refused.

A cached call does not run forward, so a forward that writes its inputs (or a tensor of
``shared_args``) in place is refused: its hits would leave them as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import channels_last_format, standard_strides
from ..errors import KeyingError
from ..tiers.batch import index_tensor
from .containers import map_tensors

__all__ = ["CallArguments", "mode_switched"]


@dataclass
class CallArguments:
    """One call, split into its per-item tensors and the rest of its key.

    Attributes:
        args: The caller's positional arguments.
        kwargs: The caller's keyword arguments.
        tensors: Per-item tensors, each with its batch dimension first (a view).
        batch: The batch size.
        training: The training flag of the cached module (``None`` for a function).
        lists_like_the_batch: Arguments that are lists of as many strings as there are
            items: keyed whole, not per item.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tensors: list[torch.Tensor]
    batch: int
    _names: list[str]
    _kw_names: dict[str, str]
    _shared: Collection[str]
    _dims: Mapping[str, int]
    training: bool | None = None
    #: Arguments that are lists of as many strings as there are items (texts, file names).
    lists_like_the_batch: list[str] = field(default_factory=list)
    #: The digest of everything but the items (module key, arguments, mode): the item check runs once per context.
    context: bytes = b""
    #: The cache's count of changes seen when the call took its key: another after it, and the check is void.
    keyed: int = 0
    #: The per-item tensors' version counters before the forward ran (:meth:`compute`).
    versions: list[int] = field(default_factory=list)
    #: Tensors of ``shared_args`` and defaults (one for the whole batch), and their version counters.
    shared: list[torch.Tensor] = field(default_factory=list)
    shared_versions: list[int] = field(default_factory=list)
    #: The rows :meth:`select` took last (the caller's tensor, its batch dimension, the positions, the rows).
    picked: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def refuse_written(self, name: str, unchanged: Callable[[], bool]) -> None:
        """Raise if a per-item tensor was written in place since the call was split (by the forward of ``name``).

        ``unchanged`` (the items hashed again) tells a write that left the values as they
        were (dropout in eval mode with ``inplace=True``) from one that changed them.

        Raises:
            KeyingError: If one was: a cached call does not run forward, so its hits would not write it.
        """
        if any(_version_of(t) != v for t, v in zip(self.tensors, self.versions)) and not _holds(unchanged):
            raise _written(name)
        self.refuse_shared_written(name)

    def refuse_shared_written(self, name: str) -> None:
        """Raise if a tensor one for the whole batch was written in place since the call was split.

        Raises:
            KeyingError: If one was (a hit would not write it).
        """
        if any(_version_of(t) != v for t, v in zip(self.shared, self.shared_versions)):
            raise _written(name)

    def compute(self, fn: Callable[..., Any]) -> Any:
        """``fn`` called with the caller's arguments, their version counters noted first (:meth:`refuse_written`)."""
        self._note_versions()
        return fn(*self.args, **self.kwargs)

    def _note_versions(self) -> None:  # on the paths that compute: a hit runs no forward, and needs none
        self.versions = list(map(_version_of, self.tensors))
        self.shared_versions = list(map(_version_of, self.shared))

    def compute_rows(self, fn: Callable[..., Any], positions: list[int], name: str) -> Any:
        """``fn`` called with the caller's arguments restricted to ``positions`` (:meth:`select`).

        Raises:
            KeyingError: If the forward (of ``name``) changed the rows it was given: an
                uncached call would change the caller's input (see :meth:`refuse_written`).
        """
        args, kwargs = self.select(positions)
        self._note_versions()
        try:
            computed = fn(*args, **kwargs)
        except Exception as exc:
            if (self._shared or self._dims) and len(positions) < self.batch:
                declared = ", ".join(
                    f"{o}={sorted(n)}" for o, n in (("shared_args", self._shared), ("batch_dims", self._dims)) if n
                )
                exc.add_note(
                    f"torchcache called {name} on {len(positions)} of the batch's {self.batch} items (the others were "
                    f"cached), passing {declared} as declared: whole, or sliced on the dimension given. A tensor that "
                    "is per item in shared_args, or a wrong batch_dims, fails this way"
                )
            raise
        for value, dim, index, rows in self.picked:
            if _version_of(rows) > 0 and not _holds(functools.partial(_kept, value, dim, index, rows)):
                raise _written(name)
        self.refuse_shared_written(name)
        return computed

    def select(self, positions: list[int]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The caller's arguments with every per-item tensor restricted to ``positions``."""
        indices: dict[torch.device, torch.Tensor] = {}
        self.picked = []

        def pick(value: torch.Tensor, dim: int) -> torch.Tensor:
            index = indices.get(value.device)
            if index is None:
                index = indices[value.device] = index_tensor(positions, value.device)
            picked = value.index_select(dim, index)
            if (layout := channels_last_format(value)) is not None:  # keyed so: computed as the whole batch is
                picked = picked.contiguous(memory_format=layout)
            if value.__dict__:  # attributes set on the caller's tensor (keyed): the rows carry them
                picked.__dict__.update({k: v for k, v in value.__dict__.items() if k not in picked.__dict__})
            self.picked.append((value, dim, index, picked))
            return picked

        args = tuple(self._map(value, self._names[i], pick) for i, value in enumerate(self.args))
        kwargs = {key: self._map(value, self._kw_names[key], pick) for key, value in self.kwargs.items()}
        return args, kwargs

    def _map(self, value: Any, name: str, pick: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
        if name in self._shared:
            return value
        return map_tensors(value, lambda t: pick(t, self._dims.get(name, 0)))


def _written(name: str) -> KeyingError:
    return KeyingError(
        f"{name}: its forward wrote an input in place; a cached call does not run forward, so its hits "
        "would leave that input unchanged. Write to a copy (x = x.clone() first), or leave the writing "
        "outside the cached module"
    )


def _kept(value: torch.Tensor, dim: int, index: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``rows`` still hold the bytes of the caller's (NaN as NaN, as the items' keys see them)."""
    before = standard_strides(value.index_select(dim, index).contiguous()).view(torch.uint8)
    return torch.equal(standard_strides(rows.contiguous()).view(torch.uint8), before)


def _holds(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except Exception:  # noqa: BLE001 - an input reshaped in place (x.resize_(())) cannot be hashed as it was
        return False


def _version_of(tensor: torch.Tensor) -> int:
    """A tensor's version counter (-1 for an inference tensor, which counts no writes)."""
    return -1 if tensor.is_inference() else tensor._version


def mode_switched(module: torch.nn.Module | None, training: bool | None) -> bool:
    """Whether ``module`` was switched to the other mode (by another thread) as a call made in ``training`` ran.

    A call counts as made in training mode when a submodule of an eval model was (dropout on for
    Monte Carlo dropout, a submodule added in its default training mode): that is no switch.
    """
    if module is None or training is None or module.training == training:
        return False
    return not (training and any(sub.training for sub in module.modules()))
