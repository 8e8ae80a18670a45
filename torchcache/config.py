"""Decorator settings: defaults, validation, per-instance overrides, the cache root.

Every setting is validated once, when the decorator is applied (or when an instance
overrides it with a ``torchcache_<name>`` attribute), with an error that names the
argument and says what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .codec import DEFAULT_QUALITY
from .errors import ConfigError
from .policy import parse_size

__all__ = ["LEGACY_OPTIONS", "Settings", "resolve_root"]

#: Options of torchcache 0.6.0 that are accepted and ignored (brotli replaced zstd).
LEGACY_OPTIONS = ("zstd_compression", "zstd_compression_level", "zstd_compression_threads", "use_mmap_on_load")
_CPU = torch.device("cpu")
_HASH_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class Settings:
    """Validated decorator settings; see :func:`torchcache.torchcache` for their meaning."""

    enabled: bool = True
    persistent: bool = False
    persistent_cache_dir: Path | None = None
    persistent_module_hash: str | None = None
    max_memory_cache_size: int = int(1e9)
    max_persistent_cache_size: int = int(10e9)
    memory_cache_device: torch.device | None = _CPU
    subsample_count: int | None = 10000
    cache_dtype: torch.dtype | None = None
    brotli_quality: int = DEFAULT_QUALITY

    @classmethod
    def create(cls, **options: Any) -> Settings:
        """Validate raw options into settings.

        Raises:
            ConfigError: If a value is invalid (the message names the argument).
        """
        legacy = [name for name in LEGACY_OPTIONS if name in options]
        for name in legacy:
            options.pop(name)
        if legacy:
            warnings.warn(
                f"torchcache: {', '.join(legacy)} {'is' if len(legacy) == 1 else 'are'} accepted for "
                "compatibility with torchcache 0.6 and ignored: entries are brotli-compressed "
                "when it pays (see brotli_quality)",
                DeprecationWarning,
                stacklevel=4,
            )
        values = {name: _validate(name, value) for name, value in options.items()}
        return cls(**values)

    def override(self, **options: Any) -> Settings:
        """A copy with some options replaced (validated)."""
        if not options:
            return self
        return dataclasses.replace(self, **{name: _validate(name, value) for name, value in options.items()})

    def key_settings(self) -> dict[str, object]:
        """The settings that change what is stored, and so belong in the module key."""
        return {
            "cache_dtype": None if self.cache_dtype is None else str(self.cache_dtype),
            "subsample_count": self.subsample_count,
        }


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _validate(name: str, value: Any) -> Any:
    if name in ("enabled", "persistent"):
        return _bool(name, value)
    if name == "persistent_cache_dir":
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"persistent_cache_dir must be a path (str or os.PathLike) or None, got {value!r}")
        return Path(value).expanduser()
    if name == "persistent_module_hash":
        if value is None:
            return None
        if not isinstance(value, str) or not _HASH_RE.match(value) or value in (".", ".."):
            raise ConfigError(
                "persistent_module_hash must be a string of 1-128 letters, digits, '_', '-' or '.', "
                f"usable as a directory name, got {value!r}"
            )
        return value
    if name in ("max_memory_cache_size", "max_persistent_cache_size"):
        return parse_size(value, name)
    if name == "memory_cache_device":
        if value is None:
            return None
        try:
            return torch.device(value)
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"memory_cache_device must be a device such as 'cpu' or 'cuda:0', or None, got {value!r}"
            ) from None
    if name == "subsample_count":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 64:
            raise ConfigError(f"subsample_count must be an int >= 64 or None (hash every element), got {value!r}")
        return value
    if name == "cache_dtype":
        if value is None:
            return None
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ConfigError(
                f"cache_dtype must be a floating torch.dtype such as torch.float16, or None, got {value!r}"
            )
        return value
    if name == "brotli_quality":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 11:
            raise ConfigError(f"brotli_quality must be an int from 0 to 11, got {value!r}")
        return value
    raise ConfigError(f"unknown torchcache option {name!r}")  # pragma: no cover - guarded by signatures


def resolve_root(persistent_cache_dir: Path | None) -> Path:
    """The cache root: the argument, else ``$TORCHCACHE_DIR``, else the user cache dir."""
    if persistent_cache_dir is not None:
        return persistent_cache_dir
    env = os.environ.get("TORCHCACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_path("torchcache"))
