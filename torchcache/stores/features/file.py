"""The file of a features cache: a :class:`~torchcache.stores.rows.RowsFile` whose header holds the sample layout.

One row per dataset index, each a sample as :class:`~.layout.SampleLayout` lays it
out; the header holds that layout with the keys and names the cache was made for.
Features caches of torchcache 1.2 (``features.tcfeat``) are read only by
``torchcache migrate``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..._gc import collector_paused
from ...errors import CorruptEntryError
from ...faults import Fault, Report
from ..files import identity
from ..rows import RowsFile
from .layout import SampleLayout

__all__ = [
    "same_header",
    "FEATURES_NAME",
    "LEGACY_FEATURES_NAME",
    "create_features",
    "features_in_memory",
    "forget_damaged",
    "layout_of",
    "missing_or_damaged",
    "open_existing",
    "open_features",
    "remove_features",
]

FEATURES_NAME = "features.tcrows"
#: The features file of torchcache 1.2, which ``torchcache migrate`` turns into a :data:`FEATURES_NAME`.
LEGACY_FEATURES_NAME = "features.tcfeat"

Warn = Report


def layout_of(file: RowsFile) -> SampleLayout:
    """The sample layout of a features file's rows.

    Raises:
        CorruptEntryError: If the header holds no valid layout for the file's rows.
    """
    layout = SampleLayout.from_json(file.header.get("layout"))
    if layout.stride != file.row_size or file.header.get("length") != file.length:
        raise CorruptEntryError("its header does not describe the file")
    return layout


def create_features(path: Path, header: dict[str, Any]) -> RowsFile:
    """Make the features file for ``header`` (its ``length`` and ``layout``), or open the one another process made.

    Raises:
        OSError: If it cannot be made (a read-only directory, a full disk).
        CorruptEntryError: If another process made a file at ``path`` that is invalid.
    """
    file = RowsFile.create(path, header, header["length"], header["layout"]["stride"])
    _check(file)
    return file


def open_features(path: Path) -> RowsFile:
    """Open the features file at ``path``, read-write if allowed, else read-only.

    Raises:
        FileNotFoundError: If there is none.
        CorruptEntryError: If it is not a valid features file (the message says why).
        OSError: If it cannot be opened.
    """
    file = RowsFile.open(path)
    _check(file)
    return file


def features_in_memory(header: dict[str, Any]) -> RowsFile:
    """Rows for ``header`` in anonymous memory (when no file can be made)."""
    return RowsFile.in_memory(header, header["length"], header["layout"]["stride"])


def _check(file: RowsFile) -> None:
    try:
        layout_of(file)
    except BaseException:
        file.close()
        raise


def same_header(stored: dict[str, Any], header: dict[str, Any]) -> bool:
    """Whether a stored header holds every field of ``header`` as it is (the same keys, input and length)."""
    return {k: stored.get(k) for k in header} == header


def open_existing(path: Path, header: dict[str, Any], warn: Warn) -> RowsFile | None:
    """The features file at ``path`` if it is whole and made for ``header``; a damaged one is removed.

    ``warn(kind, message)`` is called for a file that is damaged, made for other keys,
    cannot be opened, or is of torchcache 1.2.
    """
    try:
        file = open_features(path)
    except (FileNotFoundError, NotADirectoryError):
        if path.with_name(LEGACY_FEATURES_NAME).is_file():
            warn(
                Fault.LEGACY,
                f"{path.parent} holds a features cache of torchcache 1.2, which this version reads only once "
                f"migrated: run `torchcache migrate {path.parent.parent}` to use it; computing the features again",
            )
        return None
    except (CorruptEntryError, ValueError) as exc:
        warn(Fault.CORRUPT, f"the features file {path} is damaged ({exc}): computed again")
        remove_features(path)
        return None
    except OSError as exc:
        st = os.lstat(path) if path.is_symlink() else None
        if st is not None:  # planted: the link goes (never what it names), and the file is made again
            warn(Fault.CORRUPT, f"the features file {path} is a link ({exc}): removed, computed again")
            remove_features(path, identity(st))
            return None
        warn(Fault.OPEN, f"cannot open the features file {path} ({exc}): computed again")
        return None
    if not same_header(file.header, header):
        file.close()
        warn(Fault.CORRUPT, f"the features file {path} was made for other keys: computed again")
        remove_features(path)
        return None
    return file


def missing_or_damaged(file: RowsFile, warn: Warn) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The rows to compute: those not written, and those damaged (checked here, where the backbone can run).

    Checking every row at open costs a read of the file (about what one epoch reads), and
    means that a DataLoader worker, which may not be able to run the backbone (a CUDA
    backbone in a forked worker), meets a damaged row only if it was damaged since.
    """
    with collector_paused():  # a burst of short-lived objects: see torchcache._gc
        damaged = file.damaged()
    if len(damaged):
        forget_damaged(file, damaged.tolist(), warn)
    todo = np.zeros(file.length, np.bool_)  # (np.union1d would import numpy's set routines: 0.1 s)
    todo[file.missing()] = True
    todo[damaged] = True
    return np.flatnonzero(todo).astype(np.int64)


def forget_damaged(file: RowsFile, indices: list[int], warn: Warn) -> None:
    """Warn about damaged rows and mark them not written, so that they are computed and written again.

    A read-only file keeps them marked: they are computed again at each read.
    """
    warn(Fault.CORRUPT, f"{len(indices)} damaged rows in {file.path}: computed again")
    with contextlib.suppress(OSError):
        file.unmark(indices)


def remove_features(path: Path, judged: tuple[int, ...] | None = None) -> None:
    """Remove a features file (renamed aside first, so that no process opens it half removed).

    With ``judged``, the :func:`~torchcache.stores.files.identity` of the file found damaged (or a link), only
    that one goes: a file another process made there since is put back.
    """
    with contextlib.suppress(OSError):
        aside = path.with_name(f".{path.name}.{os.getpid()}.damaged")
        os.rename(path, aside)
        try:
            if judged is not None and identity(os.lstat(aside)) != judged:
                os.link(aside, path, follow_symlinks=False)  # fails if yet another file is there now
        finally:
            os.unlink(aside)
