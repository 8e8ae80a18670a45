"""``FeatureDataset``: a backbone's outputs by dataset index, read straight from a features file.

A read of one index or a batch of them (``__getitems__``, which ``DataLoader`` calls) is
one gather from a read-only map of the file and one xxh3 per row (or, for features that
vary in shape, one batched lookup of whole samples, :mod:`.variable`). A row that is not
written or fails its check is computed again with the backbone and the dataset when
the object holds them (one :class:`~torchcache.errors.CacheWarning` per kind of fault),
and is an error otherwise (a cache opened without its backbone). Samples come back as
the dataset gave them, the backbone's output in place of its input; tensors are copies.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from ..catalog.budget import CacheClaim, claim_directory, keep_root_budget
from ..errors import ConfigError, TorchCacheError
from ..faults import Fault, FaultLog
from ..locations import check_local_dir, check_location, resolve_location, resolve_root
from ..stores.features.digests import DIGESTS_NAME, DigestFile, batch_digests, bindings, pack_digests
from ..stores.features.file import FEATURES_NAME, LEGACY_FEATURES_NAME, forget_damaged, layout_of, open_features
from ..stores.features.layout import SampleLayout
from ..stores.rows import RowsFile
from .backbone import MissingFeatureError, compute_rows, device_of, source_keys
from .remote import from_bucket, header_folder, refuse_options
from .variable import WholeSamples, is_variable_cache, run_samples

__all__ = ["FeatureDataset", "MissingFeatureError"]

_File = TypeVar("_File", RowsFile, WholeSamples)


def find_features(location: str | os.PathLike[str] | None) -> Path:
    """The features file at ``location``: the file, its cache directory, or a root holding one cache.

    A cache of features that vary in shape has no features file: its directory is returned.

    Raises:
        ConfigError: If there is none there, or several.
    """
    path = resolve_root(check_local_dir(location, "path"))
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"there is no features cache at {path}")
    if (path / FEATURES_NAME).is_file():
        return path / FEATURES_NAME
    if is_variable_cache(path):
        return path
    if (path / LEGACY_FEATURES_NAME).is_file():
        raise ConfigError(
            f"{path} holds a features cache of torchcache 1.2; run `torchcache migrate {path.parent}` to read it here"
        )
    try:
        found = sorted(
            p / FEATURES_NAME if (p / FEATURES_NAME).is_file() else p
            for p in path.iterdir()
            if (p / FEATURES_NAME).is_file() or (p.name.startswith("features-") and is_variable_cache(p))
        )
    except OSError as exc:
        raise ConfigError(f"cannot read the cache directory {path}: {exc.strerror or exc}") from None
    if len(found) != 1:
        listed = "; ".join(str(p if p.is_dir() else p.parent) for p in found)
        what = f"{len(found)} features caches ({listed}); pass one of them" if found else "no features cache"
        raise ConfigError(f"{path} holds {what}")
    return found[0]


class FeatureDataset(Dataset[Any]):
    """A map-style dataset of a backbone's outputs by index, read from a features file.

    Made by :func:`torchcache.extract_features`, or by :meth:`open` for a cache made
    earlier (without the backbone). Reads come straight from the file, shared by
    DataLoader workers and processes; the object pickles as the file's path (and the
    backbone and dataset it holds, to compute damaged rows again).

    Args:
        file: The rows (a features file, see :mod:`torchcache.stores.features.file`), or
            the samples kept whole when they vary in shape.
        backbone: The backbone that computed them (``None``: a damaged row is an error).
        dataset: The dataset they were computed from.
        claim: The hold on the cache's directory, let go by :meth:`close`.
    """

    def __init__(
        self,
        file: RowsFile | WholeSamples,
        backbone: torch.nn.Module | None = None,
        dataset: Any = None,
        claim: CacheClaim | None = None,
        version: object = None,
    ) -> None:
        self.file = file
        self._version = version  # extract_features' version: rows computed again must be of the same keys
        self.layout: SampleLayout | None = layout_of(file) if isinstance(file, RowsFile) else None
        self.backbone = backbone
        self.dataset = dataset
        self.length = file.length
        self._faults = FaultLog(self._module)
        self._claim = claim  # while held, the root's budget and prune leave this cache alone
        self._first: torch.Tensor | None = None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        local_cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> FeatureDataset:
        """Open a features cache made earlier, without its backbone or dataset.

        Args:
            path: The cache's directory, its ``features.tcrows`` file, or a cache root
                that holds one features cache; ``None`` for ``$TORCHCACHE_DIR`` or the user
                cache directory. A bucket URL (``s3://bucket/prefix``, or its
                ``.../features-<key>`` folder) reads the file into a local copy first.
            local_cache_dir: With a bucket URL: where this machine keeps its copy.
            storage_options: With a bucket URL: fsspec options, over those of
                ``$TORCHCACHE_STORAGE_OPTIONS``.

        Raises:
            ConfigError: If there is no features cache at ``path``, or several, or it is
                not a valid features file (the message says why).
        """
        location = resolve_location(check_location(path, "path"))
        if isinstance(location, str):
            found = from_bucket(location, local_cache_dir, storage_options)
        else:
            refuse_options(local_cache_dir, storage_options, "path")
            found = find_features(location)
        if found.is_dir():
            return cls(_made_here(WholeSamples.open(found), found))
        try:
            opened = cls(_made_here(open_features(found), found.parent), claim=claim_directory(found.parent))
        except (TorchCacheError, ValueError) as exc:
            raise ConfigError(f"{found} is not a usable features cache: {exc}") from None
        if isinstance(location, str):  # a local copy: its root may have grown by it
            keep_root_budget(found.parent.parent, opened._faults.warn)
        return opened

    @property
    def _module(self) -> str:
        return str(self.info.get("module", "features"))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_faults", "_claim", "_first")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _claim=None, _first=None)  # the process that made it holds the claim
        self._faults = FaultLog(self._module)

    def __repr__(self) -> str:
        where = "in memory" if self.path is None else repr(str(self.path))
        what = "vary in shape" if self.layout is None else f"{self.layout.features.dtype} {self.layout.features.shape}"
        return f"FeatureDataset({where}, {self.length} samples, features {what})"

    @property
    def path(self) -> Path | None:
        """The features file, or the cache's directory for features that vary in shape (``None``: in memory)."""
        return self.file.path

    def _first_features(self) -> torch.Tensor:
        if self._first is None:
            assert isinstance(self.file, WholeSamples)
            self._first = self.file.features(self[0])
        return self._first

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one sample's features (of the first, when they vary in shape)."""
        return tuple(self._first_features().shape) if self.layout is None else self.layout.features.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the features."""
        if self.layout is None:
            return self._first_features().dtype
        return getattr(torch, self.layout.features.dtype)  # type: ignore[no-any-return]

    @property
    def info(self) -> dict[str, Any]:
        """What the cache was made from: module and dataset names and keys, version, layout."""
        if isinstance(self.file, WholeSamples):
            return {**self.file.header, "layout": "variable"}
        return dict(self.file.header)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        """The sample at ``index`` (negative indices count from the end), with its features.

        Raises:
            IndexError: If the index is out of range.
            MissingFeatureError: If the row is damaged and there is no backbone to compute it.
        """
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``, read with one gather (what ``DataLoader`` calls for a batch).

        Raises:
            IndexError: If an index is out of range.
            TypeError: If an index is not an integer.
            MissingFeatureError: If a row is damaged and there is no backbone to compute it.
        """
        wanted = _checked_indices(indices, self.length)
        if not len(wanted):
            return []
        if isinstance(self.file, WholeSamples):
            return self.file.read(wanted.tolist(), self._compute_whole)
        assert self.layout is not None
        return self.layout.decode(self._rows(wanted))

    def batch(self, indices: Sequence[int]) -> Any:
        """The samples at ``indices`` as one batch: what ``default_collate`` makes of them, read in one gather.

        Each field is one contiguous tensor with the batch first; a tuple or list sample
        gives a list of fields, a dict sample a dict. Features that vary in shape are
        collated with ``default_collate``.

        Raises:
            IndexError: If an index is out of range.
            TypeError: If an index is not an integer.
            MissingFeatureError: If a row is damaged and there is no backbone to compute it.
        """
        wanted = _checked_indices(indices, self.length)
        if not len(wanted):
            raise ValueError("FeatureDataset.batch() needs at least one index, got none")
        if self.layout is None:
            return default_collate(self.__getitems__(indices))  # type: ignore[no-untyped-call]
        return self.layout.collate(self._rows(wanted))

    def loader(self, batch_size: int, **options: Any) -> DataLoader[Any]:
        """A ``DataLoader`` of whole batches, each read with one gather and decoded once (:meth:`batch`).

        It gives the batches ``DataLoader(features, batch_size=...)`` gives, without
        collating them sample by sample.

        Args:
            batch_size: Samples per batch.
            **options: ``shuffle`` (a new random order every epoch), ``drop_last``, ``generator``
                (for a reproducible order), ``collate_fn`` (makes a batch of a list of samples
                instead), and the DataLoader's own: ``num_workers``, ``pin_memory``, ...

        Raises:
            ValueError: If ``batch_size`` is not a positive int.
            TypeError: If ``options`` set ``sampler`` or ``batch_sampler``.

        Example::

            for feats, labels in features.loader(256, shuffle=True, num_workers=2):
                loss = criterion(head(feats), labels)
        """
        from .loader import make_loader

        return make_loader(self, batch_size, **options)

    def _rows(self, wanted: np.ndarray[Any, np.dtype[np.int64]]) -> np.ndarray[Any, Any]:
        """The checked rows of ``wanted`` (in range), those missing or damaged computed again."""
        assert isinstance(self.file, RowsFile)
        found, rows, missing, bad = self.file.read(wanted)
        if missing or bad:
            whole = np.empty((len(wanted), rows.shape[1]), np.uint8)
            whole[found] = rows
            self._repair(wanted, whole, missing, bad)
            rows = whole
        return rows

    def _no_backbone(self, index: int, what: str) -> MissingFeatureError:
        return MissingFeatureError(
            f"the features of sample {index} in {self.path} are {what} and there is no backbone here to compute "
            "them; run torchcache.extract_features(backbone, dataset) again to complete the cache"
        )

    def _compute_whole(self, indices: list[Any]) -> list[Any]:
        """The samples at ``indices`` computed again (features that vary in shape)."""
        assert isinstance(self.file, WholeSamples)
        problem, _ = _sources_problem(self, indices, "damaged or not computed")
        if problem is not None:
            raise problem
        assert self.backbone is not None
        return run_samples(self.backbone, [self.dataset[i] for i in indices], self.file.header["input"])

    def _repair(
        self, wanted: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], missing: list[int], bad: list[int]
    ) -> None:
        """Compute the rows at ``missing`` and ``bad`` positions again, into ``rows`` and the file."""
        assert isinstance(self.file, RowsFile) and self.layout is not None
        positions = sorted(set(missing) | set(bad))
        unique = sorted({int(wanted[j]) for j in positions})
        problem, write = _sources_problem(self, unique, "damaged" if bad else "not computed")  # checks still held
        if bad:
            forget_damaged(self.file, sorted({int(wanted[j]) for j in bad}), self._faults.warn)
        if problem is not None:
            raise problem
        assert self.backbone is not None and self.dataset is not None
        if device_of(self.backbone).type == "cuda" and getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            raise MissingFeatureError(_FORKED.format(count=len(positions), path=self.path))
        computed, _ = compute_rows(self.backbone, self.layout, [self.dataset[i] for i in unique])
        by_index = dict(zip(unique, computed, strict=True))
        for j in positions:
            rows[j] = by_index[int(wanted[j])]
        if write:
            try:
                self.file.write(np.asarray(unique, np.int64), computed)
            except OSError as exc:
                self._faults.warn(
                    Fault.WRITE, f"cannot write to {self.path} ({exc}): those features are computed again"
                )

    def close(self) -> None:
        """Close the file and let go of the cache, which the root's budget may then remove (samples read stay valid)."""
        self.file.close()
        if self._claim is not None:
            self._claim.release()


