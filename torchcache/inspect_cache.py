"""Find, describe, check and remove the module caches under a cache root.

A *module cache* is a directory ``<root>/<module key>`` with a valid ``torchcache.json``,
or one that holds entries (``<3 hex digits>/<key>.tce`` files that start like a frame)
whatever its metadata: a damaged, missing or foreign ``torchcache.json`` never hides a
cache, it is a problem that ``verify`` reports and ``verify --fix`` rebuilds. Anything
else under the root is not torchcache's and is never touched. Files are opened without
blocking, only when they are regular files, and read only as far as their prefix says.

Removal is narrow on purpose: it unlinks entry files (``<3 hex digits>/<key>.tce``),
temporary files (``.*.tmp``) and the metadata file, then removes directories with
:func:`os.rmdir`, which fails on a directory that still holds something, so unknown
files survive with their directory. Each file is unlinked whole, so a process using the
cache meanwhile reads an entry or a miss, never a partial file.

Temporary files younger than :data:`TMP_GRACE_SECONDS` may be a write in progress in
another process (removing one would make that process stop writing), so checking keeps
them; removing a whole module cache removes them regardless.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._version import __version__
from .codec import MAGIC, PREFIX_SIZE, frame_length, parse_header, read_prefix, split_frame
from .errors import CorruptEntryError, TorchCacheError
from .meta import META_NAME, load_meta, meta_size, meta_time, write_json_atomic
from .stores.disk import ENTRY_SUFFIX, TMP_SUFFIX, open_regular, read_exactly
from .tree import Layout, describe

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
    "rebuild_meta",
    "remove_cache",
    "remove_file",
    "resolve_cache",
    "select_for_prune",
    "summarize_layouts",
    "verify_files",
]

#: Temporary files modified within this many seconds may belong to a write in progress.
TMP_GRACE_SECONDS = 60.0
_SHARD_RE = re.compile(r"[0-9a-f]{3}")
_ENTRY_RE = re.compile(r"[0-9a-f]{4,}" + re.escape(ENTRY_SUFFIX))
_TMP_RE = re.compile(r"\..*" + re.escape(TMP_SUFFIX), re.DOTALL)
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*$", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CacheLookupError(TorchCacheError, LookupError):
    """No module cache, or more than one, matches what was asked for."""


@dataclass(frozen=True)
class FileInfo:
    """One file of a module cache: its logical size and the bytes it takes on disk."""

    path: Path
    size: int
    mtime: float
    disk_bytes: int = 0


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
    touches whenever the cache is used (of its newest entry when the metadata is
    missing); ``nbytes`` counts every file of torchcache's, ``disk_bytes`` the blocks
    they take on disk. ``meta_problem`` says what is wrong with the metadata, if anything.
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

    @property
    def key(self) -> str:
        """The module key (the directory name)."""
        return self.directory.name


@dataclass(frozen=True)
class Problem:
    """A file that ``verify`` reports: damaged metadata, a corrupt entry or a stray temporary file."""

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
    return FileInfo(Path(entry.path), st.st_size, st.st_mtime, _disk_bytes(st))


def _disk_bytes(st: os.stat_result) -> int:
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else blocks * 512


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
        except OSError:  # removed meanwhile, or not ours to read
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
                if read_exactly(fd, len(MAGIC)) == MAGIC:
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
    files = list_files(directory)
    if problem is not None and not _holds_entries(files.entries):
        return None
    try:
        st: os.stat_result | None = os.lstat(directory / META_NAME)
    except OSError:
        st = None
    meta_file = st is not None and stat.S_ISREG(st.st_mode)
    own = [*files.entries, *files.temporaries]
    newest = max((f.mtime for f in own), default=0.0)
    last_used = st.st_mtime if st is not None and (meta_file or not own) else newest
    meta = meta or {}
    version, name = meta.get("torchcache_version"), meta.get("name")
    return ModuleCache(
        directory,
        meta,
        name=name if isinstance(name, str) else "?",
        created=meta_time(meta.get("created")),
        max_bytes=meta_size(meta.get("max_bytes")),
        version=version if isinstance(version, str) else None,
        last_used=last_used,
        entries=len(files.entries),
        nbytes=(st.st_size if st is not None and meta_file else 0) + sum(f.size for f in own),
        temporaries=len(files.temporaries),
        disk_bytes=(_disk_bytes(st) if st is not None and meta_file else 0) + sum(f.disk_bytes for f in own),
        meta_problem=problem,
    )


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


def rebuild_meta(cache: ModuleCache) -> None:
    """Write fresh metadata for a cache whose metadata is damaged, from what its entries tell.

    The name and kind are kept where the damaged metadata still has them; ``created`` is
    the modification time of the oldest entry; the last-used time is kept.

    Raises:
        OSError: If it cannot be written (a directory at its path, a read-only directory).
    """
    files = list_files(cache.directory)
    meta: dict[str, Any] = {
        "torchcache_version": __version__,
        "module_key": cache.key,
        "created": meta_time(min((f.mtime for f in files.entries), default=None)),
        "rebuilt": True,
    }
    for field in ("name", "kind"):
        if isinstance(cache.meta.get(field), str):
            meta[field] = cache.meta[field]
    write_json_atomic(cache.directory / META_NAME, meta)
    with contextlib.suppress(OSError):
        os.utime(cache.directory / META_NAME, (cache.last_used, cache.last_used))


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


def _row_bytes(header_bytes: bytes) -> int:
    return Layout.from_header(parse_header(header_bytes)).row_bytes


def check_entry(path: Path) -> str | None:
    """Check one entry file: frame, checksum, header and payload size.

    Only the prefix is read before the file's size is checked against it.

    Returns:
        Why the entry is corrupt, or ``None`` if it is sound (or was removed meanwhile).
    """
    try:
        opened = open_regular(path)
        if opened is None:
            return "not a regular file" if os.path.lexists(path) else None
        fd, st = opened
        try:
            expected = frame_length(read_exactly(fd, PREFIX_SIZE))
            if expected != st.st_size:
                return f"frame length {st.st_size} does not match its prefix ({expected})"
            data = read_exactly(fd, st.st_size)
        finally:
            os.close(fd)
        split_frame(data, raw_size=_row_bytes)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    except CorruptEntryError as exc:
        return str(exc)
    except KeyError as exc:
        return f"invalid header: missing field {exc}"
    except (TypeError, ValueError, AttributeError) as exc:
        return str(exc) if str(exc).startswith("invalid header") else f"invalid header: {exc}"
    except RecursionError:
        return "invalid header: nested too deeply"
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
        st = os.lstat(meta)
        if not stat.S_ISDIR(st.st_mode):  # a directory there is not ours: it keeps the module directory
            files.temporaries.append(FileInfo(meta, st.st_size if stat.S_ISREG(st.st_mode) else 0, 0.0))  # last
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
    """Read only the prefix and the header of an entry.

    Raises:
        FileNotFoundError: If it is gone or not a regular file.
        CorruptEntryError: If it is not a frame.
    """
    opened = open_regular(path)
    if opened is None:
        raise FileNotFoundError(path)
    fd, _ = opened
    try:
        _, header_len, _, _, _ = read_prefix(read_exactly(fd, PREFIX_SIZE))
        return parse_header(read_exactly(fd, header_len, PREFIX_SIZE))
    finally:
        os.close(fd)


def _describe(layout: Layout) -> str:
    texts = []
    for leaf in layout.leaves:
        dtype, out_dtype = (str(dt).removeprefix("torch.") for dt in (leaf.dtype, leaf.out_dtype))
        text = f"{dtype}[{','.join(str(d) for d in leaf.shape)}]"
        texts.append(text if out_dtype == dtype else f"{text} as {out_dtype}")
    return describe(layout.spec, texts)


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
            key, description = json.dumps(header, sort_keys=True), _describe(layout)
        except FileNotFoundError:
            continue
        except (OSError, KeyError, TypeError, ValueError, RecursionError):
            layout, key, description = None, "", "unreadable header"
        _, _, count = groups.get(key, (layout, description, 0))
        groups[key] = (layout, description, count + 1)
    summaries = [LayoutSummary(desc, count, layout) for layout, desc, count in groups.values()]
    summaries.sort(key=lambda s: (s.layout is None, -s.entries))
    return summaries
