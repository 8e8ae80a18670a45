"""Find and describe the module caches under a cache root.

A *module cache* is a directory ``<root>/<module key>`` with a valid ``torchcache.json``,
or one that holds cache files whatever its metadata: a packed store's (``index.lmdb`` or
``seg-*.tcs``, whatever kind of file is at those names: a FIFO there is a damaged store,
not a foreign file) or torchcache 1.0 entry files (``<3 hex digits>/<key>.tce`` that start
like a frame). A damaged, missing or foreign ``torchcache.json`` never hides a cache: it
is a problem that ``verify`` reports and ``verify --fix`` rebuilds. Anything else under
the root is not torchcache's and is never touched. Files are opened without blocking,
only when regular, and read only as far as their prefix says. Nothing here removes
entries (:mod:`.removal` does). Opening a packed store whose index was damaged rebuilds
the index, as the library does; an index that is not a regular file, or is cut short, is
not opened at all (:func:`index_problem`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..codec import MAGIC
from ..errors import CacheLookupError, CorruptEntryError
from ..meta import META_NAME, load_meta, meta_size, meta_time
from ..stores.features.digests import DIGESTS_NAME
from ..stores.features.file import FEATURES_NAME, LEGACY_FEATURES_NAME, open_features
from ..stores.files import open_regular, read_at
from ..stores.packed.format import parse_segment_name
from ..stores.packed.index import INDEX_NAME, cut_short
from ..stores.packed.locks import LOCK_NAMES
from ..stores.packed.store import PackedStore
from ..stores.packed.upkeep import index_damage

__all__ = [
    "ENTRY_SUFFIX",
    "TMP_SUFFIX",
    "CacheFiles",
    "CacheLookupError",
    "CacheUsage",
    "FileInfo",
    "ModuleCache",
    "find_caches",
    "index_problem",
    "list_files",
    "load_cache",
    "open_store",
    "read_usage",
    "resolve_cache",
]


_SHARD_RE = re.compile(r"[0-9a-f]{3}")
#: The entry files of torchcache 1.0 (``<3 hex digits>/<key>.tce``) and their writes in progress.
ENTRY_SUFFIX, TMP_SUFFIX = ".tce", ".tmp"
_ENTRY_RE = re.compile(r"[0-9a-f]{4,}" + re.escape(ENTRY_SUFFIX))
_TMP_RE = re.compile(r"\..*" + re.escape(TMP_SUFFIX), re.DOTALL)


@dataclass(frozen=True)
class FileInfo:
    """One file of a module cache: its logical size and the bytes it takes on disk."""

    path: Path
    size: int
    mtime: float
    disk_bytes: int = 0


@dataclass(frozen=True)
class CacheFiles:
    """torchcache's own files in a module directory (the metadata file aside).

    ``irregular`` are the things at the names of torchcache's files that are neither
    regular files nor directories (a FIFO, a socket, a link): never opened, and unlinked
    (never what a link points to) when the cache is removed.
    """

    entries: list[FileInfo]
    temporaries: list[FileInfo]
    shards: list[Path]
    store: list[FileInfo] = field(default_factory=list)
    irregular: list[Path] = field(default_factory=list)

    @property
    def has_store(self) -> bool:
        """Whether the directory has a packed store index."""
        return any(f.path.name == INDEX_NAME for f in self.store)

    @property
    def has_store_data(self) -> bool:
        """Whether anything is at the name of a store's index, segment or features file, whatever kind of file it is."""
        names = [f.path.name for f in self.store] + [p.name for p in self.irregular]
        stores = (INDEX_NAME, FEATURES_NAME, LEGACY_FEATURES_NAME)
        return any(name in stores or parse_segment_name(name) is not None for name in names)


@dataclass(frozen=True)
class CacheUsage:
    """What a budget needs of one module cache: its directory, when it was last used, its bytes."""

    directory: Path
    last_used: float
    nbytes: int


