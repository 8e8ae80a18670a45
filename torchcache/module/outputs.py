"""Outputs of a cached call, as stored per item and as returned.

Every output leaf is stored with the batch as its first dimension. ``batch_dims`` names
leaves whose batch is another dimension (an LSTM's ``h_n``): they are moved to batch
first before they are stored, and back on the way out. A leaf that does not hold one
row per computed item cannot be cached per item, and an error says how to declare it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError, KeyingError
from ..tree import Layout, Spec, leaf_paths, unflatten

__all__ = ["GradOutputError", "OutputPlan", "UnbatchedOutputError"]


class UnbatchedOutputError(KeyingError):
    """An output leaf does not hold one row per item."""


class GradOutputError(ConfigError):
    """A call returned outputs that require grad though no input does: its hits would carry none."""


class OutputPlan:
    """Where the batch sits in each output leaf of one cached callable.

    Args:
        name: The callable's name, for messages.
        batch_dims: ``batch_dims`` of the settings (argument names are ignored here).
    """

    def __init__(self, name: str, batch_dims: Mapping[str, int]) -> None:
        self.name = name
        self._names = {k: v for k, v in batch_dims.items() if k.startswith("output")}
        self._dims: dict[str, list[int]] = {}

    def dims(self, spec: Spec) -> list[int]:
        """The batch dimension of each leaf of ``spec`` (empty: the first, for all).

        Raises:
            ConfigError: If ``batch_dims`` names an output path that ``spec`` lacks.
        """
        if not self._names:
            return []
        key = json.dumps(spec)
        dims = self._dims.get(key)
        if dims is None:
            paths = leaf_paths(spec)
            unknown = sorted(n for n in self._names if n not in paths)
            if unknown:
                raise ConfigError(
                    f"batch_dims names {unknown}, which are not tensor outputs of {self.name}; "
                    f"its output paths are {paths}"
                )
            dims = self._dims[key] = [self._names.get(path, 0) for path in paths]
        return dims

    def to_items(self, spec: Spec, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Leaves as computed, with the batch moved first (views, no copy)."""
        dims = self.dims(spec)
        if not dims:
            return leaves
        return [leaf.movedim(dim, 0) if dim else leaf for leaf, dim in zip(leaves, dims)]

    def rebuild(self, layout: Layout, leaves: list[torch.Tensor]) -> Any:
        """The output a real call returns, from per-item leaves (batch first)."""
        dims = self.dims(layout.spec)
        if dims:
            leaves = [leaf.movedim(0, dim).contiguous() if dim else leaf for leaf, dim in zip(leaves, dims)]
        return unflatten(layout.spec, leaves)

    def check(self, leaves: list[torch.Tensor], computed: int, batch: int, spec: Spec = "T") -> None:
        """Every leaf (batch first, as :meth:`to_items` gives them, of ``spec``) must be dense, one row per item.

        Raises:
            KeyingError: For a sparse leaf, or one on the meta device.
            GradOutputError: For a leaf that requires grad (no input does: calls whose
                inputs require grad are not cached).
            UnbatchedOutputError: For a leaf whose first dimension is not the number of
                computed items.
        """
        for n, leaf in enumerate(leaves):
            if leaf.layout != torch.strided:
                raise KeyingError(
                    f"{self.name} returned a {leaf.layout} tensor: only dense (strided) outputs can be cached; "
                    "return out.to_dense() from the cached function"
                )
            if leaf.requires_grad:  # a trainable tensor the key did not see, or one made in forward
                raise GradOutputError(
                    f"{self.name} returned an output that requires grad though no input does: something it "
                    "reads is trainable where torchcache does not look (or it makes such a tensor), and cached "
                    "outputs carry no gradient; freeze it (requires_grad_(False)) and call cache_instance.clear(), "
                    "call it under torch.no_grad(), or do not cache this callable"
                )
            if leaf.device.type == "meta":
                raise KeyingError(
                    f"{self.name} returned a tensor on the meta device, which has no values to cache; call it "
                    "uncached (torchcache(enabled=False)) where it computes on meta tensors"
                )
            if leaf.dim() == 0 or leaf.shape[0] != computed:
                dim = (self.dims(spec) or [0] * len(leaves))[n]
                shape = tuple(leaf.movedim(0, dim).shape if dim else leaf.shape)  # as the callable returned it
                where = f"{leaf_paths(spec)[n]} (batch_dims {dim})" if dim else leaf_paths(spec)[n]
                raise UnbatchedOutputError(
                    f"{self.name} returned {where} shaped {shape} for {computed} items (batch {batch}): "
                    "torchcache caches outputs per item, so every output tensor must have the batch as its first "
                    "dimension. Name outputs whose batch is another dimension in batch_dims (for an LSTM's "
                    "(h_n, c_n): batch_dims={'output[1][0]': 1, 'output[1][1]': 1}); outputs that are not per "
                    "item cannot be cached."
                )
