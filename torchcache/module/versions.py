"""Seeing what a module's key covers change between calls, at a cost of a few C-level passes per call.

:class:`VersionWatch` watches the module's own tensors (version counters, data pointers,
the registries' contents), submodules and forward hooks; :class:`HeldValues` what else
the key read (names rebound, tensors and arrays held elsewhere written in place). Either
saying "changed" takes the key again. docs/how-it-works.md ("What the key covers
changed") lists what is seen and what is not; ``verify_weights=N`` hashes the weights
every N calls for writes that bypass the version counters.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
import struct
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.hooks import RemovableHandle

from ..canonical.objects import Binding, Members
from ..errors import CacheWarning, KeyingError
from ..faults import user_stacklevel
from ..keys import tensor_digest
from .fingerprint import tensor_attributes, unignored

__all__ = ["HeldValues", "VersionWatch", "forward_kept"]

_version = operator.attrgetter("_version")
_training = operator.attrgetter("training")
_requires_grad = operator.attrgetter("requires_grad")
_grad_enabled = torch.is_grad_enabled
_children = operator.attrgetter("_modules")
#: Bytes of numpy arrays a key covers that :class:`HeldValues` hashes again at every call.
ARRAY_WATCH_BYTES = 1 << 20
_data_ptr = torch.Tensor.data_ptr
_GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_pre_hooks, torch.nn.modules.module._global_forward_hooks)


class Generation:
    """A count of parameter, buffer and submodule registrations in this process."""

    value = 0

    @classmethod
    def bump(cls, *args: object) -> None:
        """Count one registration (a registration hook of torch's)."""
        cls.value += 1


torch.nn.modules.module.register_module_parameter_registration_hook(Generation.bump)
torch.nn.modules.module.register_module_buffer_registration_hook(Generation.bump)
torch.nn.modules.module.register_module_module_registration_hook(Generation.bump)


def _named_tensors(module: torch.nn.Module, ignore: Collection[str] = ()) -> list[tuple[str, torch.Tensor]]:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return unignored(named + tensor_attributes(module), ignore)


def module_tensors(module: torch.nn.Module, ignore: Collection[str] = ()) -> list[torch.Tensor]:
    """The parameters, buffers and plain tensor attributes of ``module`` and its submodules."""
    return [tensor for _, tensor in _named_tensors(module, ignore)]


def _weights_digest(module: torch.nn.Module, ignore: Collection[str] = ()) -> str:
    return tensor_digest(_named_tensors(module, ignore))


def module_ids(module: torch.nn.Module) -> list[int]:
    """The identities of ``module`` and its submodules."""
    return [id(sub) for _, sub in module.named_modules(remove_duplicate=False)]


def _hook_ids(dicts: list[dict[int, Any]]) -> list[int]:
    return [id(hook) for hooks in dicts for hook in hooks.values()]


class VersionWatch:
    """Tells whether what a module's key covers changed since :meth:`reset`.

    Args:
        module: The cached module (held weakly).
        verify_every: Also hash the weights every this many calls (``None``: never), for
            writes that bypass the version counters.
        root_hooks: Watch the module's own forward hooks too (a cached method other than
            ``forward``, which may call ``self(x)``).
        ignore: ``key_ignore``: tensors of these names (memos) are neither keyed nor watched.
    """

    __slots__ = (
        "_calls",
        "_child_count",
        "_child_values",
        "_children",
        "_count",
        "_digest",
        "_generation",
        "_grads",
        "_handle",
        "_held",
        "_hook_count",
        "_hook_dicts",
        "_hooks",
        "_ids",
        "_ignore",
        "_module",
        "_modules",
        "_plain",
        "_ptrs",
        "_registries",
        "_registries_held",
        "_root_hooks",
        "_submodules",
        "_tensors",
        "_total",
        "_values",
        "_verify_every",
        "_versioned",
        "_versions",
    )

    def __init__(
        self,
        module: torch.nn.Module,
        verify_every: int | None = None,
        root_hooks: bool = False,
        ignore: Collection[str] = (),
    ) -> None:
        self._module: Callable[[], torch.nn.Module | None] = weakref.ref(module)
        self._root_hooks = root_hooks
        self._ignore = ignore
        self._verify_every = verify_every
        self._tensors: list[torch.Tensor] = []
        self._versioned: list[torch.Tensor] = []
        self._versions: dict[int, int] = {}
        self._registries: list[dict[str, torch.Tensor | None]] = []
        self._registries_held: list[dict[str, torch.Tensor | None]] = []
        self._hook_dicts: list[dict[int, Any]] = []
        self._submodules: list[torch.nn.Module] = []
        self._children: list[dict[str, torch.nn.Module | None]] = []
        self._values: list[torch.Tensor | None] = []
        self._ids: list[int] = []
        self._modules: list[int] = []
        self._ptrs: list[int] = []
        self._hooks: list[int] = []
        self._total = self._count = self._hook_count = self._handle = self._calls = self._child_count = self._grads = 0
        self._held: list[torch.Tensor] = []
        self._plain: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        self._generation = -1
        self._digest = ""

    def reset(self) -> None:
        """Take the current state as the one the module key was taken from (call before fingerprinting)."""
        module = self._module()
        if module is None:
            return
        self._generation = Generation.value
        submodules = [sub for _, sub in module.named_modules(remove_duplicate=False)]
        self._submodules = submodules[1:]
        self._children = list(map(_children, submodules))  # a submodule deleted runs no registration hook
        self._child_count = sum(map(len, self._children))
        self._child_values = list(itertools.chain.from_iterable(map(dict.values, self._children)))
        self._registries = [r for sub in submodules for r in (sub._parameters, sub._buffers)]
        self._count = sum(map(len, self._registries))
        self._registries_held = [r for r in self._registries if r]  # the identity check skips empty ones
        self._values = list(itertools.chain.from_iterable(map(dict.values, self._registries_held)))
        self._held = [value for value in self._values if value is not None]  # a bias=None is registered too
        held = list(module_tensors(module, self._ignore))
        plain = {name for name, _ in unignored(tensor_attributes(module), self._ignore)}
        self._plain = [  # rebound with a plain setattr, which no registration hook sees
            (vars(sub), name, value)
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for name, value in vars(sub).items()
            if f"{prefix}.{name}" in plain
        ]
        self._tensors = [t for t in held if t.layout == torch.strided]  # sparse ones have no data pointer
        self._ids = list(map(id, held))
        self._modules = module_ids(module)
        self._versioned = [t for t in held if not t.is_inference()]  # sparse ones count their writes too
        self._versions = {id(t): t._version for t in self._versioned}
        self._total = sum(map(_version, self._versioned))
        self._grads = sum(map(_requires_grad, self._versioned))  # unfrozen later: the key is taken again, and refused
        self._ptrs = list(map(_data_ptr, self._tensors))
        hooked = submodules if self._root_hooks else self._submodules  # a method's key covers its module's own hooks
        self._hook_dicts = [h for sub in hooked for h in (sub._forward_pre_hooks, sub._forward_hooks)]
        self._hook_dicts += _GLOBAL_HOOKS
        self._hooks = _hook_ids(self._hook_dicts)
        self._hook_count = len(self._hooks)
        self._handle = RemovableHandle.next_id
        self._calls = 0
        if self._verify_every is not None:
            self._digest = _weights_digest(module, self._ignore)

    def changed(self) -> bool:
        """Whether a weight was written, replaced or swapped, or a forward hook came or went, since :meth:`reset`."""
        if Generation.value != self._generation:
            module = self._module()
            if module is None:
                return False
            if [id(t) for t in module_tensors(module, self._ignore)] != self._ids or module_ids(
                module
            ) != self._modules:
                return True
            self._generation = Generation.value  # registrations elsewhere: nothing changed here
        if self._plain and not all(namespace.get(name) is value for namespace, name, value in self._plain):
            return True
        if sum(map(_version, self._versioned)) != self._total or list(map(_data_ptr, self._tensors)) != self._ptrs:
            return True
        children = itertools.chain.from_iterable(map(dict.values, self._children))  # _modules[name] = new: no hook
        if sum(map(len, self._children)) != self._child_count or not all(
            map(operator.is_, children, self._child_values)
        ):
            return True
        if _grad_enabled() and sum(map(_requires_grad, self._versioned)) != self._grads:  # without grad: outputs alike
            return True
        registries = itertools.chain.from_iterable(map(dict.values, self._registries_held))
        if sum(map(len, self._registries)) != self._count or not all(map(operator.is_, registries, self._values)):
            return True
        if RemovableHandle.next_id != self._handle or sum(map(len, self._hook_dicts)) != self._hook_count:
            if _hook_ids(self._hook_dicts) != self._hooks:
                return True
            self._handle = RemovableHandle.next_id  # hooks registered elsewhere: nothing changed here
        if self._verify_every is not None:
            self._calls += 1
            if self._calls >= self._verify_every:
                self._calls = 0
                module = self._module()
                return module is not None and _weights_digest(module, self._ignore) != self._digest
        return False

    def after_forward(self) -> None:
        """Take plain tensor attributes that a forward just run rebound (a table grown on demand) as they are now."""
        if self._plain and not all(namespace.get(name) is value for namespace, name, value in self._plain):
            self.reset()

    def written(self, name: str) -> KeyingError | None:
        """The error to raise if a forward that just ran wrote the module's tensors in place (a running mean).

        A hit does not run forward, so it would not write them, and every later output
        would differ from the uncached ones; the error names them. Tensors named in
        ``key_ignore`` (a table filled on first use, which outputs do not depend on) are
        not watched.
        """
        if sum(map(_version, self._versioned)) == self._total:
            return None
        module = self._module()
        named = _named_tensors(module, self._ignore) if module is not None else []
        was = self._versions
        written = [label for label, t in named if not t.is_inference() and t._version != was.get(id(t), t._version)]
        return KeyingError(
            f"{name}: its forward wrote {', '.join(written[:3]) or 'its tensors'} in place; a cached call does not "
            "run forward, so hits would leave them as they were and later outputs would differ from uncached "
            f"ones. Keep such state outside the cached module, call it without the cache (torchcache_enabled = "
            f"False), or, if it is a memo that outputs do not depend on (a table filled on first use), name it in "
            f"key_ignore (key_ignore=({(written or ['name'])[0].rsplit('.', 1)[-1]!r},))"
        )

    @contextlib.contextmanager
    def buffers_kept(self) -> Iterator[None]:
        """Restore the module's buffers when the block ends (an extra forward in training mode updates them)."""
        module = self._module()
        buffers = [b for b in module.buffers() if not b.is_inference()] if module is not None else []
        saved = [(b.detach().clone(), b._version) for b in buffers]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, (value, version) in zip(buffers, saved):
                    # torch.equal takes strided tensors only; a sparse buffer is restored if it was written
                    strided = buffer.layout == torch.strided
                    if (strided and not torch.equal(buffer, value)) or (not strided and buffer._version != version):
                        buffer.copy_(value)

    def training_pattern(self, training: bool) -> bytes:
        """The training flags of the submodules, or ``b""`` when they all follow the module's own."""
        flags = bytes(map(_training, self._submodules))
        return b"" if flags.count(training) == len(flags) else flags


def forward_kept(watch: VersionWatch | None, held: HeldValues | None) -> contextlib.ExitStack[bool | None]:
    """A block that runs forward again for a check: buffers restored, names forward rebinds taken after it."""
    stack = contextlib.ExitStack()
    for after in [w.after_forward for w in (watch, held) if w is not None]:
        stack.callback(after)
    if watch is not None:
        stack.enter_context(watch.buffers_kept())  # restored first
    return stack


_UNBOUND = object()
_rebound: collections.Counter[tuple[int, str]] = collections.Counter()
REBOUND_WARN = 3  #: rebinding a name this often takes the key as often: a warning says so, once


def _note_rebound(binding: Binding) -> None:
    where = (id(binding.namespace), binding.name)
    _rebound[where] += 1
    if _rebound[where] == REBOUND_WARN:
        kind = "attribute" if binding.member else "global"
        warnings.warn(
            f"torchcache: the {kind} {binding.name!r} that a cached forward reads was rebound {REBOUND_WARN} times; "
            "each time the module key is taken again (its weights hashed) and earlier entries no longer match. If "
            f"outputs do not depend on it, name it in key_ignore ({binding.name!r})",
            CacheWarning,
            stacklevel=user_stacklevel(),
        )


class HeldValues:
    """What a key read beyond the module's own tensors: names (globals, attributes, class members), and values.

    Values are tensors, numpy arrays (up to :data:`ARRAY_WATCH_BYTES` in all, hashed
    again) and modules held in containers or read as globals, watched for writes in place.
    """

    __slots__ = (
        "_arrays",
        "_bindings",
        "_flags",
        "_generation",
        "_lookups",
        "_members",
        "_modules",
        "_ptrs",
        "_sizes",
        "_spaces",
        "_tensors",
        "_total",
        "_versioned",
    )

    def __init__(self, values: list[Any]) -> None:
        bindings = {(id(v.namespace), v.name): v for v in values if isinstance(v, Binding)}
        self._bind(list(bindings.values()))  # names the key read: rebinding one (SCALE = 3) is a change
        spaces = {id(v.namespace): v.namespace for v in values if isinstance(v, Members)}
        self._spaces = list(spaces.values())  # instance and class dicts: a name added to one is a change
        self._sizes = sum(map(len, self._spaces))
        unique = list({id(value): value for value in values if not isinstance(value, (Binding, Members))}.values())
        tensors = [v for v in unique if isinstance(v, torch.Tensor)]
        self._tensors = [t for t in tensors if t.layout == torch.strided]  # sparse ones have no data pointer
        self._versioned = [t for t in tensors if not t.is_inference()]
        self._total = sum(map(_version, self._versioned))
        self._ptrs = list(map(_data_ptr, self._tensors))
        self._modules = [v for v in unique if isinstance(v, torch.nn.Module)]  # held as values: their mode counts
        self._flags = bytes(map(_training, self._modules))
        self._generation = Generation.value
        self._members = self._held_members()
        self._arrays: list[tuple[np.ndarray[Any, Any], int]] = []
        room = ARRAY_WATCH_BYTES
        for array in (v for v in unique if isinstance(v, np.ndarray) and not v.dtype.hasobject):
            if array.nbytes <= room:
                room -= array.nbytes
                self._arrays.append((array, _array_digest(array)))

    def __bool__(self) -> bool:
        return bool(self._tensors or self._arrays or self._modules or self._bindings or self._spaces)

    def _bind(self, bindings: list[Binding]) -> None:
        self._bindings = bindings
        self._lookups = (  # each checked in C: a model reads hundreds
            tuple(b.namespace.get for b in bindings),
            tuple(b.name for b in bindings),
            tuple(b.value for b in bindings),
        )

    def _rebound(self) -> bool:
        """Whether a name is bound to another value than the key read (an equal number or string set again is not)."""
        bindings = []
        for binding in self._bindings:
            now = binding.namespace.get(binding.name, _UNBOUND)
            if now is not binding.value:
                if not _same_plain(now, binding.value):
                    _note_rebound(binding)
                    return True
                binding = binding._replace(value=now)
            bindings.append(binding)
        self._bind(bindings)
        return False

    def after_forward(self) -> None:
        """Take the names that a forward just run rebound or added as they are now.

        What a forward keeps for itself (a table grown on demand, a counter, a lazily built
        helper) changes whether or not calls are cached, and the key was taken before it
        ran; what changes between calls, outside forward, takes the key again.
        """
        self._bind([b._replace(value=b.namespace.get(b.name, _UNBOUND)) for b in self._bindings])
        self._sizes = sum(map(len, self._spaces))

    def _held_members(self) -> list[int]:
        """The submodules and tensors of the modules held as values, by identity."""
        return [ident for held in self._modules for ident in (*module_ids(held), *map(id, module_tensors(held)))]

    def changed(self) -> bool:
        """Whether one of them was written in place (or given new storage), or a global rebound, since collected."""
        if sum(map(_version, self._versioned)) != self._total or list(map(_data_ptr, self._tensors)) != self._ptrs:
            return True
        gets, names, values = self._lookups
        if any(map(operator.is_not, map(operator.call, gets, names), values)) and self._rebound():
            return True
        if self._spaces and sum(map(len, self._spaces)) != self._sizes:
            return True
        if self._modules and bytes(map(_training, self._modules)) != self._flags:
            return True
        if self._modules and Generation.value != self._generation:  # a parameter or submodule registered
            if self._held_members() != self._members:
                return True
            self._generation = Generation.value
        return any(_array_digest(array) != digest for array, digest in self._arrays)

    def written(self, name: str) -> KeyingError | None:
        """As :meth:`VersionWatch.written`, for tensors held in containers or read as globals."""
        if sum(map(_version, self._versioned)) == self._total:
            return None
        return KeyingError(
            f"{name}: its forward wrote in place a tensor it holds in a list, a dict or an object, or reads as a "
            "global; a cached call does not run forward, so hits would leave it as it was and later outputs would "
            "differ from uncached ones. Keep such state outside the cached module"
        )


_PLAIN = (bool, int, str, bytes, type(None))
_pack_double = struct.Struct("<d").pack


def _same_plain(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are numbers, strings or tuples of them that a key would encode alike."""
    if type(a) is not type(b):
        return False
    if isinstance(a, _PLAIN):
        return bool(a == b)
    if isinstance(a, float):
        return _pack_double(a) == _pack_double(b)  # as keys encode them: -0.0 and NaN payloads apart
    if isinstance(a, complex):
        return _same_plain(a.real, b.real) and _same_plain(a.imag, b.imag)
    if isinstance(a, tuple) and len(a) == len(b) and len(a) <= 16:
        return all(map(_same_plain, a, b))
    return False


def _array_digest(array: np.ndarray[Any, Any]) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