@dataclass(frozen=True)
class ModuleCache:
    """One module cache: its directory, what its metadata records, and what it holds.

    ``last_used`` is the modification time of its metadata file, which the library
    touches whenever the cache is used (of its newest file when the metadata is
    missing); ``nbytes`` counts every file of torchcache's, ``disk_bytes`` the blocks
    they take on disk. ``entries`` counts the packed store's entries and the 1.0 entry
    files (``legacy_entries``, read only once ``torchcache migrate`` packs them);
    ``live_bytes`` are the packed records still in use and ``reclaimable_bytes`` the
    dead ones its segment files still hold. ``meta_problem`` says what is wrong with the
    metadata, if anything.
    """

    directory: Path
    meta: dict[str, Any]
    name: str
    created: float | None
    max_bytes: int | None
    version: str | None
    last_used: float
    entries: int
    nbytes: int
    temporaries: int
    disk_bytes: int = 0
    meta_problem: str | None = None
    #: Why LMDB refused its index as it was, when this listing opened it (the store rebuilt it then).
    index_damage: str | None = None
    legacy_entries: int = 0
    live_bytes: int = 0
    reclaimable_bytes: int = 0

    @property
    def key(self) -> str:
        """The module key (the directory name)."""
        return self.directory.name


def _info(entry: os.DirEntry[str]) -> FileInfo:
    st = entry.stat(follow_symlinks=False)
    return FileInfo(Path(entry.path), st.st_size, st.st_mtime, _disk_bytes(st))


def _disk_bytes(st: os.stat_result) -> int:
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else blocks * 512


def list_files(directory: Path) -> CacheFiles:
    """List the entry files, temporary files and shard directories of a module directory.

    Files torchcache does not write are left out, and so are symbolic links and other
    things that are not regular files, except at the names of torchcache's own files
    (``irregular``).

    Raises:
        OSError: If the directory cannot be listed.
    """
    entries: list[FileInfo] = []
    temporaries: list[FileInfo] = []
    shards: list[Path] = []
    store: list[FileInfo] = []
    irregular: list[Path] = []
    try:
        top = list(os.scandir(directory))
    except FileNotFoundError:
        top = []
    for item in top:
        try:
            if item.is_dir(follow_symlinks=False):
                if _SHARD_RE.fullmatch(item.name):
                    shards.append(Path(item.path))
            elif item.is_file(follow_symlinks=False):
                if _TMP_RE.fullmatch(item.name):
                    temporaries.append(_info(item))
                elif _is_store_file(item.name):
                    store.append(_info(item))
            elif _is_store_file(item.name):
                irregular.append(Path(item.path))
        except FileNotFoundError:
            continue
    for shard in shards:
        try:
            children = list(os.scandir(shard))
        except OSError:  # removed meanwhile, or not ours to read
            continue
        for child in children:
            try:
                if child.is_dir(follow_symlinks=False):
                    continue
                if not child.is_file(follow_symlinks=False):
                    if _ENTRY_RE.fullmatch(child.name):
                        irregular.append(Path(child.path))
                elif _ENTRY_RE.fullmatch(child.name):
                    entries.append(_info(child))
                elif _TMP_RE.fullmatch(child.name):
                    temporaries.append(_info(child))
            except FileNotFoundError:  # removed meanwhile (evicted by a running process)
                continue
    entries.sort(key=lambda f: f.path)
    temporaries.sort(key=lambda f: f.path)
    return CacheFiles(entries, temporaries, sorted(shards), sorted(store, key=lambda f: f.path), sorted(irregular))


def _is_store_file(name: str) -> bool:
    known = (INDEX_NAME, INDEX_NAME + "-lock", *LOCK_NAMES, FEATURES_NAME, LEGACY_FEATURES_NAME, DIGESTS_NAME)
    return name in known or parse_segment_name(name) is not None


def _feature_rows(directory: Path) -> int:
    """Rows written in a features cache's file (0 if it has none, or it cannot be read)."""
    try:
        file = open_features(directory / FEATURES_NAME)
    except (CorruptEntryError, OSError):
        return 0
    try:
        return file.count()
    finally:
        file.close()


def index_problem(directory: Path) -> str | None:
    """What keeps the packed store's index of a module directory from being opened as it is, if anything.

    LMDB maps the index into memory, and a process that touches a page beyond the end of
    a file cut short dies of ``SIGBUS``: so the file's length is checked against what its
    header (read with ``pread``) says it holds before anything opens it. An index that is
    not an LMDB file at all is not a problem here: opening the store rebuilds it.

    Returns:
        Why the index cannot be opened (not a regular file, cut short), or ``None``
        (sound, absent, or rebuilt when opened).
    """
    path = directory / INDEX_NAME
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return "not a regular file"
    except OSError:
        return None
    return cut_short(os.fspath(path))


