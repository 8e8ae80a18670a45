"""Batches of a features cache, read whole: one gather and one decode per batch, not per sample.

``DataLoader(features, batch_size=256)`` asks for a batch's samples (``__getitems__``,
one gather) and then ``default_collate`` stacks them again, sample by sample. A loader
made by :meth:`FeatureDataset.loader <torchcache.FeatureDataset.loader>` hands the
DataLoader whole batches instead: a batch sampler picks the indices, and the dataset
turns each list of indices into the finished batch (each field one contiguous tensor),
with ``batch_size=None`` so that nothing is collated again.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import CacheWarning

if TYPE_CHECKING:
    from .dataset import FeatureDataset

__all__ = ["BatchOrder", "Batches", "make_loader"]


class Batches(Dataset[Any]):
    """A features cache indexed by lists of indices, each giving one collated batch.

    Args:
        features: The features cache.
        collate_fn: Makes a batch of a list of samples; ``None`` for the rows decoded as
            one batch (what ``default_collate`` would make of the samples).
    """

    def __init__(self, features: FeatureDataset, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.features = features
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, indices: Sequence[int]) -> Any:
        if self.collate_fn is None:
            return self.features.batch(indices)
        return self.collate_fn(self.features.__getitems__(indices))


class BatchOrder(Sampler[np.ndarray[Any, np.dtype[np.int64]]]):
    """The batches of indices ``BatchSampler(RandomSampler(...))`` gives, as arrays sliced from one permutation.

    With the same ``generator`` the orders are the same, epoch after epoch: the draws are
    the ones ``RandomSampler`` makes, at the same moments. A shuffle without a generator
    draws its seed from the global RNG, as ``RandomSampler`` does. Nothing is made per index.
    """

    def __init__(self, length: int, batch_size: int, shuffle: bool, drop_last: bool, generator: torch.Generator | None):
        self.length, self.batch_size, self.shuffle, self.drop_last = length, batch_size, shuffle, drop_last
        self.generator = generator

    def __len__(self) -> int:
        whole, rest = divmod(self.length, self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[np.ndarray[Any, np.dtype[np.int64]]]:
        if self.shuffle:
            generator = self.generator
            if generator is None:
                generator = torch.Generator()
                generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            order = torch.randperm(self.length, generator=generator).numpy()
        else:
            order = np.arange(self.length, dtype=np.int64)
        size = self.batch_size
        for start in range(0, len(self) * size, size):
            if self.shuffle and start + size > self.length:  # RandomSampler's epoch ends in one more draw
                torch.randperm(self.length, generator=generator)  # (for none), made as a short batch is filled
            yield order[start : start + size]
        if self.shuffle and (self.drop_last or not self.length % size):
            torch.randperm(self.length, generator=generator)  # ... else as the next batch is asked for


#: DataLoader options that only workers take (refused with ``num_workers=0``).
_WORKER_OPTIONS = (
    "num_workers", "persistent_workers", "prefetch_factor", "multiprocessing_context", "worker_init_fn", "timeout"
)  # fmt: skip


def _start_method(loader: DataLoader[Any]) -> str:
    """How ``loader``'s workers would be started: its context's method, else the default (which stays unset)."""
    context = loader.multiprocessing_context
    if context is not None:
        return str(context.get_start_method())
    chosen = torch.multiprocessing.get_start_method(allow_none=True)
    return str(chosen or multiprocessing.get_all_start_methods()[0])


def _as_fetched(batch: Any) -> Any:
    """The batch as :class:`Batches` made it (the DataLoader's default would turn tuples into lists)."""
    return batch


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_loader(
    features: FeatureDataset,
    batch_size: int,
    *,
    shuffle: bool = False,
    drop_last: bool = False,
    generator: torch.Generator | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_options: Any,
) -> DataLoader[Any]:
    """A DataLoader of whole batches of ``features`` (see :meth:`FeatureDataset.loader`).

    Raises:
        ValueError: If ``batch_size`` is not a positive int.
        TypeError: If ``loader_options`` name ``batch_size``, ``sampler`` or ``batch_sampler``, or
            ``generator`` is not a ``torch.Generator``.
    """
    _check_positive("batch_size", batch_size)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    taken = sorted({"batch_size", "sampler", "batch_sampler", "shuffle"} & set(loader_options))
    if taken:
        raise TypeError(f"FeatureDataset.loader() sets {', '.join(taken)} itself; pass batch_size=, shuffle= instead")
    batches = BatchOrder(len(features), batch_size, shuffle, drop_last, generator)
    fixed: dict[str, Any] = {"batch_size": None, "sampler": batches, "collate_fn": _as_fetched, "generator": generator}
    # The generator seeds workers too, as DataLoader(generator=g) does: no global RNG drawn.
    loader = DataLoader(Batches(features, collate_fn), **fixed, **loader_options)
    kept = features.path is None or bool(getattr(features.file, "kept", None))  # some or all in memory
    if kept and loader.num_workers > 0 and (method := _start_method(loader)) != "fork":
        warnings.warn(  # kept in memory when the cache could not be written: only a forked worker shares it
            f"torchcache: the features are kept in memory (their cache could not be written), which workers "
            f"started by {method!r} cannot reach: loading them in this process (num_workers=0)",
            CacheWarning,
            stacklevel=3,
        )
        alone = {k: v for k, v in loader_options.items() if k not in _WORKER_OPTIONS}
        return DataLoader(Batches(features, collate_fn), **fixed, **alone)
    return loader
