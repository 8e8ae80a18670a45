"""Where a sample cache keeps its tiers, and opening them in each process.

:func:`resolve_places` turns a :class:`~.cache.SampleCache`'s arguments into its places: a
RAM tier under the job's shared-memory directory (:mod:`.shm`), and a disk tier that is a
directory under the cache root, or a Redis server or object store bucket (behind a local
copy when there is one).
:func:`open_tiers` opens them in a process: every fault is one warning and a tier left
out, never an error.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .._version import __version__
from ..errors import ConfigError, StoreError
from ..faults import Fault, FaultLog, Report
from ..locations import (
    check_local_dir,
    check_storage_options,
    check_url,
    is_object_url,
    is_url,
    resolve_local_dir,
    resolve_root,
)
from ..meta import FULL_OR_READ_ONLY, META_NAME, load_meta, unreadable, write_json_atomic
from ..policy import parse_size
from ..stores.batched import BatchedStore
from ..stores.packed.store import PackedStore
from . import shm
from .rows import SampleRows
from .tiers import SampleTier, segment_bytes

__all__ = ["DEFAULT_DISK_SIZE", "Places", "open_tiers", "resolve_places", "write_dataset_meta"]

#: The disk tier's budget when a ``cache_dir`` is given without ``max_disk_size``.
DEFAULT_DISK_SIZE = "50GB"


@dataclass
class Places:
    """Where the tiers of one sample cache live, and their budgets (0: no such tier)."""

    dirname: str
    max_disk_size: int
    #: The disk tier's directory (``None``: none, or the tier is on Redis).
    directory: Path | None = None
    #: The Redis server or object store bucket of the disk tier, when ``cache_dir`` is a URL.
    url: str | None = None
    #: The local copy of the disk tier at ``url`` (``None``: none).
    local_directory: Path | None = None
    #: The job's shared-memory directory (``None``: no RAM tier).
    job_dir: Path | None = None
    max_memory_size: int = 0
    #: The local copy's budget (``None``: the disk tier's).
    max_local_size: int | None = None
    #: Options for the filesystem of a bucket URL (``None``: from the environment).
    storage_options: dict[str, Any] | None = None
    #: Whether the disk tier is brought within its budget: a bucket's when closed, a directory's
    #: when opened (``False``: a process that only reads, which removes nothing).
    keep_budget: bool = True
    #: What a bucket's ``torchcache.json`` records about the cache (kind, name, length...).
    info: dict[str, Any] = field(default_factory=dict)
    #: The RAM tier's name in the job: ``dirname``, and a digest of where the disk tier is
    #: (caches of one name over other disk tiers hold other entries).
    memory_name: str = ""

    @property
    def memory_dir(self) -> Path | None:
        """The RAM tier's directory (``None`` without a RAM tier)."""
        return None if self.job_dir is None else self.job_dir / (self.memory_name or self.dirname)


