"""Features caches in a bucket: the features file uploaded in chunks, read through a local copy.

``extract_features(..., cache_dir="s3://bucket/prefix")`` makes the cache in a local copy
(``local_cache_dir``, default ``copies`` under the cache root) as a local cache is made,
then uploads the finished features file into the folder ``features-<key>`` under the URL,
as entries of the object store (:mod:`torchcache.stores.objects`): the file in chunks of
64 MiB, each a segment of its own, then a *head* entry naming the file's size, its
chunks and its xxh3-128. A machine whose local copy lacks the file reads the head, then
the chunks, into a temporary file that takes the file's place once its size and digest
are right; the rows are then checked one by one as a local cache's are.

An upload cut short leaves no head, so nothing a reader uses (``torchcache prune``
sweeps its chunks). The chunks of each upload have keys of their own, so two machines
that upload one cache at once never mix their files: the newest head wins, and each
uploader checks, after its head, that the winner is whole (putting its own back if not).
Faults of the bucket are warnings: the features are computed and kept in the local
copy, and a later call uploads them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from .._log import logger
from ..errors import ConfigError, StoreError, TorchCacheError
from ..faults import Fault, FaultLog
from ..keys import tag
from ..locations import check_local_dir, check_storage_options, check_url, is_object_url, resolve_local_dir
from ..stores.features.file import FEATURES_NAME, open_features
from ..stores.objects import ObjectStore, bucket_namespaces, remove_segments, segments_of
from ..stores.redis.url import redact_url
from ..stores.remote import local_copy_dir
from ..stores.rows import RowsFile

__all__ = [
    "CHUNK_BYTES",
    "FeaturesBucket",
    "folder_of",
    "from_bucket",
    "header_folder",
    "refuse_options",
    "split_url",
]

#: The size of each uploaded piece of a features file (the last is shorter).
CHUNK_BYTES = 64 << 20
_HEAD_KEY = xxhash.xxh3_128_hexdigest(b"torchcache-features-head")
_FORMAT = "torchcache-features-bucket"
_KEY_FORMAT = b"torchcache-features-1"
_FOLDER = re.compile(r"features-[0-9a-f]{32}")


class Head(NamedTuple):
    """What a head entry says of the uploaded file."""

    size: int
    chunks: int
    upload: str  #: the upload's id, in each chunk's key
    digest: str  #: xxh3-128 of the whole file

    def chunk_key(self, i: int) -> str:
        """The key of chunk ``i``."""
        return _chunk_key(self.upload, i)

    def encode(self) -> bytes:
        """The head entry's bytes (JSON)."""
        body = {"format": _FORMAT, "version": 1, **self._asdict()}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes | memoryview | None) -> Head | None:
        """The head in ``data``, or ``None`` if there is none or it is not valid."""
        if data is None or len(data) > 4096:
            return None
        try:
            body = json.loads(bytes(data))
        except (ValueError, RecursionError):
            return None
        if not isinstance(body, dict) or body.get("format") != _FORMAT or body.get("version") != 1:
            return None
        size, chunks, upload, digest = (body.get(k) for k in cls._fields)
        if type(size) is not int or type(chunks) is not int or size < 0 or chunks != -(-size // CHUNK_BYTES):
            return None
        if not (isinstance(upload, str) and len(upload) == 32 and isinstance(digest, str) and len(digest) == 32):
            return None
        if not all(c in "0123456789abcdef" for c in upload + digest):
            return None
        return cls(size, chunks, upload, digest)


def _chunk_key(upload: str, i: int) -> str:
    return xxhash.xxh3_128_hexdigest(f"{upload}:{i}".encode())


def _sweep_parts(path: Path) -> None:
    """Remove the temporary files of downloads to ``path`` that a killed process left (none holds their lock)."""
    for part in path.parent.glob(f".{path.name}.*.part"):
        with contextlib.suppress(OSError), open(part, "rb") as file:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            part.unlink()


def folder_of(module_key: str, dataset_key: str, input: object) -> str:
    """The folder (``features-<key>``) of the features of a backbone, a dataset and an input field."""
    h = xxhash.xxh3_128(tag(b"q", _KEY_FORMAT) + tag(b"m", module_key.encode()) + tag(b"d", dataset_key.encode()))
    h.update(tag(b"i", repr(input).encode()))
    return f"features-{h.hexdigest()}"


def header_folder(header: dict[str, Any]) -> str:
    """The folder (``features-<key>``) a features file's header was made for."""
    return folder_of(str(header.get("module_key")), str(header.get("dataset_key")), header.get("input"))


def refuse_options(local_cache_dir: object, storage_options: object, name: str) -> None:
    """Refuse the options of features in a bucket where the location ``name`` is a local one.

    Raises:
        ConfigError: If either is given.
    """
    if local_cache_dir is not None or storage_options is not None:
        raise ConfigError(
            f"local_cache_dir and storage_options are for features in a bucket, but {name} is not one; leave them out"
        )


def _problem(file: RowsFile, folder: str) -> str | None:
    """What keeps ``file`` from being the whole features file of ``folder``, if anything."""
    header = file.header
    if header_folder(header) != folder:
        return "it was made for another key"
    if file.count() != file.length:
        return f"{file.length - file.count()} rows are missing"
    damaged = len(file.damaged())
    return f"{damaged} rows are damaged" if damaged else None


def split_url(url: str) -> tuple[str, str | None]:
    """A features URL as ``(root, folder)``: the folder if the URL names one (``.../features-<32 hex>``)."""
    root, _, last = url.rstrip("/").rpartition("/")
    if _FOLDER.fullmatch(last) and "://" in root and root.split("://", 1)[1]:
        return root, last
    return url.rstrip("/"), None


class FeaturesBucket:
    """The features caches under a bucket URL, and their local copies on this machine.

    Args:
        url: ``scheme://bucket/prefix``, the root of the caches.
        local_cache_dir: The root of local copies (default ``$TORCHCACHE_LOCAL_DIR``,
            else ``copies`` under the cache root).
        storage_options: Passed to the fsspec filesystem (over ``$TORCHCACHE_STORAGE_OPTIONS``).
        faults: Where faults of the bucket are warned about.
        name: The argument the URL came from, for errors.

    Raises:
        ConfigError: If the URL is not a valid object store URL (a Redis URL is refused:
            features caches are files) or an argument is invalid.
    """

    def __init__(
        self,
        url: str,
        local_cache_dir: str | os.PathLike[str] | None,
        storage_options: Mapping[str, Any] | None,
        faults: FaultLog,
        name: str = "cache_dir",
    ) -> None:
        if not is_object_url(url):
            raise ConfigError(
                f"{name}: a features cache is a file, kept in a local directory or in a bucket (s3://, gs://...), "
                f"not on a Redis server; got {redact_url(url)}"
            )
        self.url = check_url(url, name).rstrip("/")
        local = resolve_local_dir(check_local_dir(local_cache_dir), default=True)
        assert local is not None
        self.local_root = local
        self.storage_options = check_storage_options(storage_options)
        self.faults = faults
        #: Folders whose file in the bucket failed its checks here: :meth:`upload` replaces it.
        self.damaged: set[str] = set()
        #: Kinds of faults the bucket's store reported.
        self.reported: set[Fault] = set()

    def local_dir(self, folder: str) -> Path:
        """The local copy of the cache in ``folder`` (``features-<key>``)."""
        return local_copy_dir(self.local_root, folder, self.url)

    def _store(self, folder: str, meta: Mapping[str, Any] | None = None) -> ObjectStore:
        """The folder's store; a writer's (``meta``) removes what its head does not name (:meth:`upload`)."""
        return ObjectStore(
            self.url,
            folder,
            1 << 62,  # never the oldest pieces first: those of the head that won may be the oldest
            storage_options=self.storage_options,
            report=self._reported,
            meta=meta,
            keep_budget=meta is not None,  # a writer sweeps what killed uploads left
        )

    def _reported(self, kind: Fault, message: str) -> None:
        self.reported.add(kind)
        self.faults.warn(kind, message, "bucket")

    def folders(self) -> list[str]:
        """The features caches under the URL.

        Raises:
            StoreUnavailableError: If the bucket cannot be listed.
        """
        return [n for n in bucket_namespaces(self.url, self.storage_options) if _FOLDER.fullmatch(n)]

    def local_copies(self) -> list[str]:
        """The folders of this URL whose local copy here holds a features file."""
        suffix = self.local_dir("x").name[1:]  # "-<digest of the URL>"
        with contextlib.suppress(OSError):
            return sorted(
                p.name.removesuffix(suffix)
                for p in self.local_root.iterdir()
                if p.name.endswith(suffix)
                and _FOLDER.fullmatch(p.name.removesuffix(suffix))
                and (p / FEATURES_NAME).is_file()
            )
        return []

    def usable(self, folder: str, path: Path) -> bool:
        """Whether ``path`` holds the whole features file of ``folder``, every row passing its check.

        A file that exists but is not (made for another key, rows damaged or missing) is a warning.
        """
        try:
            file = open_features(path)
        except FileNotFoundError:
            return False
        except (OSError, ValueError, TorchCacheError) as exc:
            self.faults.warn(Fault.CORRUPT, f"the local copy {path} cannot be read ({exc}): not used", "local")
            return False
        try:
            problem = _problem(file, folder)
        finally:
            file.close()
        if problem is not None:
            self.faults.warn(Fault.CORRUPT, f"the features file {path} is not used: {problem}", "local")
        return problem is None

    def fetch(self, folder: str, path: Path) -> bool:
        """Download the features file of ``folder`` to ``path``; whether a whole one was there.

        Faults (the bucket away, a damaged or missing chunk, a local disk that cannot
        take the file) are warnings, and ``False``; ``path`` is then as it was.
        """
        store = self._store(folder)
        part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")
        self.reported.clear()
        try:
            head = Head.decode(store.get(_HEAD_KEY))
            if head is None:
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            _sweep_parts(path)
            digest, size = xxhash.xxh3_128(), 0
            with open(part, "wb") as out:
                fcntl.flock(out.fileno(), fcntl.LOCK_EX)  # held while written: a sweep leaves it alone
                for i in range(head.chunks):
                    data = store.get(head.chunk_key(i))
                    if data is None and Fault.UNAVAILABLE in self.reported:
                        return False  # the bucket did not answer (warned): nothing known of the file
                    if data is None or len(data) != min(CHUNK_BYTES, head.size - size):
                        return self._damaged(folder, "is missing a piece")
                    digest.update(data)
                    out.write(data)
                    size += len(data)
            if digest.hexdigest() != head.digest:
                return self._damaged(folder, "fails its digest")
            os.replace(part, path)
            logger.info("read the features file of %s/%s (%d bytes)", redact_url(self.url), folder, size)
            return True
        except OSError as exc:
            self.faults.warn(Fault.WRITE, f"cannot write the local copy {path} ({exc})", "local")
            return False
        finally:
            store.close()
            with contextlib.suppress(OSError):
                part.unlink()

    def _damaged(self, folder: str, what: str) -> bool:
        """Note that the file in ``folder`` failed its checks (:meth:`upload` replaces it); ``False``."""
        self.damaged.add(folder)
        self.faults.warn(
            Fault.CORRUPT, f"the features file in {redact_url(self.url)}/{folder} {what}: not used", "bucket"
        )
        return False

    def upload(self, folder: str, path: Path, meta: Mapping[str, Any], replace: bool = False) -> None:
        """Upload the features file at ``path`` into ``folder``, unless the bucket holds one whole already.

        ``replace``: upload it even then (the one there was read, and its rows failed
        their checks here; one that failed :meth:`fetch`'s checks is replaced too).
        Faults are warnings: the file stays in the local copy, and a later call uploads it.
        """
        try:
            path.stat()  # there to upload
            store = self._store(folder, meta)
        except OSError as exc:
            self.faults.warn(Fault.OPEN, f"cannot read the features file {path} to upload it ({exc})", "local")
            return
        try:
            head = None if replace or folder in self.damaged else Head.decode(store.get(_HEAD_KEY))
            if head is not None and all(head.chunk_key(i) in store for i in range(head.chunks)):
                return
            upload, digest, size, i = uuid.uuid4().hex, xxhash.xxh3_128(), 0, 0
            with open(path, "rb") as file:
                while chunk := file.read(CHUNK_BYTES):
                    digest.update(chunk)
                    store.put_many([(_chunk_key(upload, i), chunk)])
                    size, i = size + len(chunk), i + 1
            ours = Head(size, i, upload, digest.hexdigest())
            store.put_many([(_HEAD_KEY, ours.encode())])
            where = f"{redact_url(self.url)}/{folder}"
            if not _settle(store, ours, path, lambda why: self.faults.warn(Fault.BUDGET, f"{where}: {why}", "bucket")):
                raise StoreError("machines uploading it at once left no whole file after three tries")
            logger.info("uploaded the features file %s to %s (%d bytes)", path, where, size)
        except (StoreError, OSError) as exc:
            self.faults.warn(
                Fault.UNAVAILABLE,
                f"cannot upload the features to {redact_url(self.url)}/{folder} ({exc}); they are kept in the local "
                f"copy {path.parent}, and the next call uploads them",
                "bucket",
            )
        finally:
            store.close()


def _settle(store: ObjectStore, ours: Head, path: Path, report: Callable[[str], None]) -> bool:
    """Remove what the head that wins does not name, then check it is still whole; if it is not, put ours back.

    What goes: the pieces and heads older than the winner's oldest piece (a file it
    replaced), and any others over an hour old (an upload cut short). Younger ones may
    be another machine's upload under way, which checks the same when its head is up;
    and since a newer head may have lost a piece to this removal, the check comes after
    it. ``report`` says why the old pieces could not be removed. Returns whether a whole
    head wins after three tries (machines that keep removing each other's pieces stop).

    Raises:
        StoreError: If the bucket cannot be read or written.
        OSError: If the local file cannot be read.
    """
    for _ in range(3):
        kept = _whole_head(store)
        if kept:
            before = max(min(kept[1:] or kept), f"{time.time_ns() - 3600 * 10**9:020d}")  # names sort by age
            try:
                remove_segments(store, [name for name in segments_of(store) if name not in kept and name < before])
            except StoreError as exc:  # a bucket that refuses deletes: the old pieces stay
                report(f"cannot remove the pieces of the file it replaced ({exc})")
            if _whole_head(store):
                return True
        with open(path, "rb") as file:  # the winner lost a piece: ours, whole, takes its place
            for i in [i for i in range(ours.chunks) if ours.chunk_key(i) not in store]:
                file.seek(i * CHUNK_BYTES)
                store.put_many([(ours.chunk_key(i), file.read(CHUNK_BYTES))])
        store.put_many([(_HEAD_KEY, ours.encode())])
    return bool(_whole_head(store))  # the last try's head, or another machine's since


def _whole_head(store: ObjectStore) -> list[str]:
    """The segments of the head that wins now and of its pieces, head first; none if a piece is missing."""
    store.refresh()
    head = Head.decode(store.get(_HEAD_KEY))
    if head is None:
        return []
    placed = store.placement([_HEAD_KEY, *(head.chunk_key(i) for i in range(head.chunks))])
    return [place[0] for place in placed if place is not None] if all(placed) else []


def from_bucket(
    url: str, local_cache_dir: str | os.PathLike[str] | None, storage_options: Mapping[str, Any] | None
) -> Path:
    """The local copy of the features file of the one features cache at ``url``, read from the bucket if needed.

    ``url`` is a root holding one features cache, or the cache's folder
    (``.../features-<key>``): a whole copy of that folder here is read without the bucket.

    Raises:
        ConfigError: If there is no features cache at ``url``, or several, or the root
            cannot be listed, or the cache cannot be read whole and this machine has no
            whole copy of it.
    """
    root, folder = split_url(url)
    remote = FeaturesBucket(root, local_cache_dir, storage_options, FaultLog("features"), "path")
    shown = redact_url(url)
    if folder is None:
        try:
            folders = remote.folders()
        except StoreError as exc:
            copies = remote.local_copies()
            held = f" (this machine holds copies of {', '.join(copies)})" if copies else ""
            raise ConfigError(
                f"cannot list {shown} ({exc}); open a cache by its folder, {shown}/features-<key>, to read this "
                f"machine's copy of it{held}"
            ) from None
        if len(folders) != 1:
            listed = ", ".join(folders[:5])
            what = f"{len(folders)} features caches ({listed}); pass one's URL" if folders else "no features cache"
            raise ConfigError(
                f"{shown} holds {what} (or its bucket does not exist)" if not folders else f"{shown} holds {what}"
            )
        folder = folders[0]
    path = remote.local_dir(folder) / FEATURES_NAME
    if not remote.usable(folder, path) and not (remote.fetch(folder, path) and remote.usable(folder, path)):
        raise ConfigError(
            f"{redact_url(root)}/{folder} holds no whole features file of that key that this machine could read, "
            "and this machine has no whole copy of it"
        )
    return path