_FORKED = (
    "{count} rows of {path} were damaged since extract_features checked them, and this DataLoader worker was forked "
    "from a process that uses CUDA, where the CUDA backbone cannot run. Call extract_features(backbone, dataset) "
    "again in the main process (it computes them), or give the DataLoader multiprocessing_context='spawn'"
)


def _sources_problem(data: FeatureDataset, indices: list[int], what: str) -> tuple[MissingFeatureError | None, bool]:
    """Why the rows at ``indices`` cannot be computed again here, if they cannot; and whether to write them.

    The backbone must still have the cache's module key, and the dataset its key or, where
    it changed (a memo of decoded samples among its attributes), give for these indices the
    inputs whose digests the rows were written with: then the rows are served, not written
    (their other fields, a label, come from the dataset as it is now).
    """
    if data.backbone is None or data.dataset is None:
        return data._no_backbone(indices[0], what), False
    header = data.file.header
    module_key, dataset_key = source_keys(data.backbone, data.dataset, data._version)
    if module_key == header["module_key"] and dataset_key == header["dataset_key"]:
        return None, True
    if module_key == header["module_key"] and _inputs_as_written(data, indices):
        return None, False
    return MissingFeatureError(
        f"the features of sample {indices[0]} in {data.path} are {what}, and the backbone or the dataset changed "
        "since they were extracted (weights, code or data): rows computed now would not be the features this "
        "cache holds; run torchcache.extract_features(backbone, dataset) again"
    ), False


