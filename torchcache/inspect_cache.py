"""Find, describe, check and remove the module caches under a cache root.

A *module cache* is a directory ``<root>/<module key>`` with a valid ``torchcache.json``;
anything else under the root is not torchcache's and is never touched. Removal is narrow
on purpose: it unlinks entry files (``<3 hex digits>/<key>.tce``), temporary files
(``.*.tmp``) and the metadata file, then removes directories with :func:`os.rmdir`, which
fails on a directory that still holds something, so unknown files survive with their
directory. Each file is unlinked whole, so a process using the cache meanwhile reads an
entry or a miss, never a partial file.

Temporary files younger than :data:`TMP_GRACE_SECONDS` may be a write in progress in
another process (removing one would make that process stop writing), so checking keeps
them; removing a whole module cache removes them regardless.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .codec import decode_header, parse_header, split_frame
from .errors import CorruptEntryError, TorchCacheError
from .persist import META_NAME, read_meta
from .stores.disk import ENTRY_SUFFIX, TMP_SUFFIX
from .tree import Layout

__all__ = [
    "TMP_GRACE_SECONDS",
    "CacheFiles",
    "CacheLookupError",
    "FileInfo",
    "LayoutSummary",
    "ModuleCache",
    "Problem",
    "check_entry",
    "find_caches",
    "list_files",
    "load_cache",
    "parse_duration",
    "remove_cache",
    "remove_file",
    "resolve_cache",
    "select_for_prune",
    "summarize_layouts",
    "verify_files",
]

#: Temporary files modified within this many seconds may belong to a write in progress.
TMP_GRACE_SECONDS = 60.0
_HEADER_READ = 1 << 16
_SHARD_RE = re.compile(r"[0-9a-f]{3}")
_ENTRY_RE = re.compile(r"[0-9a-f]{4,}" + re.escape(ENTRY_SUFFIX))
_TMP_RE = re.compile(r"\..*" + re.escape(TMP_SUFFIX), re.DOTALL)
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*$", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CacheLookupError(TorchCacheError, LookupError):
    """No module cache, or more than one, matches what was asked for."""


@dataclass(frozen=True)
class FileInfo:
    """One file of a module cache."""

    path: Path
    size: int
    mtime: float


@dataclass(frozen=True)
class CacheFiles:
    """torchcache's own files in a module directory (the metadata file aside)."""

    entries: list[FileInfo]
    temporaries: list[FileInfo]
    shards: list[Path]


@dataclass(frozen=True)
class ModuleCache:
    """One module cache: its directory, what its metadata records, and what it holds.

    ``last_used`` is the modification time of its metadata file, which the library
    touches whenever the cache is used; ``nbytes`` counts every file of torchcache's.
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

    @property
    def key(self) -> str:
        """The module key (the directory name)."""
        return self.directory.name


@dataclass(frozen=True)
class Problem:
    """A file that ``verify`` reports: a corrupt entry or a stray temporary file."""

    path: Path
    kind: str
    reason: str
    size: int


@dataclass(frozen=True)
class LayoutSummary:
    """Sampled entries that share one layout (or could not be read, ``layout=None``)."""

    description: str
    entries: int
    layout: Layout | None


def _info(entry: os.DirEntry[str]) -> FileInfo:
    st = entry.stat(follow_symlinks=False)
    return FileInfo(Path(entry.path), st.st_size, st.st_mtime)


def list_files(directory: Path) -> CacheFiles:
    """List the entry files, temporary files and shard directories of a module directory.

    Symbolic links and files torchcache does not write are left out.

    Raises:
        OSError: If the directory cannot be listed.
    """
    entries: list[FileInfo] = []
    temporaries: list[FileInfo] = []
    shards: list[Path] = []
    try:
        top = list(os.scandir(directory))
    except FileNotFoundError:
        top = []
    for item in top:
        try:
            if item.is_dir(follow_symlinks=False):
                if _SHARD_RE.fullmatch(item.name):
                    shards.append(Path(item.path))
            elif item.is_file(follow_symlinks=False) and _TMP_RE.fullmatch(item.name):
                temporaries.append(_info(item))
        except FileNotFoundError:
            continue
    for shard in shards:
        try:
            children = list(os.scandir(shard))
        except FileNotFoundError:
            continue
        for child in children:
            try:
                if not child.is_file(follow_symlinks=False):
                    continue
                if _ENTRY_RE.fullmatch(child.name):
                    entries.append(_info(child))
                elif _TMP_RE.fullmatch(child.name):
                    temporaries.append(_info(child))
            except FileNotFoundError:  # removed meanwhile (evicted by a running process)
                continue
    entries.sort(key=lambda f: f.path)
    temporaries.sort(key=lambda f: f.path)
    return CacheFiles(entries, temporaries, sorted(shards))


def load_cache(directory: Path) -> ModuleCache | None:
    """Describe the module cache in ``directory``, or return ``None`` if it is not one.

    A module cache has a ``torchcache.json`` holding a JSON object with a ``torchcache_version``.
    """
    meta = read_meta(directory)
    if meta is None or "torchcache_version" not in meta:
        return None
    try:
        st = (directory / META_NAME).stat()
    except OSError:
        return None
    files = list_files(directory)
    nbytes = st.st_size + sum(f.size for f in (*files.entries, *files.temporaries))
    created, max_bytes, version = meta.get("created"), meta.get("max_bytes"), meta.get("torchcache_version")
    return ModuleCache(
        directory,
        meta,
        name=str(meta.get("name", "?")),
        created=float(created) if isinstance(created, (int, float)) else None,
        max_bytes=int(max_bytes) if isinstance(max_bytes, (int, float)) else None,
        version=None if version is None else str(version),
        last_used=st.st_mtime,
        entries=len(files.entries),
        nbytes=nbytes,
        temporaries=len(files.temporaries),
    )


def find_caches(path: Path) -> list[ModuleCache]:
    """The module caches under a root, most recently used first.

    If ``path`` is itself a module cache, it is the only one. A missing root holds none.

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
        if child.is_dir(follow_symlinks=False):
            cache = load_cache(Path(child.path))
            if cache is not None:
                caches.append(cache)
    caches.sort(key=lambda c: c.last_used, reverse=True)
    return caches


