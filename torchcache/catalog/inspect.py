"""Find and describe the module caches under a cache root.

A *module cache* is a directory ``<root>/<module key>`` with a valid ``torchcache.json``,
or one that holds files that start as torchcache writes them whatever its metadata (see
:mod:`.files`): a damaged or missing ``torchcache.json`` then never hides a cache, it is
a problem that ``verify`` reports and ``verify --fix`` rebuilds. Anything else under the
root is not torchcache's and is never touched. Describing a cache writes nothing: its
index is read as it is (:func:`open_store`, which the commands that change a cache use,
opens it as the library does, sealing what dead writers left and rebuilding a damaged
index); an index that is not a regular file, or is cut short, is not opened at all
(:func:`index_problem`). Nothing here removes entries (:mod:`.removal` does).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheLookupError, CorruptEntryError
from ..meta import META_NAME, load_meta, meta_size, meta_time
from ..stores.features.file import FEATURES_NAME, LEGACY_FEATURES_NAME, open_features
from ..stores.packed.format import encode_key, is_key, parse_segment_name
from ..stores.packed.index import INDEX_NAME, Index, IndexDamageError, open_index
from ..stores.packed.mappable import cut_short, unsound_snapshot
from ..stores.packed.store import PackedStore
from ..stores.packed.upkeep import index_damage
from ..stores.unsent import count_unsent, is_unsent_file
from .files import ENTRY_SUFFIX, LOCK_FILES, TMP_SUFFIX, CacheFiles, FileInfo, disk_bytes, has_cache_files, list_files

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


@dataclass(frozen=True)
class CacheUsage:
    """What a budget needs of one module cache: its directory, when it was last used, its bytes.

    ``unsent`` says whether it is a local copy holding entries its server did not take
    (their only copy: no budget removes it).
    """

    directory: Path
    last_used: float
    nbytes: int
    unsent: bool = False


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
    #: Entries a local copy holds that its server (Redis, a bucket) did not take: on this machine only.
    unsent: int = 0

    @property
    def key(self) -> str:
        """The module key (the directory name)."""
        return self.directory.name


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
    its file dies of ``SIGBUS``: so the file's length is checked against what its header
    says it holds, and its trees are walked (both with ``pread``), before anything opens
    it. An index that is not an LMDB file at all is not a problem here: opening the store
    rebuilds it.

    Returns:
        Why the index cannot be opened (not a regular file, cut short, pages pointing
        outside it), or ``None`` (sound, absent, or rebuilt when opened).
    """
    path = directory / INDEX_NAME
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return "not a regular file"
    except OSError:
        return None
    return cut_short(os.fspath(path)) or unsound_snapshot(os.fspath(path))


def open_store(directory: Path, max_bytes: int | None = None, readonly: bool = False) -> PackedStore | None:
    """The packed store of a module directory, or ``None`` if it has none (nothing is created).

    A directory whose index cannot be opened as it is (see :func:`index_problem`) has
    none either, until ``torchcache verify --fix`` rebuilds its index.

    Args:
        directory: The module directory.
        max_bytes: The budget to open it with (only writes use it); default: the
            metadata's, else unlimited.
        readonly: Read it as it is (``ls``, ``info``, ``verify`` without ``--fix``).

    Raises:
        StoreError: If the store cannot be opened.
    """
    if not os.path.lexists(directory / INDEX_NAME) or index_problem(directory) is not None:
        return None
    if max_bytes is None:
        meta, _ = load_meta(directory)
        max_bytes = meta_size((meta or {}).get("max_bytes")) or 1 << 62
    return PackedStore(directory, max(max_bytes, 1 << 16), report=lambda kind, message: None, readonly=readonly)


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
    files = list_files(directory)
    if problem is not None and not has_cache_files(directory, files):
        return None
    damage = index_damage(os.fspath(directory))
    usage = _store_usage(directory, [f.path.name.removesuffix(ENTRY_SUFFIX) for f in files.entries])
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
        + (usage["entries"] - usage["packed_legacy"] if usage else 0)
        + (_feature_rows(directory) if meta.get("kind") == "features" else 0),
        legacy_entries=len(files.entries),
        live_bytes=usage["records"] if usage else 0,
        reclaimable_bytes=max(0, _segment_bytes(files) - usage["records"]) if usage else 0,
        nbytes=(st.st_size if st is not None and meta_file else 0) + sum(f.size for f in own),
        temporaries=len(files.temporaries),
        disk_bytes=(disk_bytes(st) if st is not None and meta_file else 0) + sum(f.disk_bytes for f in own),
        meta_problem=problem,
        index_damage=damage,
        unsent=count_unsent(f.path for f in files.store),
    )