def _inputs_as_written(data: FeatureDataset, indices: list[int]) -> bool:
    """Whether the dataset's inputs at ``indices`` have the digests their rows were written with."""
    file, layout = data.file, data.layout
    digests = None
    if isinstance(file, RowsFile) and file.path is not None and layout is not None:
        digests = DigestFile.open(file.path.with_name(DIGESTS_NAME), file.length, create=False)
    if digests is None:
        return False
    try:
        known, bound = digests.read()
    except OSError:
        return False
    finally:
        digests.close()
    at = np.asarray(indices, np.int64)
    if not bound[at].all() or (bound[at] != bindings(known[at], file.checks(at))).any():  # type: ignore[union-attr]
        return False
    inputs, _ = layout.split([data.dataset[i] for i in indices])  # type: ignore[union-attr]
    now = pack_digests(batch_digests(default_collate(inputs), len(indices)))  # type: ignore[no-untyped-call]
    return bool((now == known[at]).all())


def _made_here(file: _File, folder: Path) -> _File:
    """``file``, unless ``folder`` is named for other keys than its header's (a copy of a bucket's adds a suffix).

    Raises:
        ConfigError: If it is.
    """
    made = header_folder(file.header)
    if folder.name.startswith("features-") and folder.name != made and not folder.name.startswith(made + "-"):
        file.close()
        raise ConfigError(f"{folder} holds features made for other keys (those of {made}); not used")
    return file


