"""The ``torchcache`` command by URL (a Redis server or cluster, a bucket): ls, info, verify, clear, prune.

A cache there is a namespace: a key prefix on a server (:mod:`torchcache.stores.redis.store`),
a folder under the URL in a bucket (:mod:`torchcache.stores.objects`). The handlers here
take the URL where the local ones take a root, and never print a password: every URL
shown is redacted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, StoreError, StoreUnavailableError
from ..locations import check_url, is_object_url
from ..policy import format_size, plural
from ..stores.batched import BatchedStore
from ..stores.objects import ObjectStore, bucket_namespaces, open_filesystem
from ..stores.redis.url import redact_url
from ..stores.remote import open_remote_store
from .output import error, print_json, table
from .verify import check_entries, check_frame, check_frame_or_sample

__all__ = [
    "open_remote",
    "remote_clear",
    "remote_info",
    "remote_ls",
    "remote_namespaces",
    "remote_prune",
    "remote_verify",
]

_UNLIMITED = 1 << 62


def open_remote(url: str, namespace: str) -> BatchedStore:
    """The store of one namespace on a server or in a bucket, opened without a budget of its own, to inspect.

    Its ``close`` removes nothing: ``torchcache ls`` and ``info`` write nothing, and
    ``prune`` removes what it is asked to.
    """
    return open_remote_store(url, namespace, _UNLIMITED, report=lambda kind, message: None, keep_budget=False)


def remote_namespaces(url: str, prefix: str | None = None) -> list[str]:
    """The namespaces (caches) on a server or in a bucket; with ``prefix``, that key, else the keys it starts."""
    if is_object_url(url):
        names = bucket_namespaces(check_url(url, "the cache root"))  # no ?versionId=: one object, not a folder
        if not names:
            _bucket_exists(url)
    else:
        from ..stores.redis.store import RedisStore

        names = RedisStore.namespaces(url)
    if prefix is None:
        return names
    exact = [n for n in names if n == prefix]
    return exact or [n for n in names if n.startswith(prefix)]


def _bucket_exists(url: str) -> None:
    """Raise :class:`~torchcache.errors.ConfigError` if the bucket of ``url`` does not exist (a misspelt name)."""
    fs, root = open_filesystem(url)
    name = root.split("/", 1)[0]
    try:
        found = fs.exists(name)
    except Exception as exc:  # whatever the library raises: the bucket cannot be reached
        raise StoreUnavailableError(f"cannot reach the bucket {name!r} of {redact_url(url)}: {exc}") from exc
    if not found:
        raise ConfigError(f"the bucket {name!r} of {redact_url(url)} does not exist")


def _describe(url: str, namespace: str) -> dict[str, Any]:
    with open_remote(url, namespace) as store:
        return {"key": namespace, "entries": len(store), "bytes": store.nbytes}


def remote_ls(url: str, args: argparse.Namespace) -> int:
    """``torchcache ls URL``: the caches (namespaces) on a server or in a bucket, with entries and bytes."""
    shown = redact_url(url)
    caches = [_describe(url, n) for n in remote_namespaces(url)]
    if args.json:
        print_json({"root": shown, "caches": caches})
    elif not caches:
        print(f"no caches on {shown}")
    else:
        rows = [[c["key"], f"{c['entries']:,}", format_size(c["bytes"])] for c in caches]
        print(table(["KEY", "ENTRIES", "SIZE"], rows, right=(1, 2)))
        total = sum(c["bytes"] for c in caches)
        print(f"\n{plural(len(caches), 'cache')}, {format_size(total)} on {shown}")
    return 0


def _one(url: str, target: str) -> str | None:
    names = remote_namespaces(url, target)
    if len(names) == 1:
        return names[0]
    what = "no cache" if not names else f"{len(names)} caches ({', '.join(names[:5])})"
    error(f"{what} on {redact_url(url)} has a key starting with {target!r} (see `torchcache ls {redact_url(url)}`)")
    return None


def remote_info(url: str, args: argparse.Namespace) -> int:
    """``torchcache info KEY --root URL``: one namespace's entries and bytes."""
    namespace = _one(url, args.target)
    if namespace is None:
        return 1
    described = {**_describe(url, namespace), "server": redact_url(url)}
    if args.json:
        print_json(described)
    else:
        for label, value in (
            ("server", described["server"]),
            ("key", namespace),
            ("entries", f"{described['entries']:,}"),
            ("size", format_size(described["bytes"])),
        ):
            print(f"{label:<10}  {value}")
    return 0


