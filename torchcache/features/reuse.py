"""Rows that other features caches computed from the same inputs with the same backbone.

When a dataset changes (samples added, removed, edited or reordered), its fingerprint
changes and ``extract_features`` makes a new cache. Most of its samples are often the
same as before, and a backbone's output depends only on its weights, code and input:
so the new cache takes a row from an older cache of the same backbone (the same module
key, mode and input field) whose input digest (:mod:`torchcache.stores.features.digests`)
equals the new sample's, and runs the backbone only on the others. The digest covers
the input's bytes after the dataset's transforms, so a changed transform or a changed
file gives other digests and nothing is taken; the other fields (the label) always come
from the new sample. A donor row is served only when its own check passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, CorruptEntryError, StoreError
from ..stores.features.digests import DIGESTS_NAME, DigestFile
from ..stores.features.file import FEATURES_NAME, FeatureFile
from ..stores.features.layout import Field, VariableLayoutError
from ..tree import DTYPES
from .dataset import run_backbone

__all__ = ["Donors", "open_digests", "outputs"]

#: Older caches looked at, most recently written first.
_MAX_DONORS = 4


class Donors:
    """The rows of older caches of one backbone and input field, found by input digest."""

    def __init__(self, files: list[FeatureFile], table: dict[bytes, tuple[int, int, int]]) -> None:
        self._files = files
        self._table = table  # input digest: (donor, row, the row's check that its entry names)

    def __len__(self) -> int:
        return len(self._table)

    @classmethod
    def find(cls, root: Path, own: str, module_key: str, input: int | str) -> Donors | None:
        """The donors in ``root`` for a backbone's ``module_key`` and ``input`` field (not the cache ``own``).

        Returns:
            ``None`` if no cache there has a written row with a known digest.
        """
        found: list[tuple[float, Path]] = []
        with contextlib.suppress(OSError):
            for directory in root.iterdir():
                if directory.name.startswith("features-") and directory.name != own:
                    with contextlib.suppress(OSError):
                        found.append(((directory / DIGESTS_NAME).stat().st_mtime, directory))
        files: list[FeatureFile] = []
        table: dict[bytes, tuple[int, int, int]] = {}
        for _, directory in sorted(found, reverse=True):
            if len(files) == _MAX_DONORS:
                break
            try:
                file = FeatureFile.open(directory / FEATURES_NAME)
            except (OSError, CorruptEntryError, ConfigError):  # a cache that cannot be read gives nothing
                continue
            header = file.header
            if header.get("module_key") != module_key or header.get("input") != input or file.path is None:
                file.close()
                continue
            digests = DigestFile.open(directory / DIGESTS_NAME, file.length, create=False)
            if digests is None:
                file.close()
                continue
            try:
                known, bound = digests.read()
            except OSError:
                file.close()
                continue
            finally:
                digests.close()
            # An entry counts only for the row content it was written for: its check is the row's.
            rows = np.flatnonzero((bound != 0) & (bound == file.checks(np.arange(file.length))))
            if not len(rows):
                file.close()
                continue
            position = len(files)
            files.append(file)
            for digest, row, check in zip(map(bytes, known[rows]), rows.tolist(), bound[rows].tolist(), strict=True):
                table.setdefault(digest, (position, row, check))
        if not table:
            return None
        return cls(files, table)

    def take(self, digests: Sequence[bytes | None], field: Field | None) -> tuple[list[int], torch.Tensor | None]:
        """The positions in a batch whose rows an older cache holds, and their features.

        Args:
            digests: The input digest of each sample of the batch (``None``: unknown).
            field: The features field the rows must have (dtype and shape); ``None``
                before the first output is known: then the first donor's.

        Returns:
            The positions served, ascending, and their features (``None`` if none).
        """
        wanted: dict[int, list[tuple[int, int, int]]] = {}
        for position, digest in enumerate(digests):
            hit = None if digest is None else self._table.get(digest)
            if hit is not None:
                wanted.setdefault(hit[0], []).append((position, hit[1], hit[2]))
        served: list[int] = []
        parts: list[torch.Tensor] = []
        for donor, pairs in wanted.items():
            file = self._files[donor]
            own = file.layout.features
            if field is None:
                field = own
            if (own.dtype, own.shape) != (field.dtype, field.shape):
                continue
            positions = [p for p, _, _ in pairs]
            indices = np.asarray([r for _, r, _ in pairs], np.int64)
            try:
                rows, missing, bad = file.read(indices)
            except (OSError, StoreError):  # a donor cut short or gone gives nothing: the backbone runs
                continue
            bound = np.asarray([c for _, _, c in pairs], np.uint64)
            changed = np.flatnonzero(file.checks(indices) != bound).tolist()  # rewritten since: not that row
            keep = np.setdiff1d(np.arange(len(pairs)), np.asarray(missing + bad + changed, np.int64))
            if not len(keep):
                continue
            raw = np.ascontiguousarray(rows[keep, own.offset : own.offset + own.nbytes])
            parts.append(torch.from_numpy(raw).view(DTYPES[own.dtype]).reshape(len(keep), *own.shape))
            served += [positions[j] for j in keep.tolist()]
        if not served:
            return [], None
        features = torch.cat(parts) if len(parts) > 1 else parts[0]
        order = np.argsort(np.asarray(served), kind="stable")
        return sorted(served), features[torch.from_numpy(order)]

    def close(self) -> None:
        """Close the donors' files."""
        for file in self._files:
            file.close()
        self._files = []
        self._table = {}


def outputs(
    backbone: torch.nn.Module,
    inputs: Any,
    count: int,
    digests: list[bytes | None],
    donors: Donors | None,
    field: Field | None,
) -> torch.Tensor:
    """The backbone's outputs for a batch: taken from older caches where they hold the same input, else computed.

    Raises:
        VariableLayoutError: If the outputs computed and those taken differ in shape or dtype.
    """
    if donors is None or not isinstance(inputs, torch.Tensor):
        return run_backbone(backbone, inputs, count)
    served, taken = donors.take(digests, field)
    if taken is None:
        return run_backbone(backbone, inputs, count)
    if len(served) == count:
        return taken
    rest = np.setdiff1d(np.arange(count), np.asarray(served))
    computed = run_backbone(backbone, inputs[torch.from_numpy(rest)], len(rest))
    if computed.shape[1:] != taken.shape[1:] or computed.dtype != taken.dtype:
        raise VariableLayoutError(
            f"the backbone returned {computed.dtype} outputs of shape {tuple(computed.shape[1:])}, but an older "
            f"cache holds {taken.dtype} outputs of shape {tuple(taken.shape[1:])}"
        )
    output = torch.empty((count, *computed.shape[1:]), dtype=computed.dtype)
    output[torch.from_numpy(rest)] = computed
    output[torch.as_tensor(served)] = taken
    return output


def open_digests(file: FeatureFile) -> DigestFile | None:
    """The input digests beside a features file (made when missing; none for rows in memory)."""
    if file.path is None:
        return None
    return DigestFile.open(file.path.with_name(DIGESTS_NAME), file.length, create=True)
