"""torchcache's own files in a module directory: listed, and told from files of the user's.

A directory under a cache root is a cache when its ``torchcache.json`` is valid, or,
when that is missing or damaged, when it holds a segment, a features file or a 1.0 entry
that starts as torchcache writes them. A file of the user's that happens to carry one
of those names (an ``index.lmdb`` of their own) does not make a directory a cache:
nothing lists, opens or removes it. Files are opened without blocking, only when
regular, and read only as far as their first bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..codec import MAGIC
from ..stores.features.digests import DIGESTS_NAME
from ..stores.features.file import FEATURES_NAME, LEGACY_FEATURES_NAME
from ..stores.files import open_regular, read_at
from ..stores.packed.format import MAGIC as SEGMENT_MAGIC
from ..stores.packed.format import parse_segment_name
from ..stores.packed.index import INDEX_NAME
from ..stores.packed.locks import LOCK_NAMES
from ..stores.rows.format import MAGIC as ROWS_MAGIC
from ..stores.unsent import is_unsent_file
from ..tiers.local import LEGACY_ENTRY, LEGACY_SHARD

__all__ = ["ENTRY_SUFFIX", "TMP_SUFFIX", "CacheFiles", "FileInfo", "disk_bytes", "has_cache_files", "list_files"]

_KEY_RE = re.compile(r"[0-9a-f]{32}")
#: The entry files of torchcache 1.0 (``<3 hex digits>/<key>.tce``) and their writes in progress.
ENTRY_SUFFIX, TMP_SUFFIX = ".tce", ".tmp"
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
    def unmigrated(self) -> list[Path]:
        """The links and other non-files at the names of 1.0 entries and their subdirectories (never read)."""
        return [p for p in self.irregular if LEGACY_ENTRY.fullmatch(p.name) or LEGACY_SHARD.fullmatch(p.name)]

    @property
    def has_store(self) -> bool:
        """Whether the directory has a packed store index."""
        return any(f.path.name == INDEX_NAME for f in self.store)


def _info(entry: os.DirEntry[str]) -> FileInfo:
    st = entry.stat(follow_symlinks=False)
    return FileInfo(Path(entry.path), st.st_size, st.st_mtime, disk_bytes(st))


def disk_bytes(st: os.stat_result) -> int:
    """The bytes a file takes on disk (its blocks; its size where the system does not say)."""
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
                if LEGACY_SHARD.fullmatch(item.name):
                    shards.append(Path(item.path))
            elif item.is_file(follow_symlinks=False):
                if _TMP_RE.fullmatch(item.name):
                    temporaries.append(_info(item))
                elif _is_store_file(item.name):
                    store.append(_info(item))
            elif _is_store_file(item.name) or LEGACY_SHARD.fullmatch(item.name):  # a link to a 1.0 subdirectory too
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
                    if LEGACY_ENTRY.fullmatch(child.name):
                        irregular.append(Path(child.path))
                elif LEGACY_ENTRY.fullmatch(child.name):
                    entries.append(_info(child))
                elif _TMP_RE.fullmatch(child.name):
                    temporaries.append(_info(child))
            except FileNotFoundError:  # removed meanwhile (evicted by a running process)
                continue
    entries.sort(key=lambda f: f.path)
    temporaries.sort(key=lambda f: f.path)
    return CacheFiles(entries, temporaries, sorted(shards), sorted(store, key=lambda f: f.path), sorted(irregular))


#: Lock files: readers write them too (LMDB's reader table), so their times say nothing of use.
LOCK_FILES = frozenset((INDEX_NAME + "-lock", *LOCK_NAMES))


def _is_store_file(name: str) -> bool:
    known = (INDEX_NAME, *LOCK_FILES, FEATURES_NAME, LEGACY_FEATURES_NAME, DIGESTS_NAME)
    return name in known or parse_segment_name(name) is not None or is_unsent_file(name)


#: What torchcache writes first in each kind of file that makes a directory a cache without its metadata.
_FIRST_BYTES = {FEATURES_NAME: ROWS_MAGIC, LEGACY_FEATURES_NAME: b"TCFEATS1"}


def has_cache_files(directory: Path, files: CacheFiles) -> bool:
    """Whether a directory without valid metadata is a cache all the same.

    It is if it holds a segment, a features file or a 1.0 entry that starts as torchcache
    writes them, or if it is named by a module key (32 hex digits, as torchcache names
    them) and something is at the name of a store's index, segment or features file
    (whatever kind of file: a FIFO there is a damaged store). A file of the user's that
    happens to have one of those names elsewhere (an ``index.lmdb`` of their own) does
    not make a cache: nothing lists, opens or removes it.
    """
    if _KEY_RE.fullmatch(directory.name):
        names = [f.path.name for f in files.store] + [p.name for p in files.irregular]
        if any(name in (INDEX_NAME, *_FIRST_BYTES) or parse_segment_name(name) is not None for name in names):
            return True
    for found in files.store:
        name = found.path.name
        magic = SEGMENT_MAGIC if parse_segment_name(name) is not None else _FIRST_BYTES.get(name)
        if magic is not None and _starts_with(found.path, magic):
            return True
    return _holds_entries(files.entries)


def _holds_entries(entries: Sequence[FileInfo]) -> bool:
    """Whether any of the files starts like a torchcache frame."""
    return any(_starts_with(entry.path, MAGIC) for entry in entries)


def _starts_with(path: Path, magic: bytes) -> bool:
    """Whether ``path`` is a regular file that starts with ``magic`` (read, never followed if it is a link)."""
    try:
        opened = open_regular(path)
    except OSError:
        return False
    if opened is None:
        return False
    fd, _ = opened
    try:
        return read_at(fd, len(magic)) == magic
    except OSError:
        return False
    finally:
        os.close(fd)
