"""Dataset samples cached in a RAM tier over a disk tier, shared by every process of a job.

Both tiers are packed stores (:class:`~torchcache.stores.packed.store.PackedStore`): the RAM
tier under :mod:`torchcache.datasets.shm`, one per job, the disk tier under
``<cache_dir>/<name>/`` beside a ``torchcache.json`` (``"kind": "dataset"``). A lookup
tries RAM, then disk (a disk hit is copied up to RAM), then computes the sample, which
is encoded by :mod:`torchcache.datasets.samples` and written through to both tiers at once, so
that every DataLoader worker sees it.

A full tier keeps what it holds and takes no more (:mod:`torchcache.datasets.sample_tiers`). A
fault of a tier (a full or read-only disk, a damaged entry) is one
:class:`~torchcache.errors.CacheWarning` and a computed sample, never an error.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from .._fork import renew_lock_after_fork
from .._version import __version__
from ..catalog.maintenance import CacheClaim, claim_module_cache
from ..config import check_local_dir, check_redis_url, is_url, module_dir_name, resolve_local_dir, resolve_root
from ..errors import ConfigError, CorruptEntryError, KeyingError, StoreError
from ..faults import FaultLog
from ..meta import META_NAME, load_meta, write_json_atomic
from ..policy import parse_size
from ..stats import CacheStats, PeriodicSummary, TierStats, format_summary
from ..stores.batched import BatchedStore
from ..stores.packed.store import PackedStore
from ..stores.redis.url import redact_url
from ..stores.slots import SlotStore
from . import shm
from .sample_keys import store_key
from .sample_tiers import HitCounters, SampleTier, segment_bytes, store_bytes
from .samples import check_sample, decode_rows, decode_samples, encode_sample

__all__ = ["DEFAULT_DISK_SIZE", "SampleCache"]

#: The disk tier's budget when a ``cache_dir`` is given without ``max_disk_size``.
DEFAULT_DISK_SIZE = "50GB"
_TIERS = ("memory", "disk")


class SampleCache:
    """Samples by key (an index or a name), cached in RAM and on disk, shared across processes.

    Args:
        name: The cache's name: a dataset fingerprint, or any string (mapped to a safe
            directory name). Caches of one name share their entries.
        cache_dir: The directory of disk tiers; ``None`` for ``$TORCHCACHE_DIR`` or the
            user cache directory, used only when ``max_disk_size`` is given.
        max_memory_size: The RAM tier's budget (bytes, or a string such as ``"8GB"``);
            ``None`` for :func:`~torchcache.datasets.shm.default_memory_size`, 0 for no RAM tier.
            One budget for the whole job: DataLoader workers and ranks share the tier.
        max_disk_size: The disk tier's budget; ``None`` for :data:`DEFAULT_DISK_SIZE` when a
            ``cache_dir`` is given and no disk tier otherwise; 0 for no disk tier.
        info: More fields for the disk tier's ``torchcache.json`` (``name``, ``length``...).
        local_cache_dir: With a Redis URL as ``cache_dir``: a directory on this machine that
            keeps a copy of the samples read from and written to the server, under
            ``max_disk_size`` too, so that their hits do not cross the network; default
            ``$TORCHCACHE_LOCAL_DIR``, else none. Not for a local ``cache_dir``.

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
    ) -> None:
        dirname = module_dir_name(name)
        if dirname is None:
            raise ConfigError("a SampleCache needs a name")
        self.name = name
        self._summaries = PeriodicSummary()
        self.dirname = dirname
        self._faults = FaultLog(str(info.get("name", name)) if info else name)
        if max_disk_size is None:
            max_disk_size = 0 if cache_dir is None else DEFAULT_DISK_SIZE
        self.max_disk_size = parse_size(max_disk_size, "max_disk_size")
        #: The Redis server of the persistent tier, when ``cache_dir`` is a Redis URL.
        self.redis_url: str | None = None
        self.directory: Path | None = None
        #: The local copy of the Redis tier (``None``: none).
        self.local_directory: Path | None = None
        if is_url(cache_dir):
            self.redis_url = check_redis_url(str(cache_dir)) if self.max_disk_size else None
            local = resolve_local_dir(check_local_dir(local_cache_dir))
            if local is not None and self.redis_url is not None:
                self.local_directory = local / dirname
        elif local_cache_dir is not None:
            raise ConfigError(
                "local_cache_dir keeps a local copy of a disk tier on a Redis server, but cache_dir is "
                f"{'not given' if cache_dir is None else 'a directory'}; leave local_cache_dir out"
            )
        elif self.max_disk_size:
            self.directory = resolve_root(None if cache_dir is None else Path(os.fspath(cache_dir)).expanduser())
            self.directory /= dirname
        self.job_dir: Path | None = None
        self._held_pid: int | None = None
        self.max_memory_size = 0
        if max_memory_size is None or parse_size(max_memory_size, "max_memory_size"):
            try:
                job_dir = shm.new_job_dir()
                self._hold_memory(job_dir, held_job=True)
            except StoreError as exc:
                self._faults.warn("memory-open", f"no RAM tier ({exc})")
            else:
                self.job_dir = job_dir
                size = shm.default_memory_size() if max_memory_size is None else max_memory_size
                self.max_memory_size = parse_size(size, "max_memory_size")
        self._info = dict(info or {})
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
        if self.local_directory is not None and self.redis_url is not None:
            copy_of = {"copy_of": redact_url(self.redis_url)}
            self._update_meta(copy_of, create=True, directory=self.local_directory)

    def __repr__(self) -> str:
        disk = self.directory if self.redis_url is None else redact_url(self.redis_url)
        return f"SampleCache({self.name!r}, memory={self.memory_dir}, disk={disk})"

    @property
    def memory_dir(self) -> Path | None:
        """The RAM tier's directory (``None`` without a RAM tier)."""
        return None if self.job_dir is None else self.job_dir / self.dirname

    # -- state across processes -----------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_tiers=[], _pid=None, _held_pid=None, _faults=self._faults.name, _lock=None, _root_claim=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._faults = FaultLog(state["_faults"])
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

    def _hold_memory(self, job_dir: Path, held_job: bool = False) -> None:
        """Hold the job directory (unless ``held_job``) and this cache's RAM tier directory in it.

        Each is removed when its last user lets go: the cache's own at :meth:`close` (unless
        another cache of this name in the job uses it), the job's when the job ends.

        Raises:
            StoreError: If either cannot be created or locked (then neither is held).
        """
        if not held_job:
            shm.hold(job_dir)
        try:
            shm.hold(job_dir / self.dirname)
        except StoreError:
            shm.release(job_dir)
            raise
        self._held_pid = os.getpid()

    def _open_tiers(self) -> None:
        self._tiers = []
        if self.directory is not None and self.max_disk_size:  # held while used: the root's budget keeps it
            self._root_claim = claim_module_cache(self.directory.parent, self.directory.name, self._faults.warn)
        places = [(self.memory_dir, self.max_memory_size), (self.directory or self.redis_url, self.max_disk_size)]
        for name, (location, size) in zip(_TIERS, places):
            if location is None or not size:
                continue
            with_slots = name == "memory" and self.length is not None and isinstance(location, Path)
            try:
                if name == "memory" and self.job_dir is not None and self._held_pid != os.getpid():
                    self._hold_memory(self.job_dir)
                store: BatchedStore | Callable[[], BatchedStore]
                if isinstance(location, str):  # a Redis URL: the namespace is the cache's name
                    store = self._redis_store(location, store_bytes(size))
                else:
                    store = functools.partial(
                        PackedStore,
                        location,
                        store_bytes(size),
                        segment_bytes=segment_bytes(size),
                        report=self._reporter(name),
                    )
                    if not with_slots:  # a RAM tier with slots opens its store when a sample is not in them
                        store = store()
            except (StoreError, ConfigError) as exc:
                self._faults.warn(f"{name}-open", f"cannot open the {name} tier ({exc}); it is left out")
                continue
            slots = None
            if with_slots:
                assert isinstance(location, Path) and self.length is not None
                slots = SlotStore(location, self.length, size, self._reporter(name))
                if slots.shortfall():  # made by a cache of this dataset with a smaller budget, in this job
                    self._faults.report(
                        "memory-size",
                        f"the RAM tier's slot file {slots.path} was made for {slots.capacity:,} samples by an "
                        "earlier cache of this dataset in this job, with a smaller budget; it is shared, so it "
                        "keeps its size and this cache's larger max_memory_size does not take effect. Give this "
                        "cache its own RAM tier with another version=",
                    )
            self._tiers.append(SampleTier(name, store, size, self._faults, slots))
        self._pid = os.getpid()

    def _redis_store(self, url: str, max_bytes: int) -> BatchedStore:
        """The disk tier on a Redis server, behind its local copy when there is one."""
        from ..stores.layered import LayeredStore
        from ..stores.redis.store import RedisStore

        namespace = xxhash.xxh3_128_hexdigest(self.dirname.encode())
        report = self._reporter("disk")
        store = RedisStore(url, namespace, max_bytes, report=report)
        if self.local_directory is None:
            return store
        try:
            near = PackedStore(self.local_directory, max_bytes, report=report)
        except StoreError as exc:
            self._faults.warn("disk-local", f"no local copy of the disk tier ({exc}); hits are read from the server")
            return store
        return LayeredStore(near, store, report)

    def _reporter(self, tier: str) -> Callable[[str, str], None]:
        def report(kind: str, message: str) -> None:
            self._faults.report(f"{tier}-{kind}", f"{tier} tier: {message}")

        return report

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
            hit = self._from_slots(tiers[0], slots, keys, results)
            if hit:
                served[tiers[0].name] += len(hit)
                pending = [i for i in pending if i not in hit] if len(hit) < len(keys) else []
        skeys = {i: store_key(keys[i]) for i in pending}  # hits in slots need no store key
        for level, tier in enumerate(tiers):
            if not pending:
                break
            frames = tier.get_many([skeys[i] for i in pending])
            found = [(i, frame) for i, frame in zip(pending, frames) if frame is not None]
            promote, hit, uppers = [], set(), tiers[:level]
            for (i, frame), sample in zip(found, decode_samples([frame for _, frame in found])):
                if isinstance(sample, CorruptEntryError):
                    self._faults.warn(f"{tier.name}-decode", f"a cached sample is damaged ({sample}); recomputed")
                    tier.drop(skeys[i])
                else:
                    results[i] = sample
                    hit.add(i)
                    if uppers:  # a hit below the first tier is copied up
                        promote.append((skeys[i], frame))
            served[tier.name] += len(hit)
            missed = [i for i in pending if i not in hit]
            for upper in uppers:
                upper.put_many(promote)
            pending = missed
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

    def _from_slots(
        self, tier: SampleTier, slots: SlotStore, keys: Sequence[int | str], results: list[Any]
    ) -> set[int]:
        """Fill ``results`` from the slots of a tier for the keys that are indices; return their positions."""
        length = slots.length
        ints = [i for i, key in enumerate(keys) if type(key) is int and 0 <= key < length]
        if not ints:
            return set()
        wanted: Sequence[Any] = [keys[i] for i in ints] if len(ints) < len(keys) else keys
        found, buf = tier.read_slots(wanted)
        if not found:
            return set()
        stride, at, size = slots.stride, slots.frame_at, slots.frame_size
        samples: list[Any] | None = decode_rows(buf, len(found), stride, at, size)
        if samples is not None:  # the common case: every frame alike, none damaged
            places = [ints[position] for position in found]
            for i, sample in zip(places, samples):
                results[i] = sample
            return set(places)
        view = memoryview(buf)  # frames of several structures (or a damaged one): one by one
        hit = set()
        for position, sample in zip(
            found, decode_samples([view[j * stride + at : j * stride + at + size] for j in range(len(found))])
        ):
            i = ints[position]
            if isinstance(sample, CorruptEntryError):
                self._faults.warn(f"{tier.name}-decode", f"a cached sample is damaged ({sample}); recomputed")
                tier.drop(store_key(keys[i]))
            else:
                results[i] = sample
                hit.add(i)
        return hit

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

    # -- upkeep -------------------------------------------------------------------------
    def summary(self) -> str:
        """A one-line summary: hits, misses, hit rate, and each tier against its budget."""
        return format_summary(f"dataset {self.name}", None, self.stats())

    def stats(self) -> CacheStats:
        """Hits per tier and misses (over this process and its DataLoader workers), and each tier's size."""
        memory_hits, disk_hits, misses = self._counters.totals()
        by_name = {tier.name: tier for tier in self._open()}

        def tier_stats(name: str, hits: int, max_bytes: int) -> TierStats:
            tier = by_name.get(name)
            if tier is None:
                return TierStats(entries=0, bytes=0, max_bytes=max_bytes, hits=hits)
            return TierStats(entries=len(tier), bytes=tier.nbytes, max_bytes=max_bytes, hits=hits)

        hits = memory_hits + disk_hits
        return CacheStats(
            hits=hits,
            misses=misses,
            hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            memory=tier_stats("memory", memory_hits, self.max_memory_size),
            disk=tier_stats("disk", disk_hits, self.max_disk_size) if self.directory or self.redis_url else None,
        )

    def metadata(self) -> dict[str, Any] | None:
        """The disk tier's ``torchcache.json`` (``None`` without a disk tier or a valid file)."""
        if self.directory is None:
            return None
        meta, problem = load_meta(self.directory)
        return meta if problem is None else None

    def update_metadata(self, fields: Mapping[str, Any]) -> bool:
        """Record more fields in the disk tier's ``torchcache.json``; return whether it was written."""
        return self.directory is not None and self._update_meta(fields, create=False)

    def _update_meta(self, fields: Mapping[str, Any], create: bool, directory: Path | None = None) -> bool:
        directory = directory or self.directory
        assert directory is not None  # callers check
        old, problem = load_meta(directory)
        if problem is not None:
            old = None
        if old is None or old.get("kind") != "dataset":
            if not create:
                return False
            old = {"created": time.time()}
        meta = {**old, **self._info, **fields}
        meta.update(torchcache_version=__version__, kind="dataset", max_bytes=self.max_disk_size)
        if meta == old:
            return True
        try:
            os.makedirs(directory, exist_ok=True)
            write_json_atomic(directory / META_NAME, meta)
        except OSError as exc:
            self._faults.warn("disk-meta", f"cannot write {directory / META_NAME} ({exc})")
            return False
        return True

    def flush(self) -> None:
        """Make this process's writes durable against a killed process (they are when ``get`` returns)."""
        for tier in self._tiers if self._pid == os.getpid() else []:
            tier.flush()

    def close(self) -> None:
        """Close the stores and let go of the RAM tier; it is removed if no other process uses it.

        The cache reopens if used again (with a new, empty RAM tier if this one was removed).
        """
        with self._lock:
            if self._pid == os.getpid():
                for tier in self._tiers:
                    tier.close()
                if self._root_claim is not None:
                    self._root_claim.release()
            self._tiers, self._pid, self._root_claim = [], None, None
            if self.job_dir is not None and self._held_pid == os.getpid():
                self._held_pid = None
                shm.release(self.job_dir / self.dirname)  # removed unless another cache uses it
                shm.release(self.job_dir)


def _encode(sample: object, key: object, check_only: bool = False) -> bytes:
    """The frame of a sample (only checked, ``b""``, with ``check_only``); a :class:`SampleTypeError` names the key."""
    try:
        if check_only:
            check_sample(sample)
            return b""
        return encode_sample(sample)
    except KeyingError as exc:
        raise type(exc)(f"the sample of {key!r}: {exc}") from None
