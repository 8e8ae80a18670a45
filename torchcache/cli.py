"""The ``torchcache`` command: list, inspect, verify, prune and clear caches on disk.

Each command is a function of parsed arguments that prints to stdout and returns the
exit status; :func:`main` turns library errors into one ``torchcache: error: ...`` line
on stderr and status 1 (usage errors give status 2, as argparse does). What is on disk is
read and removed by :mod:`torchcache.inspect_cache`, which only ever removes torchcache's
own files. Progress goes to stderr, so ``--json`` output on stdout stays parseable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, TextIO

from ._version import __version__
from .config import resolve_root
from .errors import ConfigError, TorchCacheError
from .inspect_cache import (
    CacheLookupError,
    ModuleCache,
    Problem,
    find_caches,
    list_files,
    parse_duration,
    rebuild_meta,
    remove_cache,
    remove_file,
    resolve_cache,
    select_for_prune,
    summarize_layouts,
    verify_files,
)
from .meta import META_NAME
from .policy import format_size, parse_size

__all__ = ["build_parser", "main"]

_PROG = "torchcache"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors read ``torchcache: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{_PROG}: error: {message}\n")


class _Progress:
    """Progress of a long check: a tqdm bar on a terminal, else a plain line now and then.

    Args:
        total: Steps expected.
        desc: What is being done.
        stream: Where progress goes (stderr when ``None``).
        interval: Seconds between plain lines.
    """

    def __init__(self, total: int, desc: str, stream: TextIO | None = None, interval: float = 10.0) -> None:
        self.total, self.done, self.desc, self.interval = total, 0, desc, interval
        self._stream = stream if stream is not None else sys.stderr
        self._last = time.monotonic()
        self._bar: Any = None
        if self._stream is not None and self._stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit="entry", file=self._stream, leave=False)

    def update(self, n: int = 1) -> None:
        """Record ``n`` more steps done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._stream is not None and time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            share = f" ({self.done / self.total:.0%})" if self.total else ""
            print(f"{self.desc}: {self.done:,}/{self.total:,} entries{share}", file=self._stream, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()


# -- formatting -----------------------------------------------------------------------
def _date(ts: float | None) -> datetime | None:
    try:
        return None if ts is None else datetime.fromtimestamp(ts).astimezone()
    except (OverflowError, OSError, ValueError):  # a time no date can show
        return None


def _when(ts: float | None) -> str:
    date = _date(ts)
    return "-" if date is None else date.strftime("%Y-%m-%d %H:%M")


def _iso(ts: float | None) -> str | None:
    date = _date(ts)
    return None if date is None else date.isoformat(timespec="seconds")


def _plural(n: int, word: str, many: str = "") -> str:
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = []
    for row in (headers, *rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _cache_json(cache: ModuleCache) -> dict[str, Any]:
    return {
        "key": cache.key,
        "directory": str(cache.directory),
        "name": cache.name,
        "kind": cache.meta.get("kind"),
        "entries": cache.entries,
        "bytes": cache.nbytes,
        "disk_bytes": cache.disk_bytes,
        "temporary_files": cache.temporaries,
        "max_bytes": cache.max_bytes,
        "created": _iso(cache.created),
        "last_used": _iso(cache.last_used),
        "torchcache_version": cache.version,
        "metadata_problem": cache.meta_problem,
    }


def _cache_table(caches: Sequence[ModuleCache]) -> str:
    rows = [
        [
            c.key[:12],
            c.name if c.meta_problem is None else f"{c.name} (damaged metadata)",
            f"{c.entries:,}",
            format_size(c.nbytes),
            format_size(c.disk_bytes),
            _when(c.created),
            _when(c.last_used),
            c.version or "-",
        ]
        for c in caches
    ]
    headers = ["KEY", "NAME", "ENTRIES", "SIZE", "ON DISK", "CREATED", "LAST USED", "VERSION"]
    return _table(headers, rows, right=(2, 3, 4))


def _finite(data: Any) -> Any:
    """``data`` with non-finite floats (which JSON cannot hold) as ``None``."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_finite(value) for value in data]
    return data


def _print_json(data: Any) -> None:
    print(json.dumps(_finite(data), indent=2, allow_nan=False))


def _totals(caches: Sequence[ModuleCache]) -> str:
    entries = _plural(sum(c.entries for c in caches), "entry", "entries")
    size, disk = format_size(sum(c.nbytes for c in caches)), format_size(sum(c.disk_bytes for c in caches))
    return f"{_plural(len(caches), 'module cache')}, {entries}, {size} ({disk} on disk)"


def _damaged_note(caches: Sequence[ModuleCache]) -> None:
    damaged = sum(c.meta_problem is not None for c in caches)
    if damaged:
        print(f"{_plural(damaged, 'module cache')} with damaged metadata; `torchcache verify --fix` rebuilds it")


def _root(arg: str | None) -> Path:
    """The root a command works on: the argument, else the decorator's default root."""
    if arg is None:
        return resolve_root(None)
    path = Path(arg).expanduser()
    if not path.exists():
        raise CacheLookupError(f"{path} does not exist")
    if not path.is_dir():
        raise CacheLookupError(f"{path} is not a directory")
    return path


# -- commands -------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    root = _root(args.root)
    caches = find_caches(root)
    if args.json:
        _print_json({"root": str(root), "caches": [_cache_json(c) for c in caches]})
    elif not caches:
        print(f"no module caches under {root}")
    else:
        print(_cache_table(caches))
        print(f"\n{_totals(caches)} under {root}")
        _damaged_note(caches)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    root = resolve_root(None) if args.root is None else _root(args.root)
    cache = resolve_cache(root, args.target, root_given=args.root is not None)
    files = list_files(cache.directory)
    layouts = summarize_layouts(files.entries, args.sample)
    sampled = sum(s.entries for s in layouts)
    settings = cache.meta.get("settings")
    if args.json:
        shapes = [
            {"layout": s.description, "entries": s.entries, "item_bytes": s.layout and s.layout.nbytes} for s in layouts
        ]
        _print_json({**_cache_json(cache), "meta": cache.meta, "sampled_entries": sampled, "layouts": shapes})
        return 0
    limit = cache.max_bytes
    used = f" ({cache.nbytes / limit:.1%} used)" if limit else ""
    fields = [
        ("directory", str(cache.directory)),
        ("module key", cache.key),
        ("name", cache.name),
        ("kind", str(cache.meta.get("kind", "-"))),
        ("created", _when(cache.created)),
        ("last used", _when(cache.last_used)),
        ("torchcache", cache.version or "-"),
        ("format", str(cache.meta.get("format_version", "-"))),
        ("entries", f"{cache.entries:,}"),
        ("size", f"{format_size(cache.nbytes)} ({cache.nbytes:,} bytes)"),
        ("on disk", f"{format_size(cache.disk_bytes)} ({cache.disk_bytes:,} bytes)"),
        ("size limit", "-" if limit is None else f"{format_size(limit)}{used}"),
        ("temporary files", str(cache.temporaries)),
        ("metadata", cache.meta_problem or "ok"),
    ]
    if isinstance(settings, dict):
        fields.append(("settings", ", ".join(f"{k}={v}" for k, v in sorted(settings.items(), key=str)) or "-"))
    width = max(len(label) for label, _ in fields)
    for label, value in fields:
        print(f"{label:<{width}}  {value}")
    if layouts:
        print(f"\nlayouts (headers of {_plural(sampled, 'entry', 'entries')}):")
        rows = [
            [f"{s.entries:,}", "-" if s.layout is None else format_size(s.layout.nbytes), s.description]
            for s in layouts
        ]
        print(_table(["ENTRIES", "ITEM SIZE", "LAYOUT"], rows, right=(0, 1)))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    root = _root(args.path)
    caches = find_caches(root)
    listed = [(cache, list_files(cache.directory)) for cache in caches]
    total = sum(len(files.entries) for _, files in listed)
    now = time.time()
    progress = _Progress(total, "verify")
    problems: list[Problem] = []
    damaged: dict[Path, ModuleCache] = {}
    busy = 0
    try:
        for cache, files in listed:
            if cache.meta_problem is not None:
                damaged[cache.directory / META_NAME] = cache
                problems.append(Problem(cache.directory / META_NAME, "metadata", cache.meta_problem, 0))
            found, in_progress = verify_files(files, now, progress.update)
            problems.extend(found)
            busy += len(in_progress)
    finally:
        progress.close()
    removed: list[Problem] = []
    failures: list[str] = []
    if args.fix:
        for problem in problems:
            try:
                if problem.path in damaged:
                    rebuild_meta(damaged[problem.path])
                else:
                    remove_file(problem.path)
                removed.append(problem)
            except OSError as exc:
                failures.append(f"cannot fix {problem.path}: {exc.strerror or exc}")
    rebuilt = sum(p.path in damaged for p in removed)
    left = len(problems) - len(removed)
    if args.json:
        _print_json(
            {
                "root": str(root),
                "module_caches": len(caches),
                "entries_checked": total,
                "problems": [
                    {
                        "path": str(p.path),
                        "kind": p.kind,
                        "reason": p.reason,
                        "bytes": p.size,
                        "removed": p in removed and p.path not in damaged,
                        "fixed": p in removed,
                    }
                    for p in problems
                ],
                "temporary_files_in_use": busy,
                "ok": left == 0,
            }
        )
    else:
        print(f"checked {_plural(total, 'entry', 'entries')} in {_plural(len(caches), 'module cache')} under {root}")
        if problems:
            rows = [[p.kind, p.reason, _relative(p.path, root)] for p in problems]
            print(_table(["PROBLEM", "REASON", "FILE"], rows))
        if busy:
            print(f"left {_plural(busy, 'recent temporary file')} alone (a write may be in progress)")
        if len(removed) > rebuilt:
            files_removed = [p for p in removed if p.path not in damaged]
            size = format_size(sum(p.size for p in files_removed))
            print(f"removed {_plural(len(files_removed), 'file')} ({size})")
        if rebuilt:
            print(f"rebuilt the metadata of {_plural(rebuilt, 'module cache')}")
        if not problems:
            print("no problems found")
    for failure in failures:
        _error(failure)
    if left:
        if not failures:
            _error(f"{_plural(left, 'problem')} found; run `torchcache verify --fix` to fix them")
        return 1
    return 0


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _cmd_prune(args: argparse.Namespace) -> int:
    root = _root(args.root)
    caches = find_caches(root)
    victims = select_for_prune(caches, time.time(), max_bytes=args.max_size, older_than=args.older_than, keep=args.keep)
    kept = [c for c in caches if c not in victims]
    # Everything printed is formatted before anything is removed.
    table = _cache_table(victims) if victims and not args.json else ""
    kept_json = [_cache_json(c) for c in kept] if args.json else []
    victims_json = [_cache_json(c) for c in victims] if args.json else []
    left = _totals(kept)
    freed, failed = (sum(c.nbytes for c in victims), 0) if args.dry_run else _remove(victims)
    if args.json:
        _print_json(
            {
                "root": str(root),
                "dry_run": args.dry_run,
                "removed": victims_json,
                "kept": kept_json,
                "freed_bytes": freed,
            }
        )
    elif not victims:
        print(f"nothing to prune: {_totals(caches)} under {root}")
    else:
        print(table)
        verb = "would remove" if args.dry_run else "removed"
        print(f"\n{verb} {_plural(len(victims) - failed, 'module cache')} ({format_size(freed)}); {left} left")
    return 1 if failed else 0


def _remove(caches: Sequence[ModuleCache]) -> tuple[int, int]:
    """Remove module caches; return the bytes freed and how many could not be removed.

    Directories holding other files are kept (and named); a cache that cannot be
    removed is named and the others are still removed.
    """
    freed = failed = 0
    for cache in caches:
        try:
            size, kept = remove_cache(cache.directory)
        except OSError as exc:
            failed += 1
            _error(f"cannot remove {cache.directory}: {exc.strerror or exc}")
            continue
        freed += size
        if kept is not None:
            print(f"{_PROG}: kept {kept}: it holds files that torchcache did not write", file=sys.stderr)
    return freed, failed


def _cmd_clear(args: argparse.Namespace) -> int:
    root = resolve_root(None) if args.root is None else _root(args.root)
    targets = find_caches(root) if args.all else [resolve_cache(root, args.target, root_given=args.root is not None)]
    if not targets:
        print(f"nothing to clear: no module caches under {root}")
        return 0
    size = format_size(sum(c.nbytes for c in targets))
    single = len(targets) == 1 and not args.all
    what = (
        f"module cache {targets[0].key} ({targets[0].name}, {size}) in {targets[0].directory.parent}"
        if single
        else f"{_plural(len(targets), 'module cache')} ({size}) under {root}"
    )
    if not args.yes:
        stdin = sys.stdin
        if stdin is None or not stdin.isatty():
            _error(f"refusing to remove {what} without confirmation (stdin is not a terminal); pass --yes")
            return 1
        print(f"remove {what}? [y/N] ", end="", file=sys.stderr, flush=True)
        if stdin.readline().strip().lower() not in ("y", "yes"):
            print("aborted; nothing removed", file=sys.stderr)
            return 1
    freed, failed = _remove(targets)
    print(f"removed {_plural(len(targets) - failed, 'module cache')} ({format_size(freed)})")
    return 1 if failed else 0


# -- parser ---------------------------------------------------------------------------
def _size(text: str) -> int:
    try:
        return parse_size(text, "--max-size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``torchcache`` command."""
    parser = _Parser(
        prog=_PROG,
        description="Inspect and maintain torchcache's caches on disk. The default root is the decorator's: "
        "$TORCHCACHE_DIR, else the user cache directory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    root_help = "cache root (default: $TORCHCACHE_DIR, else the user cache directory)"
    key_help = (
        "a module cache directory, or its key (a unique prefix is enough); with --root, a key is looked up "
        "under that root only"
    )

    def command(name: str, summary: str, description: str, handler: Callable[[argparse.Namespace], int]) -> Any:
        sub = commands.add_parser(name, help=summary, description=description)
        sub.set_defaults(handler=handler)
        return sub

    ls = command("ls", "list the module caches under a root", "List module caches, most recently used first.", _cmd_ls)
    ls.add_argument("root", nargs="?", metavar="ROOT", help=root_help)
    info = command(
        "info",
        "describe one module cache",
        "Describe a module cache: metadata, size, size limit and the layouts of a sample of its entries.",
        _cmd_info,
    )
    info.add_argument("target", metavar="DIR_OR_KEY", help=key_help)
    info.add_argument("--root", help=root_help)
    info.add_argument(
        "--sample", type=_count, default=100, metavar="N", help="entries whose headers are read (default: 100)"
    )
    verify = command(
        "verify",
        "check every entry and look for stray temporary files",
        "Check every module cache's metadata and every entry (frame, checksum, header, payload size), and look "
        "for stray temporary files. The exit status is 1 if problems were found and not fixed.",
        _cmd_verify,
    )
    verify.add_argument("path", nargs="?", metavar="ROOT|DIR", help=f"{root_help}, or one module cache")
    verify.add_argument(
        "--fix",
        action="store_true",
        help="remove corrupt entries and stray temporary files, rebuild damaged metadata from the entries",
    )
    prune = command(
        "prune",
        "remove whole module caches, least recently used first",
        "Remove whole module caches, least recently used first, until the condition holds.",
        _cmd_prune,
    )
    prune.add_argument("root", nargs="?", metavar="ROOT", help=root_help)
    condition = prune.add_mutually_exclusive_group(required=True)
    condition.add_argument("--max-size", type=_size, metavar="SIZE", help="total size to get under (20GB, 500MiB)")
    condition.add_argument("--older-than", type=_duration, metavar="DURATION", help="last used before (30d, 12h, 2w)")
    condition.add_argument("--keep", type=_count, metavar="N", help="keep the N most recently used")
    prune.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    for sub in (ls, info, verify, prune):
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
    clear = command(
        "clear",
        "remove a module cache, or all",
        "Remove a module cache, or every one under the root. Only torchcache's own files are removed; asks for "
        "confirmation unless --yes (and refuses without --yes when stdin is not a terminal).",
        _cmd_clear,
    )
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("target", nargs="?", metavar="DIR_OR_KEY", help=key_help)
    which.add_argument("--all", action="store_true", help="every module cache under the root")
    clear.add_argument("--root", help=root_help)
    clear.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    return parser


def _error(message: str) -> None:
    print(f"{_PROG}: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchcache`` command.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 on failure or unfixed problems, 2 on a usage error,
        130 when interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    try:
        return int(args.handler(args))
    except BrokenPipeError:  # e.g. `torchcache ls | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (TorchCacheError, OSError) as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
