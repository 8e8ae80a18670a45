"""A cache's objects in a bucket (requests with a backoff, one report per outage); the caches under a URL."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..._fork import renew_lock_after_fork
from ...errors import StoreError, StoreUnavailableError
from ...faults import Fault, Report
from ...policy import plural
from .filesystem import open_filesystem
from .manifests import CHECKPOINT, MANIFEST, SEGMENT, TOMBSTONE

__all__ = ["META_NAME", "Bucket", "bucket_namespaces", "find_caches", "is_own"]

#: The object that describes a cache (its kind, name, length), beside its segments.
META_NAME = "torchcache.json"

T = TypeVar("T")


def is_own(name: str) -> bool:
    """Whether an object name (or path) is one that torchcache writes in a cache's folder."""
    base = name.rsplit("/", 1)[-1]
    return base == META_NAME or base.endswith((SEGMENT, MANIFEST, TOMBSTONE, CHECKPOINT))


class Bucket:
    """The objects under ``prefix`` of an fsspec filesystem, by name (no ``/`` in names).

    A request that fails (the server away, 403, 404 on the bucket, throttling after the
    library's own retries) raises :class:`~torchcache.errors.StoreUnavailableError` and
    starts a backoff (0.5 s doubling to 30 s) during which requests fail at once; a
    success ends it. Reads and writes back off apart: a bucket that refuses writes (read-only
    credentials) is still read. ``requests`` counts the requests sent, ``received`` the bytes of entries read.
    With ``reopen``, a forked child (a DataLoader worker) opens a filesystem of its own with
    it: fsspec's are not fork-safe.
    """

    def __init__(self, fs: Any, prefix: str, url: str, report: Report, reopen: Callable[[], Any] | None = None) -> None:
        self._fs, self._reopen, self._pid = fs, reopen, os.getpid()
        self.prefix = prefix
        self.url = url
        self.requests = 0
        self.received = 0
        #: Each object's size in bytes, as the last listing gave it.
        self.sizes: dict[str, int] = {}
        self._report = report
        self._retry_at, self._delay = [float("-inf")] * 2, [0.0] * 2  # reads, writes
        self._troubled = False
        self._next_sweep = float("-inf")  # see abort_stale_uploads
        self._last_stamp = 0
        self._stamp_lock = threading.RLock()
        renew_lock_after_fork(self, "_stamp_lock")
        self._replaced: list[str] = []  # see replace()

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (this process's own: a forked child opens one with ``reopen``)."""
        if self._pid != os.getpid() and self._reopen is not None:
            self._fs, self._pid = self._reopen(), os.getpid()
        return self._fs

    def new_name(self) -> str:
        """A new object name: a stamp that grows in this process (names sort by age), then a random id."""
        with self._stamp_lock:
            stamp = self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return f"{stamp:020d}-{uuid.uuid4().hex[:16]}"

    def call(self, op: Callable[[], T], what: str, requests: int = 1, write: bool = False) -> T:
        """Run ``op``, which sends ``requests`` requests (``FileNotFoundError`` passes through: an object gone)."""
        wait = self._retry_at[write] - time.monotonic()
        if wait > 0:
            raise StoreUnavailableError(f"cannot {what}: {self.url} was unreachable; next try in {wait:.1f} s")
        self.requests += requests
        try:
            result = op()
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - any fault of the bucket is a store fault
            self._delay[write] = min(30.0, max(0.5, self._delay[write] * 2))
            self._retry_at[write] = time.monotonic() + self._delay[write]
            raise StoreUnavailableError(f"cannot {what} in {self.url}: {type(exc).__name__}: {exc}") from None
        self._delay[write], self._retry_at[write], self._troubled = 0.0, float("-inf"), False
        return result

    def reads_failing(self, retry: bool = False) -> bool:
        """Whether the last read failed; ``retry`` ends the read backoff, so that the next read is sent."""
        failing = self._delay[False] > 0
        if retry:
            self._retry_at[False] = float("-inf")
        return failing

    def end_write_backoff(self) -> None:
        """Send the next write whatever the backoff (a flush at the end: the outage may be over)."""
        self._retry_at[True] = float("-inf")

    def writes_backing_off(self) -> bool:
        """Whether a write failed less than its backoff ago (the bucket away, or refusing writes)."""
        return self._retry_at[True] > time.monotonic()

    def read_failed(self, exc: StoreError) -> None:
        """Report a failed read, once until a request succeeds again."""
        if not self._troubled:
            self._troubled = True
            self._report(Fault.UNAVAILABLE, str(exc))

    def path(self, name: str) -> str:
        """The full path of object ``name``."""
        return f"{self.prefix}/{name}"

    def names(self) -> set[str]:
        """The names of the objects there now (a fresh listing; their sizes go to :attr:`sizes`)."""

        def ls() -> list[dict[str, Any]]:
            try:
                self.fs.invalidate_cache(self.prefix)
                return list(self.fs.ls(self.prefix, detail=True))
            except FileNotFoundError:
                return []

        listed = self.call(ls, "list")
        self.sizes = {str(item["name"]).rsplit("/", 1)[-1]: int(item.get("size") or 0) for item in listed}
        return set(self.sizes)

    def cat(self, names: Sequence[str]) -> dict[str, object]:
        """Each object's bytes, or the exception its read raised (``FileNotFoundError``: gone)."""
        paths = [self.path(name) for name in names]
        found = self.call(lambda: self.fs.cat(paths, on_error="return"), f"read {len(paths)} objects", len(paths))
        return {name: found.get(path) for name, path in zip(names, paths)}

    def ranges(self, names: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[object]:
        """One byte range of each object (in one call; the library sends them concurrently).

        A call whose every range failed (but for objects gone, and ranges that start past
        the end of the object listed, which are damage: ``b""``) is a failed request: the
        backoff starts, as it does for a call that raises (a server that hangs answers
        each range with its timeout).
        """
        paths = [self.path(name) for name in names]

        def op() -> list[object]:
            blobs = list(self.fs.cat_ranges(paths, starts, ends, on_error="return"))
            past = {j for j, (name, start) in enumerate(zip(names, starts)) if self.sizes.get(name, start + 1) <= start}
            failed = [
                b for j, b in enumerate(blobs) if j not in past and isinstance(b, Exception)
                and not isinstance(b, FileNotFoundError)
            ]  # fmt: skip
            if failed and len(failed) == len(blobs) - len(past):
                raise failed[0]
            return [b"" if j in past and isinstance(b, Exception) else b for j, b in enumerate(blobs)]  # the 416s

        blobs = self.call(op, "read entries", requests=len(paths))
        self.received += sum(len(blob) for blob in blobs if isinstance(blob, bytes))
        return blobs

    def put(self, name: str, data: bytes, what: str) -> None:
        """Upload one object (a new name: objects are never overwritten)."""
        self.call(lambda: self.fs.pipe_file(self.path(name), data), what, write=True)

    def upload(self, name: str, segment: bytes, manifest: bytes, entries: int) -> None:
        """Upload a segment, then its manifest; a segment whose manifest failed is removed (best effort).

        Raises:
            StoreUnavailableError: If either cannot be written (nothing is visible then).
        """
        self.put(name + SEGMENT, segment, f"write {plural(entries, 'entry')}")
        try:
            self.put(name + MANIFEST, manifest, "write a manifest")
        except StoreError:
            with contextlib.suppress(Exception):  # a segment no manifest names would count for nothing
                self.fs.rm_file(self.path(name + SEGMENT))  # at once, whatever the backoff
            raise

    def replace(self, suffix: str, data: bytes, what: str) -> None:
        """Upload a new object named with ``suffix``, then remove those this process uploaded with it before."""
        name = self.new_name() + suffix
        self.put(name, data, what)
        with self._stamp_lock:
            older = [n for n in self._replaced if n.endswith(suffix)]
            self._replaced = [n for n in self._replaced if not n.endswith(suffix)] + [name]
        with contextlib.suppress(StoreError):
            self.remove(older)

    def describe(self, meta: dict[str, Any]) -> None:
        """Upload ``torchcache.json`` unless there is one; a failure is reported, not raised."""
        try:
            if not self.call(lambda: self.fs.exists(self.path(META_NAME)), "look for the description"):
                self.put(META_NAME, json.dumps(meta, sort_keys=True).encode(), "describe the cache")
        except StoreError as exc:
            self._report(Fault.META, f"cannot describe the cache in {self.url}: {exc}")

    def description(self) -> dict[str, Any]:
        """What ``torchcache.json`` says of the cache (``{}``: none, or not a JSON object).

        Raises:
            StoreUnavailableError: If the bucket cannot be read.
        """
        try:
            body = self.call(lambda: self.fs.cat_file(self.path(META_NAME)), "read the description")
            meta = json.loads(body)
        except (FileNotFoundError, ValueError, RecursionError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def remove(self, names: Sequence[str]) -> None:
        """Remove objects, in one bulk request per 1,000 where the library batches deletes.

        An object already removed (by another writer) is skipped.
        """
        paths = [self.path(name) for name in names]
        for at in range(0, len(paths), 1000):
            chunk = paths[at : at + 1000]
            try:
                op = lambda chunk=chunk: self.fs.rm(chunk)  # type: ignore[misc]  # noqa: E731
                self.call(op, "remove objects", -(-len(chunk) // 1000), write=True)
            except FileNotFoundError:  # some were gone: the others one by one
                for path in chunk:
                    with contextlib.suppress(FileNotFoundError):
                        self.call(lambda path=path: self.fs.rm_file(path), "remove an object", write=True)  # type: ignore[misc]

    def abort_stale_uploads(self, before: float) -> int:
        """Abort the multipart uploads under the prefix begun before ``before`` (seconds since the epoch); how many.

        A writer killed while it uploaded a large segment leaves parts that no listing
        shows and that the store bills. Only S3 has such uploads to list. At most once an
        hour per process, outside the backoff (a refusal here must not stop the writes): a
        server that cannot list or abort them (no permission, no such call) leaves them.
        """
        now = time.monotonic()
        if not hasattr(self.fs, "call_s3") or now < self._next_sweep:
            return 0
        bucket, _, key_prefix = self.prefix.partition("/")
        try:
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix + "/")
        except Exception:  # noqa: BLE001 - any refusal: nothing swept, tried again in a minute
            self._next_sweep = now + 60.0
            return 0
        self._next_sweep = now + 3600.0
        stale = [
            upload
            for upload in listed.get("Uploads", [])
            if str(upload.get("Key", "")).startswith(key_prefix + "/")
            and getattr(upload.get("Initiated"), "timestamp", lambda: before)() < before
        ]
        for upload in stale:
            with contextlib.suppress(Exception):  # aborted by another writer meanwhile, or refused
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        return len(stale)

    def remove_all(self) -> None:
        """Remove the cache's objects under the prefix; other objects put there are left alone."""
        self.remove(sorted(name for name in self.names() if is_own(name)))


def find_caches(url: str, storage_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The ``torchcache.json`` of every cache under ``url`` (invalid ones are left out).

    Raises:
        ConfigError: If the URL is invalid or a package is missing.
        StoreUnavailableError: If the bucket cannot be listed or read.
    """
    fs, root = open_filesystem(url, storage_options)
    bucket = Bucket(fs, root, url, lambda kind, message: None)
    paths = bucket.call(lambda: list(fs.glob(f"{root}/*/{META_NAME}")), "list caches")
    found = bucket.call(lambda: fs.cat(paths, on_error="return"), "read cache descriptions") if paths else {}
    metas = []
    for body in found.values():
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            meta = json.loads(body)
            if isinstance(meta, dict):
                metas.append(meta)
    return metas


def bucket_namespaces(url: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The caches (namespaces) under ``url``: its folders that hold what torchcache writes (others are not caches).

    Raises:
        ConfigError: If the URL is invalid or a package is missing.
        StoreUnavailableError: If the bucket cannot be listed.
    """
    fs, root = open_filesystem(url, storage_options)
    bucket = Bucket(fs, root, url, lambda kind, message: None)
    found = bucket.call(lambda: fs.ls(root, detail=True) if fs.exists(root) else [], "list caches")
    folders = sorted(str(item["name"]) for item in found if item.get("type") == "directory")

    def holds_a_cache(folder: str) -> bool:
        try:
            return bool(fs.exists(f"{folder}/{META_NAME}")) or any(map(is_own, fs.ls(folder, detail=False)))
        except FileNotFoundError:  # cleared since the listing
            return False

    held = [folder for folder in folders if bucket.call(functools.partial(holds_a_cache, folder), "list a cache")]
    return [folder.rsplit("/", 1)[-1] for folder in held]