def resolve_cache(root: Path, target: str) -> ModuleCache:
    """Find a module cache by directory path, or by its key (or a unique prefix) under ``root``.

    Raises:
        CacheLookupError: If nothing, or more than one module cache, matches.
    """
    if not target:
        raise CacheLookupError("give a module cache directory or key (see `torchcache ls`)")
    path = Path(target).expanduser()
    if path.is_dir():
        own = load_cache(path)
        if own is not None:
            return own
    if os.sep in target or (os.altsep is not None and os.altsep in target) or target.startswith((".", "~")):
        if not path.exists():
            raise CacheLookupError(f"{path} does not exist")
        raise CacheLookupError(f"{path} is not a torchcache module cache (it has no valid {META_NAME})")
    caches = find_caches(root)
    exact = [c for c in caches if c.key == target]
    matches = exact or [c for c in caches if c.key.startswith(target)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CacheLookupError(f"no module cache under {root} has a key starting with {target!r} (see `torchcache ls`)")
    shown = ", ".join(c.key for c in matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise CacheLookupError(f"{target!r} matches {len(matches)} module caches ({shown}); give more of the key")


def check_entry(path: Path) -> str | None:
    """Check one entry file: frame, checksum, header and payload size.

    Returns:
        Why the entry is corrupt, or ``None`` if it is sound (or was removed meanwhile).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    try:
        header_bytes, payload = split_frame(data)
        layout = Layout.from_header(parse_header(header_bytes))
    except CorruptEntryError as exc:
        return str(exc)
    except KeyError as exc:
        return f"invalid header: missing field {exc}"
    except (TypeError, ValueError, RecursionError) as exc:
        return f"invalid header: {exc}"
    if len(payload) != layout.row_bytes:
        return f"payload is {len(payload)} bytes, its header describes {layout.row_bytes}"
    return None


def verify_files(
    files: CacheFiles, now: float, tick: Callable[[int], None] | None = None
) -> tuple[list[Problem], list[FileInfo]]:
    """Check every entry of a module cache (calling ``tick(1)`` after each) and find stray temporaries.

    Returns:
        The problems, and the temporary files young enough (at ``now``) to be writes in progress.
    """
    problems = []
    for entry in files.entries:
        reason = check_entry(entry.path)
        if reason is not None:
            problems.append(Problem(entry.path, "corrupt", reason, entry.size))
        if tick is not None:
            tick(1)
    in_progress = []
    for tmp in files.temporaries:
        if now - tmp.mtime < TMP_GRACE_SECONDS:
            in_progress.append(tmp)
        else:
            problems.append(Problem(tmp.path, "temporary", "stray temporary file", tmp.size))
    return problems, in_progress


def remove_file(path: Path) -> bool:
    """Unlink one file; return whether it was there.

    Raises:
        OSError: If it exists and cannot be removed.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_cache(directory: Path) -> tuple[int, Path | None]:
    """Remove a module cache: its entries, temporaries and metadata, then empty directories.

    Files torchcache did not write are kept, and so are the directories that hold them.

    Returns:
        The bytes freed, and the module directory if it was kept (not empty).

    Raises:
        OSError: If a file cannot be removed.
    """
    files = list_files(directory)
    meta = directory / META_NAME
    with contextlib.suppress(FileNotFoundError):
        files.temporaries.append(FileInfo(meta, meta.stat().st_size, 0.0))  # removed last
    freed = sum(item.size for item in (*files.entries, *files.temporaries) if remove_file(item.path))
    for shard in files.shards:
        with contextlib.suppress(OSError):  # not empty: unknown files, or entries written meanwhile
            os.rmdir(shard)
    kept: Path | None = None
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:
        kept = directory
    return freed, kept


def select_for_prune(
    caches: Sequence[ModuleCache],
    now: float,
    *,
    max_bytes: int | None = None,
    older_than: float | None = None,
    keep: int | None = None,
) -> list[ModuleCache]:
    """Pick the module caches to remove, least recently used first, until the condition holds.

    Exactly one of ``max_bytes`` (total size to get under), ``older_than`` (seconds since
    last use) and ``keep`` (how many of the most recently used to keep) is given.

    Raises:
        ValueError: If not exactly one condition is given.
    """
    if sum(x is not None for x in (max_bytes, older_than, keep)) != 1:
        raise ValueError("give exactly one of max_bytes, older_than and keep")
    order = sorted(caches, key=lambda c: c.last_used)
    if keep is not None:
        return order[: max(0, len(order) - keep)]
    if older_than is not None:
        return [c for c in order if now - c.last_used > older_than]
    assert max_bytes is not None
    total = sum(c.nbytes for c in order)
    chosen = []
    for cache in order:
        if total <= max_bytes:
            break
        chosen.append(cache)
        total -= cache.nbytes
    return chosen


def parse_duration(text: str) -> float:
    """Parse a duration such as ``30d``, ``12h``, ``90m``, ``2w`` or ``45s`` into seconds.

    Raises:
        ValueError: If the text is not a number followed by one of the units s, m, h, d, w.

    Example:
        >>> parse_duration("30d"), parse_duration("90m"), parse_duration("1.5h")
        (2592000.0, 5400.0, 5400.0)
    """
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"invalid duration {text!r}: expected a number and a unit s, m, h, d or w, such as 30d or 12h")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read(_HEADER_READ)
    try:
        return decode_header(data)
    except CorruptEntryError:
        if len(data) < _HEADER_READ:
            raise
    return decode_header(path.read_bytes())


def _describe(header: dict[str, Any]) -> str:
    leaves = iter(header["leaves"])

    def walk(node: Any) -> str:
        if node == "T":
            leaf = next(leaves)
            text = f"{leaf['dtype']}[{','.join(str(d) for d in leaf['shape'])}]"
            out_dtype = leaf.get("out_dtype", leaf["dtype"])
            return text if out_dtype == leaf["dtype"] else f"{text} as {out_dtype}"
        kind, items = node
        if kind == "dict":
            return "{" + ", ".join(f"{key!r}: {walk(value)}" for key, value in items) + "}"
        inner = ", ".join(walk(value) for value in items)
        return f"({inner}{',' if len(items) == 1 else ''})" if kind == "tuple" else f"[{inner}]"

    return walk(header["tree"])


def summarize_layouts(entries: Sequence[FileInfo], sample: int) -> list[LayoutSummary]:
    """Group a sample of entries by layout, reading only their headers.

    Args:
        entries: The entry files.
        sample: At most this many entries, spread evenly over ``entries``, are read.

    Returns:
        One summary per layout, the most common first; unreadable headers are grouped
        under ``layout=None``.
    """
    n = len(entries)
    picks = [entries[i * n // sample] for i in range(sample)] if n > sample > 0 else list(entries[: max(sample, 0)])
    groups: dict[str, tuple[Layout | None, str, int]] = {}
    for entry in picks:
        try:
            header = _read_header(entry.path)
            layout = Layout.from_header(header)
            key, description = json.dumps(header, sort_keys=True), _describe(header)
        except FileNotFoundError:
            continue
        except (OSError, KeyError, TypeError, ValueError, RecursionError):
            layout, key, description = None, "", "unreadable header"
        _, _, count = groups.get(key, (layout, description, 0))
        groups[key] = (layout, description, count + 1)
    summaries = [LayoutSummary(desc, count, layout) for layout, desc, count in groups.values()]
    summaries.sort(key=lambda s: (s.layout is None, -s.entries))
    return summaries