def resolve_places(
    dirname: str,
    cache_dir: str | os.PathLike[str] | None,
    max_memory_size: int | float | str | None,
    max_disk_size: int | float | str | None,
    local_cache_dir: str | os.PathLike[str] | None,
    faults: FaultLog,
    *,
    storage_options: Mapping[str, Any] | None = None,
    max_local_size: int | float | str | None = None,
    info: dict[str, Any] | None = None,
    keep_budget: bool = True,
) -> Places:
    """The places of a sample cache's tiers; the RAM tier's directories are held on return.

    Raises:
        ConfigError: If a size, the URL, ``local_cache_dir`` or ``storage_options`` is invalid.
    """
    if max_disk_size is None:
        max_disk_size = 0 if cache_dir is None else DEFAULT_DISK_SIZE
    places = Places(dirname, parse_size(max_disk_size, "max_disk_size"), info=info if info is not None else {})
    places.keep_budget = keep_budget
    places.storage_options = check_storage_options(storage_options)
    if storage_options is not None and not is_object_url(cache_dir):
        raise ConfigError(
            "storage_options are the fsspec options of a bucket URL (s3://, gs://), but cache_dir is "
            f"{'not given' if cache_dir is None else 'not one'}; leave storage_options out"
        )
    if max_local_size is not None:
        places.max_local_size = parse_size(max_local_size, "max_local_size")
    if is_url(cache_dir):
        places.url = check_url(str(cache_dir), "cache_dir") if places.max_disk_size else None
        local = resolve_local_dir(check_local_dir(local_cache_dir), default=is_object_url(cache_dir))
        if local is not None and places.url is not None:
            from ..stores.remote import local_copy_dir

            places.local_directory = local_copy_dir(local, dirname, places.url)
    elif local_cache_dir is not None:
        raise ConfigError(
            "local_cache_dir keeps a local copy of a disk tier on a Redis server or in a bucket, but cache_dir is "
            f"{'not given' if cache_dir is None else 'a directory'}; leave local_cache_dir out"
        )
    elif places.max_disk_size:
        root = resolve_root(check_local_dir(cache_dir, "cache_dir"))
        places.directory = root / dirname
    disk = places.directory or places.url
    if disk is not None:
        from ..stores.redis.url import redact_url

        where = os.path.realpath(disk) if isinstance(disk, Path) else redact_url(disk)  # one name per directory
        places.memory_name = f"{dirname}-{xxhash.xxh3_64_hexdigest(where.encode())[:8]}"
    if max_memory_size is None or parse_size(max_memory_size, "max_memory_size"):
        try:
            job_dir = shm.new_job_dir()  # held: the cache's directory in it too (see SampleCache's MemoryHold)
            shm.hold_in(job_dir, places.memory_name or dirname)
        except StoreError as exc:
            faults.warn(Fault.OPEN, f"no RAM tier ({exc})", "memory")
        else:
            places.job_dir = job_dir
            size = shm.default_memory_size() if max_memory_size is None else max_memory_size
            places.max_memory_size = parse_size(size, "max_memory_size")
    return places


def open_tiers(places: Places, length: int | None, faults: FaultLog) -> list[SampleTier]:
    """Open the RAM tier (with slots when the dataset's ``length`` is known), then the disk tier.

    A tier that cannot be opened is one warning in ``faults`` and is left out. The disk
    tier's directory was made with its metadata when the cache was: if it is missing, it
    was removed while in use (``torchcache clear``), and is not made again without them.
    """
    tiers: list[SampleTier] = []
    wanted = [
        ("memory", places.memory_dir, places.max_memory_size),
        ("disk", places.directory or places.url, places.max_disk_size),
    ]
    for name, location, size in wanted:
        if location is None or not size:
            continue
        with_slots = name == "memory" and length is not None and isinstance(location, Path)
        try:
            store: BatchedStore | Callable[[], BatchedStore]
            if isinstance(location, str):  # a Redis or bucket URL: the namespace is the cache's name
                store = _remote_store(places, location, size, faults)
            else:
                store = functools.partial(_open_store, location, size, name, faults, places.keep_budget)
                if not with_slots:  # a RAM tier with slots opens its store when a sample is not in them
                    store = store()
        except (StoreError, ConfigError) as exc:
            faults.warn(Fault.OPEN, f"cannot open the {name} tier ({exc}); it is left out", name)
            continue
        slots = None
        if with_slots:
            assert isinstance(location, Path) and length is not None
            slots = SampleRows(location, length, size, _reporter(faults, name))
            if slots.shortfall():  # made by a cache of this dataset with a smaller budget, in this job
                assert slots.file is not None
                faults.report(
                    Fault.SIZE,
                    f"the RAM tier's rows file {slots.path} was made for {slots.file.capacity:,} samples by an "
                    "earlier cache of this dataset in this job, with a smaller budget; the tier is shared, so it "
                    "keeps that budget and this cache's larger max_memory_size does not take effect. Give this "
                    "cache its own RAM tier with another version=",
                    "memory",
                )
                size = slots.max_bytes = min(size, slots.file.size)  # the samples its store takes too
                store = functools.partial(_open_store, location, size, name, faults, places.keep_budget)
        reserve_in = location if name == "memory" and isinstance(location, Path) else None
        tiers.append(SampleTier(name, store, size, faults, slots, reserve_in))
    return tiers


