"""A store in an object store bucket (S3, GCS and others fsspec reaches): immutable segments and manifests.

Writers never overwrite an object. A batch of entries is uploaded as one *segment*
(``<stamp>-<id>.tcs``: the payloads one after another), then its *manifest*
(``<stamp>-<id>.tcm``: JSON naming each entry's key, offset, length and xxh3-64), and
an entry is visible once its manifest is: a writer killed mid-upload leaves a segment
no reader sees (``prune`` sweeps it). Removing entries uploads a *tombstone*
(``<stamp>-<id>.tcd``) that hides them in the manifests made before it. ``<stamp>`` is
the upload time in nanoseconds, so the names sort by age, and any number of writers on
any number of machines need no lock.

A reader lists the manifests once, then again when it misses (at most every
``refresh_seconds``), and fetches each segment's entries of a batch with one ranged
read; every payload is checked against its manifest's digest, so a damaged or planted
object is a miss, never wrong bytes. Manifests are parsed as JSON and validated; nothing
read from the bucket is unpickled or run. Credentials come from the filesystem
library's own chain (environment, config files, instance metadata) or
``storage_options``; they are never logged or written.

The budget (``max_bytes``) counts segment bytes: past it, the oldest segments go
first (manifest, then segment), across writers, and a segment another writer removed
first is simply gone. Faults of the bucket (unreachable, 403, 404, throttling) are
reported once per outage; reads then miss and writes raise
:class:`~torchcache.errors.StoreUnavailableError` until a backoff (0.5 s doubling to
30 s) has passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import xxhash

from .._log import logger
from ..errors import ConfigError, StoreError, StoreUnavailableError
from ..faults import Fault, Report
from .batched import BatchedStore, VerifyReport
from .packed.format import encode_key, is_key

__all__ = ["OBJECT_SCHEMES", "ObjectStore", "open_filesystem", "storage_options_from_env"]

#: URL schemes of object stores (through fsspec and the scheme's package).
OBJECT_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "oss://")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_FORMAT = "torchcache-objects"
_SEGMENT, _MANIFEST, _TOMBSTONE = ".tcs", ".tcm", ".tcd"
_MAX_MANIFEST = 64 << 20
_STALE_UPLOAD_SECONDS = 3600.0


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path it names (``bucket/prefix``, no scheme).

    Raises:
        ConfigError: If ``url`` is not an object store URL, or fsspec or the scheme's package is missing.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if not url.lower().startswith(OBJECT_SCHEMES) or not url.split("://", 1)[1].strip("/"):
        raise ConfigError(
            f"an object store URL is scheme://bucket/prefix with scheme one of {OBJECT_SCHEMES}, got {url!r}"
        )
    extra = _EXTRAS.get(scheme, scheme)
    try:
        import fsspec

        fs = fsspec.filesystem(scheme, **(storage_options or {}))
    except ImportError as exc:
        raise ConfigError(
            f"{scheme}:// caches need fsspec and the package of the scheme ({exc}): pip install 'torchcache[{extra}]'"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a filesystem that cannot be made is a configuration problem
        raise ConfigError(f"cannot use {scheme}:// ({type(exc).__name__}: {exc})") from None
    return fs, url.split("://", 1)[1].strip("/")


class _Entry(NamedTuple):
    segment: str
    offset: int
    length: int
    digest: int
    stamp: str


class ObjectStore(BatchedStore):
    """Entries in a bucket, as immutable segments with manifests (see the module's description).

    Args:
        url: ``scheme://bucket/prefix``.
        namespace: The cache's name: its objects live under ``prefix/namespace/``.
        max_bytes: The budget of segment bytes under the namespace.
        storage_options: Passed to the fsspec filesystem (``endpoint_url``, credentials...).
        report: Called with ``(kind, message)`` for faults.
        refresh_seconds: A miss lists the manifests again at most this often.
        fs: A filesystem to use instead of making one (for tests).

    Raises:
        ConfigError: If the URL is invalid or a package is missing.
    """

    remote = True

    def __init__(
        self,
        url: str,
        namespace: str,
        max_bytes: int,
        *,
        storage_options: dict[str, Any] | None = None,
        report: Report | None = None,
        refresh_seconds: float = 30.0,
        fs: Any = None,
    ) -> None:
        if fs is None:
            fs, root = open_filesystem(url, storage_options)
        else:
            root = url.split("://", 1)[-1].strip("/")
        self.url = url
        self.fs = fs
        self.prefix = f"{root}/{namespace}"
        self.max_bytes = max_bytes
        self.refresh_seconds = refresh_seconds
        self.requests = 0
        self._report = report or (lambda kind, message: logger.warning("%s", message))
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._segments: dict[str, int] = {}  # segment name -> bytes
        self._seen: set[str] = set()  # manifests and tombstones read
        self._listed_at = float("-inf")
        self._retry_at, self._delay, self._troubled = float("-inf"), 0.0, False

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, {self.prefix.rsplit('/', 1)[-1]!r})"

    # -- faults -------------------------------------------------------------------
    def _call(self, op: Callable[[], Any], what: str) -> Any:
        """Run one request; a failure is a StoreUnavailableError and starts a backoff."""
        wait = self._retry_at - time.monotonic()
        if wait > 0:
            raise StoreUnavailableError(f"cannot {what}: {self.url} was unreachable; next try in {wait:.1f} s")
        self.requests += 1
        try:
            result = op()
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - any fault of the bucket is a store fault
            self._delay = min(30.0, max(0.5, self._delay * 2))
            self._retry_at = time.monotonic() + self._delay
            raise StoreUnavailableError(f"cannot {what} in {self.url}: {type(exc).__name__}: {exc}") from None
        self._delay, self._retry_at, self._troubled = 0.0, float("-inf"), False
        return result

    def _read_failed(self, exc: StoreError) -> None:
        if not self._troubled:
            self._troubled = True
            self._report(Fault.UNAVAILABLE, str(exc))

    # -- the index ----------------------------------------------------------------
    def refresh(self) -> None:
        """List the bucket and read the manifests and tombstones not read yet.

        Raises:
            StoreUnavailableError: If the bucket cannot be listed.
        """
        with self._lock:
            names = self._list()
            new = sorted(n for n in names if n.endswith((_MANIFEST, _TOMBSTONE)) and n not in self._seen)
            if new:
                bodies = self._call(
                    lambda: self.fs.cat([f"{self.prefix}/{n}" for n in new], on_error="return"), "read manifests"
                )
                for name in new:
                    body = bodies.get(f"{self.prefix}/{name}")
                    if isinstance(body, FileNotFoundError):
                        continue  # pruned since it was listed
                    self._seen.add(name)
                    self._apply(name, body)
            gone = {n for n in self._seen if n not in names}
            if gone:  # manifests pruned by another writer: their entries are gone
                self._seen -= gone
                dropped = {n.removesuffix(_MANIFEST) + _SEGMENT for n in gone}
                self._forget(dropped)
            self._listed_at = time.monotonic()

    def _list(self) -> set[str]:
        def ls() -> list[str]:
            try:
                self.fs.invalidate_cache(self.prefix)
                return list(self.fs.ls(self.prefix, detail=False))
            except FileNotFoundError:
                return []

        return {path.rsplit("/", 1)[-1] for path in self._call(ls, "list")}

    def _apply(self, name: str, body: object) -> None:
        """Merge one manifest or tombstone into the index; an invalid one is reported and skipped."""
        stamp = name.split("-", 1)[0]
        parsed = _parse(body, name)
        if isinstance(parsed, str):
            self._report(
                Fault.INDEX, f"{self.prefix}/{name} is not a valid manifest ({parsed}); its entries are not used"
            )
            return
        if name.endswith(_TOMBSTONE):
            for key in parsed["deleted"]:
                entry = self._entries.get(key)
                if entry is not None and entry.stamp < stamp:
                    del self._entries[key]
            return
        segment = name.removesuffix(_MANIFEST) + _SEGMENT
        self._segments[segment] = parsed["bytes"]
        for key, offset, length, digest in parsed["entries"]:
            old = self._entries.get(key)
            if old is None or old.stamp < stamp:
                self._entries[key] = _Entry(segment, offset, length, digest, stamp)

    def _forget(self, segments: set[str]) -> None:
        for segment in segments:
            self._segments.pop(segment, None)
        for key in [k for k, e in self._entries.items() if e.segment in segments]:
            del self._entries[key]

    def _index(self, refresh_if_missing: Sequence[str] = ()) -> None:
        due = time.monotonic() - self._listed_at >= self.refresh_seconds
        if self._listed_at == float("-inf") or (due and any(k not in self._entries for k in refresh_if_missing)):
            self.refresh()

    # -- reads --------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The stored bytes of each key, ``None`` for a miss: one ranged read per segment.

        A bucket that cannot be read gives misses (reported once per outage).

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """
        for key in keys:
            encode_key(key)
        out: list[bytes | memoryview | None] = [None] * len(keys)
        try:
            with self._lock:
                self._index(keys)
                wanted = [(i, self._entries.get(key)) for i, key in enumerate(keys)]
            by_segment: dict[str, list[tuple[int, _Entry]]] = {}
            for i, entry in wanted:
                if entry is not None:
                    by_segment.setdefault(entry.segment, []).append((i, entry))
            if not by_segment:
                return out
            segments = list(by_segment)
            starts = [min(e.offset for _, e in by_segment[s]) for s in segments]
            ends = [max(e.offset + e.length for _, e in by_segment[s]) for s in segments]
            paths = [f"{self.prefix}/{s}" for s in segments]
            blobs = self._call(lambda: self.fs.cat_ranges(paths, starts, ends, on_error="return"), "read entries")
        except StoreError as exc:
            self._read_failed(exc)
            return out
        damaged: list[str] = []
        for segment, start, blob in zip(segments, starts, blobs):
            if isinstance(blob, FileNotFoundError):  # pruned by another writer since the listing
                with self._lock:
                    self._forget({segment})
                continue
            if not isinstance(blob, bytes):
                self._read_failed(StoreUnavailableError(f"cannot read {self.prefix}/{segment}: {blob}"))
                continue
            view = memoryview(blob)
            for i, entry in by_segment[segment]:
                data = view[entry.offset - start : entry.offset - start + entry.length]
                if len(data) == entry.length and xxhash.xxh3_64_intdigest(data) == entry.digest:
                    out[i] = data
                else:
                    damaged.append(keys[i])
        if damaged:
            self._report(Fault.CORRUPT, f"{len(damaged)} entries in {self.prefix} fail their checksum: not used")
            with self._lock:
                for key in damaged:
                    self._entries.pop(key, None)
        return out

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str) or not is_key(key):
            return False
        try:
            with self._lock:
                self._index()
        except StoreError as exc:
            self._read_failed(exc)
        return key in self._entries

    def keys(self) -> Iterator[str]:
        """The keys of the manifests read so far (the bucket is listed once first)."""
        with self._lock:
            self._index()
            return iter(list(self._entries))

    def __len__(self) -> int:
        with self._lock:
            self._index()
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the visible entries."""
        with self._lock:
            return sum(e.length for e in self._entries.values())

    @property
    def disk_bytes(self) -> int:
        """Bytes of the segments in the bucket (0: nothing is on this machine's disk)."""
        with self._lock:
            return sum(self._segments.values())

    # -- writes -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Upload the entries not stored yet as one segment, then its manifest; then keep the budget.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreUnavailableError: If the bucket cannot be written (nothing is visible then).
        """
        latest: dict[str, bytes | memoryview] = {}
        for key, data in items:
            encode_key(key)
            if len(data) <= self.max_bytes:
                latest[key] = data
        with self._lock:
            self._index()
            todo = {k: v for k, v in latest.items() if k not in self._entries}
        if not todo:
            return len(latest)
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:16]}"
        entries, chunks, offset = [], [], 0
        for key, data in todo.items():
            entries.append([key, offset, len(data), xxhash.xxh3_64_intdigest(data)])
            chunks.append(bytes(data))
            offset += len(data)
        manifest = {"format": _FORMAT, "version": 1, "bytes": offset, "entries": entries}
        segment = f"{self.prefix}/{name}{_SEGMENT}"
        self._call(lambda: self.fs.pipe_file(segment, b"".join(chunks)), f"write {len(todo)} entries")
        body = json.dumps(manifest, separators=(",", ":")).encode()
        self._call(lambda: self.fs.pipe_file(f"{self.prefix}/{name}{_MANIFEST}", body), "write a manifest")
        with self._lock:
            self._seen.add(name + _MANIFEST)
            self._apply(name + _MANIFEST, body)
        if self.disk_bytes > self.max_bytes:
            self.prune(self.max_bytes, sweep_seconds=None)
        return len(latest)

    def delete_many(self, keys: Sequence[str]) -> int:
        """Hide entries behind a tombstone; return how many were visible.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreUnavailableError: If the bucket cannot be written.
        """
        for key in keys:
            encode_key(key)
        with self._lock:
            self._index()
            present = [key for key in dict.fromkeys(keys) if key in self._entries]
        if not present:
            return 0
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:16]}{_TOMBSTONE}"
        body = json.dumps({"format": _FORMAT, "version": 1, "deleted": present}).encode()
        self._call(lambda: self.fs.pipe_file(f"{self.prefix}/{name}", body), "write a tombstone")
        with self._lock:
            self._seen.add(name)
            self._apply(name, body)
        return len(present)

    def prune(self, max_bytes: int, sweep_seconds: float | None = _STALE_UPLOAD_SECONDS) -> int:
        """Remove the oldest segments until the rest fit ``max_bytes``; sweep unfinished uploads.

        A segment without a manifest older than ``sweep_seconds`` (a writer killed
        mid-upload) is removed too (``None``: no sweep).

        Returns:
            How many segments were removed.

        Raises:
            StoreUnavailableError: If the bucket cannot be listed or written.
        """
        with self._lock:
            self.refresh()
            names = self._list()
            total = sum(self._segments.values())
            doomed: list[str] = []
            for segment in sorted(self._segments):
                if total <= max_bytes:
                    break
                total -= self._segments[segment]
                doomed.append(segment)
            now = time.time_ns()
            for name in names if sweep_seconds is not None else ():
                base = name.removesuffix(_SEGMENT)
                if name.endswith(_SEGMENT) and base + _MANIFEST not in names and name not in doomed:
                    stamp = base.split("-", 1)[0]
                    if stamp.isdigit() and now - int(stamp) > sweep_seconds * 1e9:  # type: ignore[operator]
                        doomed.append(name)
            self._forget(set(doomed))
        paths = []
        for segment in doomed:
            paths += [f"{self.prefix}/{segment.removesuffix(_SEGMENT)}{_MANIFEST}", f"{self.prefix}/{segment}"]
        for path in paths:  # manifests first: an entry is never visible without its segment
            with contextlib.suppress(FileNotFoundError):  # removed by another writer
                self._call(lambda path=path: self.fs.rm_file(path), "remove a segment")  # type: ignore[misc]
        return len(doomed)

    def clear(self) -> None:
        """Remove every object under the namespace.

        Raises:
            StoreUnavailableError: If the bucket cannot be written.
        """

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.prefix, recursive=True)

        self._call(rm, "clear")
        with self._lock:
            self._entries.clear()
            self._segments.clear()
            self._seen.clear()

    def flush(self) -> None:
        """Nothing to do: every write is visible when ``put_many`` returns."""

    def close(self) -> None:
        """Forget the index; it is listed again when used."""
        with self._lock:
            self._entries.clear()
            self._segments.clear()
            self._seen.clear()
            self._listed_at = float("-inf")

    def verify(self, fix: bool = False) -> VerifyReport:
        """Read every entry and check it; with ``fix``, hide the bad ones behind a tombstone.

        Raises:
            StoreError: If ``fix`` is set and the bucket cannot be written.
        """
        self.refresh()
        keys = list(self._entries)
        bad: list[str] = []
        for start in range(0, len(keys), 4096):
            chunk = keys[start : start + 4096]
            bad += [key for key, data in zip(chunk, self.get_many(chunk)) if data is None]
        problems = [f"{len(bad)} entries fail their checksum or cannot be read"] if bad else []
        if fix and bad:
            self.delete_many(bad)
        return VerifyReport(entries=len(keys), bad=bad, problems=problems, fixed=bool(fix and bad))


def _parse(body: object, name: str) -> dict[str, Any] | str:
    """A manifest or tombstone, validated, or what is wrong with it."""
    if not isinstance(body, bytes) or len(body) > _MAX_MANIFEST:
        return "unreadable or too large"
    try:
        data = json.loads(body)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != 1:
        return "not a torchcache manifest of a known version"
    if name.endswith(_TOMBSTONE):
        deleted = data.get("deleted")
        if not isinstance(deleted, list) or not all(isinstance(k, str) and is_key(k) for k in deleted):
            return "invalid deleted keys"
        return data
    size, entries = data.get("bytes"), data.get("entries")
    if type(size) is not int or size < 0 or not isinstance(entries, list):
        return "invalid size or entries"
    for entry in entries:
        if (
            not isinstance(entry, list)
            or len(entry) != 4
            or not isinstance(entry[0], str)
            or not is_key(entry[0])
            or not all(type(v) is int and v >= 0 for v in entry[1:])
            or entry[1] + entry[2] > size
            or entry[3] >= 1 << 64
        ):
            return f"invalid entry {str(entry)[:80]}"
    return data


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
