"""The cache of one decorated module instance or function: lookup, compute misses, merge.

One call hashes every item of the batch, looks the keys up in the memory tier, then
the disk tier, runs the wrapped callable on the items found nowhere (only those), and
returns outputs in input order. Hits come back as new tensors with the dtype and device
a real call would give. Faults of the cache become one :class:`CacheWarning` per kind
and a recompute; they never break the call.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._fork import renew_lock_after_fork
from .._log import logger
from .._version import __version__
from ..canonical import INFERENCE_MODE_READ, collecting
from ..catalog.budget import CacheClaim, claim_module_cache, keep_root_budget
from ..config import Settings
from ..errors import ConfigError, StoreError
from ..faults import Fault, FaultLog
from ..keys import FORMAT_VERSION, Context, hash_items, numerics
from ..locations import is_object_url, resolve_local_dir, resolve_location
from ..output_types import RebuildError
from ..stats import CacheStats, PeriodicSummary, TierStats, format_summary
from ..tiers.batch import cast_returned, gather_hits, gather_rows, index_tensor, merge_parts
from ..tiers.lookup import look_up
from ..tiers.memory import MemoryLevel, MemoryTier
from ..tiers.persistent import DiskLevel, PersistentTier
from ..tiers.shared import SharedTier, open_shared_tier
from ..tree import Layout, Spec, flatten
from .arguments import CallSplitter, ShapeHint, UncachedInput, list_hint
from .call import CallArguments
from .exit import track
from .independence import ItemCheck
from .outputs import GradOutputError, OutputPlan, UnbatchedOutputError
from .rebinding import note_alike
from .traceless import traceless
from .versions import HeldValues, VersionWatch

__all__ = ["Cache"]

SHAPE_HINT_CALLS = 64  #: calls after which a low hit rate with varying input shapes is pointed out
_AUTOCAST_DEVICES = ("cpu", "cuda")
_FIXED_KEY = (
    "%s uses persistent_module_hash=%r: changes to its code, init arguments or weights will not invalidate its cache"
)


class _KeyRetakeError(Exception):
    """Taking the module key again failed; the call runs without the cache."""


class Cache:
    """The cache behind a decorated module instance or function (``.cache_instance``).

    Args:
        settings: Validated settings.
        name: Qualified name of the class or function (for metadata and logs).
        kind: ``"module"`` or ``"function"``.
        signature: Gives the signature calls are bound to (without ``self``), taken again with the key.
        fingerprint: Computes the module key at the first call (or :attr:`module_hash`), if no persistent_module_hash.
    """

    def __init__(
        self,
        settings: Settings,
        name: str,
        kind: str,
        signature: Callable[[], inspect.Signature],
        fingerprint: Callable[[], str],
    ) -> None:
        self.settings = settings
        self.name = name
        self.kind = kind
        self._splitter = CallSplitter(signature, settings.shared_args, settings.batch_dims)
        self._fingerprint = fingerprint
        self._rebind: Callable[[Any], Cache] | None = None
        self._watch: VersionWatch | None = None
        self._held: HeldValues | None = None  # tensors and arrays the key covers beyond the module's own
        self._owner: weakref.ref[Any] | None = None
        self._module_hash: str | None = settings.fixed_key()
        self._changes = self._keyed = self._alike = 0  # changes seen, those the key reflects; retakes alike in a row
        self._grad_refused: dict[bytes, str] = {}  # call contexts whose outputs required grad, and why refused
        if self._module_hash is not None:
            logger.warning(_FIXED_KEY, name, self._module_hash)
        self.memory = MemoryTier(settings.max_memory_cache_size, settings.memory_cache_device)
        self._disk: PersistentTier | None = None
        self._root_claim: CacheClaim | None = None  # this process's hold on its directory (root budget)
        self._shared: SharedTier | None = None
        self._disk_ready = not settings.persistent
        self.faults = FaultLog(name)
        self._items = ItemCheck(name, settings.check_items, self.faults)
        self._lock = threading.RLock()
        self._shape_hint = ShapeHint(SHAPE_HINT_CALLS)
        self._outputs = OutputPlan(name, settings.batch_dims)
        #: Whether the cached module holds dropout or batch-norm layers (``None``: not known yet).
        self.stochastic: bool | None = None
        self._hits = self._misses = self._memory_hits = 0
        #: The devices of a call's output leaves, by its context and input device (f(x, "cuda"), a leaf on the CPU).
        self._devices: dict[tuple[bytes, torch.device], tuple[torch.device, ...]] = {}
        self._summaries = PeriodicSummary()
        track(self)  # flushed and summarized at exit
        renew_lock_after_fork(self, "_lock")

    def bind_owner(self, owner: Any, rebind: Callable[[Any], Cache]) -> None:
        """Remember the object this cache belongs to and how to make one for a copy of it."""
        self._owner = weakref.ref(owner)
        self._rebind = rebind

    def belongs_to(self, owner: Any) -> bool:
        """Whether this cache was made for ``owner`` (a shallow copy of a module shares its original's)."""
        return self._owner is not None and self._owner() is owner

    def watch_weights(self, module: torch.nn.Module, root_hooks: bool = False) -> None:
        """Take the key again at the first call after ``module``'s weights or hooks (``root_hooks``: its own) change."""
        if self.settings.persistent_module_hash is None:
            self._watch = VersionWatch(module, self.settings.verify_weights, root_hooks, self.settings.key_ignore)

    def __deepcopy__(self, memo: dict[int, Any]) -> Cache:
        """A new cache for the copy of the owner (same settings, its own memory tier).

        A copy whose weights are equal has the same module key, so it shares the disk
        directory (and, in this process, the disk tier) with the original; its memory
        tier and counters are its own.
        """
        owner = self._owner() if self._owner is not None else None
        if self._rebind is None or owner is None:
            raise TypeError(f"cannot copy the cache of {self.name} on its own; copy the module or function owning it")
        return self._rebind(memo.get(id(owner), owner))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled modules carry no cache: a new one is made at their first call."""
        return (_no_cache, ())

    def __repr__(self) -> str:
        return f"<torchcache.Cache of {self.name} memory={self.memory!r} disk={self._disk!r}>"

    # -- identity ---------------------------------------------------------------------
    @property
    def module_hash(self) -> str:
        """The module key (32 hex digits, or ``persistent_module_hash``).

        Fixed at the first call, and taken again at the next call after
        ``load_state_dict()`` or ``.to()``. Reading it in between gives the key the
        current weights would give, without fixing it.
        """
        if self._module_hash is not None and self._changes == self._keyed:
            return self._module_hash
        return self._fingerprint()

    def _freeze_key(self) -> str:
        for _ in range(3):  # a change seen during a re-key: taken again (writes from another thread may not stop)
            if self._changes != self._keyed:
                self._rekey()
        if self._module_hash is None:
            self.take_key()
        assert self._module_hash is not None
        return self._module_hash

    def take_key(self, early: bool = False) -> None:
        """Take the key now rather than at the first call (unless ``persistent_module_hash`` gives it).

        ``early`` (at decoration): a check only, and the key is taken again at the first call (a
        script binds the globals a function reads, ``model = load()``, after decorating it).

        Raises:
            KeyingError: If what the key covers cannot be encoded.
        """
        with self._lock:  # threads making the first calls at once fingerprint once
            if self._module_hash is None:
                if self._watch is not None:
                    self._watch.reset()  # before hashing: a write during it is seen at the next call
                key = self._take_key(frozen=not early)  # early: what is trained may be frozen before the call
                self._module_hash = None if early else key
                if not early:
                    logger.info("%s has module key %s", self.name, key)

    def _take_key(self, frozen: bool = True) -> str:
        """Fingerprint, and watch the tensors and arrays the key read by content for in-place writes."""
        with collecting() as found:
            key = self._fingerprint()
        self._splitter = self._splitter.renewed(any(v is INFERENCE_MODE_READ for v in found))  # defaults anew
        owner = self._watch.module() if self._watch is not None else None
        held = HeldValues(found, owner) if self.settings.persistent_module_hash is None else None
        self._held = (held.frozen(self.name) if frozen else held) if held else None
        return key

    def weights_changed(self) -> None:
        """Take the module key again at the next call (the weights may have changed).

        The decorator calls this after ``load_state_dict()`` and after conversions such as
        ``.to()``, ``.half()`` and ``.cuda()``. A key that comes out the same (a move to
        another device) keeps every entry; a new key starts from an empty memory tier and
        the disk directory of the new key.
        """
        if self.settings.persistent_module_hash is None and self._module_hash is not None:
            self._changes, self._alike = self._changes + 1, 0  # asked for: not a key retaken alike unasked

    def _rekey(self) -> None:
        with self._lock:
            seen = self._changes
            if seen == self._keyed:  # another thread took it while this one waited
                return
            try:
                if self._watch is not None:
                    self._watch.reset()  # before hashing: a write during it is seen at the next call
                key = self._take_key()
            except Exception as exc:
                raise _KeyRetakeError(f"{type(exc).__name__}: {exc}") from exc
            self._alike = note_alike(self.name, self._alike) if key == self._module_hash else 0
            if key != self._module_hash:  # switched whole before the key counts as fresh
                logger.info("%s changed its weights; new module key %s", self.name, key)
                if self._disk is not None:
                    self._disk.flush()
                self._module_hash = key
                self._items.reset()
                self._disk, self._shared = None, None
                self._disk_ready = not self.settings.persistent
                self._devices.clear()
                with self.memory.lock:
                    self.memory.clear()
            self._keyed = seen

    @property
    def cache_dir(self) -> Path | None:
        """Directory of this module's entries, or ``None`` when not persistent, on a server, or in memory only."""
        try:
            location = resolve_location(self.settings.persistent_cache_dir) if self.settings.persistent else ""
        except ConfigError:  # a bad $TORCHCACHE_DIR: the calls warned once and stay in memory
            return None
        fallen = self._disk is None and self._disk_ready  # the directory could not be used
        return None if isinstance(location, str) or fallen else location / self.module_hash

    def _disk_tier(self) -> PersistentTier | None:
        if not self._disk_ready:
            with self._lock:
                if not self._disk_ready:
                    self._open_disk_tier()
        return self._disk

    def _open_disk_tier(self) -> None:
        """Create the disk tier (call with ``_lock`` held); on failure, warn and stay in memory."""
        key = self._freeze_key()
        try:
            location = resolve_location(self.settings.persistent_cache_dir)
            default = is_object_url(location)
            local = resolve_local_dir(self.settings.local_cache_dir, default) if isinstance(location, str) else None
        except ConfigError as exc:  # $TORCHCACHE_DIR holds a bad URL
            self.faults.warn(Fault.WRITE, f"{exc}; caching in memory only")
            self._disk_ready = True
            return
        self._root_claim = claim_module_cache(location, key, self.faults.warn, local)  # the root's budget
        meta = {
            "torchcache_version": __version__,
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "kind": self.kind,
            "module_key": self._module_hash,
            "settings": {k: str(v) for k, v in self.settings.key_settings().items()},
        }
        settings = self.settings
        self._shared, self._disk = open_shared_tier(  # kept while this cache uses it: caches of this key share it
            location,
            key,
            settings.max_persistent_cache_size,
            settings.brotli_quality,
            meta,
            self.faults,
            local=local,
            storage_options=settings.storage_options,
            local_bytes=settings.max_local_cache_size,
        )
        self._disk_ready = True

    # -- public API -------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Hits and misses (batch items, every tier together) and each tier's size."""
        disk = self._disk
        return CacheStats(
            hits=self._hits,
            misses=self._misses,
            hit_rate=self._hits / max(1, self._hits + self._misses),
            memory=TierStats(len(self.memory), self.memory.nbytes, self.memory.max_bytes, self._memory_hits),
            disk=None
            if not self.settings.persistent or (disk is None and self._disk_ready)  # fell back to memory
            else TierStats(
                len(disk.store) if disk else 0,
                disk.store.nbytes if disk else 0,
                self.settings.max_persistent_cache_size,
                self._hits - self._memory_hits,  # this cache's: the tier is shared by every cache of its key
            ),
        )

    def summary(self) -> str:
        """A one-line summary: hits, misses, hit rate, and each tier against its budget."""
        return format_summary(self.name, self._module_hash, self.stats())

    def flush(self) -> None:
        """Wait until every pending write is on disk."""
        if self._disk is not None:
            self._disk.flush()
            self._disk.touch()
            if self._root_claim is not None:  # the cache grew: keep the root under its budget
                keep_root_budget(self._root_claim.directory.parent, self.faults.warn)
        self.faults.emit()

    def clear(self) -> None:
        """Remove this module's entries from memory and disk, zero :meth:`stats`; the next call takes the key again."""
        self.weights_changed()  # what it did not see (a global rebound) is in the new key, not under the old
        with self._lock:
            with self.memory.lock:  # calls on other threads find and put under it
                self._hits = self._misses = self._memory_hits = 0
                self.memory.clear()
            self._grad_refused.clear()  # what made outputs require grad may be gone
            disk = self._disk_tier() if self.settings.persistent else None
            try:
                disk.clear() if disk is not None else None
            except StoreError as exc:
                self.faults.warn(Fault.WRITE, f"could not clear the disk cache: {exc}")
        self.faults.emit()

    # -- the call ---------------------------------------------------------------------
    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], training: bool | None = None
    ) -> Any:
        """Call ``fn(*args, **kwargs)`` through the cache (called back with per-item tensors replaced by rows)."""
        watch, held = self._watch, self._held
        if self._module_hash is not None and (
            (watch is not None and watch.changed()) or (held is not None and held.changed())
        ):
            self._changes += 1  # weights written in place (EMA, an optimizer step, batch norm): a new key
        try:
            call, context = self._split(args, kwargs, training)
        except UncachedInput as exc:
            self.faults.warn(Fault.UNCACHED, f"{exc}; such calls run without the cache")
            return fn(*args, **kwargs)
        except _KeyRetakeError as exc:  # weights swapped in for this call (functional_call) that need grad
            self.faults.warn(
                Fault.REKEY,
                f"the module changed since its key was taken, and its key cannot be taken again ({exc}); calls "
                "run without the cache until it can",
            )
            return fn(*args, **kwargs)
        if call.training in self._items.uncached:  # items that depend on each other in this mode
            return fn(*args, **kwargs)
        tensors = call.tensors
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *call.shared)):
            self.faults.warn(Fault.GRAD, "an input requires grad: calls with such inputs are not cached")
            return fn(*args, **kwargs)
        if context in self._grad_refused and torch.is_grad_enabled():
            raise GradOutputError(self._grad_refused[context])
        self.faults.emit()
        self._summaries.tick(self.summary)
        keys = hash_items(context, tensors, self.settings.subsample_count)
        batch = len(keys)
        if batch == 0:
            return fn(*args, **kwargs)
        if not self.faults.warned(Fault.SHAPES):
            hint = self._shape_hint.note(tensors, self._hits, self._misses)
            if hint is not None:
                self.faults.warn(Fault.SHAPES, hint)
        if call.lists_like_the_batch and not self.faults.warned(Fault.LISTS):
            self.faults.warn(Fault.LISTS, list_hint(call.lists_like_the_batch[0]))
        device = self._devices.get((call.context, tensors[0].device), (tensors[0].device,))
        with self.memory.lock:
            found = self.memory.find(keys)
            if found.count(None) == batch:  # no memory hit (or no memory tier): straight to the disk
                found = []
            first = found[0] if found else None
            slab = first[0] if first is not None else None
            hit_rows = [f[1] for f in found if f is not None and f[0] is slab]
            whole: list[torch.Tensor] | None = None
            if len(hit_rows) == batch and slab is not None:  # every item, from one slab
                rows = index_tensor(hit_rows, slab.device)
                whole = cast_returned([gather_rows(t, rows) for t in slab.leaves], slab.layout, device)
                layout: Layout | None = slab.layout
            else:
                layout, parts = gather_hits(found)
        if whole is not None:  # copies of the rows: built outside the lock
            assert layout is not None
            try:
                output = self._outputs.rebuild(layout, whole)
            except RebuildError as exc:
                return self._recompute(fn, args, kwargs, batch, exc.with_traceback(None))
            self._count(hits=batch, memory_hits=batch)
            if self._check_due(call) and not self._verify_items(fn, call, layout, whole, keys):
                return fn(*args, **kwargs)
            return output
        return self._call_mixed(fn, call, keys, layout, parts, device)

    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool | None
    ) -> tuple[CallArguments, bytes]:
        """Split a call into its per-item tensors and the digest of everything else."""
        context = Context(self._freeze_key())
        call = self._splitter.split(args, kwargs, context)
        call.keyed = self._changes
        call.training = training
        if training is not None:
            context.add(b"training" if training else b"eval")
            # Submodules switched to another mode on their own: their flags, when they differ.
            pattern = self._watch.training_pattern(training) if self._watch is not None else b""
            if pattern:
                context.add(b"submodules:" + pattern)
                call.training = training or 1 in pattern  # dropout on in an eval model (MC dropout): training
        # Settings that change the values of outputs (autocast, precisions): none added at torch's defaults.
        for line in numerics((*_AUTOCAST_DEVICES, call.tensors[0].device.type)):
            context.add(line)
        call.context = context.digest()
        return call, call.context

    def _call_mixed(
        self,
        fn: Callable[..., Any],
        call: CallArguments,
        keys: list[bytes],
        layout: Layout | None,
        parts: list[tuple[list[int], list[torch.Tensor]]],
        device: tuple[torch.device, ...],
    ) -> Any:
        """Fill the memory misses from disk, compute the rest, merge in input order."""
        batch = len(keys)
        memory_hits = sum(len(p) for p, _ in parts)
        if parts:
            covered = {pos for positions, _ in parts for pos in positions}
            missing = [pos for pos in range(batch) if pos not in covered]
        else:
            missing = list(range(batch))
        disk = self._disk_tier() if self.settings.persistent else None
        if disk is not None and missing:
            levels = (MemoryLevel(self.memory), DiskLevel(disk, layout, self.faults))
            found = look_up(levels, keys, pending=missing, searched=1)
            for part in found.parts:
                layout = part.values[0]
                parts.append((part.positions, part.values[1]))
            missing = found.missing

        fresh = True  # False: the forward wrote state, its rows are returned and not stored
        if missing:
            whole = len(missing) == batch or self.settings.exact_batches  # exact_batches: computed as uncached
            if whole:
                computed = call.compute(fn)
                unchanged = lambda: hash_items(call.context, call.tensors, self.settings.subsample_count) == keys  # noqa: E731
                call.refuse_written(self.name, unchanged)  # a hit does not run forward: the input would stay as it was
            else:
                computed = call.compute_rows(fn, missing, self.name)
            watches = (self._watch, self._held)  # and no change seen since the key was taken (another thread's re-key)
            fresh = self._items.state_kept(self.name, watches, call.training) and call.keyed == self._changes
            if not fresh and whole:
                self._count(misses=batch)
                return computed
            spec, leaves = flatten(computed)
            leaves = self._outputs.to_items(spec, leaves)
            self._check_items(leaves, batch if whole else len(missing), call.batch, spec, call.context)
            new_layout = Layout.of(spec, leaves, self.settings.cache_dtype)
            if layout is not None and not new_layout.same_rows(layout):  # a memory format of its own is fine
                self.faults.warn(
                    Fault.LAYOUT, "cached outputs do not match the shapes just computed; computing the whole batch"
                )
                self._count(misses=batch)
                return computed if whole else fn(*call.args, **call.kwargs)
            layout = new_layout
            if leaves:  # the devices of at most 4096 contexts kept
                self._devices = self._devices if len(self._devices) < 4096 else {}
                self._devices[(call.context, call.tensors[0].device)] = tuple(t.device for t in leaves)
            if whole:
                due = self._check_due(call, computed=batch)
                if due and not self._verify_items(fn, call, layout, leaves, keys, cached=False):
                    return computed
                if leaves and len(missing) < batch:  # store the misses' rows only
                    rows = index_tensor(missing, leaves[0].device)
                    leaves = [leaf.index_select(0, rows) for leaf in leaves]
                self._store(keys, missing, layout, leaves)
                self._count(misses=batch)
                return computed
            if fresh:
                self._store(keys, missing, layout, leaves)
            parts.append((missing, leaves))
        assert layout is not None
        merged = merge_parts(parts, batch, layout, device)
        if fresh and self._check_due(call, len(missing)) and not self._verify_items(fn, call, layout, merged, keys):
            return fn(*call.args, **call.kwargs)
        try:
            output = self._outputs.rebuild(layout, merged)
        except RebuildError as exc:
            return self._recompute(fn, call.args, call.kwargs, batch, exc)
        self._count(hits=batch - len(missing), misses=len(missing), memory_hits=memory_hits)
        return output

    def _recompute(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], batch: int, error: RebuildError
    ) -> Any:
        """Compute a whole batch whose cached outputs name a class this process cannot rebuild."""
        self.faults.warn(Fault.REBUILD, f"{error}; computing the batch instead (its entries are kept for when it can)")
        self._count(misses=batch)
        return fn(*args, **kwargs)

    def _check_items(self, leaves: list[torch.Tensor], computed: int, batch: int, spec: Spec, context: bytes) -> None:
        """Refuse leaves that are not per item, or that require grad (then the context's later calls in grad mode).

        A leaf whose first dimension equals the batch only by chance (an LSTM's ``h_n`` with
        ``num_layers == batch``) was stored per item in earlier calls: those entries are removed.
        """
        try:
            self._outputs.check(leaves, computed, batch, spec)
        except GradOutputError as exc:
            self._grad_refused[context] = str(exc)  # hits too: they would carry no gradient
            raise
        except UnbatchedOutputError as exc:
            if len(self.memory) > 0 or (self._disk is not None and len(self._disk.store) > 0):
                self.clear()
                raise UnbatchedOutputError(f"{exc} Entries cached so far may hold such outputs: removed.") from None
            raise

    def _check_due(self, call: CallArguments, computed: int = 0) -> bool:
        """Whether the call's items are to be checked (one item: only when computed, to see randomness)."""
        found = self._items.passed.get(call.context)  # read once: another thread's re-key may clear it
        if found is not None:  # and checked again: in a larger batch, or after SPOT_ITEMS computed
            return (computed > 0 or call.batch > found[0]) and self._items.again(call.context, call.batch, computed)
        return self._items.enabled and (call.batch > 1 or (computed > 0 and call.context not in self._items.alone))

    def _verify_items(
        self, fn: Any, call: CallArguments, layout: Layout, rows: list[Any], keys: list[bytes], cached: bool = True
    ) -> bool:
        """:meth:`ItemCheck.verify` for this call (``False``: compute it afresh, uncached; ``cached``: rows from it)."""
        kept = traceless(self._watch.module() if self._watch is not None else None, fn)
        watches = [w for w in (self._watch, self._held) if w is not None]
        moved = lambda: self._changes != call.keyed or any(w.changed() for w in watches)  # noqa: E731
        return self._items.verify(fn, call, self._outputs, layout, rows, keys, kept, self.clear, moved, cached)

    def _count(self, hits: int = 0, misses: int = 0, memory_hits: int = 0) -> None:
        with self.memory.lock:  # also held by the all-hits path, so counts from threads add up
            self._hits += hits
            self._misses += misses
            self._memory_hits += memory_hits

    def _store(self, keys: list[bytes], positions: list[int], layout: Layout, leaves: list[torch.Tensor]) -> None:
        item_keys = [keys[p] for p in positions]
        disk = self._disk
        stored = None
        if disk is not None:
            stored = [
                leaf.detach().to(device="cpu", dtype=spec.dtype, copy=True).contiguous()
                for leaf, spec in zip(leaves, layout.leaves)
            ]
            disk.write([k.hex() for k in item_keys], layout, stored)
        cpu_memory = self.memory.device is not None and self.memory.device.type == "cpu"
        with self.memory.lock:
            self.memory.put(
                item_keys, layout, stored if stored is not None and cpu_memory else [t.detach() for t in leaves]
            )


def _no_cache() -> None:
    """What an unpickled cache becomes: nothing (the owner makes a new one when called)."""
    return None
