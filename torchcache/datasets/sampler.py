"""Shuffled epochs that fetch each segment of a bucket once: :class:`WindowSampler`.

A cache in a bucket is read in whole segments (a few megabytes of samples each). A
plain shuffled epoch asks every batch for a few samples of every segment, so when the
local copy cannot hold the whole cache, each batch fetches most segments again (ten
times the cache's bytes per epoch). :class:`WindowSampler` shuffles the segments, cuts
them into windows of :data:`~torchcache.tiers.stash.STASH_BYTES`, and shuffles the
samples within each window (the samples held on this machine are spread over all
windows): the batches of a window ask for its segments alone, the first batch fetches
them, and the next ones find the rest in the RAM stash. That is how streaming
datasets shuffle shards (MosaicML streaming's "shuffle blocks").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Sampler

from ..errors import ConfigError
from ..policy import parse_size
from ..tiers.stash import STASH_BYTES

__all__ = ["WindowSampler", "window_order"]


class _Placed(Protocol):
    def placement(self, keys: Sequence[int], shared: bool = False) -> list[tuple[str, int] | None]: ...


def window_order(placement: Sequence[tuple[str, int] | None], window_bytes: int, rng: np.random.Generator) -> list[int]:
    """A shuffled order of ``range(len(placement))`` that keeps the indices of a window of segments together.

    Args:
        placement: Per index, ``(segment, its bytes)`` where a read fetches it, or ``None``
            (held locally, or not cached): those are spread over all windows.
        window_bytes: The segments of a window add up to at most this many bytes (a
            window has one segment at least).
        rng: The random generator.

    Example:
        >>> order = window_order([("a", 10), ("b", 10), ("a", 10), ("b", 10)], 10, np.random.default_rng(0))
        >>> sorted(order), abs(order.index(0) - order.index(2))  # 0 and 2 share segment a: one window
        ([0, 1, 2, 3], 1)
    """
    n = len(placement)
    names: dict[str, int] = {}
    sizes: list[int] = []
    segment = np.full(n, -1, np.int64)
    for i, place in enumerate(placement):
        if place is not None:
            at = names.setdefault(place[0], len(names))
            if at == len(sizes):
                sizes.append(place[1])
            segment[i] = at
    if not names:
        return rng.permutation(n).tolist()  # type: ignore[no-any-return]
    window_of = np.empty(len(names), np.int64)
    window, total = 0, 0
    for at in rng.permutation(len(names)).tolist():
        if total and total + sizes[at] > window_bytes:
            window, total = window + 1, 0
        window_of[at] = window
        total += sizes[at]
    placed = segment >= 0
    windows = np.empty(n, np.int64)
    windows[placed] = window_of[segment[placed]]
    counts = np.bincount(windows[placed], minlength=window + 1)
    windows[~placed] = rng.choice(window + 1, size=int((~placed).sum()), p=counts / counts.sum())
    return np.lexsort((rng.random(n), windows)).tolist()  # type: ignore[no-any-return]


class WindowSampler(Sampler[int]):
    """A shuffled order of a cached dataset's indices that reads a bucket's segments once per epoch.

    Use it where a :class:`~torchcache.CachedDataset` in a bucket has a local copy smaller
    than the cache: each epoch then fetches each segment it needs once (see the module's
    description), where a plain shuffle fetches most segments at every batch. For a cache
    on a local disk or in Redis, it is a plain shuffle.

    Each ``iter()`` is the next epoch, drawn from ``(seed, epoch)``: the same orders in
    every run with one seed. :meth:`set_epoch` sets the epoch (to resume a run).

    In a distributed job, as with ``DistributedSampler``, each rank takes its share of
    every epoch: ``len(dataset) / num_replicas`` indices (the order wraps around to make
    the shares equal, unless ``drop_last``), a contiguous run of whole windows, so that
    each rank reads its own segments. Every rank must then see the same entries in the
    bucket (a warmed cache): the order is made from the bucket's placement alone, not
    from what each machine's local copy holds.

    Args:
        dataset: The :class:`~torchcache.CachedDataset`.
        seed: The seed of the orders; ``None`` draws one from torch's global generator
            (seeded by ``torch.manual_seed``), or is 0 with several replicas (every rank
            needs the same orders).
        window_bytes: The bytes of segments in a window (bytes or a size such as ``"32MB"``); default the stash's,
            :data:`~torchcache.tiers.stash.STASH_BYTES` (64 MiB). Smaller windows mix less.
        num_replicas: The processes sharing each epoch; default the world size of
            ``torch.distributed`` when it is initialized, else 1.
        rank: This process's share; default its rank in ``torch.distributed``, else 0.
        drop_last: With several replicas, leave out the last indices that do not fill
            a share (``False``: wrap around to the first ones).

    Raises:
        ConfigError: (a ``ValueError``) If ``dataset`` is not a cached dataset, ``seed`` not an
            int, ``window_bytes`` not a size (``"64MB"`` or bytes) or ``num_replicas`` not a
            positive int, or ``rank`` is not in ``[0, num_replicas)``.

    Example:
        >>> import tempfile
        >>> from torchcache import CachedDataset
        >>> class Squares(torch.utils.data.Dataset):
        ...     def __len__(self) -> int:
        ...         return 8
        ...     def __getitem__(self, i: int) -> torch.Tensor:
        ...         return torch.tensor(i * i)
        >>> cached = CachedDataset(Squares(), tempfile.mkdtemp(), max_memory_size=0)
        >>> loader = torch.utils.data.DataLoader(cached, batch_size=4, sampler=WindowSampler(cached, seed=0))
        >>> sorted(torch.cat(list(loader)).tolist())
        [0, 1, 4, 9, 16, 25, 36, 49]
        >>> cached.close()
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int | None = None,
        window_bytes: int = STASH_BYTES,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if num_replicas is None:
            num_replicas = torch.distributed.get_world_size() if distributed else 1
        if rank is None:
            rank = torch.distributed.get_rank() if distributed else 0
        if not hasattr(dataset, "cache") or not hasattr(dataset, "__len__"):
            raise ConfigError(f"dataset must be a CachedDataset (WindowSampler orders its cache), got {dataset!r}")
        window_bytes = parse_size(window_bytes, "window_bytes")
        for name, value in (("window_bytes", window_bytes), ("num_replicas", num_replicas)):
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if type(rank) is not int or not 0 <= rank < num_replicas:
            raise ConfigError(f"rank must be an int in [0, {num_replicas}) (num_replicas), got {rank!r}")
        if seed is not None and type(seed) is not int:
            raise ConfigError(f"seed must be an int or None, got {seed!r}")
        self.dataset = dataset
        if seed is None:
            seed = 0 if num_replicas > 1 else int(torch.empty((), dtype=torch.int64).random_().item())
        self.seed, self.window_bytes, self.epoch = seed, window_bytes, 0
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last

    def __repr__(self) -> str:
        share = f", rank={self.rank} of {self.num_replicas}" if self.num_replicas > 1 else ""
        return f"WindowSampler(seed={self.seed}, window_bytes={self.window_bytes}, epoch={self.epoch}{share})"

    def __len__(self) -> int:
        n, replicas = len(self.dataset), self.num_replicas
        return n // replicas if self.drop_last else -(-n // replicas)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` epoch ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        cache: _Placed = self.dataset.cache
        rng = np.random.default_rng([self.seed % 2**63, self.epoch])
        self.epoch += 1
        n, share = len(self.dataset), len(self)
        order = window_order(cache.placement(range(n), shared=self.num_replicas > 1), self.window_bytes, rng)
        if self.num_replicas > 1:
            order = (order * -(-share * self.num_replicas // max(n, 1)))[: share * self.num_replicas]
            order = order[self.rank * share : (self.rank + 1) * share]
        return iter(order)
