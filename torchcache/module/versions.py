"""Seeing what a module's key covers change between calls, at a cost of a few C-level passes per call.

Checked before every cached call, against the state the key was taken from: in-place writes (the sum of the
version counters of the parameters, buffers and tensor attributes, which optimizer steps, ``copy_`` and batch
norm bump); storage replaced (``p.data = new``: data pointers); tensors swapped in the registries
(``torch.func.functional_call``); parameters, buffers and submodules registered or replaced (torch's
registration hooks bump a generation; ``_modules`` dicts compared by identity); forward hooks registered,
removed or replaced (dict sizes, identities); and (:class:`HeldValues`) the plain attributes, class values and
globals the key read, rebound to another value (``model.scale = 3.0``, ``Net.K = 3``, ``SCALE = 3``), and the
tensors and small arrays it read inside containers, written in place (a tensor also set to require grad). Any
change takes the key again. Submodules switched to training or eval mode on their own are part of each call's
key instead (:meth:`VersionWatch.training_pattern`).

Not seen: writes through ``.data`` or a ``numpy()`` view, and in-place writes to inference
tensors; ``verify_weights=N`` hashes the weights every N calls for those.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
import xxhash

from ..canonical.code import EMPTY
from ..canonical.globals import ProcessState
from ..canonical.modules import WeakState
from ..canonical.objects import Binding
from ..errors import ConfigError, KeyingError
from ..keys import tensor_digest
from ..policy import plural
from .fingerprint import tensor_attributes, unignored
from .rebinding import alike, note_rebound, note_written

__all__ = ["HeldValues", "VersionWatch"]

_version, _training = operator.attrgetter("_version"), operator.attrgetter("training")
_requires_grad, _children = operator.attrgetter("requires_grad"), operator.attrgetter("_modules")
_grad_enabled = torch.is_grad_enabled
#: Bytes of numpy arrays a key covers that :class:`HeldValues` hashes again at every call.
ARRAY_WATCH_BYTES = 1 << 20
_data_ptr = torch.Tensor.data_ptr
_GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_pre_hooks, torch.nn.modules.module._global_forward_hooks)
#: Said of every write seen during a call: the watch cannot tell the forward's writes from another thread's.
_OVERLAP = "If another thread wrote it while the call ran: change a cached module between its calls, not during them"


class _Generation:
    """A count of parameter, buffer and submodule registrations in this process."""

    value = 0

    @classmethod
    def bump(cls, *args: object) -> None:
        cls.value += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_Generation.bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_Generation.bump)
torch.nn.modules.module.register_module_module_registration_hook(_Generation.bump)


def _named_tensors(module: torch.nn.Module, ignore: Collection[str] = ()) -> list[tuple[str, torch.Tensor]]:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return unignored(named + tensor_attributes(module), ignore)


def _tensors(module: torch.nn.Module, ignore: Collection[str] = ()) -> list[torch.Tensor]:
    return [tensor for _, tensor in _named_tensors(module, ignore)]


def _weights_digest(module: torch.nn.Module, ignore: Collection[str] = ()) -> str:
    return tensor_digest(_named_tensors(module, ignore))


def _module_ids(module: torch.nn.Module) -> list[int]:
    return [id(sub) for _, sub in module.named_modules(remove_duplicate=False)]


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
        "_held",
        "_hook_count",
        "_hook_dicts",
        "_hooked",
        "_hooks",
        "_ids",
        "_ignore",
        "_module",
        "_modules",
        "_ptrs",
        "_registries",
        "_registries_held",
        "_root_hooks",
        "_sub_classes",
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
        self._hooked: list[dict[int, Any]] = []  # those holding hooks when the key was taken
        self._submodules: list[torch.nn.Module] = []
        self._children: list[dict[str, torch.nn.Module | None]] = []
        self._values: list[torch.Tensor | None] = []
        self._ids: list[int] = []
        self._modules: list[int] = []
        self._ptrs: list[int] = []
        self._hooks: list[Any] = []
        self._total = self._count = self._hook_count = self._calls = self._child_count = self._grads = 0
        self._held: list[torch.Tensor] = []
        self._sub_classes: list[type] = []
        self._generation = -1
        self._digest = ""

    def module(self) -> torch.nn.Module | None:
        """The watched module, ``None`` once it is gone."""
        return self._module()

    def reset(self) -> None:
        """Take the current state as the one the module key was taken from (call before fingerprinting)."""
        module = self._module()
        if module is None:
            return
        self._generation = _Generation.value
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
        self._sub_classes = list(map(type, submodules))  # sub.__class__ = Other (the module's own too): no hook sees it
        held = list(_tensors(module, self._ignore))
        self._tensors = [t for t in held if t.layout == torch.strided]  # sparse ones have no data pointer
        self._ids = list(map(id, held))
        self._modules = _module_ids(module)
        self._versioned = [t for t in held if not t.is_inference()]  # sparse ones count their writes too
        self._versions = {id(t): t._version for t in self._versioned}
        self._total = sum(map(_version, self._versioned))
        self._grads = sum(map(_requires_grad, self._versioned))  # unfrozen later: the key is taken again, and refused
        self._ptrs = list(map(_data_ptr, self._tensors))
        hooked = submodules if self._root_hooks else self._submodules  # a method's key covers its module's own hooks
        self._hook_dicts = [h for sub in hooked for h in (sub._forward_pre_hooks, sub._forward_hooks)]
        self._hook_dicts += _GLOBAL_HOOKS
        self._hooked = [hooks for hooks in self._hook_dicts if hooks]
        self._hooks = list(itertools.chain.from_iterable(map(dict.values, self._hooked)))
        self._hook_count, self._calls = len(self._hooks), 0
        if self._verify_every is not None:
            self._digest = _weights_digest(module, self._ignore)

    def changed(self, verify: bool = True) -> bool:
        """Whether weights were written, replaced or swapped, or forward hooks changed, since :meth:`reset`.

        ``verify``: also count the call and hash the weights as ``verify_weights`` asks.
        """
        if _Generation.value != self._generation:
            module = self._module()
            if module is None:
                return False
            if [id(t) for t in _tensors(module, self._ignore)] != self._ids or _module_ids(module) != self._modules:
                return True
            self._generation = _Generation.value  # registrations elsewhere: nothing changed here
        if list(map(type, [self._module(), *self._submodules])) != self._sub_classes:
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
        hooks = itertools.chain.from_iterable(map(dict.values, self._hooked))  # hooks[k] = other: no handle
        if sum(map(len, self._hook_dicts)) != self._hook_count or not all(map(operator.is_, hooks, self._hooks)):
            return True
        if verify and self._verify_every is not None:
            self._calls += 1
            if self._calls >= self._verify_every:
                self._calls = 0
                module = self._module()
                return module is not None and _weights_digest(module, self._ignore) != self._digest
        return False

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
            f"key_ignore (key_ignore=({(written or ['name'])[0].rsplit('.', 1)[-1]!r},)). {_OVERLAP}"
        )

    def training_pattern(self, training: bool) -> bytes:
        """The training flags of the submodules, or ``b""`` when they all follow the module's own."""
        flags = bytes(map(_training, self._submodules))
        return b"" if flags.count(training) == len(flags) else flags


