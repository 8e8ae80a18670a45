"""Open the store a cache URL names: a Redis server or cluster, or an object store bucket."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from ..faults import Report
from .batched import BatchedStore
from .objects import OBJECT_SCHEMES, ObjectStore

__all__ = ["local_copy_dir", "open_remote_store"]


def local_copy_dir(local: Path, name: str, url: str) -> Path:
    """Where the local copy of cache ``name`` at ``url`` lives under ``local``: one folder per cache and URL.

    Caches of one name at two URLs (two buckets or prefixes, two servers) never share a
    copy: each would serve the other's entries.

    Example:
        >>> local_copy_dir(Path("/copies"), "a" * 32, "s3://b/x").name != local_copy_dir(Path("/c"), "a" * 32, "s3://b/y").name
        True
    """
    from .redis.url import redact_url

    scheme, sep, rest = redact_url(url).partition("://")  # a password changed is the same server
    where = scheme.lower() + sep + rest.rstrip("/")  # s3://b/x/ is s3://b/x
    return local / f"{name}-{xxhash.xxh3_64_hexdigest(where.encode())[:12]}"


def open_remote_store(
    url: str,
    namespace: str,
    max_bytes: int,
    report: Report,
    meta: dict[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    keep_budget: bool = True,
) -> BatchedStore:
    """The store at ``url`` for the cache ``namespace`` (nothing is sent yet).

    Object store URLs (``s3://``, ``gs://``...) take fsspec ``storage_options``, over those
    of ``$TORCHCACHE_STORAGE_OPTIONS`` (a JSON object), beside the filesystem's own chain;
    ``meta`` is what their ``torchcache.json`` records (Redis stores keep none);
    ``keep_budget=False`` opens a bucket's store for a reader or an inspector: it removes nothing.

    Raises:
        ConfigError: If the URL is invalid or its package is missing.
    """
    if url.lower().startswith(OBJECT_SCHEMES):
        return ObjectStore(
            url,
            namespace,
            max_bytes,
            storage_options=storage_options,
            report=report,
            meta=meta,
            keep_budget=keep_budget,
        )
    from .redis.store import RedisStore

    return RedisStore(url, namespace, max_bytes, report=report)
