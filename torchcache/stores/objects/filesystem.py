"""The fsspec filesystem of an object store URL, with bounded retries, and storage options from the environment."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError

__all__ = ["OBJECT_SCHEMES", "filesystem_only", "open_filesystem"]

#: URL schemes of object stores (through fsspec and the scheme's package).
OBJECT_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "oss://")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 15, "retries": {"max_attempts": 2, "mode": "standard"}}
#: botocore validates the CRC of a response that carries one (some servers send it with a byte range):
#: every entry read is checked against its own digest before it is used, so that would be done twice.
_S3_READ_CHECK = {"response_checksum_validation": "when_required"}
#: s3fs's own retries of a request botocore gave up on (5 by default): with botocore's two attempts and
#: the read timeout, a server that accepts connections but never answers costs about a minute per try.
_S3FS_RETRIES = 2
#: Seconds a gcsfs request may take (its default: aiohttp's 300), and the tries of one that fails
#: (gcsfs's own: 6, about 31 s of backoff between them, fixed when its class is made).
_GCS_TIMEOUT = 15
_GCS_TRIES = 2
_GCS_PAUSE = 0.5


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path it names (``bucket/prefix``, no scheme).

    ``storage_options`` go to the filesystem over those of ``$TORCHCACHE_STORAGE_OPTIONS``.

    Raises:
        ConfigError: If ``url`` is not an object store URL, or fsspec or the scheme's package is missing.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    path = url.split("://", 1)[1].strip("/") if "://" in url else ""
    if not url.lower().startswith(OBJECT_SCHEMES) or not path or "//" in path:  # b//x: listed as b/x by some
        raise ConfigError(
            f"an object store URL is scheme://bucket/prefix with scheme one of {OBJECT_SCHEMES} and no empty "
            f"folder name (//), got {url!r}"
        )
    extra = _EXTRAS.get(scheme, scheme)
    options = {**storage_options_from_env(), **(storage_options or {})}
    if extra == "s3":  # bounded retries: a bucket that is away costs seconds, not minutes
        # a copy each time: botocore rewrites the dict it is given, and fsspec keys its instances by these
        # options, so a shared dict would make every later call a new filesystem with a new session
        options.setdefault("config_kwargs", copy.deepcopy({**_S3_CONFIG, **_s3_read_check()}))
    elif extra == "gcs":
        options.setdefault("requests_timeout", _GCS_TIMEOUT)
    try:
        import fsspec

        fs = fsspec.filesystem(scheme, **options)
        if extra == "s3" and getattr(fs, "retries", 0) > _S3FS_RETRIES:
            fs.retries = _S3FS_RETRIES
        elif extra == "gcs":
            _bound_gcs_tries(fs)
    except ImportError as exc:
        raise ConfigError(
            f"{scheme}:// caches need fsspec and the package of the scheme ({exc}): pip install 'torchcache[{extra}]'"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a filesystem that cannot be made is a configuration problem
        raise ConfigError(f"cannot use {scheme}:// ({type(exc).__name__}: {exc})") from None
    return fs, path


def _s3_read_check() -> dict[str, str]:
    """:data:`_S3_READ_CHECK` where botocore has the setting (1.36 and later), else nothing."""
    try:
        from botocore.config import Config  # type: ignore[import-untyped]
    except ImportError:
        return {}
    return _S3_READ_CHECK if set(_S3_READ_CHECK) <= set(getattr(Config, "OPTION_DEFAULTS", {})) else {}


def _bound_gcs_tries(fs: Any) -> None:
    """Make ``fs`` (a gcsfs filesystem) try a failing request :data:`_GCS_TRIES` times, not gcsfs's six.

    gcsfs fixes its tries and backoff when its class is made (a decorator on ``_request``),
    so this instance's ``_request`` is the undecorated one, tried here. Left as it is if
    gcsfs no longer has that shape.
    """
    raw = getattr(type(fs)._request, "__wrapped__", None)
    if raw is None or getattr(fs, "_torchcache_tries", False):
        return
    try:
        from gcsfs.retry import is_retriable  # type: ignore[import-untyped]
    except ImportError:
        return

    async def request(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(_GCS_TRIES):
            try:
                return await raw(fs, *args, **kwargs)
            except Exception as exc:
                if attempt + 1 == _GCS_TRIES or not is_retriable(exc):
                    raise
            await asyncio.sleep(_GCS_PAUSE)
        raise AssertionError("unreachable")  # pragma: no cover

    fs._request = request
    fs._torchcache_tries = True


def filesystem_only(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of ``url`` (:func:`open_filesystem`'s first part)."""
    return open_filesystem(url, storage_options)[0]


def storage_options_from_env() -> dict[str, Any]:
    """``storage_options`` from ``TORCHCACHE_STORAGE_OPTIONS`` (a JSON object), or none.

    Raises:
        ConfigError: If the variable is set but is not a JSON object.
    """
    raw = os.environ.get("TORCHCACHE_STORAGE_OPTIONS")
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise ConfigError("TORCHCACHE_STORAGE_OPTIONS must be a JSON object of fsspec storage options")
    return options
