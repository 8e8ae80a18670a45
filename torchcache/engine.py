"""The cache of one decorated module instance or function: lookup, compute misses, merge.

One call hashes every item of the batch, looks the keys up in the memory tier, then
the disk tier, runs the wrapped callable on the items found nowhere (only those), and
returns outputs in input order. Hits come back as new tensors with the dtype and device
a real call would give. Faults of the cache become one :class:`CacheWarning` per kind
and a recompute; they never break the call.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._fork import renew_lock_after_fork
from ._log import logger
from ._version import __version__
from .batch import cast_returned, gather_hits, index_tensor, merge_parts, select_items
from .config import Settings, resolve_root
from .errors import CacheWarning, KeyingError, StoreError
from .keys import FORMAT_VERSION, Context, encode_value, hash_items
from .persist import DiskTier
from .policy import format_size
from .stats import CacheStats, TierStats
from .stores.memory import MemoryTier
from .tree import Layout, flatten, unflatten

__all__ = ["Cache"]

_TENSOR = b"\x00T"
#: Seconds between the INFO-level summaries a cache logs while it is being called.
SUMMARY_INTERVAL = 60.0
_caches: weakref.WeakSet[Cache] = weakref.WeakSet()


class Cache:
    """The cache behind a decorated module instance or function (``.cache_instance``).

    Args:
        settings: Validated settings.
        name: Qualified name of the class or function (for metadata and logs).
        kind: ``"module"`` or ``"function"``.
        signature: The signature calls are bound to (without ``self``).
        fingerprint: Computes the module key; called once, at the first call (or the first
            access of :attr:`module_hash`), unless ``persistent_module_hash`` is set.
    """

    def __init__(
        self,
        settings: Settings,
        name: str,
        kind: str,
        signature: inspect.Signature,
        fingerprint: Callable[[], str],
    ) -> None:
        self.settings = settings
        self.name = name
        self.kind = kind
        self._signature = signature
        self._var_kinds = {
            p.name: p.kind
            for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        }
        self._fingerprint = fingerprint
        self._module_hash: str | None = settings.persistent_module_hash
        self._stale = False
        if self._module_hash is not None:
            logger.warning(
                "torchcache: %s uses persistent_module_hash=%r: changes to its code, init arguments "
                "or weights will not invalidate its cache",
                name,
                self._module_hash,
            )
        self.memory = MemoryTier(settings.max_memory_cache_size, settings.memory_cache_device)
        self._disk: DiskTier | None = None
        self._disk_ready = not settings.persistent
        self._warned: set[str] = set()
        self._pending_faults: list[tuple[str, str]] = []
        self._lock = threading.RLock()
        self._hits = 0
        self._misses = 0
        self._memory_hits = 0
        self._devices: dict[torch.device, torch.device] = {}  # input device -> output device
        self._last_summary = time.monotonic()
        _caches.add(self)
        renew_lock_after_fork(self, "_lock")

    def __repr__(self) -> str:
        return f"<torchcache.Cache of {self.name} memory={self.memory!r} disk={self._disk!r}>"

    # -- identity ---------------------------------------------------------------------
    @property
    def module_hash(self) -> str:
        """The module key (32 hex digits, or ``persistent_module_hash``).

        Fixed at the first call. Before it, reading this gives the key the current
        weights would give, without fixing it.
        """
        if self._module_hash is not None:
            return self._module_hash
        return self._fingerprint()

    def _freeze_key(self) -> str:
        if self._stale:
            self._rekey()
        if self._module_hash is None:
            with self._lock:  # threads making the first calls at once fingerprint once
                if self._module_hash is None:
                    self._module_hash = self._fingerprint()
                    logger.info("torchcache: %s has module key %s", self.name, self._module_hash)
        return self._module_hash

    def weights_changed(self) -> None:
        """Take the module key again at the next call (the weights may have changed).

        The decorator calls this after ``load_state_dict()`` and after conversions such as
        ``.to()``, ``.half()`` and ``.cuda()``. A key that comes out the same (a move to
        another device) keeps every entry; a new key starts from an empty memory tier and
        the disk directory of the new key.
        """
        if self.settings.persistent_module_hash is None and self._module_hash is not None:
            self._stale = True

    def _rekey(self) -> None:
        with self._lock:
            self._stale = False
            key = self._fingerprint()
            if key == self._module_hash:
                return
            logger.info("torchcache: %s changed its weights; new module key %s", self.name, key)
            if self._disk is not None:
                self._disk.flush()
            self._module_hash = key
            self._disk = None
            self._disk_ready = not self.settings.persistent
            self._devices.clear()
            with self.memory.lock:
                self.memory.clear()

    @property
    def cache_dir(self) -> Path | None:
        """Directory of this module's entries, or ``None`` when not persistent."""
        if not self.settings.persistent:
            return None
        return resolve_root(self.settings.persistent_cache_dir) / self.module_hash

    def _disk_tier(self) -> DiskTier | None:
        if not self._disk_ready:
            with self._lock:
                if not self._disk_ready:
                    self._open_disk_tier()
        return self._disk

    def _open_disk_tier(self) -> None:
        """Create the disk tier (call with ``_lock`` held); on failure, warn and stay in memory."""
        directory = resolve_root(self.settings.persistent_cache_dir) / self._freeze_key()
        meta = {
            "torchcache_version": __version__,
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "kind": self.kind,
            "module_key": self._module_hash,
            "settings": {k: str(v) for k, v in self.settings.key_settings().items()},
        }
        try:
            self._disk = DiskTier(
                directory, self.settings.max_persistent_cache_size, self.settings.brotli_quality, meta, self._report
            )
        except StoreError as exc:
            self._warn("write", f"{exc}; caching in memory only")
        self._disk_ready = True

    # -- faults -----------------------------------------------------------------------
    def _report(self, kind: str, message: str) -> None:
        """Record a fault from any thread; it is warned about on the caller's thread."""
        with self._lock:
            self._pending_faults.append((kind, message))

    def _warn(self, kind: str, message: str) -> None:
        text = f"torchcache ({self.name}): {message}"
        if kind in self._warned:
            logger.debug(text)
            return
        self._warned.add(kind)
        logger.warning(text)
        warnings.warn(text, CacheWarning, stacklevel=4)

    def _emit_faults(self) -> None:
        if self._pending_faults:
            with self._lock:
                faults, self._pending_faults = self._pending_faults, []
            for kind, message in faults:
                self._warn(kind, message)

    # -- public API -------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Hits and misses (batch items, every tier together) and each tier's size."""
        disk = self._disk
        total = self._hits + self._misses
        return CacheStats(
            hits=self._hits,
            misses=self._misses,
            hit_rate=self._hits / total if total else 0.0,
            memory=TierStats(len(self.memory), self.memory.nbytes, self.memory.max_bytes, self._memory_hits),
            disk=None
            if not self.settings.persistent
            else TierStats(
                len(disk.store) if disk else 0,
                disk.store.nbytes if disk else 0,
                self.settings.max_persistent_cache_size,
                disk.hits if disk else 0,
            ),
        )

    def summary(self) -> str:
        """A one-line summary: hits, misses, hit rate, and each tier against its budget."""
        s = self.stats()
        tiers = [f"memory {s.memory.entries} entries {format_size(s.memory.bytes)}/{format_size(s.memory.max_bytes)}"]
        if s.disk is not None:
            tiers.append(f"disk {s.disk.entries} entries {format_size(s.disk.bytes)}/{format_size(s.disk.max_bytes)}")
        return (
            f"torchcache {self.name} [{self._module_hash or '-'}]: {s.hits} hits, {s.misses} misses, "
            f"hit rate {s.hit_rate:.1%}; {'; '.join(tiers)}"
        )

    def _maybe_summarize(self) -> None:
        now = time.monotonic()
        if now - self._last_summary >= SUMMARY_INTERVAL:
            self._last_summary = now
            if logger.isEnabledFor(logging.INFO):
                logger.info(self.summary())

    def flush(self) -> None:
        """Wait until every pending write is on disk."""
        if self._disk is not None:
            self._disk.flush()
            self._disk.touch()
        self._emit_faults()

    def clear(self) -> None:
        """Remove this module's entries from memory and from disk."""
        with self._lock:
            self.memory.clear()
            disk = self._disk_tier() if self.settings.persistent else None
            if disk is not None:
                try:
                    disk.clear()
                except StoreError as exc:
                    self._warn("write", f"could not clear the disk cache: {exc}")
        self._emit_faults()

    # -- the call ---------------------------------------------------------------------
    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], training: bool | None = None
    ) -> Any:
        """Call ``fn(*args, **kwargs)`` through the cache."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tensors, context = self._split(bound.arguments, training)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            self._warn("grad", "an input requires grad: calls with such inputs are not cached")
            return fn(*args, **kwargs)
        self._emit_faults()
        self._maybe_summarize()
        keys = hash_items(context, tensors, self.settings.subsample_count)
        batch = len(keys)
        if batch == 0:
            return fn(*args, **kwargs)
        device = self._devices.get(tensors[0].device, tensors[0].device)
        with self.memory.lock:
            found = self.memory.find(keys)
            first = found[0]
            slab = first[0] if first is not None else None
            hit_rows = [f[1] for f in found if f is not None and f[0] is slab]
            if len(hit_rows) == batch and slab is not None:  # every item, from one slab
                rows = index_tensor(hit_rows, slab.device)
                leaves = [t.index_select(0, rows) for t in slab.leaves]
                self._count(hits=batch, memory_hits=batch)
                return unflatten(slab.layout.spec, cast_returned(leaves, slab.layout, device))
            layout, parts = gather_hits(found)
        return self._call_mixed(fn, bound, keys, layout, parts, tensors, device)

    def _split(self, arguments: dict[str, Any], training: bool | None) -> tuple[list[torch.Tensor], bytes]:
        context = Context(self._freeze_key())
        tensors: list[torch.Tensor] = []
        batch = -1
        for name, value in arguments.items():
            kind = self._var_kinds.get(name)
            if kind is inspect.Parameter.VAR_POSITIONAL:
                items = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                items = [(key, value[key]) for key in sorted(value)]
            else:
                items = [(name, value)]
            for label, item in items:
                context.add(label.encode())
                if isinstance(item, torch.Tensor):
                    if item.dim() == 0:
                        raise ValueError(
                            f"argument {label!r}: expected a tensor shaped (batch, ...), got a 0-d tensor; "
                            "add a batch dimension (x.unsqueeze(0)) or pass a Python number"
                        )
                    if batch < 0:
                        batch = item.shape[0]
                    elif item.shape[0] != batch:
                        raise ValueError(
                            f"argument {label!r}: batch size {item.shape[0]} does not match the batch size "
                            f"{batch} of the tensor arguments before it; every tensor argument must be "
                            "shaped (batch, ...) with the same batch"
                        )
                    context.add(_TENSOR + str(item.dtype).encode() + repr(tuple(item.shape[1:])).encode())
                    tensors.append(item)
                else:
                    context.add(encode_value(item, f"argument {label!r}"))
        if not tensors:
            raise KeyingError("torchcache needs at least one tensor argument shaped (batch, ...) to key items by")
        if training is not None:
            context.add(b"training" if training else b"eval")
        return tensors, context.digest()

    def _call_mixed(
        self,
        fn: Callable[..., Any],
        bound: inspect.BoundArguments,
        keys: list[bytes],
        layout: Layout | None,
        parts: list[tuple[list[int], list[torch.Tensor]]],
        tensors: list[torch.Tensor],
        device: torch.device,
    ) -> Any:
        """Fill the memory misses from disk, compute the rest, merge in input order."""
        batch = len(keys)
        memory_hits = sum(len(p) for p, _ in parts)
        covered = {pos for positions, _ in parts for pos in positions}
        missing = [pos for pos in range(batch) if pos not in covered]

        disk = self._disk_tier() if self.settings.persistent else None
        if disk is not None and missing:
            hex_keys = [keys[pos].hex() for pos in missing]
            found_at, disk_layout, disk_leaves = disk.read(hex_keys)
            if found_at and (layout is None or disk_layout == layout):
                layout = disk_layout
                positions = [missing[i] for i in found_at]
                parts.append((positions, disk_leaves))
                with self.memory.lock:
                    self.memory.put([keys[p] for p in positions], disk_layout, disk_leaves)  # type: ignore[arg-type]
                taken = set(positions)
                missing = [pos for pos in missing if pos not in taken]
            self._emit_faults()

        computed: Any = None
        if missing:
            sub = bound if len(missing) == batch else select_items(bound, self._var_kinds, missing)
            computed = fn(*sub.args, **sub.kwargs)
            spec, leaves = flatten(computed)
            for leaf in leaves:
                if leaf.dim() == 0 or leaf.shape[0] != len(missing):
                    raise ValueError(
                        f"{self.name} returned a tensor shaped {tuple(leaf.shape)} for {len(missing)} items: "
                        "torchcache caches outputs per item, so every output tensor must be shaped (batch, ...)"
                    )
            new_layout = Layout.of(spec, leaves, self.settings.cache_dtype)
            if layout is not None and new_layout != layout:
                self._warn("layout", "cached outputs do not match the shapes just computed; computing the whole batch")
                self._count(misses=batch)
                return fn(*bound.args, **bound.kwargs)
            layout = new_layout
            if leaves:
                self._devices[tensors[0].device] = leaves[0].device
            self._store(keys, missing, layout, leaves)
            if len(missing) == batch:
                self._count(misses=batch)
                return computed
            parts.append((missing, leaves))
        self._count(hits=batch - len(missing), misses=len(missing), memory_hits=memory_hits)
        assert layout is not None
        return unflatten(layout.spec, merge_parts(parts, batch, layout, device))

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


def _summarize_at_exit() -> None:
    """Flush every cache and log its summary at INFO level (interpreter exit)."""
    for cache in list(_caches):
        if cache._hits or cache._misses:
            cache.flush()
            if logger.isEnabledFor(logging.INFO):
                logger.info(cache.summary())


atexit.register(_summarize_at_exit)
