"""``CachedDataset``: a map-style dataset whose samples are computed once, then served from a cache.

Samples are keyed by their index within a *dataset fingerprint*
(:func:`~torchcache.datasets.keys.fingerprint_dataset`: the dataset's class and source,
its public attributes, its length and ``version``). What the fingerprint cannot see
(files changed on disk, a global setting read in ``__getitem__``) is what ``version``
is for: change it and the cache starts afresh.

The transform runs after the cache, at every access, so random augmentations stay
random. ``__getitems__`` lets a DataLoader fetch a whole batch with one lookup and one
write per tier.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..config import module_dir_name
from ..errors import CacheWarning, ConfigError, StoreError, StoreUnavailableError, TorchCacheError
from ..faults import user_stacklevel
from ..locations import check_local_dir, is_object_url, resolve_root
from ..meta import read_meta
from ..stats import CacheStats
from ..stores.redis.url import redact_url
from .cache import DEFAULT_DISK_SIZE, SampleCache
from .draws import checked_for_draws, draw_mark
from .keys import fingerprint_dataset

__all__ = ["CachedDataset", "MissingSampleError"]

#: Seconds that a cache served without its dataset waits for its bucket to answer again.
SERVE_WAIT = 60.0
_RETRY_EVERY = 1.0


class _StillMissing(Exception):
    """Samples still not found while a bucket is read again."""


def _still_missing(indices: list[Any]) -> Sequence[Any]:
    raise _StillMissing


class MissingSampleError(TorchCacheError, LookupError):
    """A sample is not in a cache served without its dataset."""


def _find_cache(directory: Path) -> Path:
    """The dataset cache at ``directory``, or the single one right under it.

    Caches of a :class:`~torchcache.SampleCache` used on its own record no length and
    are not counted.

    Raises:
        ConfigError: If there is none, or several.
    """
    if not directory.is_dir():
        raise ConfigError(f"CachedDataset(None, {str(directory)!r}): there is no dataset cache at {directory}")
    meta = read_meta(directory)
    if meta is not None and meta.get("kind") == "dataset":
        return directory
    found = []
    try:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            meta = read_meta(Path(entry.path)) if entry.is_dir(follow_symlinks=False) else None
            # A SampleCache used on its own has no length: it is no dataset to serve.
            if meta is not None and meta.get("kind") == "dataset" and type(meta.get("length")) is int:
                found.append((Path(entry.path), meta.get("name")))
    except OSError as exc:
        raise ConfigError(f"cannot read the cache directory {directory}: {exc}") from exc
    if len(found) != 1:
        listed = "; ".join(f"{path} ({name})" for path, name in found)
        what = f"{len(found)} dataset caches: {listed}; pass one of them" if found else "no dataset cache"
        raise ConfigError(f"CachedDataset(None, {str(directory)!r}): {directory} holds {what}")
    return found[0][0]


def _find_bucket_cache(url: str, storage_options: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The name and description of the one dataset cache under ``url``.

    Raises:
        ConfigError: If there is none, several, or the bucket cannot be read.
    """
    from ..stores.objects.bucket import find_caches

    try:
        metas = find_caches(url, storage_options)
    except StoreError as exc:
        raise ConfigError(f"CachedDataset(None, {redact_url(url)!r}): {exc}") from None
    except FileNotFoundError:  # gcsfs: no such bucket (a name in capitals, a typo)
        raise ConfigError(f"CachedDataset(None, {redact_url(url)!r}): there is no such bucket") from None
    found = [m for m in metas if m.get("kind") == "dataset" and isinstance(m.get("cache"), str)]
    if len(found) != 1:
        listed = "; ".join(f"{m['cache']} ({m.get('name')})" for m in found)
        what = f"{len(found)} dataset caches: {listed}; give each dataset a prefix of its own" if found else "none"
        raise ConfigError(f"CachedDataset(None, {redact_url(url)!r}): {redact_url(url)} holds {what}")
    return found[0]["cache"], found[0]


