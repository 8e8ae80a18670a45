"""Caches in object store buckets (S3, GCS and others fsspec reaches): :class:`ObjectStore`."""

from .bucket import bucket_namespaces, find_caches
from .filesystem import OBJECT_SCHEMES, open_filesystem
from .store import ObjectStore, remove_segments, segments_of

__all__ = [
    "OBJECT_SCHEMES",
    "ObjectStore",
    "bucket_namespaces",
    "find_caches",
    "open_filesystem",
    "remove_segments",
    "segments_of",
]
