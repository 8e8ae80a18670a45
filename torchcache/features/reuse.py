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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..dtypes import DTYPES
from ..errors import ConfigError, CorruptEntryError, StoreError
from ..stores.features.digests import DIGESTS_NAME, DigestFile, bindings, pack_digests
from ..stores.features.file import FEATURES_NAME, layout_of, open_features, remove_features
from ..stores.features.layout import Field, SampleLayout, VariableLayoutError
from ..stores.rows import RowsFile
from .backbone import run_backbone

__all__ = ["Donors", "open_digests", "outputs"]

#: Older caches looked at, most recently written first.
_MAX_DONORS = 4


@dataclass
class _Donor:
    """One older cache: its file, and its usable entries sorted by the first 8 bytes of their digest."""

    file: RowsFile
    layout: SampleLayout
    prefixes: np.ndarray[Any, np.dtype[np.uint64]]
    digests: np.ndarray[Any, np.dtype[np.uint8]]  # (n, 16), in the order of ``prefixes``
    rows: np.ndarray[Any, np.dtype[np.int64]]
    checks: np.ndarray[Any, np.dtype[np.uint64]]  # the row checks the entries name


def _prefixes(digests: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.ascontiguousarray(digests[:, :8]).view("<u8").reshape(len(digests)).astype(np.uint64)


class Donors:
    """The rows of older caches of one backbone and input field, found by input digest.

    Each older cache's usable entries are kept as sorted arrays (40 bytes per row, not a
    dictionary of Python objects), and a batch is looked up with one binary search per
    cache.
    """

    def __init__(self, donors: list[_Donor]) -> None:
        self._donors = donors

    def __len__(self) -> int:
        return sum(len(d.rows) for d in self._donors)

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
        donors: list[_Donor] = []
        for _, directory in sorted(found, reverse=True):
            if len(donors) == _MAX_DONORS:
                break
            donor = _open_donor(directory, module_key, input)
            if donor is not None:
                donors.append(donor)
        return cls(donors) if donors else None

    def take(self, digests: list[bytes | None], field: Field | None) -> tuple[list[int], torch.Tensor | None]:
        """The positions in a batch whose rows an older cache holds, and their features.

        Args:
            digests: The input digest of each sample of the batch (``None``: unknown).
            field: The features field the rows must have (dtype and shape); ``None``
                before the first output is known: then the first donor's.

        Returns:
            The positions served, ascending, and their features (``None`` if none).
        """
        query = pack_digests(digests)
        wanted = np.asarray([d is not None for d in digests], np.bool_)
        prefixes = _prefixes(query)
        served: list[np.ndarray[Any, Any]] = []
        parts: list[torch.Tensor] = []
        for donor in self._donors:
            own = donor.layout.features
            field = own if field is None else field
            if not wanted.any() or (own.dtype, own.shape) != (field.dtype, field.shape):
                continue
            at = np.minimum(np.searchsorted(donor.prefixes, prefixes), len(donor.prefixes) - 1)
            hit = wanted & (donor.prefixes[at] == prefixes) & (donor.digests[at] == query).all(axis=1)
            where = np.flatnonzero(hit)
            if not len(where):
                continue
            indices = donor.rows[at[where]]
            try:
                found, rows, _, _ = donor.file.read(indices)
            except (OSError, StoreError):  # a donor cut short or gone gives nothing: the backbone runs
                continue
            changed = np.flatnonzero(donor.file.checks(indices) != donor.checks[at[where]])  # rewritten since
            unchanged = np.isin(found, changed, invert=True)
            keep = found[unchanged]
            if not len(keep):
                continue
            raw = np.ascontiguousarray(rows[unchanged, own.offset : own.offset + own.nbytes])
            parts.append(torch.from_numpy(raw).view(DTYPES[own.dtype]).reshape(len(keep), *own.shape))
            served.append(where[keep])
            wanted[where[keep]] = False
        if not served:
            return [], None
        positions = np.concatenate(served)
        order = np.argsort(positions, kind="stable")
        features = torch.cat(parts) if len(parts) > 1 else parts[0]
        return positions[order].tolist(), features[torch.from_numpy(order)]

    def close(self) -> None:
        """Close the donors' files."""
        for donor in self._donors:
            donor.file.close()
        self._donors = []


def _open_donor(directory: Path, module_key: str, input: int | str) -> _Donor | None:
    """The cache in ``directory`` as a donor, if it is one of this backbone and input with usable entries."""
    try:
        file = open_features(directory / FEATURES_NAME)
    except (OSError, CorruptEntryError, ConfigError):  # a cache that cannot be read gives nothing
        return None
    header = file.header
    digests = None
    if header.get("module_key") == module_key and header.get("input") == input and file.path is not None:
        digests = DigestFile.open(directory / DIGESTS_NAME, file.length, create=False)
    if digests is None:
        file.close()
        return None
    try:
        known, bound = digests.read()
    except OSError:
        file.close()
        return None
    finally:
        digests.close()
    # An entry counts only for the row content it was written for, and for its own digest: its
    # binding is the digest's hash seeded by the row's check.
    checks = file.checks(np.arange(file.length))
    rows = np.flatnonzero(bound != 0)
    rows = rows[bound[rows] == bindings(known[rows], checks[rows])]
    if not len(rows):
        file.close()
        return None
    prefixes = _prefixes(known[rows])
    order = np.argsort(prefixes, kind="stable")
    rows = rows[order]
    return _Donor(file, layout_of(file), prefixes[order], known[rows], rows.astype(np.int64), checks[rows])


def outputs(
    backbone: torch.nn.Module,
    inputs: Any,
    count: int,
    digests: list[bytes | None] | None,
    donors: Donors | None,
    field: Field | None,
) -> torch.Tensor:
    """The backbone's outputs for a batch: taken from older caches where they hold the same input, else computed.

    ``digests`` are the inputs' (``None`` when they were not hashed: nothing is taken).

    Raises:
        VariableLayoutError: If the outputs computed and those taken differ in shape or dtype.
    """
    if donors is None or digests is None or not isinstance(inputs, torch.Tensor):
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


def open_digests(file: RowsFile) -> DigestFile | None:
    """The input digests beside a features file (made when missing, or in place of a damaged or planted one).

    None for rows in memory, or where none can be made.
    """
    if file.path is None:
        return None
    path = file.path.with_name(DIGESTS_NAME)
    opened = DigestFile.open(path, file.length, create=True)
    judged = DigestFile.planted_or_damaged(path, file.length) if opened is None else None
    if judged is not None:  # that file (or link) goes, never what a link names, nor one made since
        remove_features(path, judged)
        opened = DigestFile.open(path, file.length, create=True)
    return opened
