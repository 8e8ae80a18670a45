"""One persistent tier per module directory, disk settings and process, shared by the caches of that key.

Caches with the same key (two instances of one model, a deep copy, a re-created
function) then see each other's entries, pending writes included, and faults of the
tier reach each of them. A tier lives while a cache uses it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from .._fork import after_fork
from ..errors import ConfigError, StoreError
from ..faults import Fault, FaultLog, Report
from ..stores.batched import BatchedStore
from .local import meta_toucher, open_local_store, open_local_tier
from .persistent import PersistentTier

__all__ = ["SharedTier", "open_shared_tier"]


class SharedTier:
    """A persistent tier and the fault logs of the caches that use it."""

    def __init__(self) -> None:
        self.tier: PersistentTier | None = None
        self.users: weakref.WeakSet[FaultLog] = weakref.WeakSet()
        self.lock = threading.Lock()

    def report(self, kind: Fault, message: str) -> None:
        """Hand a fault of the tier to every cache that uses it."""
        for faults in list(self.users):
            faults.report(kind, message)


_tiers: weakref.WeakValueDictionary[str, SharedTier] = weakref.WeakValueDictionary()
_tiers_lock = threading.Lock()


def _new_locks_after_fork() -> None:
    global _tiers_lock
    _tiers_lock = threading.Lock()
    for shared in list(_tiers.values()):
        shared.lock = threading.Lock()


after_fork(_new_locks_after_fork)


def open_shared_tier(
    location: Path | str,
    name: str,
    max_bytes: int,
    quality: int,
    meta: dict[str, Any],
    faults: FaultLog,
    *,
    local: Path | None = None,
    storage_options: Mapping[str, Any] | None = None,
    local_bytes: int | None = None,
) -> tuple[SharedTier, PersistentTier | None]:
    """The shared tier of module key ``name`` under ``location`` with these settings, made at first use.

    Args:
        location: A cache root directory, or a Redis or object store URL.
        name: The module key (a directory under the root, a namespace on the server).
        max_bytes: The budget of the module's entries.
        quality: brotli quality of new entries.
        meta: What the metadata file records (local directories).
        faults: The fault log of the cache that asks.
        local: With a URL: the root of a local copy of its entries (``None``: none).
        storage_options: With a bucket URL: options for its filesystem (``None``: from the environment).
        local_bytes: The budget of the local copy (``None``: ``max_bytes``).

    Returns:
        The shared tier (keep a reference while using it) and its persistent tier, or ``None``
        when the location cannot be used (``faults`` was warned).
    """
    options = repr(sorted(storage_options.items())).encode() if storage_options is not None else b""
    digest = xxhash.xxh3_64_hexdigest(options)  # the options (credentials) stay out of the registry's keys
    key = f"{location}|{name}|{max_bytes}|{quality}|{local}|{local_bytes}|{digest}"
    with _tiers_lock:
        shared = _tiers.get(key)
        if shared is None:
            shared = _tiers[key] = SharedTier()
    shared.users.add(faults)
    with shared.lock:
        if shared.tier is None:
            try:
                if isinstance(location, str):
                    shared.tier = open_remote_tier(
                        location, name, max_bytes, quality, _reporter(shared), local, meta, storage_options, local_bytes
                    )
                else:
                    shared.tier = open_local_tier(location / name, max_bytes, quality, meta, _reporter(shared))
            except (StoreError, ConfigError) as exc:
                faults.warn(Fault.WRITE, f"{exc}; caching in memory only")
        return shared, shared.tier


def _reporter(shared: SharedTier) -> Report:
    """``shared.report`` without a reference to ``shared``: its tier must not keep it alive past its users."""
    ref = weakref.ref(shared)

    def report(kind: Fault, message: str) -> None:
        owner = ref()
        if owner is not None:
            owner.report(kind, message)

    return report


def open_remote_tier(
    url: str,
    namespace: str,
    max_bytes: int,
    quality: int,
    report: Report,
    local: Path | None = None,
    meta: dict[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    local_bytes: int | None = None,
) -> PersistentTier:
    """The persistent tier of a module on a Redis server or cluster, or in a bucket (nothing is sent yet).

    With ``local``, a packed store in a folder of ``local`` for this cache and URL
    (:func:`~torchcache.stores.remote.local_copy_dir`) keeps a copy of the entries read
    and written (:class:`~torchcache.tiers.layered.LayeredStore`); if it cannot be
    opened, ``report`` is told and the server is used alone.

    Raises:
        ConfigError: If the URL is invalid or the redis package is missing.
    """
    from ..stores.redis.url import redact_url
    from ..stores.remote import local_copy_dir, open_remote_store
    from .layered import LayeredStore

    where = f"{redact_url(url)} (namespace {namespace})"
    store: BatchedStore = open_remote_store(url, namespace, max_bytes, report, meta, storage_options)
    touch = None
    if local is not None:
        directory = local_copy_dir(local, namespace, url)
        try:
            budget = max_bytes if local_bytes is None else local_bytes
            near = open_local_store(directory, budget, {**(meta or {}), "copy_of": redact_url(url)}, report)
        except StoreError as exc:
            report(Fault.LOCAL, f"{exc}; no local copy, every hit is read from the server")
        else:
            store = LayeredStore(near, store, report)
            where = f"{where} with a local copy in {directory}"
            touch = meta_toucher(directory)
    return PersistentTier(store, quality, report, where=where, touch=touch)