def _read(get: Callable[[str], Any], name: str) -> Any:
    try:
        return get(name)
    except Exception:  # noqa: BLE001 - an empty cell (EMPTY), or a deleted slot: unlike any value the key read
        return EMPTY


_TRAINED = (
    "through its globals, closures or the objects it holds: cached outputs carry no gradient, so training them "
    "through the cache would silently stop. Freeze them (requires_grad_(False)), or keep what is trained outside it"
)


class HeldValues:
    """Tensors, numpy arrays and modules held as values that a key covers, beyond the module's own tensors.

    Tensors in lists, dicts or other objects among the attributes, and those a function
    reads from its globals: the key was taken from their content, so an in-place write
    (seen by the version counter, or for numpy arrays, up to :data:`ARRAY_WATCH_BYTES`
    in all, by hashing them again) means the key must be taken again.
    """

    __slots__ = (
        "_arrays",
        "_bindings",
        "_child_values",
        "_children",
        "_flags",
        "_generation",
        "_graded",
        "_hook_dicts",
        "_hooked",
        "_hooks",
        "_lookups",
        "_members",
        "_modules",
        "_ptrs",
        "_states",
        "_tensors",
        "_total",
        "_types",
        "_versioned",
    )

    def __init__(self, values: list[Any], owner: torch.nn.Module | None = None) -> None:
        bindings = {(id(v.namespace), v.name): v for v in values if isinstance(v, Binding)}
        if owner is not None:  # the cached module's own attributes, read through a weak reference: no cycle
            own, weak = vars(owner), WeakState(owner)
            bindings = {k: (Binding(weak, *b[1:]) if b.namespace is own else b) for k, b in bindings.items()}
        # What the key read by name (SCALE, model.scale, Net.K): rebinding one is a change. Plain dicts
        # first, each looked up with dict.get in C: a model holds hundreds.
        self._bindings = sorted(bindings.values(), key=lambda b: type(b.namespace) is not dict)
        self._lookups = self._index()
        unique = list({id(value): value for value in values if not isinstance(value, Binding)}.values())
        self._states = [v for v in unique if isinstance(v, ProcessState)]  # os.environ, sys.argv: by content
        tensors = [v for v in unique if isinstance(v, torch.Tensor)]
        self._tensors = [t for t in tensors if t.layout == torch.strided]  # sparse ones have no data pointer
        self._versioned = [t for t in tensors if not t.is_inference()]
        self._total = sum(map(_version, self._versioned))
        self._ptrs = list(map(_data_ptr, self._tensors))
        self._modules = [v for v in unique if isinstance(v, torch.nn.Module)]  # held as values: their mode counts
        self._graded = [*self._versioned, *(t for module in self._modules for t in _tensors(module))]
        self._flags = bytes(map(_training, self._modules)) + bytes(map(_requires_grad, self._graded))  # unfrozen later
        self._types = list(map(type, self._modules))  # a class swapped (m.__class__ = Other): no hook sees it
        # their forward hooks and submodules, registered, removed or replaced (HEAD.register_forward_pre_hook(f),
        # del seq[1]: no registration hook sees those), as the module's own are watched
        subs = [sub for held in self._modules for sub in held.modules()]
        self._hook_dicts = [hooks for sub in subs for hooks in (sub._forward_pre_hooks, sub._forward_hooks)]
        self._hooked = [hooks for hooks in self._hook_dicts if hooks]  # the counts cover the others
        self._hooks = list(itertools.chain.from_iterable(map(dict.values, self._hooked)))
        self._children = list(map(_children, subs))
        self._child_values = list(itertools.chain.from_iterable(map(dict.values, self._children)))
        self._generation = _Generation.value
        self._members = self._held_members()
        self._arrays: list[tuple[np.ndarray[Any, Any], int]] = []
        room = ARRAY_WATCH_BYTES
        for array in (v for v in unique if isinstance(v, np.ndarray) and not v.dtype.hasobject):
            if array.nbytes <= room:
                room -= array.nbytes
                self._arrays.append((array, _array_digest(array)))

    def __bool__(self) -> bool:
        return bool(self._tensors or self._arrays or self._modules or self._bindings or self._states)

    def frozen(self, name: str) -> HeldValues:
        """These values; a ConfigError naming ``name`` if a tensor held (or a held module's) requires grad."""
        if trainable := sum(1 for t in {id(t): t for t in self._graded}.values() if t.requires_grad and t.is_leaf):
            raise ConfigError(f"{name} reads {plural(trainable, 'tensor')} that require grad {_TRAINED}")
        return self

    def _held_members(self) -> list[int]:
        """The submodules and tensors of the modules held as values, by identity."""
        return [ident for held in self._modules for ident in (*_module_ids(held), *map(id, _tensors(held)))]

    def changed(self) -> bool:
        """Whether one of them was written in place (or given new storage), or a global rebound, since collected."""
        if sum(map(_version, self._versioned)) != self._total or list(map(_data_ptr, self._tensors)) != self._ptrs:
            return True
        if self._states and self.states_written():
            self._states = list(map(note_written, self._states))  # counted, and taken as they are now
            return True
        spaces, names, values = self._lookups[:3]
        moved = any(map(operator.is_not, map(dict.get, spaces, names), values)) or self._others_moved()
        if moved and self.rebound():
            return True
        if self._flags and (
            bytes(map(_training, self._modules)) + bytes(map(_requires_grad, self._graded)) != self._flags
            or self._types != [*map(type, self._modules)]
        ):
            return True
        if self._hook_dicts and not (
            _same(self._hook_dicts, self._hooked, self._hooks)
            and _same(self._children, self._children, self._child_values)
        ):
            return True
        if self._modules and _Generation.value != self._generation:  # a parameter or submodule registered
            if self._held_members() != self._members:
                return True
            self._generation = _Generation.value
        return any(_array_digest(array) != digest for array, digest in self._arrays)

    def states_written(self) -> bool:
        """Whether the environment or command line the key read was written since (not counted, not taken)."""
        return any(state.changed() for state in self._states)

    def _others_moved(self) -> bool:
        """Whether a binding outside a plain dict (a slot, a class's value, a function's code) holds another value."""
        _, _, _, gets, names, values = self._lookups
        try:
            return any(map(operator.is_not, map(operator.call, gets, names), values))
        except Exception:  # noqa: BLE001 - an emptied cell, a slot deleted: a change, said by rebound()
            return True

    def rebound(self, note: bool = True, same: Callable[[Any, Any], bool] = alike) -> bool:
        """Whether a binding holds a value not ``same`` as before (noted, and the same ones taken, if ``note``)."""
        now = self._now()
        changed = [b for b, value in zip(self._bindings, now) if value is not b.value and not same(b.value, value)]
        if changed and note:
            note_rebound(changed[0])
        elif note:
            self._settle()
        return bool(changed)

    def _settle(self) -> None:
        """Take the values bound now as those the key read (each equal to it and of its type)."""
        now = self._now()
        if any(map(operator.is_not, now, (b.value for b in self._bindings))):
            self._bindings = [b._replace(value=value) for b, value in zip(self._bindings, now)]
            self._lookups = self._index()

    def _index(self) -> tuple[tuple[Any, ...], ...]:
        n = sum(type(b.namespace) is dict for b in self._bindings)
        spaces, names, values = zip(*self._bindings) if self._bindings else ((), (), ())
        gets = tuple(b.namespace.get for b in self._bindings[n:])
        return spaces[:n], names[:n], values[:n], gets, names[n:], values[n:]

    def _now(self) -> tuple[Any, ...]:
        spaces, names, _, gets, other_names, _ = self._lookups
        return (*map(dict.get, spaces, names), *map(_read, gets, other_names))

    def written(self, name: str) -> KeyingError | None:
        """As :meth:`VersionWatch.written`, for tensors held in containers or read as globals."""
        if sum(map(_version, self._versioned)) == self._total:
            return None
        return KeyingError(
            f"{name}: its forward wrote in place a tensor it holds in a list, a dict or an object, or reads as a "
            "global; a cached call does not run forward, so hits would leave it as it was and later outputs would "
            f"differ from uncached ones. Keep such state outside the cached module. {_OVERLAP}"
        )


def _same(dicts: list[dict[Any, Any]], held: list[dict[Any, Any]], values: list[Any]) -> bool:
    """Whether ``dicts`` hold as many values as when collected, and those that held any (``held``) the same ones."""
    now = itertools.chain.from_iterable(map(dict.values, held))
    return sum(map(len, dicts)) == len(values) and all(map(operator.is_, now, values))


def _array_digest(array: np.ndarray[Any, Any]) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
