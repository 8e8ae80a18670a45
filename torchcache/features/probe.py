"""What makes features unfit to cache by dataset index, detected before extraction.

Random augmentation before the backbone (reads of a sample that differ), a backbone in
training mode whose outputs are random, and one whose rows depend on the other inputs
of the batch (batch statistics): rows computed in other batches (a resumed, repaired or
partly reused extraction) would differ from those of one run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from ..datasets.draws import random_reads
from ..dtypes import standard_strides
from ..errors import ConfigError
from ..module.closeness import rows_agree
from ..stores.features.layout import SampleLayout
from .backbone import run_backbone

__all__ = ["PROBE_INPUTS", "check_deterministic", "refuse_dependent", "refuse_random"]

#: Inputs :func:`refuse_dependent` runs through the backbone: two together, then each alone.
PROBE_INPUTS = 4

_RANDOM = (
    "dataset[{index}] is random (read again, it gave {why}): the dataset applies random augmentation "
    "(RandomResizedCrop, RandomHorizontalFlip, ...) before the backbone, and outputs of random inputs cannot be "
    "cached. Give extract_features the dataset with deterministic transforms only (e.g. Resize and CenterCrop) "
    "and augment the features, or cache the decoded samples with CachedDataset and augment after it"
)


def check_deterministic(dataset: Any, todo: np.ndarray[Any, Any]) -> Any:
    """The first sample to compute, once three reads of each of four samples agreed.

    A read that draws from a process-wide generator is refused whatever it returned
    (:func:`~torchcache.datasets.draws.random_reads`); one that draws from a generator of
    its own, flipping with probability 0.5, passes one sample's three reads a quarter of
    the time, and four samples' about once in 250 runs.

    Raises:
        ConfigError: If a sample differs between reads (random augmentation).
    """
    probes = sorted({int(todo[len(todo) * k // 4]) for k in range(4)})
    first = None
    for index in probes:
        sample = dataset[index]
        why = random_reads(dataset.__getitem__, index, sample)
        if why is not None:
            raise ConfigError(_RANDOM.format(index=index, why=why))
        if first is None:
            first = sample
    return first


def refuse_random(backbone: torch.nn.Module, layout: SampleLayout, sample: Any, batch_size: int) -> None:
    """Refuse a backbone in training mode whose outputs for one input differ (stochastic depth, RReLU, F.dropout).

    One input eight times in a batch (fewer with a smaller ``batch_size``), twice over (the caller's random
    state is kept by extract_features): each place's row must be the same bits in both runs, and the places'
    rows equal up to rounding (a kernel may round a row by its place in the batch). A sample's branch dropped
    with probability 0.5 passes once in 32,768 runs; with 0.1, once in 5.

    Raises:
        ConfigError: If they are not.
    """
    count = min(8, batch_size)  # a backbone made for batches of one gets one
    inputs, _ = layout.split([sample] * count)
    first, second = (run_backbone(backbone, default_collate(inputs), count) for _ in range(2))  # type: ignore[no-untyped-call]
    same = torch.equal(_bits(first), _bits(second))  # NaN as itself
    if not (same and (count < 2 or rows_agree(first[:1].expand_as(first[1:]), first[1:], first))):
        raise ConfigError(
            "the backbone is in training mode and its outputs are random (one input gave other features at each "
            "run: stochastic depth, RReLU or dropout called as a function). Call backbone.eval() first"
        )


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return standard_strides(rows.contiguous().reshape(-1)).view(torch.uint8)


_DEPENDENT = (
    "the backbone's rows depend on the other inputs of the batch ({how}): features are cached by dataset index, "
    "and rows computed in other batches (a resumed, repaired or partly reused extraction) would differ. Give "
    "batch norm running statistics (track_running_stats=True, eval mode), or extract with a backbone whose "
    "outputs are per input"
)


def refuse_dependent(backbone: torch.nn.Module, layout: SampleLayout, samples: list[Any]) -> None:
    """Refuse a backbone whose rows for two inputs computed together differ from those computed one by one.

    Raises:
        ConfigError: If they differ beyond floating-point noise, or a batch of one fails.
    """
    inputs, _ = layout.split(samples)
    try:
        batch = default_collate(inputs)  # type: ignore[no-untyped-call]
    except (RuntimeError, TypeError):  # inputs of two shapes: extraction itself says what is wrong
        return
    together = run_backbone(backbone, batch, len(samples))
    alone = []
    for one in inputs:
        try:
            alone.append(run_backbone(backbone, default_collate([one]), 1))  # type: ignore[no-untyped-call]
        except ConfigError as exc:  # a batch of one: what a resumed or repaired extraction may run
            raise ConfigError(f"{exc}. An input alone (a batch of one, as resuming or repairing runs) failed") from None
        except Exception as exc:  # noqa: BLE001 - BatchNorm without running statistics refuses a batch of one
            how = f"an input alone raised {type(exc).__name__}: {str(exc)[:200]}"
            raise ConfigError(_DEPENDENT.format(how=how)) from None
    if any(row.shape[1:] != together.shape[1:] for row in alone) or not rows_agree(
        together, torch.cat(alone), together
    ):
        raise ConfigError(_DEPENDENT.format(how="an input alone gave other features than in a batch of two"))
