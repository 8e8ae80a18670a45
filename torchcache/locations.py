"""Where caches go: local directories, Redis and object store URLs, checked, and the defaults of each.

A location is a local directory (a ``Path``) or a URL (a ``str``): ``redis://``,
``rediss://`` and their ``+cluster`` forms for Redis, ``s3://``, ``gs://`` and the other
:data:`OBJECT_SCHEMES` for object stores. Each check raises a ``ConfigError`` that names
the option.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import platformdirs

from .errors import ConfigError
from .stores.objects import OBJECT_SCHEMES
from .stores.redis.url import parse_url, redact_url

__all__ = [
    "OBJECT_SCHEMES",
    "REDIS_SCHEMES",
    "check_local_dir",
    "check_location",
    "check_redis_url",
    "check_storage_options",
    "check_url",
    "is_object_url",
    "is_url",
    "resolve_local_dir",
    "resolve_location",
    "resolve_root",
]


#: URL schemes that make the persistent tier a Redis server or cluster.
REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
#: The package each object store URL scheme needs (with fsspec).
_OBJECT_PACKAGES = {"oss": "ossfs"} | dict.fromkeys(("s3", "s3a"), "s3fs") | dict.fromkeys(("gs", "gcs"), "gcsfs")
_OBJECT_PACKAGES |= dict.fromkeys(("az", "abfs", "abfss"), "adlfs")
#: Any other ``scheme://`` (not a local directory named ``https:``), or a URL of a known scheme mistyped (``redis:/h``).
_OTHER_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|(?i:rediss?(\+cluster)?|s3a?|gc?s|oss|az|abfss?):(?!//)")


def is_url(location: object) -> bool:
    """Whether a cache location is a Redis or object store URL rather than a path."""
    return isinstance(location, str) and location.lower().startswith((*REDIS_SCHEMES, *OBJECT_SCHEMES))


def is_object_url(location: object) -> bool:
    """Whether a cache location is an object store URL (``s3://``, ``gs://``, ...)."""
    return isinstance(location, str) and location.lower().startswith(OBJECT_SCHEMES)


def check_redis_url(value: str, name: str = "persistent_cache_dir") -> str:
    """``value``, a Redis URL, once it parses and the redis package is there.

    Raises:
        ConfigError: Naming ``name``, if it is malformed or redis is missing.
    """
    if importlib.util.find_spec("redis") is None:
        raise ConfigError(f"{name} is a Redis URL, which needs the redis package: pip install 'torchcache[redis]'")
    parse_url(value, name)  # a ConfigError naming the option; never shows the password
    return value


def check_url(value: str, name: str = "persistent_cache_dir") -> str:
    """``value``, a Redis or object store URL, once it is well formed and its packages are there.

    Raises:
        ConfigError: Naming ``name``, if the URL is malformed or a package is missing.
    """
    if not is_object_url(value):
        return check_redis_url(value, name)
    scheme, _, path = value.partition("://")
    if not path.strip("/") or path.startswith("/") or "?" in path or "//" in path.rstrip("/"):  # s3fs: ?versionId=
        raise ConfigError(
            f"{name} must be {scheme}://bucket/prefix without a query or an empty folder name (//), got {value!r}"
        )
    package = _OBJECT_PACKAGES.get(scheme.lower())
    for module in ("fsspec", package):
        if module is not None and importlib.util.find_spec(module) is None:
            extra = {"s3fs": "s3", "gcsfs": "gcs"}.get(package or "", "")
            hint = f"pip install 'torchcache[{extra}]'" if extra else f"pip install fsspec {package}"
            raise ConfigError(f"{name} is a {scheme}:// URL, which needs {module}: {hint}")
    return value


def check_location(value: object, name: str = "persistent_cache_dir") -> Path | str | None:
    """``value`` as a directory or a checked URL (``None`` stays ``None``); a ConfigError naming ``name`` otherwise."""
    if value is None:
        return None
    if is_url(value):
        return check_url(value, name)  # type: ignore[arg-type]
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a path (str or os.PathLike) or None, got {value!r}")
    if isinstance(value, str) and _OTHER_URL.match(value):
        if "://" in value:
            shown = redact_url(value)
        else:  # a URL with a typo: no parser finds its password, so all before the host is hidden
            shown = value if "@" not in value else f"{value.partition(':')[0]}:***@{value.rpartition('@')[2]}"
        raise ConfigError(
            f"{name} must be a local directory, a Redis URL (redis://, rediss://) or an object store URL "
            f"({', '.join(OBJECT_SCHEMES)}), got {shown}"
            + ("" if "://" in value or "@" in value else f" (a directory named so: './{value}')")
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"{name} must be a non-empty path, got {value!r}; pass None for the default "
            "cache directory or '.' for the working directory"
        )
    if "\0" in text:
        raise ConfigError(f"{name} must not contain a NUL character, got {value!r}")
    return Path(text).expanduser()


def check_local_dir(value: object, name: str = "local_cache_dir") -> Path | None:
    """``value`` (the option ``name``) as a local path (``None`` stays ``None``).

    Raises:
        ConfigError: Naming ``name``, if it is a URL or not a usable path.
    """
    if is_url(value):
        raise ConfigError(f"{name} must be a local directory here, got the URL {redact_url(value)}")  # type: ignore[arg-type]
    return check_location(value, name)  # type: ignore[return-value]


def check_storage_options(value: object) -> dict[str, Any] | None:
    """``storage_options`` as a dict (``None`` stays ``None``); a ConfigError naming it otherwise."""
    if value is not None and (not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value)):
        got = type(value).__name__
        raise ConfigError(f"storage_options must be a dict of fsspec options (str keys) or None, got a {got}")
    options = None if value is None else dict(value)  # type: ignore[arg-type]
    for name in {"endpoint_url", "key", "secret", "project", "profile"} & set(options or ()):  # text to s3fs, gcsfs
        if not isinstance(options[name], str):  # type: ignore[index]
            raise ConfigError(f"storage_options[{name!r}] must be a string, got a {type(options[name]).__name__}")  # type: ignore[index]
    return options


