"""Seeing weights change in place: version counters, registrations and an opt-in content check.

Every tensor has a version counter that in-place operations bump (``copy_``, ``mul_``,
``lerp_``, ``_foreach_*``, optimizer steps, batch norm's running statistics); a
``detach()`` view shares it. Counters only grow, so the sum of the counters of a
module's parameters, buffers and plain tensor attributes changes exactly when one of
them was written in place: one C call per tensor per cached call (about 0.1 us each).

A parameter, buffer or submodule *replaced* (``model.fc.weight = nn.Parameter(...)``,
``model.head = nn.Linear(...)``) goes through torch's registration hooks, which bump a
process-wide generation; the tensors are then listed again and compared by identity.

Writes that bypass the counters: ``p.data.copy_(...)`` (``.data`` has a counter of its
own), ``p.data = ...``, and writes through a ``numpy()`` view. ``verify_weights=N``
hashes the weights every N calls to see those too.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch

from ..keys import tensor_digest
from .fingerprint import tensor_attributes

__all__ = ["VersionWatch"]

_version = operator.attrgetter("_version")


class _Generation:
    """A count of parameter, buffer and submodule registrations in this process."""

    value = 0

    @classmethod
    def bump(cls, *args: object) -> None:
        cls.value += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_Generation.bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_Generation.bump)
torch.nn.modules.module.register_module_module_registration_hook(_Generation.bump)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [p for _, p in module.named_parameters(remove_duplicate=False)]
    tensors += [b for _, b in module.named_buffers(remove_duplicate=False)]
    tensors += [t for _, t in tensor_attributes(module)]
    return tensors


def _weights_digest(module: torch.nn.Module) -> str:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return tensor_digest(named + tensor_attributes(module))


class VersionWatch:
    """Tells whether a module's weights changed since :meth:`reset`, at a cost per call of one counter read a tensor.

    Args:
        module: The cached module (held weakly).
        verify_every: Also hash the weights every this many calls (``None``: never), for
            writes that bypass the version counters.
    """

    __slots__ = ("_calls", "_digest", "_generation", "_ids", "_module", "_tensors", "_total", "_verify_every")

    def __init__(self, module: torch.nn.Module, verify_every: int | None = None) -> None:
        self._module: Callable[[], torch.nn.Module | None] = weakref.ref(module)
        self._verify_every = verify_every
        self._tensors: list[torch.Tensor] = []
        self._ids: list[int] = []
        self._total = 0
        self._generation = -1
        self._calls = 0
        self._digest = ""

    def reset(self) -> None:
        """Take the current state as the one the module key was taken from (call before fingerprinting)."""
        module = self._module()
        if module is None:
            return
        self._generation = _Generation.value
        self._tensors = _tensors(module)
        self._ids = [id(t) for t in self._tensors]
        self._total = sum(map(_version, self._tensors))
        self._calls = 0
        if self._verify_every is not None:
            self._digest = _weights_digest(module)

    def changed(self) -> bool:
        """Whether a weight was written in place or replaced since :meth:`reset`."""
        if sum(map(_version, self._tensors)) != self._total:
            return True
        if _Generation.value != self._generation:
            module = self._module()
            if module is None:
                return False
            if [id(t) for t in _tensors(module)] != self._ids:
                return True
            self._generation = _Generation.value  # registrations elsewhere: nothing changed here
        if self._verify_every is not None:
            self._calls += 1
            if self._calls >= self._verify_every:
                self._calls = 0
                module = self._module()
                return module is not None and _weights_digest(module) != self._digest
        return False
