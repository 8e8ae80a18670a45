"""``extract_features``: run a frozen backbone over a dataset once, then read its outputs by index.

The linear-probe workflow: the backbone runs over the dataset in batches through a
``DataLoader`` (its workers, the device the backbone is on, a progress bar), and each
sample's output is stored with the sample's other fields (its label) in a row of a
fixed-stride file (:mod:`torchcache.stores.features.file`); later epochs, runs and processes
read rows straight from the file, a batch of random indices in one gather.

The cache lives in ``<root>/features-<key>/`` (the root is ``cache_dir``, else
``$TORCHCACHE_DIR``, else the user cache directory); the key covers the backbone as the
decorator keys it (class, source, attributes, weights; refused while it has trainable
parameters), its train/eval mode, the dataset's fingerprint
(:func:`~torchcache.datasets.keys.fingerprint_dataset`, with ``version``) and the input
field: change any of them and the features go to another directory, where the rows of
inputs that an older cache of the same backbone holds are taken from it
(:mod:`torchcache.features.reuse`) and the backbone runs on the others.
A killed extraction leaves the rows it wrote marked and the others unmarked; a rerun
computes only the unmarked ones. Random augmentation before the backbone is detected
(two reads of a sample that differ) and refused, since its outputs cannot be cached.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from .._log import logger
from .._version import __version__
from ..catalog.budget import claim_module_cache, keep_root_budget
from ..catalog.removal import remove_cache
from ..errors import ConfigError, CorruptEntryError
from ..faults import Fault, FaultLog
from ..locations import check_location, resolve_location
from ..meta import META_NAME, write_json_atomic
from ..module.guards import check_frozen
from ..stores.features.digests import batch_digests
from ..stores.features.file import (
    FEATURES_NAME,
    create_features,
    features_in_memory,
    layout_of,
    missing_or_damaged,
    open_existing,
    remove_features,
    same_header,
)
from ..stores.features.layout import SampleLayout, VariableLayoutError
from ..stores.rows import RowsFile
from .backbone import MissingFeatureError, source_keys
from .dataset import FeatureDataset
from .probe import check_deterministic, refuse_dependent, refuse_random
from .remote import FeaturesBucket, folder_of, refuse_options
from .reuse import Donors, outputs
from .variable import extract_variable, made_for
from .writer import Batch, BatchWriter

__all__ = ["FeatureDataset", "MissingFeatureError", "extract_features"]

_STOCHASTIC = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)


def extract_features(
    backbone: torch.nn.Module | None,
    dataset: Any,
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    version: object = None,
    input: int | str = 0,
    progress: bool = True,
    local_cache_dir: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> FeatureDataset:
    """Run a frozen backbone over a dataset once and return its outputs as a dataset, by index.

    The first call computes every sample's features in batches and stores them with the
    sample's other fields; later calls, in this process or another, find them by key and
    return at once (the backbone does not run, the dataset is not read). A call after an
    interrupted one computes only the samples that were missing. For a changed dataset
    (another key), the backbone runs only on inputs that no older cache of it holds.
    torch's global random generators (CUDA's too, once initialised) are left as they were,
    although the DataLoader that reads the dataset draws its seed from them.

    Args:
        backbone: A frozen module (no parameter requires grad), on the device it should
            run on, in eval mode if it holds dropout or batch norm. ``None`` (with
            ``dataset=None``) opens the cache at ``cache_dir`` without it.
        dataset: A map-style dataset whose samples are the backbone's input (a tensor),
            or a tuple, list or dict holding it (``(image, label)``). Its transforms must
            be deterministic: random augmentation is refused.
        batch_size: Samples per backbone call while extracting.
        num_workers: DataLoader workers that read the dataset while extracting.
        cache_dir: The root of caches (default ``$TORCHCACHE_DIR``, else the user cache
            directory); each backbone and dataset get a ``features-<key>`` directory in it.
            With ``backbone=None``, the cache's own directory or a root holding one. A
            bucket URL (``s3://bucket/prefix``, ``gs://...``) keeps the features there
            for other machines (:mod:`torchcache.features.remote`).
        version: Part of the dataset's key: change it when the data changed in a way
            the dataset's attributes do not show (files edited on disk).
        input: The field of a sample that goes through the backbone: its position in a
            tuple or list, or its key in a dict. The other fields are stored beside the
            features and returned as they were.
        progress: Show a progress bar while extracting, when tqdm is installed and
            stderr is a terminal (or in a notebook).
        local_cache_dir: With a bucket URL: where this machine keeps its copy of the
            features (default ``$TORCHCACHE_LOCAL_DIR``, else ``copies`` under the cache root).
        storage_options: With a bucket URL: fsspec options (``endpoint_url``,
            credentials...), over those of ``$TORCHCACHE_STORAGE_OPTIONS``.

    Returns:
        A map-style dataset of ``len(dataset)`` samples: each the dataset's sample with
        the backbone's output (on the CPU) in place of its input.

    Raises:
        ConfigError: If the backbone has trainable parameters or stochastic layers in
            training mode, the dataset applies random augmentation, its samples or the
            backbone's outputs vary in shape, or an argument is invalid.
        KeyingError: If the backbone or the dataset cannot be keyed (the message names
            the attribute and how to give a key).

    Example:
        >>> import tempfile, torch
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.arange(10))
        >>> head = torch.nn.Linear(4, 3).requires_grad_(False)
        >>> feats = extract_features(head, data, batch_size=4, cache_dir=tempfile.mkdtemp(), progress=False)
        >>> x, y = feats[7]
        >>> image, label = data[7]
        >>> torch.allclose(x, head(image)), y
        (True, tensor(7))
        >>> len(feats), feats.shape
        (10, (3,))
    """
    if backbone is None:
        if dataset is not None:
            raise ConfigError("extract_features(None, dataset): pass the backbone, or dataset=None to open a cache")
        return FeatureDataset.open(cache_dir, local_cache_dir=local_cache_dir, storage_options=storage_options)
    where = (cache_dir, local_cache_dir, storage_options)
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        return _extract_features(backbone, dataset, batch_size, num_workers, where, version, input, progress)


def _extract_features(
    backbone: torch.nn.Module,
    dataset: Any,
    batch_size: int,
    num_workers: int,
    where: tuple[Any, Any, Any],
    version: object,
    input: int | str,
    progress: bool,
) -> FeatureDataset:
    """:func:`extract_features` with a backbone, once the global generators are forked.

    ``where``: ``cache_dir``, ``local_cache_dir`` and ``storage_options``.
    """
    _check_arguments(backbone, batch_size, num_workers, input)
    try:
        length = len(dataset)
    except TypeError:
        raise TypeError(f"extract_features needs a map-style dataset with __len__, got {dataset!r}") from None
    if length == 0:
        raise ConfigError("extract_features: the dataset is empty")
    faults = FaultLog(type(backbone).__qualname__)
    cache_dir, local_cache_dir, storage_options = where
    location = resolve_location(check_location(cache_dir, "cache_dir"))
    remote = None if isinstance(location, Path) else FeaturesBucket(location, local_cache_dir, storage_options, faults)
    if remote is None:
        refuse_options(local_cache_dir, storage_options, "cache_dir")
    module_key, dataset_key = source_keys(backbone, dataset, version)
    folder = folder_of(module_key, dataset_key, input)
    directory = remote.local_dir(folder) if remote is not None else Path(location) / folder
    header = {
        "format": 1,
        "length": length,
        "module": f"{type(backbone).__module__}.{type(backbone).__qualname__}",
        "module_key": module_key,
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "dataset_key": dataset_key,
        "version": repr(version),
        "input": input,
    }

    def variable() -> FeatureDataset:
        """Samples kept whole in a dataset cache (they vary in shape): the missing ones computed."""
        bar = _progress_bar(length, None) if progress else None
        try:
            check = functools.partial(check_deterministic, dataset)
            update = None if bar is None else bar.update
            whole = extract_variable(backbone, dataset, directory, header, batch_size, num_workers, check, update)
            return FeatureDataset(whole, backbone, dataset, version=version)
        finally:
            if bar is not None:
                bar.close()

    stored = made_for(directory) if remote is None else None
    if stored is not None:
        if not same_header(stored, header):  # a folder copied or planted under this key
            faults.warn(Fault.CORRUPT, f"the features in {directory} were made for other keys: computed again")
            try:
                remove_cache(directory)
            except OSError as exc:
                raise ConfigError(f"{directory} holds features made for other keys and cannot be removed ({exc}); "
                                  "remove it") from None  # fmt: skip
        return variable()
    claim = claim_module_cache(directory.parent, directory.name, faults.warn)  # the root's budget keeps it
    try:
        file = open_existing(directory / FEATURES_NAME, header, faults.warn)
        todo = np.arange(length, dtype=np.int64) if file is None else missing_or_damaged(file, faults.warn)
        fetched = bool(len(todo)) and remote is not None and remote.fetch(folder, directory / FEATURES_NAME)
        if fetched:  # the local copy now holds the bucket's file
            keep_root_budget(directory.parent, faults.warn)  # the root has grown by it
            if file is not None:
                file.close()
            file = open_existing(directory / FEATURES_NAME, header, faults.warn)
            todo = np.arange(length, dtype=np.int64) if file is None else missing_or_damaged(file, faults.warn)
        if len(todo):
            probe = check_deterministic(dataset, todo)
            try:
                layout = SampleLayout.of_sample(probe, input)
                if backbone.training:
                    refuse_random(backbone, layout, probe, batch_size)
                donors = Donors.find(directory.parent, directory.name, module_key, input)
                if file is None and donors is None and len(todo) > 1 and batch_size > 1:
                    # A first extraction of this backbone: rows resumed, repaired or reused later come from
                    # other batches than those of this run
                    refuse_dependent(backbone, layout, [probe, dataset[int(todo[len(todo) // 2])]])
                try:
                    loader = DataLoader(
                        dataset,
                        batch_size=batch_size,
                        sampler=todo.tolist(),
                        num_workers=num_workers,
                        # Inputs are hashed as they are collated (in the workers, if any), before the
                        # backbone runs: one that changes them in place through .data or numpy is not
                        # seen by torch's count of in-place changes.
                        collate_fn=_Collate(layout),
                        pin_memory=False,
                    )
                    file = _extract(backbone, loader, todo, layout, file, directory, header, faults, progress, donors)
                finally:
                    if donors is not None:
                        donors.close()
            except VariableLayoutError as exc:  # samples of several shapes: kept whole instead
                if remote is not None:
                    raise ConfigError(
                        f"{exc}: features that vary in shape are kept whole, in a local cache only; pass a local "
                        "cache_dir, or make the backbone's outputs one shape (pool or pad them)"
                    ) from None
                logger.info("%s; the features are kept whole, sample by sample, in %s", exc, directory)
                if file is not None:
                    file.close()
                remove_features(directory / FEATURES_NAME)
                file = None
            else:
                keep_root_budget(directory.parent, faults.warn)  # the root has grown by the new rows
    except BaseException:  # refused or interrupted: no claim held, no empty directory left
        if claim is not None:
            claim.release()
        with contextlib.suppress(OSError):
            directory.rmdir()  # only when empty: rows already written are kept for the next run
        raise
    if file is None:
        if claim is not None:
            claim.release()  # the dataset cache takes its own
        gc.collect()  # workers of the loader the layout error left in a traceback cycle: shut down here, not by
        return variable()  # the garbage collection of the workers forked next (an AssertionError printed there)
    if remote is not None and file.path is not None and file.count() == length:
        remote.upload(folder, file.path, _meta(file.header, file.size), replace=fetched and bool(len(todo)))
    return FeatureDataset(file, backbone, dataset, claim, version=version)


def _check_arguments(backbone: object, batch_size: object, num_workers: object, input: object) -> None:
    if not isinstance(backbone, torch.nn.Module):
        raise TypeError(
            f"extract_features needs the backbone as a torch.nn.Module, got {type(backbone).__name__}; wrap a "
            "function in a module so that its weights and code can be keyed"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an int >= 0, got {num_workers!r}")
    if isinstance(input, bool) or not isinstance(input, (int, str)):
        raise ConfigError(f"input must be a field's position (int) or key (str), got {input!r}")
    check_frozen(backbone, "the backbone")
    if backbone.training and any(isinstance(m, _STOCHASTIC) for m in backbone.modules()):
        raise ConfigError(
            "the backbone is in training mode and holds dropout or batch-norm layers: its outputs would be random "
            "(dropout) or would move its batch-norm statistics while it runs. Call backbone.eval() first"
        )


class _Collate:
    """A DataLoader's collate function: the inputs collated, the other fields as they are, the inputs' digests.

    Args:
        layout: The samples' layout.
    """

    def __init__(self, layout: SampleLayout) -> None:
        self.layout = layout

    def __call__(self, samples: list[Any]) -> tuple[Any, list[list[Any]], int, list[bytes | None]]:
        inputs, columns = self.layout.split(samples)
        try:
            batch = default_collate(inputs)  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            raise VariableLayoutError(f"the inputs of a batch cannot be stacked ({exc})") from None
        return batch, columns, len(samples), batch_digests(batch, len(samples))


def _extract(
    backbone: torch.nn.Module,
    loader: DataLoader[Any],
    todo: np.ndarray[Any, Any],
    layout: SampleLayout,
    file: RowsFile | None,
    directory: Path,
    header: dict[str, Any],
    faults: FaultLog,
    progress: bool,
    donors: Donors | None,
) -> RowsFile:
    """Compute the rows of ``todo`` batch by batch (or take them from ``donors``), each written as the next runs."""
    bar = _progress_bar(len(todo), file) if progress else None
    done = 0
    writer = BatchWriter(file, faults)
    try:
        for inputs, columns, count, digests in loader:
            indices = todo[done : done + count]
            known = layout.features if layout.fields and layout.fields[0].kind == "features" else None
            output = outputs(backbone, inputs, count, digests, donors, known)
            if writer.file is None:
                layout = layout.with_features(output[0])
                writer.start(_create(directory, {**header, "layout": layout.to_json()}, faults))
            elif known is None:
                layout = layout_of(writer.file)
            writer.submit(Batch(layout, indices, output, columns, digests))
            done += count
            if bar is not None:
                bar.update(count)
        file = writer.close()
    except BaseException:
        writer.close(failed=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    assert file is not None
    return file


def _create(directory: Path, header: dict[str, Any], faults: FaultLog) -> RowsFile:
    """The features file for ``header`` in ``directory`` (in memory, with a warning, if none can be made)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        file = create_features(directory / FEATURES_NAME, header)
    except (OSError, CorruptEntryError) as exc:
        faults.warn(
            Fault.CREATE, f"cannot make the features file in {directory} ({exc}): the features are kept in memory"
        )
        return features_in_memory(header)
    if file.header != header:  # another process made one for the same key with another layout
        file.close()
        raise ConfigError(f"{directory} holds features of another layout than the backbone's outputs; remove it")
    with contextlib.suppress(OSError):
        write_json_atomic(directory / META_NAME, _meta(header, file.size))
    return file


def _meta(header: dict[str, Any], size: int) -> dict[str, Any]:
    """What a features cache's ``torchcache.json`` records."""
    return {
        "torchcache_version": __version__,
        "kind": "features",
        "created": time.time(),
        "name": header["module"],
        "dataset": header["dataset"],
        "length": header["length"],
        "version": header["version"],
        "max_bytes": size,
    }


def _progress_bar(total: int, file: RowsFile | None) -> Any:
    """A tqdm bar when tqdm is installed and someone can see it."""
    from ..module.precompute import _interactive

    if not _interactive():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    done = 0 if file is None else file.count()
    return tqdm(
        total=total, desc="extract_features", unit="sample", dynamic_ncols=True, initial=0, postfix=f"{done} cached"
    )
