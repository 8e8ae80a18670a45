"""Dataset samples cached in a RAM tier over a disk tier, shared by every process of a job.

Both tiers are packed stores (:class:`~torchcache.stores.packed.store.PackedStore`): the RAM
tier under :mod:`torchcache.datasets.shm`, one per job, the disk tier under
``<cache_dir>/<name>/`` beside a ``torchcache.json`` (``"kind": "dataset"``). A lookup
tries RAM, then disk (a disk hit is copied up to RAM), then computes the sample, which
is encoded by :mod:`torchcache.datasets.encode` and written through to both tiers at once, so
that every DataLoader worker sees it.

A full tier keeps what it holds and takes no more (:mod:`torchcache.datasets.tiers`). A
fault of a tier (a full or read-only disk, a damaged entry) is one
:class:`~torchcache.errors.CacheWarning` and a computed sample, never an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._fork import renew_lock_after_fork
from ..catalog.budget import CacheClaim, claim_module_cache
from ..config import module_dir_name
from ..errors import ConfigError, KeyingError, StoreError
from ..faults import Fault, FaultLog, SharedWarnings
from ..meta import load_meta
from ..stats import CacheStats, PeriodicSummary, TierStats, format_summary
from ..stores.redis.url import redact_url
from ..tiers.lookup import look_up
from . import shm
from .encode import check_sample, encode_sample
from .keys import store_key
from .opening import DEFAULT_DISK_SIZE, open_tiers, resolve_places, write_dataset_meta
from .tiers import HitCounters, SampleTier, fill_tier, placement, samples_from_slots

__all__ = ["DEFAULT_DISK_SIZE", "SampleCache"]


class SampleCache:
    """Samples by key (an index or a name), cached in RAM and on disk, shared across processes.

    Args:
        name: The cache's name: a dataset fingerprint, or any string (mapped to a safe
            directory name). Caches of one name over one ``cache_dir`` share their entries.
        cache_dir: The directory of disk tiers; ``None`` for ``$TORCHCACHE_DIR`` or the
            user cache directory, used only when ``max_disk_size`` is given.
        max_memory_size: The RAM tier's budget (bytes, or a string such as ``"8GB"``);
            ``None`` for :func:`~torchcache.datasets.shm.default_memory_size`, 0 for no RAM tier.
            One budget for the whole job: DataLoader workers and ranks share the tier.
        max_disk_size: The disk tier's budget; ``None`` for :data:`DEFAULT_DISK_SIZE` when a
            ``cache_dir`` is given and no disk tier otherwise; 0 for no disk tier.
        info: More fields for the disk tier's ``torchcache.json`` (``name``, ``length``...).
        local_cache_dir: With a Redis or bucket URL as ``cache_dir``: a directory on this
            machine that keeps a copy of the samples read from and written to there, under
            ``max_disk_size`` too, so that their hits do not cross the network; default
            ``$TORCHCACHE_LOCAL_DIR``, else none for Redis and ``copies`` under the cache root for a
            bucket. Not for a local ``cache_dir``.
        storage_options: With a bucket URL, as for :class:`~torchcache.CachedDataset`.
        max_local_size: The local copy's budget, as for :class:`~torchcache.CachedDataset`.
        keep_budget: Keep the disk tier's budget: a bucket's when closed, a directory's when
            opened (``False``: a reader, which removes nothing and records no budget of its own).

    Raises:
        ConfigError: If a size or the name is invalid.

    Example:
        >>> import tempfile
        >>> cache = SampleCache("squares", tempfile.mkdtemp(), max_memory_size=0, max_disk_size="1MB")
        >>> cache.get(3, lambda key: key * key)
        9
        >>> 3 in cache, cache.get(3, lambda key: -1)
        (True, 9)
        >>> cache.stats().hits, cache.stats().misses
        (1, 1)
        >>> cache.close()
    """

    def __init__(
        self,
        name: str,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        max_memory_size: int | float | str | None = None,
        max_disk_size: int | float | str | None = None,
        info: Mapping[str, Any] | None = None,
        local_cache_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        max_local_size: int | float | str | None = None,
        keep_budget: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name must be a non-empty string (the cache's name), got {name!r}")
        dirname = module_dir_name(name)
        assert dirname is not None
        self.name, self.dirname = name, dirname
        self._summaries = PeriodicSummary()
        self._faults = FaultLog(str(info.get("name", name)) if info else name, SharedWarnings())  # workers too
        self._info = dict(info or {})
        self._places = places = resolve_places(
            dirname, cache_dir, max_memory_size, max_disk_size, local_cache_dir, self._faults,
            storage_options=storage_options, max_local_size=max_local_size, info=self._info, keep_budget=keep_budget,
        )  # fmt: skip
        job, memory_name = places.job_dir, places.memory_name or dirname  # the RAM tier, held: let go when dropped
        self._hold = None if job is None else shm.MemoryHold(job, memory_name, taken=True)
        length = self._info.get("length")
        #: The dataset's length, when known: the RAM tier then keeps samples in slots by index.
        self.length: int | None = length if type(length) is int and length > 0 else None
        self._counters = HitCounters()
        self._tiers: list[SampleTier] = []
        self._root_claim: CacheClaim | None = None
        self._pid: int | None = None
        self._lock = threading.RLock()
        renew_lock_after_fork(self, "_lock")
        if self.directory is not None:
            self._update_meta({}, create=True)
        if self.local_directory is not None and self.url is not None:
            self._update_meta({"copy_of": redact_url(self.url)}, create=True, directory=self.local_directory)

    def __repr__(self) -> str:
        disk = self.directory if self.url is None else redact_url(self.url)
        return f"SampleCache({self.name!r}, memory={self.memory_dir}, disk={disk})"

    @property
    def memory_dir(self) -> Path | None:
        """The RAM tier's directory (``None`` without a RAM tier)."""
        return self._places.memory_dir

    # -- where the tiers live (see :class:`~.opening.Places`) -------------------------
    @property
    def directory(self) -> Path | None:
        """The disk tier's directory (``None``: no disk tier, or it is at a URL)."""
        return self._places.directory

    @property
    def url(self) -> str | None:
        """The Redis server or object store bucket of the disk tier, when ``cache_dir`` is a URL."""
        return self._places.url

    @property
    def local_directory(self) -> Path | None:
        """The local copy of the disk tier at :attr:`url` (``None``: none)."""
        return self._places.local_directory

    @property
    def job_dir(self) -> Path | None:
        """The job's shared-memory directory (``None``: no RAM tier)."""
        return self._places.job_dir

    @property
    def max_memory_size(self) -> int:
        """The RAM tier's budget in bytes (0: none)."""
        return self._places.max_memory_size

    @property
    def max_disk_size(self) -> int:
        """The disk tier's budget in bytes (0: none)."""
        return self._places.max_disk_size

    # -- state across processes -----------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        fresh: dict[str, Any] = {"_tiers": [], "_pid": None, "_lock": None, "_root_claim": None}
        return {**self.__dict__, **fresh, "_faults": (self._faults.name, self._faults.shared)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._faults = FaultLog(*state["_faults"])
        self._lock = threading.RLock()
        renew_lock_after_fork(self, "_lock")

    def _open(self) -> list[SampleTier]:
        """This process's tiers, opened on first use in each process."""
        if self._pid == os.getpid():
            return self._tiers
        with self._lock:
            if self._pid != os.getpid():
                self._open_tiers()
        return self._tiers

    def _open_tiers(self) -> None:
        if (where := self.directory) is not None and self.max_disk_size:  # held while used; made with its metadata
            self._root_claim = claim_module_cache(  # a reader keeps no budget: it removes no other cache either
                where.parent, where.name, self._faults.warn, create=False, keep=self._places.keep_budget
            )
        if self._hold is not None and not self._hold.here:
            try:
                self._hold.take()
            except StoreError as exc:
                self._faults.warn(Fault.OPEN, f"cannot open the memory tier ({exc}); it is left out", "memory")
        memory_held = self._hold is not None and self._hold.here
        places = self._places if memory_held else dataclasses.replace(self._places, job_dir=None)
        self._tiers = open_tiers(places, self.length, self._faults)
        self._pid = os.getpid()

    # -- lookups ----------------------------------------------------------------------
    def get(self, key: int | str, compute: Callable[[Any], Any]) -> Any:
        """The sample of ``key``: from a tier, or ``compute(key)`` stored in every tier.

        Raises:
            KeyingError: If the key is neither an int nor a str.
            SampleTypeError: If a computed sample holds a value that cannot be cached.
        """
        return self.get_many([key], lambda keys: [compute(keys[0])])[0]

    def get_many(self, keys: Sequence[int | str], compute_many: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
        """The samples of ``keys``; ``compute_many(missing_keys)`` gives the missing ones, in order.

        Lookups and writes are batched: one read per tier, one write per tier.

        Raises:
            KeyingError: If a key is neither an int nor a str.
            SampleTypeError: If a computed sample holds a value that cannot be cached.
            ValueError: If ``compute_many`` returns the wrong number of samples.
        """
        results: list[Any] = [None] * len(keys)
        pending = list(range(len(keys)))
        served = {"memory": 0, "disk": 0}
        tiers = self._open()
        slots = tiers[0].slots_ready() if tiers else None  # only the RAM tier, the first, has slots
        if slots is not None:
            hit = samples_from_slots(tiers[0], slots, keys, results, self._faults)
            if hit:
                served[tiers[0].name] += len(hit)
                pending = [i for i in pending if i not in hit] if len(hit) < len(keys) else []
        skeys = [""] * len(keys)
        if pending:  # hits in slots need no store key and no lookup
            for i in pending:
                skeys[i] = store_key(keys[i])
            found = look_up(tiers, skeys, pending=pending)
            for part in found.parts:
                served[tiers[part.tier].name] += len(part.positions)
                for i, (_, sample) in zip(part.positions, part.values):
                    results[i] = sample
            pending = found.missing
        if pending:
            computed = compute_many([keys[i] for i in pending])
            if len(computed) != len(pending):
                raise ValueError(f"compute_many returned {len(computed)} samples for {len(pending)} keys")
            takers = [tier for tier in tiers if tier.accepting]  # full tiers: samples are only checked
            items = []
            for i, sample in zip(pending, computed):
                results[i] = sample
                if takers:
                    items.append((skeys[i], _encode(sample, keys[i])))
                elif tiers:
                    _encode(sample, keys[i], check_only=True)
            for tier in takers:
                tier.put_many(items)
        self._counters.add(served["memory"], served["disk"], len(pending))
        self._faults.emit()
        self._summaries.tick(self.summary)
        return results

    def reads_failing(self, retry: bool = False) -> bool:
        """Whether the last read of the disk tier's server or bucket failed (``retry``: send the next at once)."""
        return any(tier.store.reads_failing(retry) for tier in self._open() if tier.store is not None)

    def fill(self, keys: Sequence[int | str], compute_many: Callable[[list[Any]], Sequence[Any]]) -> None:
        """Put the samples of ``keys`` that the disk tier lacks into it, and those computed in RAM too (a warm-up)."""
        self._counters.add(0, 0, fill_tier(self._open(), keys, compute_many, _encode, self._faults))
        self._faults.emit()

    def __contains__(self, key: object) -> bool:
        try:
            skey = store_key(key)  # type: ignore[arg-type]
        except KeyingError:
            return False
        return any(skey in tier for tier in self._open())

    def missing(self, keys: Sequence[int | str], tier: str | None = None) -> list[int | str]:
        """The keys not stored in ``tier`` (``"memory"`` or ``"disk"``; ``None``: in no tier)."""
        tiers = [t for t in self._open() if tier is None or t.name == tier]
        return [key for key in keys if not any(store_key(key) in t for t in tiers)]

    def placement(self, keys: Sequence[int | str], shared: bool = False) -> list[tuple[str, int] | None]:
        """Where the slowest tier would fetch each sample from (:func:`~.tiers.placement`)."""
        return placement(self._open(), [store_key(key) for key in keys], shared)

    # -- upkeep -------------------------------------------------------------------------
    def summary(self) -> str:
        """A one-line summary: hits, misses, hit rate, and each tier against its budget."""
        return format_summary(f"dataset {self.name}", None, self.stats())

    def stats(self) -> CacheStats:
        """Hits per tier and misses (over this process and its DataLoader workers), and each tier's size."""
        memory_hits, disk_hits, misses = self._counters.totals()
        by_name = {tier.name: tier for tier in self._open()}
        hits = memory_hits + disk_hits
        disk = _tier_stats(by_name.get("disk"), disk_hits, self.max_disk_size)
        stats = CacheStats(
            hits=hits,
            misses=misses,
            hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            memory=_tier_stats(by_name.get("memory"), memory_hits, self.max_memory_size),
            disk=disk if self.directory or self.url else None,
        )
        self._faults.emit()  # a tier that could not be read said so (here, not in the next forked worker)
        return stats

    def metadata(self) -> dict[str, Any] | None:
        """The disk tier's ``torchcache.json`` (``None`` without a disk tier or a valid file)."""
        meta, problem = load_meta(self.directory) if self.directory is not None else (None, "no disk tier")
        return meta if problem is None else None

    def update_metadata(self, fields: Mapping[str, Any]) -> bool:
        """Record more fields in the disk tier's ``torchcache.json``; return whether it was written."""
        return self.directory is not None and self._update_meta(fields, create=False)

    def _update_meta(self, fields: Mapping[str, Any], create: bool, directory: Path | None = None) -> bool:
        directory = directory or self.directory
        assert directory is not None  # callers check
        if directory == self.directory and not self._places.keep_budget:
            return False  # a reader writes only its local copy's
        return write_dataset_meta(directory, {**self._info, **fields}, self.max_disk_size, create, self._faults)

    def flush(self) -> None:
        """Make this process's writes durable against a killed process (they are when ``get`` returns)."""
        for tier in self._tiers if self._pid == os.getpid() else []:
            tier.flush()

    def close(self) -> None:
        """Close the stores and let go of the RAM tier (removed if no other process uses it); reopened at next use."""
        with self._lock:
            if self.url and self._pid != os.getpid():  # opened to keep the bucket's budget over workers' writes
                with contextlib.suppress(StoreError, ConfigError):
                    self._open()
            if self._pid == os.getpid():
                for tier in self._tiers:
                    tier.close()
                if self._root_claim is not None:
                    self._root_claim.release()
            self._tiers, self._pid, self._root_claim = [], None, None
            if self._hold is not None:
                self._hold.release()  # removed unless another cache uses it


def _encode(sample: object, key: object, check_only: bool = False) -> bytes:
    """The frame of a sample (only checked, ``b""``, with ``check_only``); a :class:`SampleTypeError` names the key."""
    try:
        if check_only:
            check_sample(sample)
            return b""
        return encode_sample(sample)
    except KeyingError as exc:
        raise type(exc)(f"the sample of {key!r}: {exc}") from None


def _tier_stats(tier: SampleTier | None, hits: int, max_bytes: int) -> TierStats:
    """A tier's figures (none for a tier not open, or a server away: its store reports the fault)."""
    try:
        entries, nbytes = (len(tier), tier.nbytes) if tier is not None else (0, 0)
    except StoreError:
        entries = nbytes = 0
    budget = min(max_bytes, tier.budget) if tier is not None else max_bytes  # a shared tier keeps its own
    return TierStats(entries=entries, bytes=nbytes, max_bytes=budget, hits=hits)
