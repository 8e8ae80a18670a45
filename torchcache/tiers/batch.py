"""Batch assembly: pick the items to compute, gather hits, merge parts in input order.

Every step is a constant number of tensor operations per batch (``index_select``,
``index_copy_``, or ``copy_`` into a slice where the rows are consecutive), never one
per item. Index tensors are built through numpy, which is several times faster than
``torch.tensor`` on a list of ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from .. import _buffers
from ..tree import Layout

__all__ = ["Slab", "cast_returned", "gather_hits", "gather_rows", "index_tensor", "leaf_devices", "merge_parts"]

Parts = list[tuple[list[int], list[torch.Tensor]]]


class Slab(Protocol):
    """Rows of one layout, one tensor per leaf (the memory tier's slabs)."""

    layout: Layout
    device: torch.device
    leaves: list[torch.Tensor]


def index_tensor(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """An int64 index tensor of ``values`` (through numpy: 6x faster than ``torch.tensor(list)``)."""
    index = torch.from_numpy(np.array(values, dtype=np.int64))
    return index if torch.device(device).type == "cpu" else index.to(device)


def run_start(values: Sequence[int]) -> int | None:
    """The first value when ``values`` are consecutive and ascending (a slice can stand for them), else ``None``."""
    if not values:
        return None
    first, count = values[0], len(values)
    return first if values[-1] - first == count - 1 and list(values) == list(range(first, first + count)) else None


def gather_hits(
    found: Sequence[tuple[Slab, int] | None],
) -> tuple[Layout | None, Parts]:
    """Copy the memory hits out of their slabs (call with the memory tier's lock held).

    Returns:
        The layout of the hits, and per slab the batch positions and gathered leaves.
        Hits whose layout differs from the first slab's are left out (recomputed).
    """
    by_slab: dict[int, tuple[Slab, list[int], list[int]]] = {}
    for pos, hit in enumerate(found):
        if hit is not None:
            entry = by_slab.setdefault(id(hit[0]), (hit[0], [], []))
            entry[1].append(pos)
            entry[2].append(hit[1])
    layout: Layout | None = None
    parts: Parts = []
    for slab, positions, rows in by_slab.values():
        if layout is not None and slab.layout != layout:
            continue
        layout = slab.layout
        index = index_tensor(rows, slab.device)
        parts.append((positions, [gather_rows(t, index) for t in slab.leaves]))
    return layout, parts


def gather_rows(leaf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``leaf`` in a new tensor: a large one on the CPU in a buffer used again (``empty_rows``).

    A fresh allocation of 32 MiB or more costs the kernel new zeroed pages at every call
    (12 ms of a 39 MB batch's 16 ms here); a buffer no tensor refers to any more does not.
    """
    count, row_bytes = len(index), leaf[0].nbytes if len(leaf) else 0
    if leaf.device.type != "cpu" or count * row_bytes < _buffers.MIN_BYTES or not leaf.is_contiguous():
        return leaf.index_select(0, index)
    out = torch.from_numpy(_buffers.empty_rows(count, row_bytes)).view(leaf.dtype).view(count, *leaf.shape[1:])
    return torch.index_select(leaf, 0, index, out=out)


def leaf_devices(devices: Sequence[torch.device], count: int) -> list[torch.device]:
    """The device of each of ``count`` leaves: ``devices`` has one per leaf, or one for all (or the first for all)."""
    return list(devices) if len(devices) == count else [devices[0]] * count


def cast_returned(
    leaves: Sequence[torch.Tensor], layout: Layout, devices: Sequence[torch.device]
) -> list[torch.Tensor]:
    """Cast gathered leaves to the dtype, device and memory format a real call returns (``devices``: per leaf)."""
    return [
        t.to(device=device, dtype=spec.out_dtype, memory_format=spec.memory_format)
        for t, spec, device in zip(leaves, layout.leaves, leaf_devices(devices, len(leaves)))
    ]


def merge_parts(
    parts: Sequence[tuple[list[int], list[torch.Tensor]]],
    batch: int,
    layout: Layout,
    devices: Sequence[torch.device],
) -> list[torch.Tensor]:
    """Scatter the parts' rows into new ``(batch, ...)`` tensors in input order.

    A single part that holds the whole batch in order is returned as it is where its
    tensors already have the output's dtype, device and a contiguous layout: the tiers
    hand over tensors that nothing else holds, so no copy is needed.
    """
    per_leaf = leaf_devices(devices, len(layout.leaves))
    if len(parts) == 1 and len(parts[0][0]) == batch and parts[0][0] == list(range(batch)):
        whole = parts[0][1]
        if all(
            leaf.dtype == spec.out_dtype
            and leaf.device == device
            and leaf.is_contiguous(memory_format=spec.memory_format)
            for leaf, spec, device in zip(whole, layout.leaves, per_leaf)
        ):
            return list(whole)
    runs = [run_start(positions) is not None for positions, _ in parts]  # a run of positions is a slice
    indices = {
        d: [None if run else index_tensor(positions, d) for run, (positions, _) in zip(runs, parts)]
        for d in set(per_leaf)
    }
    outs = []
    for i, (spec, device) in enumerate(zip(layout.leaves, per_leaf)):
        out = torch.empty((batch, *spec.shape), dtype=spec.out_dtype, device=device, memory_format=spec.memory_format)
        for index, (positions, leaves) in zip(indices[device], parts):
            values = leaves[i].to(device=device, dtype=spec.out_dtype)
            if index is None:
                out.narrow(0, positions[0], len(positions)).copy_(values)
            else:
                out.index_copy_(0, index, values)
        outs.append(out)
    return outs
