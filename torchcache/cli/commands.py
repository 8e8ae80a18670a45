"""What each ``torchcache`` command does: one handler per command, from parsed arguments to exit status.

Each handler finds caches with :mod:`torchcache.catalog.inspect`, checks them with
:mod:`.verify`, removes them with :mod:`torchcache.catalog.removal` (which only ever removes
torchcache's own files), and writes with :mod:`.output`. Library errors propagate to the caller, which
reports them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..catalog.budget import cache_in_use, remove_unused_cache
from ..catalog.inspect import CacheLookupError, ModuleCache, find_caches, list_files, resolve_cache
from ..catalog.removal import remove_cache, remove_file, select_for_prune
from ..errors import StoreError
from ..locations import check_local_dir, is_url, resolve_root
from ..meta import META_NAME, unreadable
from ..policy import format_size, plural
from ..stores.packed.index import INDEX_NAME
from .output import (
    Progress,
    cache_json,
    cache_table,
    count_caches,
    damaged_note,
    error,
    note,
    print_json,
    product,
    relative,
    table,
    totals,
    visible,
)
from .verify import Problem, rebuild_meta, verify_files, verify_store

__all__ = ["cmd_clear", "cmd_ls", "cmd_prune", "cmd_verify", "command_root"]


def command_root(arg: str | None) -> Path:
    """The root a command works on: the argument, else the decorator's default root."""
    if arg is None:  # $TORCHCACHE_DIR or the user cache directory: one not made yet holds no caches
        root = resolve_root(None)
        if root.exists() and not root.is_dir():
            raise CacheLookupError(f"the cache root {root} is not a directory")
        return root
    path = check_local_dir(arg, "the cache root")  # another scheme's URL is refused, not taken as a path
    assert path is not None
    if not path.exists():
        raise CacheLookupError(f"{path} does not exist")
    if not path.is_dir():
        raise CacheLookupError(f"{path} is not a directory")
    return path


