"""Random augmentation before the backbone, detected: reads of a sample that differ."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..dtypes import standard_strides
from ..errors import ConfigError

__all__ = ["check_deterministic"]

_RANDOM = (
    "dataset[{index}] returned a different {what} on two reads: the dataset applies random augmentation "
    "(RandomResizedCrop, RandomHorizontalFlip, ...) before the backbone, and outputs of random inputs cannot be "
    "cached. Give extract_features the dataset with deterministic transforms only (e.g. Resize and CenterCrop) "
    "and augment the features, or cache the decoded samples with CachedDataset and augment after it"
)


def _same(a: Any, b: Any) -> bool:
    """Whether two samples are equal, byte for byte where they are tensors or arrays (NaN equals NaN)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(_bytes_of(a), _bytes_of(b)))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return type(a) is type(b) and (bool(a == b) or bool(a != a and b != b))  # a NaN target is as it was
    except (TypeError, ValueError, RuntimeError):
        return False


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return standard_strides(tensor.detach().cpu().contiguous().reshape(-1)).view(torch.uint8)


def check_deterministic(dataset: Any, todo: np.ndarray[Any, Any]) -> Any:
    """The first sample to compute, once three reads of each of four samples agreed.

    A flip with probability 0.5 passes one sample's three reads a quarter of the time, and
    four samples' about once in 250 runs.

    Raises:
        ConfigError: If a sample differs between reads (random augmentation).
    """
    probes = sorted({int(todo[len(todo) * k // 4]) for k in range(4)})
    first = None
    for index in probes:
        sample = dataset[index]
        if not (_same(sample, dataset[index]) and _same(sample, dataset[index])):
            raise ConfigError(_RANDOM.format(index=index, what="sample"))
        if first is None:
            first = sample
    return first