def _open_store(location: Path, size: int, name: str, faults: FaultLog, trim: bool = True) -> PackedStore:
    """A tier's packed store, within its budget (a later run may give it a smaller one) unless ``trim`` is off."""
    from ..tiers.local import trimmed

    if name == "disk" and not location.is_dir():  # made with its metadata, then removed: not made again
        raise StoreError(errno.ENOENT, f"the store directory {location} is gone (removed while in use)")
    report = _reporter(faults, name)
    store = PackedStore(location, size, evict="none", segment_bytes=segment_bytes(size), report=report)
    held = len(store)
    if name == "disk" and trim and len(trimmed(store, report)) < held:  # samples went: no longer every sample
        write_dataset_meta(location, {"complete": False}, size, create=False, faults=faults)
    return store


def write_dataset_meta(
    directory: Path, fields: Mapping[str, Any], max_bytes: int, create: bool, faults: FaultLog
) -> bool:
    """Record ``fields`` in the ``torchcache.json`` of a dataset's disk tier; return whether it holds them.

    Without ``create``, a directory whose metadata is missing or not a dataset's is left
    alone. A write that fails is one warning.
    """
    old, problem = load_meta(directory)
    if unreadable(problem):  # permissions or I/O, not damage: left as it is
        faults.warn(Fault.META, f"{directory / META_NAME}: {problem}; left as it is", "disk")
        return False
    if problem is not None:
        old = None
    if old is None or old.get("kind") != "dataset":
        if not create:
            return False
        old = {"created": time.time()}
    meta = {**old, **fields}
    meta.update(torchcache_version=__version__, kind="dataset", max_bytes=max_bytes)
    if meta == old:
        return True
    try:
        os.makedirs(directory, exist_ok=True)
        write_json_atomic(directory / META_NAME, meta)
    except OSError as exc:
        if (
            exc.errno not in FULL_OR_READ_ONLY
        ):  # a read-only or full disk: the store reports it, once, as it opens or writes
            faults.warn(Fault.META, f"cannot write {directory / META_NAME} ({exc})", "disk")
        return False
    return True


def _remote_store(places: Places, url: str, max_bytes: int, faults: FaultLog) -> BatchedStore:
    """The disk tier on a Redis server or in a bucket, behind its local copy when there is one."""
    from ..stores.remote import open_remote_store
    from ..tiers.layered import LayeredStore

    namespace = xxhash.xxh3_128_hexdigest(places.dirname.encode())
    report = _reporter(faults, "disk")
    meta = {**places.info, "kind": "dataset", "cache": places.dirname, "torchcache_version": __version__}
    meta["max_bytes"] = max_bytes  # CachedDataset(None, url): the default budget of its local copy
    store = open_remote_store(
        url, namespace, max_bytes, report, meta=meta if places.keep_budget else None,  # a reader describes nothing
        storage_options=places.storage_options,
        keep_budget=places.keep_budget,
    )  # fmt: skip
    if places.local_directory is None:
        return store
    try:
        local_bytes = max_bytes if places.max_local_size is None else places.max_local_size
        near = PackedStore(places.local_directory, local_bytes, report=report)
    except StoreError as exc:
        faults.warn(Fault.LOCAL, f"no local copy of the disk tier ({exc}); hits are read from the server", "disk")
        return store
    return LayeredStore(near, store, report)


def _reporter(faults: FaultLog, tier: str) -> Report:
    def report(kind: Fault, message: str) -> None:
        faults.report(kind, f"{tier} tier: {message}", tier)

    return report