def resolve_location(persistent_cache_dir: Path | str | None) -> Path | str:
    """Where persistent entries go: the argument, else ``$TORCHCACHE_DIR``, else the user cache dir.

    Returns:
        A directory, or a Redis or object store URL (a ``str``, see :func:`is_url`).

    Raises:
        ConfigError: If ``$TORCHCACHE_DIR`` is a URL that is not valid, or of another scheme.
    """
    if persistent_cache_dir is not None:
        return persistent_cache_dir
    env = os.environ.get("TORCHCACHE_DIR")
    found = check_location(env, "TORCHCACHE_DIR") if env and env.strip() else None
    return found if found is not None else Path(platformdirs.user_cache_path("torchcache"))


def resolve_local_dir(local_cache_dir: Path | None, default: bool = False) -> Path | None:
    """Where a local copy of a Redis or object store tier goes.

    The argument, else ``$TORCHCACHE_LOCAL_DIR``, else (with ``default``, for object
    stores) ``copies`` under the cache root (``$TORCHCACHE_DIR`` or the user cache directory).

    Returns:
        A directory, or ``None`` for no local copy.

    Raises:
        ConfigError: If ``$TORCHCACHE_LOCAL_DIR`` is a URL.
    """
    if local_cache_dir is not None:
        return local_cache_dir
    env = os.environ.get("TORCHCACHE_LOCAL_DIR")
    if env and is_url(env):
        raise ConfigError(f"TORCHCACHE_LOCAL_DIR must be a local directory, got the URL {redact_url(env)}")
    if env:
        return Path(env).expanduser()
    if not default:
        return None
    root = resolve_location(None)  # $TORCHCACHE_DIR, else the user cache directory
    return root / "copies" if isinstance(root, Path) else Path(platformdirs.user_cache_path("torchcache")) / "copies"


def resolve_root(persistent_cache_dir: Path | str | None) -> Path:
    """The local cache root: the argument, else ``$TORCHCACHE_DIR``, else the user cache dir.

    Raises:
        ConfigError: If that is a Redis URL (see :func:`resolve_location`).
    """
    location = resolve_location(persistent_cache_dir)
    if isinstance(location, str):
        raise ConfigError(f"expected a cache directory, got the Redis URL {redact_url(location)}")
    return location