def _meta_stat(directory: Path, files: CacheFiles) -> tuple[os.stat_result | None, float]:
    """The metadata file's ``lstat`` (``None`` if there is none), and when the cache was last used.

    That is the metadata's modification time where it is a regular file (or the cache has
    no other file), else the newest of its files' but its lock files, which readers
    write (``torchcache ls`` too).
    """
    try:
        st: os.stat_result | None = os.lstat(directory / META_NAME)
    except OSError:
        st = None
    own = [*files.entries, *files.temporaries, *files.store]
    if st is not None and (stat.S_ISREG(st.st_mode) or not own):
        return st, st.st_mtime
    return st, max((f.mtime for f in own if f.path.name not in LOCK_FILES), default=0.0)


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
    if not has_cache_files(directory, files):
        meta, problem = load_meta(directory)
        if meta is None or problem is not None:
            return None
    st, last_used = _meta_stat(directory, files)
    meta_bytes = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0
    own = [*files.entries, *files.temporaries, *files.store]
    unsent = any(is_unsent_file(f.path.name) and f.path.suffix == ".keys" for f in files.store)
    return CacheUsage(directory, last_used, meta_bytes + sum(f.size for f in own), unsent)


def _segment_bytes(files: CacheFiles) -> int:
    """Bytes of the segment files: live records, dead ones and torn tails (not the block slack)."""
    return sum(f.size for f in files.store if parse_segment_name(f.path.name) is not None)


def _store_usage(directory: Path, legacy: list[str]) -> dict[str, int] | None:
    """The entries and live record bytes the store's index counts, or ``None`` if it cannot be read.

    ``packed_legacy`` counts the keys of ``legacy`` (1.0 entry files) the index holds too:
    a migration interrupted after it packed them and before it removed their files.

    The index is opened for reading: what a store does when it opens for writing (seal
    what dead writers left, remove orphaned files, rebuild a damaged index) is left to
    the library and to ``torchcache verify --fix``.
    """
    if not os.path.lexists(directory / INDEX_NAME) or index_problem(directory) is not None:
        return None
    try:
        index = open_index(os.fspath(directory), readonly=True)
    except IndexDamageError:  # its lock file is not a regular file: read without it
        with contextlib.suppress(Exception):
            return _counted(Index(os.fspath(directory / INDEX_NAME), readonly=True, lock=False), legacy)
        return None
    except Exception:  # noqa: BLE001 - an unreadable index is a problem for verify, not for ls
        return None
    return _counted(index, legacy)


def _counted(index: Index, legacy: list[str]) -> dict[str, int] | None:
    """The entries and live record bytes ``index`` counts (then it is closed), or ``None``."""
    try:
        with index.begin() as txn:
            packed = sum(txn.get(encode_key(key), db=index.entries) is not None for key in legacy if is_key(key))
            return {"entries": index.count(txn), "records": index.totals(txn)[b"records"], "packed_legacy": packed}
    except Exception:  # noqa: BLE001 - an unreadable index is a problem for verify, not for ls
        return None
    finally:
        index.close()


def find_caches(path: Path) -> list[ModuleCache]:
    """The module caches under a root, most recently used first.

    If ``path`` is itself a module cache, it is the only one. A missing root holds none;
    a directory under it that cannot be listed is left out, and so is a link.

    Raises:
        CacheLookupError: If ``path`` is a link to a module cache.
        OSError: If the root cannot be listed.
    """
    own = load_cache(path)
    if own is not None:
        _not_a_link(path)
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


def _not_a_link(path: Path) -> None:
    """Refuse a module cache reached through a link: what it names is not this path's to change."""
    if path.is_symlink():
        raise CacheLookupError(
            f"{path} is a link: torchcache does not follow links to module caches (give the directory it names, "
            f"{os.path.realpath(path)})"
        )


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
            _not_a_link(path)
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