def open_store(directory: Path, max_bytes: int | None = None) -> PackedStore | None:
    """The packed store of a module directory, or ``None`` if it has none (nothing is created).

    A directory whose index cannot be opened as it is (see :func:`index_problem`) has
    none either, until ``torchcache verify --fix`` rebuilds its index.

    Args:
        directory: The module directory.
        max_bytes: The budget to open it with (only writes use it); default: the
            metadata's, else unlimited.

    Raises:
        StoreError: If the store cannot be opened.
    """
    if not os.path.lexists(directory / INDEX_NAME) or index_problem(directory) is not None:
        return None
    if max_bytes is None:
        meta, _ = load_meta(directory)
        max_bytes = meta_size((meta or {}).get("max_bytes")) or 1 << 62
    return PackedStore(directory, max(max_bytes, 1 << 16), report=lambda kind, message: None)


def _holds_entries(entries: Sequence[FileInfo]) -> bool:
    """Whether any of the files starts like a torchcache frame."""
    for entry in entries:
        try:
            opened = open_regular(entry.path)
        except OSError:
            continue
        if opened is not None:
            fd, _ = opened
            try:
                if read_at(fd, len(MAGIC)) == MAGIC:
                    return True
            except OSError:
                continue
            finally:
                os.close(fd)
    return False


def load_cache(directory: Path) -> ModuleCache | None:
    """Describe the module cache in ``directory``, or return ``None`` if it is not one.

    A module cache has valid metadata (see :func:`~torchcache.meta.load_meta`) or holds
    entries; in the second case ``meta_problem`` says what is wrong with its metadata.

    Raises:
        OSError: If the directory cannot be listed.
    """
    meta, problem = load_meta(directory)
    if meta is None and problem is None:
        problem = f"no {META_NAME}"
    damage = index_damage(os.fspath(directory))  # before the store opens it, and rebuilds what LMDB refuses
    usage = _store_usage(directory)  # first: opening a store may seal or rebuild it, which changes its files
    files = list_files(directory)
    if problem is not None and not _has_cache_files(files):
        return None
    st, last_used = _meta_stat(directory, files)
    meta_file = st is not None and stat.S_ISREG(st.st_mode)
    own = [*files.entries, *files.temporaries, *files.store]
    meta = meta or {}
    if "kind" not in meta and any(f.path.name in (FEATURES_NAME, LEGACY_FEATURES_NAME) for f in files.store):
        meta = {**meta, "kind": "features"}  # damaged metadata: the features file tells the kind
    version, name = meta.get("torchcache_version"), meta.get("name")
    if not isinstance(name, str):  # a SampleCache of its own is named by its directory; "?": damaged metadata
        name = "?" if problem is not None else directory.name if meta.get("kind") == "dataset" else "-"
    return ModuleCache(
        directory,
        meta,
        name=name,
        created=meta_time(meta.get("created")),
        max_bytes=meta_size(meta.get("max_bytes")),
        version=version if isinstance(version, str) else None,
        last_used=last_used,
        entries=len(files.entries)
        + (usage["entries"] if usage else 0)
        + (_feature_rows(directory) if meta.get("kind") == "features" else 0),
        legacy_entries=len(files.entries),
        live_bytes=usage["records"] if usage else 0,
        reclaimable_bytes=max(0, _segment_bytes(files) - usage["records"]) if usage else 0,
        nbytes=(st.st_size if st is not None and meta_file else 0) + sum(f.size for f in own),
        temporaries=len(files.temporaries),
        disk_bytes=(_disk_bytes(st) if st is not None and meta_file else 0) + sum(f.disk_bytes for f in own),
        meta_problem=problem,
        index_damage=damage,
    )


def _has_cache_files(files: CacheFiles) -> bool:
    """Whether a directory holds a packed store's files (of any kind) or 1.0 entries."""
    return files.has_store_data or _holds_entries(files.entries)