class CachedDataset(Dataset[Any]):
    """A map-style dataset that caches the samples of another one, in RAM and on disk.

    The RAM tier lives in ``/dev/shm`` and is shared by the DataLoader workers (fork or
    spawn, persistent or not) and the ``torchrun`` ranks of one machine, then removed
    when the job ends (with another launcher, give the ranks one ``TORCHCACHE_JOB_ID``).
    The disk tier persists across runs, and a copy of it serves without the dataset:
    ``CachedDataset(None, cache_dir)``. A tier that is full keeps what it holds: later
    samples are computed each time. Samples are cached as they come from ``dataset``;
    ``transform`` runs after the cache. The object pickles without its open files.

    Args:
        dataset: A map-style dataset; ``None`` to serve a disk cache made earlier, found at
            ``cache_dir`` (the cache's own directory, or the one holding it).
        cache_dir: The directory of disk caches (one subdirectory per dataset fingerprint).
            Giving it turns the disk tier on.
        max_memory_size: The RAM tier's budget (bytes, or a string such as ``"8GB"``); by
            default a quarter of the RAM (or of a container's memory limit), at most half of
            ``/dev/shm`` and at most 32 GB; 0 turns the RAM tier off.
        max_disk_size: The disk tier's budget; by default 50 GB when ``cache_dir`` is given
            and no disk tier otherwise (a size with no ``cache_dir`` uses ``$TORCHCACHE_DIR``
            or the user cache directory); 0 turns it off. Without a dataset the cache is only
            read: nothing is removed to fit it (what went could not be computed again).
        version: Part of the fingerprint: change it when the data changed in a way the
            fingerprint cannot see (files edited on disk are not seen).
        transform: Applied to every sample after the cache, at every access.
        local_cache_dir: With a Redis or bucket URL as ``cache_dir``: a directory on this
            machine that keeps a copy of the samples read from there, so that their hits do
            not cross the network (default ``$TORCHCACHE_LOCAL_DIR``, else none for Redis
            and ``copies`` under the cache root for a bucket).
        storage_options: With a bucket URL as ``cache_dir``: options for its fsspec
            filesystem (``endpoint_url``, ``profile``...), over ``$TORCHCACHE_STORAGE_OPTIONS``;
            never logged or written.
        max_local_size: The budget of the local copy (``None``: ``max_disk_size``). A copy
            smaller than the cache keeps a fixed subset over shuffled epochs (its entries
            are evicted most recently used first) and reads the rest from the URL.
        check_samples: Read the first sample each process computes twice more (and those
            of a batch whose computing moved a process-wide random generator), and refuse
            a dataset whose samples are random (:mod:`torchcache.datasets.draws`) with a
            ``KeyingError`` at that access; ``False`` skips these reads (a dataset whose
            reads have side effects).

    Raises:
        ConfigError: If a size is invalid, or (without a dataset) ``cache_dir`` holds no
            dataset cache, or several.
        TypeError: If the dataset has no length, or ``check_samples`` is not a bool.

    Example:
        >>> import tempfile, torch
        >>> class Squares(torch.utils.data.Dataset):
        ...     def __len__(self) -> int:
        ...         return 4
        ...     def __getitem__(self, i: int) -> torch.Tensor:
        ...         return torch.tensor([i * i])
        >>> data = CachedDataset(Squares(), tempfile.mkdtemp(), max_memory_size="1MB")
        >>> data[3], data[-1], len(data)
        (tensor([9]), tensor([9]), 4)
        >>> data.stats().hits, data.stats().misses
        (1, 1)
        >>> data.close()
    """

    def __init__(
        self,
        dataset: Any,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        max_memory_size: int | float | str | None = None,
        max_disk_size: int | float | str | None = None,
        version: object = None,
        transform: Callable[[Any], Any] | None = None,
        local_cache_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        max_local_size: int | float | str | None = None,
        check_samples: bool = True,
    ) -> None:
        self.dataset = dataset
        if not isinstance(check_samples, bool):
            raise TypeError(f"check_samples must be True or False, got {check_samples!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be a callable or None, got {transform!r}")
        self.transform = transform
        if dataset is None:
            if version is not None:
                raise ConfigError("version names a cache of a dataset; without a dataset, pass its directory")
            if is_object_url(cache_dir):
                name, meta = _find_bucket_cache(str(cache_dir), storage_options)
                where: str | Path = str(cache_dir)
            else:
                root = resolve_root(check_local_dir(cache_dir, "cache_dir"))
                directory = _find_cache(root)
                name, meta, where = directory.name, read_meta(directory) or {}, directory.parent
            length = meta.get("length")
            if type(length) is not int or not 0 <= length <= sys.maxsize or module_dir_name(name) != name:
                raise ConfigError(f"{name} in {where} is not a usable dataset cache (its length or name is invalid)")
            self.fingerprint = name
            size = (meta.get("max_bytes") or DEFAULT_DISK_SIZE) if max_disk_size is None else max_disk_size
            self.cache = SampleCache(
                name,
                where,
                max_memory_size=max_memory_size,
                max_disk_size=size,
                info={"length": length},
                local_cache_dir=local_cache_dir if isinstance(where, str) else None,
                storage_options=storage_options,
                max_local_size=max_local_size,
                keep_budget=False,  # it only reads: the writers' budgets hold (a reader's could be smaller)
            )
        else:
            if isinstance(dataset, IterableDataset):
                raise TypeError(f"CachedDataset needs a map-style dataset (indexed by position), got {dataset!r}")
            try:
                length = len(dataset)
            except TypeError:
                raise TypeError(f"CachedDataset needs a map-style dataset with __len__, got {dataset!r}") from None
            cls = type(dataset)
            self.fingerprint = fingerprint_dataset(dataset, version)
            info = {"name": f"{cls.__module__}.{cls.__qualname__}", "length": length, "version": repr(version)}
            self.cache = SampleCache(
                self.fingerprint,
                cache_dir,
                max_memory_size=max_memory_size,
                max_disk_size=max_disk_size,
                info=info,
                local_cache_dir=local_cache_dir,
                storage_options=storage_options,
                max_local_size=max_local_size,
            )
        self.length = length
        # "first": the first sample this process computes is read again; "moved": a batch that moved a generator
        self._check = "first" if check_samples else ""
        self._batched = hasattr(dataset, "__getitems__")  # False once it gave no list of samples

    def __repr__(self) -> str:
        return f"CachedDataset({self.dataset!r}, fingerprint={self.fingerprint}, cache={self.cache!r})"

    def __len__(self) -> int:
        return self.length

    def _index(self, index: object) -> int:
        if type(index) is int and 0 <= index < self.length:
            return index
        try:
            i = int(index.__index__())  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            raise TypeError(f"CachedDataset indices must be integers, got {type(index).__name__}") from None
        if not -self.length <= i < self.length:
            raise IndexError(f"index {i} is out of range for a dataset of {self.length} samples")
        return i + self.length if i < 0 else i

    def _compute(self, indices: list[Any]) -> Sequence[Any]:
        if self.dataset is None:
            return self._when_back(indices)
        batched = getattr(self.dataset, "__getitems__", None) if self._batched else None
        before = draw_mark() if self._check else None
        samples, self._batched = _read_samples(self.dataset, batched, indices)
        moved = before is not None and before != draw_mark()
        due = (moved or self._check == "first") and bool(samples)
        if due and checked_for_draws(self.dataset, batched if self._batched else None, indices, samples, moved):
            self._check = "moved"
        return samples

    def _when_back(self, indices: list[Any]) -> Sequence[Any]:
        """Samples not found without a dataset: read again while the bucket is away, for up to :data:`SERVE_WAIT` s."""
        start = time.monotonic()
        deadline = start + SERVE_WAIT
        while self.cache.reads_failing(retry=True):  # a read every _RETRY_EVERY s, whatever the backoff
            try:
                return self.cache.get_many(indices, _still_missing)
            except _StillMissing:
                if time.monotonic() >= deadline:
                    break
                time.sleep(_RETRY_EVERY)
        where = self.cache.directory or redact_url(self.cache.url or "")
        if self.cache.reads_failing():
            raise StoreUnavailableError(
                f"sample {indices[0]} cannot be read: {where} has not answered for {time.monotonic() - start:.0f} s, "
                "and there is no dataset to compute it"
            )
        raise MissingSampleError(
            f"sample {indices[0]} is not in the cache at {where} and there is no dataset to compute it; warm the "
            "cache up completely (CachedDataset(dataset, cache_dir).warmup()) first"
        )

    def __getitem__(self, index: int) -> Any:
        """The sample at ``index`` (negative indices count from the end), transformed.

        Raises:
            IndexError: If the index is out of range.
            MissingSampleError: If the sample is not cached and there is no dataset.
            StoreUnavailableError: If there is no dataset and the bucket did not answer for
                :data:`SERVE_WAIT` seconds.
            SampleTypeError: If the sample holds a value that cannot be cached.
        """
        sample = self.cache.get_many([self._index(index)], self._compute)[0]
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples of a batch of indices (one lookup per tier), each transformed."""
        if set(map(type, indices)) == {int} and min(indices) >= 0 and max(indices) < self.length:
            keys = indices  # the common case: indices in range, checked at C speed
        else:
            keys = [self._index(i) for i in indices]
        samples = self.cache.get_many(keys, self._compute)
        return samples if self.transform is None else [self.transform(sample) for sample in samples]

    def warmup(self, num_workers: int | None = None, *, batch_size: int = 64, progress: bool = True) -> CacheStats:
        """Fill the cache with every sample not yet cached, in parallel; resumable.

        When every sample is on disk afterwards, ``torchcache.json`` records it
        (``"complete": true``). A tier that fills up keeps what it holds.

        Args:
            num_workers: DataLoader workers computing samples (default: the CPUs, at most
                8); 0 computes them in this process.
            batch_size: Samples per lookup and write.
            progress: Show a progress bar (tqdm when installed, else a line now and then).

        Returns:
            The cache statistics afterwards.
        """
        for name, value, least in (("num_workers", num_workers, 0), ("batch_size", batch_size, 1)):
            if value is not None and (type(value) is not int or value < least):
                raise TypeError(f"warmup(): {name} must be an int >= {least}, got {value!r}")
        tier = "disk" if self.cache.directory is not None or self.cache.url is not None else "memory"
        todo = [int(i) for i in self.cache.missing(range(self.length), tier)]
        if todo and self.dataset is not None:
            if num_workers is None:
                num_workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
            loader = DataLoader(
                _Filler(self, tier), batch_size=batch_size, sampler=todo, num_workers=num_workers, collate_fn=_count
            )
            bar = _Progress(len(todo), progress)
            try:
                for count in loader:
                    bar.update(count)
            finally:
                bar.close()
        if tier == "disk" and not self.cache.missing(range(self.length), "disk"):
            self.cache.update_metadata({"complete": True, "length": self.length})
        return self.stats()

    def stats(self) -> CacheStats:
        """Hits per tier and misses (this process and its DataLoader workers), and each tier's size."""
        return self.cache.stats()

    def close(self) -> None:
        """Close the cache's files and let go of the RAM tier (see :meth:`SampleCache.close`)."""
        self.cache.close()