def remote_verify(url: str, args: argparse.Namespace) -> int:
    """``torchcache verify URL``: every namespace's bookkeeping, record checksums and (module caches) frames."""
    problems: list[tuple[str, str]] = []
    unsure: list[tuple[str, str]] = []  # checks the server did not let run: no fix helps
    checked, fixed = 0, False
    for namespace in remote_namespaces(url):
        with open_remote(url, namespace) as store:
            report = store.verify(args.fix)
            checked += report.entries
            fixed = fixed or report.fixed
            problems += [(namespace, f"entry {key}: record failed its checks") for key in report.bad]
            problems += [(namespace, line) for line in report.problems]
            unsure += [(namespace, line) for line in report.unsure]
            check = _entry_check(store)
            if check is not None:
                for key, reason, _ in check_entries(store, check, set(report.bad), args.fix):
                    problems.append((namespace, f"entry {key}: {reason}"))
                    fixed = fixed or args.fix
    if args.json:
        print_json(
            {
                "root": redact_url(url),
                "entries_checked": checked,
                "problems": [{"key": ns, "reason": why} for ns, why in problems + unsure],
                "ok": (not problems or fixed) and not unsure,
            }
        )
    else:
        print(f"checked {plural(checked, 'entry', 'entries')} on {redact_url(url)}")
        if problems or unsure:
            print(table(["KEY", "PROBLEM"], [list(p) for p in problems + unsure]))
        print("fixed" if fixed else "no problems found" if not problems and not unsure else "")
    if problems and not args.fix:
        error(f"{plural(len(problems), 'problem')} found; run `torchcache verify --fix` to fix them")
        return 1
    if unsure:
        error(f"{plural(len(unsure), 'check')} could not be made (each line above says why)")
        return 1
    return 0


def remote_clear(url: str, args: argparse.Namespace) -> int:
    """``torchcache clear KEY|--all --root URL --yes``: remove namespaces from a server or a bucket."""
    if args.all:
        targets = remote_namespaces(url)
    else:
        one = _one(url, args.target)
        if one is None:
            return 1
        targets = [one]
    if not args.yes:
        error(f"refusing to remove {plural(len(targets), 'cache')} from {redact_url(url)} without --yes")
        return 1
    for namespace in targets:
        try:
            with open_remote(url, namespace) as store:
                store.clear()
        except StoreError as exc:
            error(f"cannot clear {namespace}: {exc}")
            return 1
    print(f"removed {plural(len(targets), 'cache')} from {redact_url(url)}", file=sys.stdout)
    return 0


def _entry_check(store: BatchedStore) -> Callable[[bytes | memoryview], str | None] | None:
    """How a namespace's entries are checked (``None``: they are not).

    A bucket's cache says what it holds; a server's holds module outputs or dataset samples
    (it keeps no description), each of which is intact as one or the other.
    """
    if not isinstance(store, ObjectStore):
        return check_frame_or_sample
    kind = store.bucket.description().get("kind")  # none: it cannot be told, not checked
    return check_frame if kind in ("module", "function") else None


def remote_prune(url: str, args: argparse.Namespace) -> int:
    """``torchcache prune URL --max-size SIZE``: each bucket cache's oldest segments, and unfinished uploads."""
    if not is_object_url(url) or args.max_size is None:
        error("prune on a URL takes a bucket (s3://, gs://...) and --max-size; a Redis server keeps its own budget")
        return 1
    removed = 0
    for namespace in remote_namespaces(url):
        store = open_remote(url, namespace)
        assert isinstance(store, ObjectStore)
        try:
            removed += store.prune(args.max_size, dry_run=args.dry_run)
        except StoreError as exc:
            error(f"cannot prune {namespace}: {exc}")
            return 1
    print(f"{'would remove' if args.dry_run else 'removed'} {plural(removed, 'segment')} from {redact_url(url)}")
    return 0