def _checked_indices(indices: Sequence[int], length: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``indices`` as an array, negative ones counted from the end, checked against ``length``.

    Raises:
        TypeError: If an index is not an integer (``2.7``, ``"3"``, a float tensor, a bool).
        IndexError: If one is out of range, naming it as given.
    """
    if isinstance(indices, (int, slice, str, bytes, Mapping, AbstractSet)) or not hasattr(indices, "__iter__"):
        raise TypeError(
            "FeatureDataset.batch(indices) takes a list, a numpy array or a 1-D tensor of integers, "
            f"got {type(indices).__name__}"
        )
    if not hasattr(indices, "__len__"):  # a generator
        indices = list(indices)
    if getattr(indices, "ndim", 1) != 1:  # a 2-D array or tensor is not a batch of positions
        raise TypeError(f"FeatureDataset indices must be one list of integers, got shape {np.shape(indices)}")
    if isinstance(indices, np.ndarray) and indices.dtype.kind in "iu":  # a sampler's array: nothing per index
        if len(indices) and (top := indices.max()) >= length:  # before a uint64 wraps to a negative int64
            raise IndexError(f"index {top} is out of range for {length} samples")
        given = indices.astype(np.int64, copy=False)
        if not len(given) or given.min() >= 0:  # the largest was checked: all in range
            return given
    else:
        given = _as_positions(indices, length)
    wanted = given
    if len(given) and (given.min() < 0 or given.max() >= length):
        wanted = np.where(given < 0, given + length, given)
        outside = (wanted < 0) | (wanted >= length)
        if outside.any():
            raise IndexError(f"index {int(given[outside][0])} is out of range for {length} samples")
    return wanted


def _as_positions(indices: Sequence[Any], length: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """A 1-D sequence of integers (not an integer array) as int64 positions.

    Raises:
        TypeError: If an item is not an integer (``2.7``, ``"3"``, a float tensor, a bool).
        IndexError: If one is past int64.
    """
    kinds = set(map(type, indices))
    masks = torch.Tensor in kinds and any(getattr(i, "dtype", None) is torch.bool for i in indices)
    if bool in kinds or masks or getattr(indices, "dtype", None) in (torch.bool, np.bool_):  # a mask is no positions
        raise TypeError(f"FeatureDataset indices must be integers, got {list(indices)[:4]!r}")
    try:
        if kinds <= {int}:  # a batch sampler's list
            return np.fromiter(indices, np.int64, len(indices))
        return np.array([operator.index(i) for i in indices], np.int64)  # 2.7, "3", a float tensor: refused
    except OverflowError:  # an int past int64: no such position
        far = next(i for i in map(int, indices) if not -(1 << 63) <= i < 1 << 63)
        raise IndexError(f"index {far} is out of range for {length} samples") from None
    except (TypeError, ValueError):
        several = next((i for i in indices if getattr(i, "ndim", 0)), None)  # features[tensor([1, 2])]
        shape: tuple[int, ...] | None = None if several is None else tuple(np.shape(several))
        hint = "" if shape is None else f"; several go to features.batch(indices), not in one of shape {shape}"
        raise TypeError(f"FeatureDataset indices must be integers, got {list(indices)[:4]!r}{hint}") from None
