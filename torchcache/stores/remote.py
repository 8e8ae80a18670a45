"""Open the store a cache URL names: a Redis server or cluster, or an object store bucket."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..faults import Report
from .batched import BatchedStore
from .objects import OBJECT_SCHEMES, ObjectStore

__all__ = ["open_remote_store"]


def open_remote_store(
    url: str,
    namespace: str,
    max_bytes: int,
    report: Report,
    meta: dict[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> BatchedStore:
    """The store at ``url`` for the cache ``namespace`` (nothing is sent yet).

    Object store URLs (``s3://``, ``gs://``...) take fsspec ``storage_options``, over those
    of ``$TORCHCACHE_STORAGE_OPTIONS`` (a JSON object), beside the filesystem's own chain;
    ``meta`` is what their ``torchcache.json`` records (Redis stores keep none).

    Raises:
        ConfigError: If the URL is invalid or its package is missing.
    """
    if url.lower().startswith(OBJECT_SCHEMES):
        return ObjectStore(url, namespace, max_bytes, storage_options=storage_options, report=report, meta=meta)
    from .redis.store import RedisStore

    return RedisStore(url, namespace, max_bytes, report=report)
