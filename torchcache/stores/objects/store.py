"""A store in an object store bucket (S3, GCS and others fsspec reaches): immutable segments and manifests.

Writers never overwrite an object. A batch of entries is uploaded as one *segment*
(``<stamp>-<id>.tcs``: the payloads one after another), then its *manifest*
(``<stamp>-<id>.tcm``: JSON naming each entry's key, offset, length and xxh3-64), and
an entry is visible once its manifest is: a writer killed mid-upload leaves a segment
no reader sees (``prune`` sweeps it). Removing entries uploads a *tombstone*
(``<stamp>-<id>.tcd``) that hides them in the manifests made before it. ``<stamp>`` is
the upload time in nanoseconds, so the names sort by age, and any number of writers on
any number of machines need no lock. Once many manifests are not covered by one, a
writer uploads a *checkpoint* (``<stamp>-<id>.tci``): their merge, which a reader
starting from nothing reads in their place.

A reader lists the bucket once (reading the newest checkpoint and the manifests it does
not cover), then again when it misses (at most every ``refresh_seconds``), and fetches
each segment's entries of a batch with one ranged read; every payload is checked against
its manifest's digest, so a damaged or planted object is a miss, never wrong bytes.
Manifests and checkpoints are parsed as JSON and validated; nothing read from the bucket
is unpickled or run. Credentials come from the filesystem library's own chain
(environment, config files, instance metadata) or ``storage_options``; they are never
logged or written.

The budget (``max_bytes``) counts segment bytes: past it, the oldest segments go
first (manifest, then segment), across writers, and a segment another writer removed
first is simply gone. Faults of the bucket (unreachable, 403, 404, throttling) are
reported once per outage; reads then miss and writes raise
:class:`~torchcache.errors.StoreUnavailableError` until a backoff (0.5 s doubling to
30 s) has passed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..._fork import renew_lock_after_fork
from ..._gc import collector_paused
from ..._log import logger
from ...errors import StoreError, StoreUnavailableError
from ...faults import Fault, Report
from ..batched import BatchedStore, VerifyReport
from ..packed.format import encode_key, is_key
from .bucket import META_NAME, Bucket
from .filesystem import filesystem_only, open_filesystem
from .index import Index, pending
from .manifests import (
    CHECKPOINT,
    MANIFEST,
    SEGMENT,
    pack,
    ranged_reads,
    take_all,
    to_sweep,
)
from .verify import hide, verify_store

__all__ = ["ObjectStore", "remove_segments", "segments_of"]

_STALE_UPLOAD_SECONDS = 3600.0


class ObjectStore(BatchedStore):
    """Entries in a bucket, as immutable segments with manifests (see the module's description).

    Args:
        url: ``scheme://bucket/prefix``.
        namespace: The cache's name: its objects live under ``prefix/namespace/``.
        max_bytes: The budget of segment bytes under the namespace.
        storage_options: Passed to the fsspec filesystem (``endpoint_url``, credentials...).
        report: Called with ``(kind, message)`` for faults.
        refresh_seconds: A miss lists the manifests again at most this often.
        meta: What the namespace's ``torchcache.json`` records, written with the first entries.
        keep_budget: Keep the budget after writes and at :meth:`close`, and sweep leftovers
            then (``False``: a reader or an inspector, ``torchcache ls``, which removes nothing).

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
        storage_options: Mapping[str, Any] | None = None,
        report: Report | None = None,
        refresh_seconds: float = 30.0,
        meta: Mapping[str, Any] | None = None,
        keep_budget: bool = True,
    ) -> None:
        fs, root = open_filesystem(url, storage_options)
        self.url, self.max_bytes, self.refresh_seconds = url, max_bytes, refresh_seconds
        self._report = report or (lambda kind, message: logger.warning("%s", message))
        reopen = functools.partial(filesystem_only, url, dict(storage_options or {}))
        self.bucket = Bucket(fs, f"{root}/{namespace}", url, self._report, reopen)
        self._lock, self._known = threading.RLock(), Index()
        renew_lock_after_fork(self, "_lock")  # a child forked while a thread read the bucket must not hang
        renew_lock_after_fork(self._known, "_lock")
        self._listed_at = float("-inf")
        self._meta, self._described_at = None if meta is None else dict(meta), float("-inf")
        self._extras: list[tuple[str, bytes | memoryview]] = []
        self._partial = False  # entries left out for faults of this process's reads: it uploads no checkpoint
        #: Index objects whose read failed at the latest listing (not judged: read again at the next).
        self.unreadable: set[str] = set()
        self._keep_budget = keep_budget
        self._removing: list[str] = []  # segments whose manifests went but whose own removal failed
        self._damaged: list[str] | None = None  # keys whose bytes fail their digest, while verify() collects them

    def __repr__(self) -> str:
        namespace, entries = self.bucket.prefix.rsplit("/", 1)[-1], len(self._known)
        return f"ObjectStore({self.url!r}, {namespace!r}, max_bytes={self.max_bytes}, {entries} entries)"

    # -- the index ----------------------------------------------------------------
    def refresh(self) -> set[str]:
        """List the bucket and read the manifests and tombstones not read yet; return the names listed.

        Raises:
            StoreUnavailableError: If the bucket cannot be listed.
        """
        with self._lock, collector_paused():  # thousands of entries made and kept: see torchcache._gc
            names = self.bucket.names()
            _read_index_objects(self, names)
            self._known.drop_gone(names)
            self._known.sized(self.bucket.sizes)  # a manifest may claim any size: the budget counts real bytes
            self._listed_at = time.monotonic()
            return names

    def _apply(self, name: str, body: object) -> None:
        problem = self._known.apply(name, body)
        if problem is not None:  # damaged, planted, or a newer torchcache's
            self._report(Fault.INDEX, f"{self.bucket.path(name)} is not used: {problem}")

    def _index(self, refresh_if_missing: Sequence[str] = (), stale: bool = False) -> None:
        """List the bucket at first use, and again once ``refresh_seconds`` passed at a miss (or with ``stale``)."""
        due = time.monotonic() - self._listed_at >= self.refresh_seconds
        if self._listed_at == float("-inf") or (due and (stale or self._known.missing(refresh_if_missing))):
            self.refresh()

    # -- reads --------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The stored bytes of each key, ``None`` for a miss: a few ranged reads per segment (:func:`ranged_reads`).

        A segment gone since the listing (pruned by another writer) makes the bucket be listed
        again and its keys read once more. A bucket that cannot be read gives misses.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """
        list(map(encode_key, keys))  # each key checked
        out: list[bytes | memoryview | None] = [None] * len(keys)
        try:
            with self._lock:
                self._index(keys)
            if gone := _fetch(self, keys, range(len(keys)), out):
                with self._lock:
                    listed = self.refresh()  # newer manifests are read (another writer's copies of those keys)
                    self._known.forget(gone)  # and the gone segments left out, even where still listed
                    self._partial = self._partial or not listed.isdisjoint(gone)
                _fetch(self, keys, [i for i, data in enumerate(out) if data is None], out)
        except StoreError as exc:
            self.bucket.read_failed(exc)
        return out

    def take_extras(self) -> list[tuple[str, bytes | memoryview]]:
        """Entries read with whole segments beyond those asked for, once (for a local copy to keep)."""
        with self._lock:
            extras, self._extras = self._extras, []
        return extras

    def placement(self, keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
        """Each key's segment and its bytes (``None``: not in the bucket as far as it could be listed)."""
        return _listed(self).placement(keys)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and is_key(key) and key in _listed(self)

    def keys(self) -> Iterator[str]:
        """The keys of the manifests read so far (the bucket is listed once first)."""
        self._index()
        return iter(self._known.keys())

    def __len__(self) -> int:
        """Entries of the manifests read so far (a bucket that cannot be listed: those, and the fault reported)."""
        return len(_listed(self))

    @property
    def nbytes(self) -> int:
        """Payload bytes of the visible entries."""
        return self._known.nbytes()

    @property
    def disk_bytes(self) -> int:
        """Bytes of the segments in the bucket (0: nothing is on this machine's disk), those left to remove too."""
        return sum(list(self._known.segments.values())) + sum(self.bucket.sizes.get(n, 0) for n in self._removing)

    def reads_failing(self, retry: bool = False) -> bool:
        """Whether the last read of the bucket failed (``retry``: send the next read whatever the backoff)."""
        return self.bucket.reads_failing(retry)

    def end_write_backoff(self) -> None:
        """Send the next write whatever the backoff (a flush at the end: the outage may be over)."""
        self.bucket.end_write_backoff()

    # -- writes -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Upload the entries as one segment, then its manifest; then keep the budget; return how many.

        An empty value is not stored (a segment of nothing reads as one removed).

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreUnavailableError: If the bucket cannot be written (nothing is visible then).
        """
        todo = {key: data for key, data in items if encode_key(key) and 0 < len(data) <= self.max_bytes}
        if not todo:
            return 0
        with self._lock:
            self._index(stale=True)  # other writers' segments count against the budget
        name, (segment, body) = self.bucket.new_name(), pack(todo)
        self.bucket.upload(name, segment, body, len(todo))
        with self._lock:
            self._apply(name + MANIFEST, body)
        _describe_again(self)
        if self._keep_budget and self.disk_bytes > self.max_bytes:
            _keep_budget(self)
        with self._lock:
            checkpoint = self._known.checkpoint() if self._known.checkpoint_due() and not self._partial else None
        with contextlib.suppress(StoreError):  # the entries are visible without it
            if checkpoint is not None:
                self.bucket.replace(CHECKPOINT, checkpoint, "write a checkpoint")
        return len(todo)

    def delete_many(self, keys: Sequence[str]) -> int:
        """Hide entries behind a tombstone; return how many were visible (listed again for keys not in the index).

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreUnavailableError: If the bucket cannot be written.
        """
        list(map(encode_key, keys))  # each key checked
        with self._lock:
            asked = list(dict.fromkeys(keys))
            if self._listed_at == float("-inf") or self._known.missing(asked):  # another writer's since the listing
                self.refresh()
            present = [key for key, entry in zip(asked, self._known.find(asked)) if entry is not None]
        if present:
            hide(self, present)
        return len(present)

    def prune(self, max_bytes: int, sweep_seconds: float | None = _STALE_UPLOAD_SECONDS, dry_run: bool = False) -> int:
        """Remove the oldest segments until the rest fit ``max_bytes``; sweep unfinished uploads.

        Uploads older than ``sweep_seconds`` that never got their manifest (a writer killed
        mid-upload) go too (``None``: no sweep), and every checkpoint but the newest. Returns
        how many segments were removed (``dry_run``: how many the budget would remove; none is).

        Raises:
            StoreUnavailableError: If the bucket cannot be listed or written.
        """
        with self._lock:
            names = self.refresh()
            oldest = self._known.oldest_over(max_bytes)
            if dry_run:
                return len(oldest)
            left = to_sweep(names, sweep_seconds, self._known.invalid)
            left += [name for name in self._removing if name in names and name not in left]
        remove_segments(self, oldest, left)
        if sweep_seconds is not None:  # the parts of a large segment whose writer was killed
            self.bucket.abort_stale_uploads(time.time() - sweep_seconds)
        return len(oldest) + sum(1 for n in left if n.endswith(SEGMENT))

    def clear(self) -> None:
        """Remove every object under the namespace (the next write lists it again, and describes it).

        Raises:
            StoreUnavailableError: If the bucket cannot be written.
        """
        self.bucket.remove_all()
        with self._lock:
            self._known.clear()
            self._listed_at, self._partial = float("-inf"), False  # what it left out for faults is gone too

    def flush(self) -> None:
        """Nothing to do: every write is visible when ``put_many`` returns."""

    def close(self) -> None:
        """Keep the budget over a fresh listing (DataLoader workers and other writers wrote too); forget the index."""
        with contextlib.suppress(StoreError):  # a bucket away, or read-only: the next writer keeps it
            if self._keep_budget and not self.bucket.writes_backing_off():  # a send at the end just failed
                self.prune(self.max_bytes)
            if len(self._known):  # cleared since this process last listed it: described again for its readers
                _describe_again(self)
        with self._lock:
            self._known.clear()
            self._listed_at = float("-inf")

    def verify(self, fix: bool = False) -> VerifyReport:
        """Read and check every entry; ``fix`` hides those failing their digest (not those unread) behind a tombstone.

        Raises:
            StoreError: If ``fix`` is set and the bucket cannot be written.
        """
        return verify_store(self, fix)


def _listed(store: ObjectStore) -> Index:
    """The index, the bucket listed first if it was not (if it cannot be, the fault is reported)."""
    try:
        with store._lock:
            store._index()
    except StoreError as exc:
        store.bucket.read_failed(exc)
    return store._known


def _describe_again(store: ObjectStore) -> None:
    """Write what ``CachedDataset(None, url)`` finds where the latest listing lacks it (again after a clear)."""
    if store._meta is not None and META_NAME not in store.bucket.sizes and store._listed_at > store._described_at:
        store.bucket.describe(store._meta)
        store._described_at = time.monotonic()


def _read_index_objects(store: ObjectStore, names: set[str]) -> None:
    """Read and apply the index objects of a listing not read yet.

    A checkpoint is applied before the manifests and tombstones it does not cover; those
    named after it (later, by their writers' clocks) are read with it, in one round trip,
    and any others it does not cover after it. One whose read fails is not judged: it is
    read again at the next listing, and its entries are left out until then (a checkpoint
    covers only the objects read).
    """
    store.unreadable = set()
    fetched: dict[str, object] = {}
    for new in store._known.unread(names):
        if wanted := [name for name in new if name not in fetched]:
            if len(wanted) == 1 and wanted[0].endswith(CHECKPOINT):  # those named after it: not covered, likely
                wanted += [name for name in pending(store._known, names) if name > wanted[0]]
            fetched.update(store.bucket.cat(wanted))
        for name in new:
            body = fetched[name]
            if isinstance(body, bytes):
                store._apply(name, body)
            elif not isinstance(body, FileNotFoundError):  # else pruned since it was listed
                store.unreadable.add(name)
    if store.unreadable:
        store.bucket.read_failed(StoreUnavailableError(f"cannot read {len(store.unreadable)} index objects"))


def remove_segments(store: ObjectStore, segments: Sequence[str], others: Sequence[str] = ()) -> None:
    """Remove segments (their manifests first: no entry is left without its segment), and other objects.

    Raises:
        StoreUnavailableError: If the bucket cannot be written.
    """
    store.bucket.remove([s.removesuffix(SEGMENT) + MANIFEST for s in segments])
    with store._lock:  # their entries are gone; the segments must go now or at the next prune
        store._known.forget(set(segments))
        store._removing = sorted(set(store._removing) | set(segments))
    store.bucket.remove([*segments, *others])
    with store._lock:
        store._removing = [name for name in store._removing if name not in segments and name not in others]


def segments_of(store: ObjectStore) -> list[str]:
    """The segments the store's index knows (those listed with their manifests), oldest first."""
    with store._lock:
        return sorted(store._known.segments)


def _keep_budget(store: ObjectStore) -> None:
    """Prune to the budget after a write (and sweep what killed writers left an hour ago or more)."""
    try:
        store.prune(store.max_bytes)
    except StoreError as exc:  # the entries are visible: the budget is kept at the next write
        store._report(Fault.BUDGET, f"cannot keep the budget of {store.bucket.prefix} ({exc}); tried again later")


def _fetch(
    store: ObjectStore, keys: Sequence[str], positions: Sequence[int], out: list[bytes | memoryview | None]
) -> set[str]:
    """Read the entries of ``keys`` at ``positions`` into ``out``; return the segments that were gone.

    Raises:
        StoreError: If the bucket cannot be read.
    """
    asked = [keys[i] for i in positions]
    with store._lock:
        reads = ranged_reads(asked, store._known, store.prefetch) if asked else []
    if not reads:
        return set()
    blobs = store.bucket.ranges([r.segment for r in reads], [r.start for r in reads], [r.end for r in reads])
    found: list[bytes | memoryview | None] = [None] * len(asked)
    taken = take_all(reads, blobs, asked, found)
    for i, data in zip(positions, found):
        if data is not None:
            out[i] = data
    if taken.unreadable:
        store.bucket.read_failed(StoreUnavailableError(f"cannot read {store.bucket.path(taken.unreadable)}"))
    if taken.damaged:
        if store._damaged is not None:
            store._damaged.extend(taken.damaged)
        n = len(taken.damaged)
        store._report(Fault.CORRUPT, f"{n} entries in {store.bucket.prefix} fail their checksum: not used")
    with store._lock:
        store._extras += taken.extras
        if taken.damaged:  # not read again here; the index no longer holds all its manifests say
            store._known.forget(set(), taken.damaged)
            store._partial = True
    return taken.gone
