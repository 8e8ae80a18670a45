"""Features that do not fit one fixed-size row: each sample kept whole, by index, in a dataset cache.

When the backbone's outputs vary in shape from sample to sample (sequences of several
lengths, images of several sizes), or a field beside the input has no fixed size (a
string, ``None``, a nested container), :func:`~torchcache.features.extract.extract_features`
keeps each sample, the backbone's output in place of its input, as a frame of the
dataset cache's format (:mod:`torchcache.datasets.format`), in the disk tier of a
:class:`~torchcache.datasets.cache.SampleCache` keyed by index, in the same
``features-<key>`` directory. Reads are one batched lookup in the packed store (not one
gather as in a fixed-stride file), with each entry's checksum; a damaged or missing
sample is computed again with the backbone. Inputs of several shapes are run through
the backbone in groups of one shape.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from ..datasets.cache import SampleCache
from ..errors import CacheWarning, ConfigError
from ..faults import user_stacklevel
from ..meta import load_meta
from .backbone import run_backbone

__all__ = ["WholeSamples", "extract_variable", "is_variable_cache", "made_for", "run_samples"]

#: The field of ``torchcache.json`` that marks a dataset cache as variable features.
MARK = "features_of"
#: Said once when samples cannot be stored in the cache's directory.
KEPT = "torchcache: the features cannot be stored in {directory}: those not stored are kept in memory for this process"


def _field(sample: Any, input: int | str) -> Any:
    if isinstance(sample, torch.Tensor):
        return sample
    try:
        return sample[input]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"input={input!r} names no field of the dataset's samples") from None


def _replaced(sample: Any, input: int | str, output: torch.Tensor) -> Any:
    """The sample with the backbone's output in place of its input field."""
    if isinstance(sample, torch.Tensor):
        return output
    if isinstance(sample, dict):
        return {k: output if k == input else v for k, v in sample.items()}
    assert isinstance(input, int)
    fields = [output if i == input else v for i, v in enumerate(sample)]
    return tuple(fields) if isinstance(sample, tuple) else fields


def _shape_key(value: Any) -> Any:
    """What must agree for inputs to be stacked into one batch."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype)
    if isinstance(value, np.ndarray):
        return ("a", value.shape, value.dtype.str)
    if isinstance(value, dict):
        return ("d", tuple((k, _shape_key(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return ("s", tuple(_shape_key(v) for v in value))
    return ("o", type(value).__name__)


def run_samples(backbone: torch.nn.Module, samples: Sequence[Any], input: int | str) -> list[Any]:
    """The samples with the backbone's outputs in place of their inputs; inputs of one shape run as one batch."""
    groups: dict[Any, list[int]] = {}
    inputs = [_field(sample, input) for sample in samples]
    for j, value in enumerate(inputs):
        groups.setdefault(_shape_key(value), []).append(j)
    results: list[Any] = [None] * len(samples)
    for positions in groups.values():
        batch = default_collate([inputs[j] for j in positions])  # type: ignore[no-untyped-call]
        output = run_backbone(backbone, batch, len(positions))
        for row, j in enumerate(positions):
            results[j] = _replaced(samples[j], input, output[row].clone())
    return results


def _pick(by_index: dict[Any, Any], indices: list[Any]) -> list[Any]:
    return [by_index[i] for i in indices]


_NOT_KEPT = object()


def _keeping(compute: Callable[[list[Any]], list[Any]], kept: dict[int, Any], indices: list[Any]) -> list[Any]:
    """``compute(indices)``, each sample kept in ``kept`` too (the cache cannot store them)."""
    samples = compute(indices)
    kept.update(zip(indices, samples))
    return samples


def is_variable_cache(directory: Path) -> bool:
    """Whether ``directory`` holds features kept whole in a dataset cache."""
    return made_for(directory) is not None


def made_for(directory: Path) -> dict[str, Any] | None:
    """The header of the features kept whole in ``directory`` (``None``: it holds none)."""
    meta, problem = load_meta(directory)
    header = meta.get(MARK) if problem is None and meta is not None and meta.get("kind") == "dataset" else None
    return header if isinstance(header, dict) else None