def cmd_ls(args: argparse.Namespace) -> int:
    """``torchcache ls``: list the caches under a root (modules, datasets, features), most recently used first.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 0.
    """
    if is_url(args.root):
        from . import remote

        return remote.remote_ls(args.root, args)
    root = command_root(args.root)
    caches = find_caches(root)
    if args.json:
        print_json({"root": str(root), "caches": [cache_json(c) for c in caches]})
    elif not caches:
        print(f"no caches under {root}")
    else:
        print(cache_table(caches, caches))
        print(f"\n{totals(caches)} under {root}")
        damaged_note(caches)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``torchcache verify``: check every entry and the metadata, and fix what is wrong with ``--fix``.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 1 if problems were found and not fixed, else 0.
    """
    if is_url(args.path):
        from . import remote

        return remote.remote_verify(args.path, args)
    root = command_root(args.path)
    caches = find_caches(root)
    listed = [(cache, list_files(cache.directory)) for cache in caches]
    total = sum(len(files.entries) for _, files in listed)
    now = time.time()
    total += sum(cache.entries - cache.legacy_entries for cache in caches)
    progress = Progress(total, "verify")
    total = 0  # what is checked, which the listing only estimated (an index rebuilt by --fix, a writer meanwhile)
    problems: list[Problem] = []
    damaged: dict[Path, ModuleCache] = {}
    removed: list[Problem] = []
    from_stores: list[Problem] = []  # entries (and index rows) the stores repaired themselves
    files_removed: list[Problem] = []
    failures: list[str] = []
    busy = 0
    try:
        for cache, files in listed:
            if cache.meta_problem is not None:
                if not unreadable(cache.meta_problem):  # one that cannot be read is not rebuilt over
                    damaged[cache.directory / META_NAME] = cache
                problems.append(Problem(cache.directory / META_NAME, "metadata", cache.meta_problem, 0))
            damage = []
            if cache.index_damage is not None:  # the fix opens the store, which rebuilds the index
                note = f"{cache.index_damage}; {'rebuilt' if args.fix else '--fix rebuilds it'} from the segment files"
                damage = [Problem(cache.directory / INDEX_NAME, "store", note, 0)]
                problems.extend(damage)
            try:
                checked, found, fixed = verify_store(cache.directory, args.fix, progress.update, cache.meta.get("kind"))
                total += checked
                removed.extend(damage if args.fix else ())
            except StoreError as exc:
                found, fixed = [Problem(cache.directory, "store", str(exc), 0)], False
                failures.append(f"cannot check the store of {cache.directory}: {exc}") if args.fix else None
            problems.extend(found)
            if fixed:
                removed.extend(found)
                from_stores.extend(found)
            found, in_progress = verify_files(files, now, progress.update)
            total += len(files.entries)
            problems.extend(found)
            busy += len(in_progress)
    finally:
        progress.close()
    if args.fix:
        repaired = {id(p) for p in from_stores}
        for problem in problems:
            if id(problem) in repaired or problem.kind == "store":
                continue
            try:
                if problem.path in damaged:
                    rebuild_meta(damaged[problem.path])
                elif problem.kind == "metadata":  # unreadable: its mode or the disk is to be fixed, not the file
                    failures.append(f"cannot fix {problem.path}: {problem.reason}")
                    continue
                else:
                    remove_file(problem.path)
                    files_removed.append(problem)
                removed.append(problem)
            except OSError as exc:
                failures.append(f"cannot fix {problem.path}: {exc.strerror or exc}")
    rebuilt = [damaged[p.path] for p in removed if p.path in damaged]
    left = len(problems) - len(removed)
    fixed_ids = {id(p) for p in removed}
    if args.json:
        print_json(
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
                        "removed": id(p) in fixed_ids and p.path not in damaged,
                        "fixed": id(p) in fixed_ids,
                    }
                    for p in problems
                ],
                "temporary_files_in_use": busy,
                "ok": left == 0,
            }
        )
    else:
        print(f"checked {plural(total, 'entry', 'entries')} in {count_caches(caches)} under {root}")
        if problems:
            rows = [[p.kind, p.reason, relative(p.path, root)] for p in problems]
            print(table(["PROBLEM", "REASON", "FILE"], rows))
        if busy:
            print(f"left {plural(busy, 'recent temporary file')} alone (a write may be in progress)")
        entries = sum(p.kind != "store" for p in from_stores)
        if entries:
            print(f"removed or repaired {plural(entries, 'damaged entry', 'damaged entries')}")
        if len(from_stores) > entries:
            print(f"repaired {plural(len(from_stores) - entries, 'problem')} of the stores' index and files")
        if files_removed:
            size = format_size(sum(p.size for p in files_removed))
            print(f"removed {plural(len(files_removed), 'file')} ({size})")
        if rebuilt:
            print(f"rebuilt the metadata of {count_caches(rebuilt)}")
        if not problems:
            print("no problems found")
    for failure in failures:
        error(failure)
    if left:
        if not failures and args.fix:
            error(f"{plural(left, 'problem')} left that --fix cannot fix (see the list above)")
        elif not failures:
            error(f"{plural(left, 'problem')} found; run `torchcache verify --fix` to fix them")
        return 1
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """``torchcache prune``: remove whole module caches, least recently used first, until the condition holds.

    A module cache that a live process has open is kept (and named); with ``--max-size``,
    more recently used ones may go in its place.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 1 if a module cache could not be removed, else 0.
    """
    if is_url(args.root):
        from . import remote

        return remote.remote_prune(args.root, args)
    root = command_root(args.root)
    caches = find_caches(root)
    busy: list[ModuleCache] = []

    def in_use(cache: ModuleCache) -> bool:
        if cache_in_use(cache.directory, strict=False):  # where directories cannot be locked, as before
            busy.append(cache)
            return True
        return False

    victims = select_for_prune(
        caches, time.time(), max_bytes=args.max_size, older_than=args.older_than, keep=args.keep, in_use=in_use
    )
    if args.dry_run:
        removed, freed, failed = victims, sum(c.nbytes for c in victims), 0
    else:
        removed, freed, failed = _remove(victims, busy)
    kept = [c for c in caches if c not in removed]
    if args.json:
        print_json(
            {
                "root": str(root),
                "dry_run": args.dry_run,
                "removed": [cache_json(c) for c in removed],
                "in_use": [cache_json(c) for c in busy],
                "kept": [cache_json(c) for c in kept],
                "freed_bytes": freed,
            }
        )
    elif not victims and not busy:
        print(f"nothing to prune: {totals(caches)} under {root}")
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {count_caches(removed)} ({format_size(freed)})" + (":" if removed else ""))
        if args.dry_run and (unsent := sum(c.unsent for c in removed)):
            note(f"{plural(unsent, 'entry', 'entries')} of those local copies have not reached their servers yet")
        if removed:
            print(cache_table(removed, caches))
        if busy:
            print(f"\nkept {count_caches(busy)} in use by a running process:")
            print(cache_table(busy, caches))
        print(f"\nleft {totals(kept)} under {root}")
    return 1 if failed else 0


def _remove(caches: Sequence[ModuleCache], busy: list[ModuleCache] | None = None) -> tuple[list[ModuleCache], int, int]:
    """Remove module caches; return those removed, the bytes freed and how many could not be removed.

    Directories holding other files are kept (and named); a cache that cannot be
    removed is named and the others are still removed. With ``busy``, a cache that a
    process has open is kept and added to it.
    """
    removed: list[ModuleCache] = []
    freed = failed = 0
    for cache in caches:
        try:
            done = remove_cache(cache.directory) if busy is None else remove_unused_cache(cache.directory, strict=False)
        except OSError as exc:
            failed += 1
            error(f"cannot remove {cache.directory}: {exc.strerror or exc}")
            continue
        if done is None:
            assert busy is not None
            busy.append(cache)
            continue
        size, kept = done
        removed.append(cache)
        freed += size
        if cache.unsent:  # a local copy's entries that its server did not take: this was their only copy
            note(f"{cache.directory} held {plural(cache.unsent, 'entry', 'entries')} not yet sent to its server")
        if kept is not None:
            note(f"kept {kept}: it holds files that torchcache did not write")
    return removed, freed, failed


def cmd_clear(args: argparse.Namespace) -> int:
    """``torchcache clear``: remove one module cache, or every one under the root, once confirmed.

    Args:
        args: The parsed arguments of the command.

    Returns:
        The exit status: 1 if not confirmed or a module cache could not be removed, else 0.

    Raises:
        CacheLookupError: If no module cache, or more than one, matches the target.
    """
    if is_url(args.root):
        from . import remote

        return remote.remote_clear(args.root, args)
    root = command_root(args.root)
    targets = find_caches(root) if args.all else [resolve_cache(root, args.target, root_given=args.root is not None)]
    if not targets:
        print(f"nothing to clear: no caches under {root}")
        return 0
    size = format_size(sum(c.nbytes for c in targets))
    single = len(targets) == 1 and not args.all
    first = targets[0]
    unsent = sum(c.unsent for c in targets)
    what = visible(  # names, keys and paths as a terminal can show them
        (
            f"{product(first)} cache {first.key} ({first.name}, {size}) in {first.directory.parent}"
            if single
            else f"{count_caches(targets)} ({size}) under {root}"
        )
        + (f", with {plural(unsent, 'entry', 'entries')} its server has not taken yet" if unsent else "")
    )
    if not args.yes:
        stdin = sys.stdin
        if stdin is None or not stdin.isatty():
            error(f"refusing to remove {what} without confirmation (stdin is not a terminal); pass --yes")
            return 1
        print(f"remove {what}? [y/N] ", end="", file=sys.stderr, flush=True)
        if stdin.readline().strip().lower() not in ("y", "yes"):
            print("aborted; nothing removed", file=sys.stderr)
            return 1
    removed, freed, failed = _remove(targets)
    print(f"removed {count_caches(removed)} ({format_size(freed)})")
    return 1 if failed else 0
