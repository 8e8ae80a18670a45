"""Running a frozen backbone over a batch of dataset samples, for a features cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from ..datasets.keys import fingerprint_dataset
from ..errors import ConfigError, TorchCacheError
from ..keys import numerics
from ..module.fingerprint import fingerprint_module
from ..stores.features.layout import SampleLayout

__all__ = ["MissingFeatureError", "compute_rows", "device_of", "run_backbone", "source_keys"]


class MissingFeatureError(TorchCacheError, LookupError):
    """A row of a features cache opened without its backbone is not written or is damaged."""


def source_keys(backbone: torch.nn.Module, dataset: Any, version: object) -> tuple[str, str]:
    """The module key and the dataset key of a features cache: what its rows are the features of.

    Raises:
        KeyingError: If the backbone or the dataset cannot be keyed.
    """
    settings: dict[str, object] = {"features": backbone.training}
    device = next(iter(backbone.parameters()), torch.empty(0)).device.type
    lines = numerics(("cpu", "cuda", device))  # autocast, the default dtype: nothing at their defaults
    if lines:  # in the module key: rows are reused only from caches computed the same way
        settings["numerics"] = b"|".join(lines).decode()
    module_key = fingerprint_module(backbone, b"", settings, root_hooks=True)  # rows hold what its hooks did
    return module_key, fingerprint_dataset(dataset, version)


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (the CPU for a module with neither)."""
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def run_backbone(backbone: torch.nn.Module, inputs: Any, count: int) -> torch.Tensor:
    """The backbone's outputs for a collated batch of ``count`` inputs, on the CPU.

    Raises:
        ConfigError: If the backbone does not return one tensor with a row per input.
    """
    with torch.no_grad():
        output = backbone(_to_device(inputs, device_of(backbone)))
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != count:
        got = f"shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
        raise ConfigError(
            f"the backbone returned {got} for a batch of {count} inputs; extract_features needs one tensor with a "
            "row per input (wrap a model that returns a tuple or a dict in a module that returns the tensor wanted, "
            "e.g. its pooled output)"
        )
    return output.detach().to("cpu").resolve_conj().resolve_neg()  # conjugate views: their values, stored


def compute_rows(
    backbone: torch.nn.Module, layout: SampleLayout, samples: Sequence[Any]
) -> tuple[np.ndarray[Any, Any], SampleLayout]:
    """The rows of ``samples`` and the layout completed with the output's shape (when it was not).

    Raises:
        ConfigError: If a sample or the backbone's output does not fit the layout.
    """
    inputs, columns = layout.split(samples)
    output = run_backbone(backbone, default_collate(inputs), len(samples))  # type: ignore[no-untyped-call]
    if not layout.fields or layout.fields[0].kind != "features":
        layout = layout.with_features(output[0])
    rows = np.zeros((len(samples), layout.stride), np.uint8)
    layout.fill(rows, output, columns)
    return rows, layout
