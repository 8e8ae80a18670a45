"""Decorator settings: defaults, validation, per-instance overrides, the cache root.

Every setting is validated once, when the decorator is applied (or when an instance
overrides it with a ``torchcache_<name>`` attribute), with an error that names the
argument and says what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from .codec import DEFAULT_QUALITY
from .dtypes import OUTPUT_DTYPES
from .errors import ConfigError
from .locations import check_local_dir, check_location, check_storage_options
from .policy import parse_size

__all__ = [
    "DEFAULT_ROOT_BUDGET",
    "LEGACY_OPTIONS",
    "ROOT_BUDGET_ENV",
    "Settings",
    "legacy_note",
    "module_dir_name",
    "resolve_root_budget",
]

#: Options of torchcache 0.6.0 that are accepted and ignored (brotli replaced zstd).
LEGACY_OPTIONS = ("zstd_compression", "zstd_compression_level", "zstd_compression_threads", "use_mmap_on_load")


def legacy_note(names: list[str]) -> str:
    """The warning for options of torchcache 0.6 that are accepted and ignored."""
    why = (
        "disk hits are read from memory-mapped segments",
        "entries are brotli-compressed when it pays (brotli_quality)",
    )
    reasons = "; ".join(dict.fromkeys(why["mmap" not in name] for name in names))
    verb = "is" if len(names) == 1 else "are"
    return (
        f"torchcache: {', '.join(names)} {verb} accepted for compatibility with torchcache 0.6 and ignored: {reasons}"
    )


_CPU = torch.device("cpu")
_HASH_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]+")
_MAPPED_RE = re.compile(r"-[0-9a-f]{16}$")  # what a mapped name ends with: never taken as it is
_STORED_DTYPES = frozenset(dt for dt in OUTPUT_DTYPES if dt.is_floating_point)


@dataclass(frozen=True)
class Settings:
    """Validated decorator settings; see :func:`torchcache.torchcache` for their meaning."""

    enabled: bool = True
    persistent: bool = False
    persistent_cache_dir: Path | str | None = None  # a str is a Redis URL
    persistent_module_hash: str | None = None
    max_memory_cache_size: int = int(1e9)
    max_persistent_cache_size: int = int(10e9)
    memory_cache_device: torch.device | None = _CPU
    subsample_count: int | None = None
    cache_dtype: torch.dtype | None = None
    brotli_quality: int = DEFAULT_QUALITY
    shared_args: frozenset[str] = frozenset()
    batch_dims: Mapping[str, int] = field(default_factory=dict)
    keep_eval: bool = False
    local_cache_dir: Path | None = None
    storage_options: Mapping[str, Any] | None = None
    max_local_cache_size: int | None = None
    key_ignore: frozenset[str] = frozenset()
    verify_weights: int | None = None
    exact_batches: bool = False
    check_items: bool = True

    def __post_init__(self) -> None:
        if self.local_cache_dir is not None and (isinstance(self.persistent_cache_dir, Path) or not self.persistent):
            where = f"the directory {self.persistent_cache_dir}" if self.persistent else "off (persistent=False)"
            raise ConfigError(
                "local_cache_dir keeps a local copy of a persistent tier on a Redis server or in a bucket, but "
                f"persistent_cache_dir is {where}; leave local_cache_dir out"
            )
        if both := sorted(set(self.shared_args) & set(self.batch_dims)):
            raise ConfigError(f"{both} named in both shared_args (whole) and batch_dims (per item): name each in one")

    @classmethod
    def create(cls, stacklevel: int = 3, **options: Any) -> Settings:
        """Validate raw options into settings.

        Args:
            stacklevel: Where the warning about options of torchcache 0.6 points (the
                default, 3, is the caller of the function that calls ``create``).
            **options: The options, by name.

        Raises:
            ConfigError: If a value is invalid (the message names the argument).
        """
        legacy = [name for name in LEGACY_OPTIONS if name in options]
        for name in legacy:
            del options[name]
        if legacy:
            warnings.warn(legacy_note(legacy), FutureWarning, stacklevel=stacklevel)
        values = {name: _validate(name, value) for name, value in options.items()}
        return cls(**values)

    def override(self, **options: Any) -> Settings:
        """A copy with some options replaced (validated); ``persistent=False`` drops ``local_cache_dir``."""
        if not options:
            return self
        values = {name: _validate(name, value) for name, value in options.items()}
        if values.get("persistent") is False:  # one instance off the disk: the copy of its tier goes with it
            values.setdefault("local_cache_dir", None)
        return dataclasses.replace(self, **values)

    def key_settings(self) -> dict[str, object]:
        """The settings that change what is stored, and so belong in the module key."""
        settings: dict[str, object] = {
            "cache_dtype": None if self.cache_dtype is None else str(self.cache_dtype),
            "subsample_count": self.subsample_count,
        }
        # Only when set, so that caches made without them keep their keys.
        if self.shared_args:
            settings["shared_args"] = sorted(self.shared_args)
        if self.batch_dims:
            settings["batch_dims"] = {name: self.batch_dims[name] for name in sorted(self.batch_dims)}
        if self.key_ignore:
            settings["key_ignore"] = sorted(self.key_ignore)
        return settings

    def fixed_key(self) -> str | None:
        """The module key ``persistent_module_hash`` gives: its name, and the :meth:`key_settings` not at defaults.

        ``cache_dtype=torch.float16`` stores other values than the default: under the same
        name it gets a directory of its own (``name-`` and 16 hex digits).
        """
        name, stored = self.persistent_module_hash, self.key_settings()
        if name is None or stored == _DEFAULT_KEY_SETTINGS:
            return name
        described = (name + "\n" + json.dumps(stored, sort_keys=True)).encode("utf-8", "surrogatepass")
        return f"{name[:96]}-{xxhash.xxh3_64_hexdigest(described)}"


_DEFAULT_KEY_SETTINGS = Settings().key_settings()


def _bool(name: str, value: object) -> bool:
    if type(value) is int and value in (0, 1):  # 0.6 took persistent=1
        return bool(value)
    if isinstance(value, np.bool_):  # a flag read from a numpy array or a config library
        return bool(value)
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _validate(name: str, value: Any) -> Any:
    if name in ("enabled", "persistent", "keep_eval", "exact_batches", "check_items"):
        return _bool(name, value)
    if name == "persistent_cache_dir":
        return check_location(value)
    if name == "local_cache_dir":
        return check_local_dir(value)
    if name == "storage_options":
        return check_storage_options(value)
    if name == "persistent_module_hash":
        return module_dir_name(value)
    if name in ("max_memory_cache_size", "max_persistent_cache_size"):
        return parse_size(value, name)
    if name == "max_local_cache_size":
        return None if value is None else parse_size(value, name)
    if name == "memory_cache_device":
        return _device(value)
    if name == "subsample_count":
        if value is None:
            return None
        if isinstance(value, np.integer):  # numpy's, as a plain int (the settings are keyed)
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 64:
            raise ConfigError(f"subsample_count must be an int >= 64 or None (hash every element), got {value!r}")
        return value
    if name == "cache_dtype":
        if value is None:
            return None
        if not isinstance(value, torch.dtype) or not value.is_floating_point or value not in _STORED_DTYPES:
            allowed = ", ".join(sorted(str(dt) for dt in _STORED_DTYPES))
            raise ConfigError(f"cache_dtype must be None or one of {allowed}, got {value!r}")
        return value
    if name == "brotli_quality":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 11:
            raise ConfigError(f"brotli_quality must be an int from 0 to 11, got {value!r}")
        return value
    if name == "shared_args":
        if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"shared_args must be a list of argument names such as ['mask'], got {value!r}")
        return frozenset(value)
    if name == "batch_dims":
        return _batch_dims(value)
    if name == "verify_weights":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"verify_weights must be None (off) or an int >= 1 (hash the weights every that many calls), "
                f"got {value!r}"
            )
        return value
    if name == "key_ignore":
        if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(
                f"key_ignore must be a list of attribute names or dotted paths such as ['fn', 'head.scales'], "
                f"got {value!r}"
            )
        return frozenset(value)
    raise ConfigError(f"unknown torchcache option {name!r}")  # pragma: no cover - guarded by signatures


def _device(value: object) -> torch.device | None:
    if value is None:
        return None
    try:
        device: torch.device = torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"memory_cache_device must be a device such as 'cpu' or 'cuda:0', or None, got {value!r}"
        ) from None
    if device.type == "meta":
        raise ConfigError("memory_cache_device cannot be 'meta': a meta tensor holds no values to return")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"memory_cache_device={value!r} but CUDA is not available here; use 'cpu' or None "
                "(keep outputs on the device they came from)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"memory_cache_device={value!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return device


def _batch_dims(value: object) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            "batch_dims must be a dict from argument names or output paths to the dimension that "
            f"indexes the batch, such as {{'x': 1, 'output[1][0]': 1}}, got {value!r}"
        )
    dims: dict[str, int] = {}
    for key, dim in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"batch_dims keys must be argument names or output paths (str), got {key!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ConfigError(f"batch_dims[{key!r}] must be a dimension index >= 0, got {dim!r}")
        dims[key] = dim
    return dims


def module_dir_name(value: object) -> str | None:
    """The directory name of a ``persistent_module_hash``: safe names as they are, others mapped.

    Any string is accepted (torchcache 0.6 accepted any). A string that is not a safe
    directory name (letters, digits, ``_``, ``-``, ``.``; at most 128 characters; not
    ``.`` or ``..``) becomes its safe characters joined by ``_`` plus 16 hex digits of
    its hash, so that two different strings never share a directory. A safe string that
    ends the way mapped names do (``-`` and 16 hex digits) is mapped too.

    Raises:
        ConfigError: If the value is neither a string nor None, or is empty.

    Example:
        >>> module_dir_name("resnet50-v2"), module_dir_name("resnet50 v2")
        ('resnet50-v2', 'resnet50_v2-058acb977cc773ad')
        >>> module_dir_name("resnet50_v2-058acb977cc773ad") != "resnet50_v2-058acb977cc773ad"
        True
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"persistent_module_hash must be a non-empty string or None, got {value!r}")
    if _HASH_RE.match(value) and value not in (".", "..") and not _MAPPED_RE.search(value):
        return value
    stem = _UNSAFE_RE.sub("_", value).strip("._")[:96] or "module"
    return f"{stem}-{xxhash.xxh3_64_hexdigest(value.encode('utf-8', 'surrogatepass'))}"


#: The environment variable that sets the budget of a whole cache root (``"20GB"``; ``"0"``: none).
ROOT_BUDGET_ENV = "TORCHCACHE_MAX_SIZE"
#: The budget of a cache root when nothing sets one: five module caches at the default
#: ``max_persistent_cache_size`` (10 GB each), the same on every machine and file system.
DEFAULT_ROOT_BUDGET = 50 * 10**9


def resolve_root_budget() -> tuple[int | None, str]:
    """The budget of a cache root from ``$TORCHCACHE_MAX_SIZE``, else :data:`DEFAULT_ROOT_BUDGET`.

    Returns:
        The budget in bytes (``None`` when the variable is ``0``: no budget) and where it
        came from (``"TORCHCACHE_MAX_SIZE"`` or ``"default"``).

    Raises:
        ConfigError: If the variable is set and is not a byte count such as ``20GB``.
    """
    env = os.environ.get(ROOT_BUDGET_ENV, "").strip()
    if not env:
        return DEFAULT_ROOT_BUDGET, "default"
    budget = parse_size(env, ROOT_BUDGET_ENV)
    return budget or None, ROOT_BUDGET_ENV