def _read_samples(dataset: Any, batched: Any, indices: list[Any]) -> tuple[list[Any], bool]:
    """The samples at ``indices``, and whether ``__getitems__`` is to read the next ones.

    A ``__getitems__`` that gives no list of one sample per index (a collated batch, which
    cannot be split into samples) is not called again: samples are read one by one.
    """
    if batched:
        samples = batched(indices)
        if isinstance(samples, (list, tuple)) and len(samples) == len(indices):
            return list(samples), True
        warnings.warn(
            f"torchcache: {type(dataset).__qualname__}.__getitems__ gave a {type(samples).__name__} for "
            f"{len(indices)} indices, not a list of one sample per index (what a Dataset's __getitems__ "
            "returns): CachedDataset reads its samples one by one with __getitem__",
            CacheWarning,
            stacklevel=user_stacklevel(),
        )
    return [dataset[i] for i in indices], False


class _Filler(Dataset[int]):
    """Fills the cache of a dataset; a batch gives back its size, not its samples."""

    def __init__(self, cached: CachedDataset, tier: str) -> None:
        self.cached, self.tier = cached, tier

    def __getitem__(self, index: int) -> int:
        return len(self.__getitems__([index]))

    def __getitems__(self, indices: list[int]) -> list[None]:
        if self.tier == "disk":  # samples the RAM tier holds are written to disk too
            self.cached.cache.fill(indices, self.cached._compute)
        else:
            self.cached.cache.get_many(indices, self.cached._compute)
        return [None] * len(indices)


def _count(batch: list[None]) -> int:
    return len(batch)


class _Progress:
    """A tqdm bar if tqdm is installed, else a line on stderr every 10 seconds."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.done, self.bar, self.show = total, 0, None, show
        self.last = time.monotonic()
        if show:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc="warmup", unit="sample", dynamic_ncols=True)

    def update(self, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
        elif self.show and (time.monotonic() - self.last > 10 or self.done == self.total):
            self.last = time.monotonic()
            print(f"torchcache warmup: {self.done}/{self.total} samples", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