def _open_cache(directory: Path, header: dict[str, Any] | None) -> SampleCache:
    info: dict[str, Any] = {"name": f"features of {header['module']}"} if header else {}
    if header:
        info.update({MARK: header, "length": header["length"], "dataset": header["dataset"]})
    return SampleCache(directory.name, directory.parent, max_memory_size=0, info=info)


class WholeSamples:
    """The samples of a features cache kept whole, by index, in a dataset cache (features that vary in shape).

    :class:`~.dataset.FeatureDataset` reads through it; it pickles with its cache.

    Args:
        cache: The dataset cache that holds the samples, keyed by index.
        header: What the cache was made from (backbone, dataset, keys, input, length).
    """

    def __init__(self, cache: SampleCache, header: dict[str, Any], kept: dict[int, Any] | None = None) -> None:
        self.cache = cache
        self.header = header
        self.length: int = header["length"]
        #: Samples the cache could not store (its directory full or read-only), kept for this process.
        self.kept = kept

    @classmethod
    def open(cls, directory: Path) -> WholeSamples:
        """Open the cache of variable features in ``directory``, made earlier.

        Raises:
            ConfigError: If ``directory`` is not such a cache, or its header is not valid.
        """
        if not is_variable_cache(directory):
            raise ConfigError(f"there is no features cache at {directory}")
        cache = _open_cache(directory, None)
        header = (cache.metadata() or {}).get(MARK)
        if not isinstance(header, dict) or type(header.get("length")) is not int or header["length"] < 0:
            cache.close()
            raise ConfigError(f"{directory} is not a usable features cache: its torchcache.json has no valid header")
        return cls(cache, header)

    def __getstate__(self) -> dict[str, Any]:
        # Samples kept in memory stay in this process: a spawned worker computes those it reads (each kept
        # tensor sent would hold a file descriptor); a forked one shares them.
        return {**self.__dict__, "kept": None}

    @property
    def path(self) -> Path | None:
        """The cache's directory."""
        return self.cache.directory

    def read(self, indices: list[int], compute: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """The samples at ``indices`` (in range), in one batched lookup; ``compute`` makes those missing or damaged."""
        kept = self.kept
        if kept is None:
            return self.cache.get_many(indices, compute)
        here = [kept.get(i, _NOT_KEPT) for i in indices]
        rest = [i for i, sample in zip(indices, here) if sample is _NOT_KEPT]
        if rest:
            found = self.cache.get_many(rest, functools.partial(_keeping, compute, kept))
            iterator = iter(found)
            here = [next(iterator) if sample is _NOT_KEPT else sample for sample in here]
        return here

    def features(self, sample: Any) -> torch.Tensor:
        """The backbone's output in ``sample``."""
        value = sample if isinstance(sample, torch.Tensor) else _field(sample, self.header["input"])
        assert isinstance(value, torch.Tensor)
        return value

    def close(self) -> None:
        """Close the cache's store."""
        self.cache.close()


def extract_variable(
    backbone: torch.nn.Module,
    dataset: Any,
    directory: Path,
    header: dict[str, Any],
    batch_size: int,
    num_workers: int,
    check: Callable[[np.ndarray[Any, Any]], Any],
    progress: Callable[[int], Any] | None,
) -> WholeSamples:
    """Compute the samples missing from the variable cache in ``directory``, batch by batch.

    ``check`` is called with the indices to compute first (it refuses random augmentation).
    """
    length = header["length"]
    cache = _open_cache(directory, header)
    todo = cache.missing(list(range(length)), tier="disk")
    kept: dict[int, Any] | None = None
    if todo:
        check(np.asarray(todo, np.int64))
        loader = DataLoader(dataset, batch_size=batch_size, sampler=todo, num_workers=num_workers, collate_fn=list)
        done = 0
        for samples in loader:
            indices = todo[done : done + len(samples)]
            by_index = dict(zip(indices, run_samples(backbone, samples, header["input"]), strict=True))
            cache.get_many(indices, functools.partial(_pick, by_index))
            if lost := cache.missing(indices, tier="disk"):  # not stored: the directory full or read-only
                if kept is None:
                    warnings.warn(KEPT.format(directory=directory), CacheWarning, stacklevel=user_stacklevel())
                    kept = {}
                kept.update((int(i), by_index[i]) for i in lost)
            done += len(samples)
            if progress is not None:
                progress(len(samples))
        cache.flush()
    return WholeSamples(cache, header, kept)