def _meta_stat(directory: Path, files: CacheFiles) -> tuple[os.stat_result | None, float]:
    """The metadata file's ``lstat`` (``None`` if there is none), and when the cache was last used.

    That is the metadata's modification time where it is a regular file (or the cache has
    no other file), else the newest of its files'.
    """
    try:
        st: os.stat_result | None = os.lstat(directory / META_NAME)
    except OSError:
        st = None
    own = [*files.entries, *files.temporaries, *files.store]
    if st is not None and (stat.S_ISREG(st.st_mode) or not own):
        return st, st.st_mtime
    return st, max((f.mtime for f in own), default=0.0)


def read_usage(directory: Path) -> CacheUsage | None:
    """The last use and size of the module cache in ``directory``, or ``None`` if it is not one.

    Counted as :func:`load_cache` counts them, from a listing of its files and the
    ``lstat`` of its metadata, without opening its store: cheap enough to run over a
    whole root whenever a cache opens. The metadata is read only when the directory has
    no cache files, to tell a module cache from a foreign directory.

    Raises:
        OSError: If the directory cannot be listed.
    """
    files = list_files(directory)
    if not _has_cache_files(files):
        meta, problem = load_meta(directory)
        if meta is None or problem is not None:
            return None
    st, last_used = _meta_stat(directory, files)
    meta_bytes = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0
    own = [*files.entries, *files.temporaries, *files.store]
    return CacheUsage(directory, last_used, meta_bytes + sum(f.size for f in own))


def _segment_bytes(files: CacheFiles) -> int:
    """Bytes of the segment files: live records, dead ones and torn tails (not the block slack)."""
    return sum(f.size for f in files.store if parse_segment_name(f.path.name) is not None)


def _store_usage(directory: Path) -> dict[str, int] | None:
    """:meth:`PackedStore.usage` of the directory's store, or ``None`` if it cannot be read."""
    try:
        store = open_store(directory)
        if store is None:
            return None
        with store:
            return store.usage()
    except Exception:  # noqa: BLE001 - an unreadable index is a problem for verify, not for ls
        return None


def find_caches(path: Path) -> list[ModuleCache]:
    """The module caches under a root, most recently used first.

    If ``path`` is itself a module cache, it is the only one. A missing root holds none;
    a directory under it that cannot be listed is left out.

    Raises:
        OSError: If the root cannot be listed.
    """
    own = load_cache(path)
    if own is not None:
        return [own]
    try:
        children = sorted(os.scandir(path), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    caches = []
    for child in children:
        try:
            cache = load_cache(Path(child.path)) if child.is_dir(follow_symlinks=False) else None
        except OSError:
            continue
        if cache is not None:
            caches.append(cache)
    caches.sort(key=lambda c: c.last_used, reverse=True)
    return caches


def resolve_cache(root: Path, target: str, *, root_given: bool = False) -> ModuleCache:
    """Find a module cache by directory path, or by its key (or a unique prefix) under ``root``.

    A bare key (no path separator, not starting with ``.`` or ``~``) is tried as a
    directory relative to the working directory first, unless ``root_given``: then it is
    looked up under ``root`` only.

    Raises:
        CacheLookupError: If nothing, or more than one module cache, matches.
    """
    if not target:
        raise CacheLookupError("give a module cache directory or key (see `torchcache ls`)")
    path = Path(target).expanduser()
    is_path = os.sep in target or (os.altsep is not None and os.altsep in target) or target.startswith((".", "~"))
    if (is_path or not root_given) and path.is_dir():
        own = load_cache(path)
        if own is not None:
            return own
    if is_path:
        if not path.exists():
            raise CacheLookupError(f"{path} does not exist")
        raise CacheLookupError(f"{path} is not a torchcache module cache (it has no valid {META_NAME} and no entries)")
    caches = find_caches(root)
    exact = [c for c in caches if c.key == target]
    matches = exact or [c for c in caches if c.key.startswith(target)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CacheLookupError(f"no module cache under {root} has a key starting with {target!r} (see `torchcache ls`)")
    shown = ", ".join(c.key for c in matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise CacheLookupError(f"{target!r} matches {len(matches)} module caches ({shown}); give more of the key")
