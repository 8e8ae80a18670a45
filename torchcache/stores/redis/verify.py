"""Verification of a Redis store's namespace, and the list of namespaces on a server.

:func:`verify` reads every entry of the namespace (``SCAN`` on each node, values
fetched a page at a time) and checks its record, then compares what it found with the
bookkeeping: entries the server evicted are still counted there, values another client
planted or a failed write left are not. With ``fix``, damaged values are deleted,
the bookkeeping of vanished entries is dropped, intact values missing from it (or with
another size) are recorded as new writes (evicting to keep the budget), and a script
recomputes the totals from the sizes. Nothing here is atomic with concurrent writers: a write
during a check may show up as a problem, and a fix is best run while nobody writes.
"""

from __future__ import annotations

import contextlib
import reprlib
import time

from ...errors import ConfigError, KeyingError
from ..batched import VerifyReport
from ..packed.format import check_record, encode_key, is_key
from .keys import REBUILD, STATS_PATTERN, charge, parse_count
from .link import Client, RedisLink, fetch_on_node, node_clients, run_pipeline
from .namespace import Namespace
from .url import RedisAddress, check_namespace

__all__ = ["list_namespaces", "verify"]

_PAGE = 1000


def verify(client: Client, namespace: Namespace, fix: bool) -> VerifyReport:
    """Check every entry and the bookkeeping of a namespace; with ``fix``, repair them.

    Args:
        client: The connected client.
        namespace: The namespace's requests.
        fix: Whether to repair.

    Returns:
        What was found; ``bad`` holds the keys of damaged values. Names under the
        namespace's prefix that are no key are another program's: left alone.

    Raises:
        redis.exceptions.RedisError: If the server fails; the caller turns it into a store error.
    """
    link, space = namespace.link, namespace.space
    result = VerifyReport()
    found: dict[str, int] = {}
    bad_names: list[bytes] = []
    unread: set[str] = set()  # an error reply other than WRONGTYPE (a slot moving between nodes): not judged
    for node in node_clients(client, link.cluster):
        cursor = 0
        while True:
            cursor, names = namespace.scan(node, cursor)
            if names:
                link.count(1)
                values = fetch_on_node(node, names, link.cluster)
                for name, value in zip(names, values):
                    key = space.key_of(name) or ""
                    if value is None or not is_key(key):  # evicted since the scan; another program's name
                        continue
                    if isinstance(value, Exception) and "WRONGTYPE" not in str(value):
                        unread.add(key)
                        continue
                    result.entries += 1
                    payload = _payload(key, value)
                    if payload is None:  # damaged or planted: a read deletes it too
                        bad_names.append(name)
                        result.bad.append(key)
                    else:
                        found[key] = payload
            if cursor == 0:
                break
    link.count(1)
    types = client.pipeline(transaction=False)
    for meta_name in space.meta:
        types.type(meta_name)
    kinds = [_text_of(kind) for kind in run_pipeline(types, link.cluster)]
    wanted = ("zset", "hash", "hash")
    replaced = [meta for meta, want, got in zip(space.meta, wanted, kinds) if got not in (want, "none")]
    if replaced:  # another client's values under the bookkeeping's names: unreadable until removed
        result.problems.append(f"bookkeeping keys of another kind than torchcache writes: {', '.join(replaced)}")
        if not fix:
            return result
        client.delete(*replaced)  # rebuilt below from the entries found
    sizes = _sizes(client, namespace)
    link.count(1)
    pipe = client.pipeline(transaction=False)
    pipe.zcard(space.meta[0])
    pipe.hmget(space.meta[2], "bytes", "payload")
    count, (used, payload) = run_pipeline(pipe, link.cluster)
    gone = [key for key in sizes if key not in found and key not in result.bad and key not in unread]
    if gone and link.cluster:  # a slot that moved between the nodes' scans: its keys were on none when scanned
        moved = _present(client, namespace, gone)
        unread |= moved
        gone = [key for key in gone if key not in moved]
    unaccounted = [key for key in found if key not in sizes]
    mismatched = [key for key in found if key in sizes and sizes[key] != found[key]]
    if gone:
        result.problems.append(
            f"{len(gone)} entries in the bookkeeping are not on the server (evicted by its maxmemory policy, "
            "or removed by another client)"
        )
    if unaccounted:
        result.problems.append(f"{len(unaccounted)} entries on the server are missing from the bookkeeping")
    if mismatched:
        result.problems.append(f"{len(mismatched)} entries have another size than the bookkeeping says")
    malformed = [key for key, n in sizes.items() if n < 0]
    if malformed:
        result.problems.append(f"{len(malformed)} sizes in the bookkeeping are not byte counts")
    if parse_count(count) != len(sizes):
        result.problems.append(f"the write order holds {count!r} keys but the sizes hash {len(sizes)}")
    want_used = sum(charge(len(space.prefix), key, max(0, n)) for key, n in sizes.items())
    want_payload = sum(max(0, n) for n in sizes.values())
    if parse_count(used or 0) != want_used or parse_count(payload or 0) != want_payload:
        result.problems.append(
            f"the totals say {_shown(used)} bytes charged, {_shown(payload)} payload bytes; "
            f"the sizes say {want_used} and {want_payload}"
        )
    if unread:
        moving = f"{len(unread)} entries could not be read (their slot is moving between nodes); verify again"
        result.unsure.append(moving)
    if fix and not result.ok and not unread:  # nothing is repaired from a partial view
        _repair(client, namespace, bad_names, gone)
        adopted = [(key, found[key]) for key in [*unaccounted, *mismatched]]
        for start in range(0, len(adopted), _PAGE):
            namespace.account(client, adopted[start : start + _PAGE])
        link.count(1)
        client.eval(REBUILD, 3, *space.meta, len(space.prefix))
        result.fixed = True
    return result


def _present(client: Client, namespace: Namespace, keys: list[str]) -> set[str]:
    """Those of ``keys`` whose entry a cluster still has (asked where the slot is now), or whose answer was an error."""
    present: set[str] = set()
    for start in range(0, len(keys), _PAGE):
        page = keys[start : start + _PAGE]
        pipe = client.pipeline()
        for key in page:
            pipe.exists(namespace.space.name(key))
        namespace.link.count(1)
        for key, reply in zip(page, run_pipeline(pipe, cluster=True, raise_on_error=False)):
            if not isinstance(reply, int) or reply:
                present.add(key)
    return present


def _text_of(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _shown(value: object) -> str:
    """A total read from the server, for a message (bounded: it may be anything)."""
    count = parse_count(value or 0)
    return str(count) if count is not None else reprlib.repr(value)


def _payload(key: str, value: object) -> int | None:
    """The payload length of an intact record stored under ``key``, else ``None``."""
    try:
        kb = encode_key(key)
    except KeyingError:
        return None
    checked = check_record(value, kb, None) if isinstance(value, bytes) else None
    return None if checked is None else len(checked[1])


def _sizes(client: Client, namespace: Namespace) -> dict[str, int]:
    link, space = namespace.link, namespace.space
    sizes: dict[str, int] = {}
    cursor = 0
    while True:
        link.count(1)
        cursor, page = client.hscan(space.meta[1], cursor, count=_PAGE)
        for key, size in page.items():
            count = parse_count(size)
            sizes[key.decode("utf-8", "replace")] = -1 if count is None else count  # -1: matches no entry
        if int(cursor) == 0:
            return sizes


def _repair(client: Client, namespace: Namespace, bad_names: list[bytes], keys: list[str]) -> None:
    """Unlink damaged values and drop ``keys`` and the damaged ones from the bookkeeping."""
    link, space = namespace.link, namespace.space
    for start in range(0, len(bad_names), _PAGE):
        pipe = client.pipeline() if link.cluster else client.pipeline(transaction=False)
        for name in bad_names[start : start + _PAGE]:
            pipe.unlink(name)
        link.count(1)
        run_pipeline(pipe, link.cluster)
    keys = keys + [key for key in (space.key_of(name) or "" for name in bad_names) if is_key(key)]
    keys = list(dict.fromkeys(keys))
    for start in range(0, len(keys), _PAGE):
        namespace.remove(client, keys[start : start + _PAGE])


def list_namespaces(address: RedisAddress, timeout: float) -> list[str]:
    """The namespaces with bookkeeping on the server at ``address``, sorted.

    Raises:
        ConfigError: If the redis package is missing.
        StoreError: If the server cannot be read.
    """
    link = RedisLink(address, timeout, time.monotonic, lambda kind, message: None)

    def op(client: Client) -> list[str]:
        names: set[str] = set()
        for node in node_clients(client, link.cluster):
            cursor = 0
            while True:
                link.count(1)
                cursor, page = node.scan(cursor, match=STATS_PATTERN, count=_PAGE)
                fields = node.pipeline(transaction=False)
                for raw in page:
                    fields.hmget(raw, "bytes", "payload", "clock")
                link.count(1)
                suspects: list[str] = []  # totals of another kind: the namespace is torchcache's if its sizes are
                for raw, found in zip(page, fields.execute(raise_on_error=False) if page else []):
                    text = raw.decode("utf-8", "replace")
                    name = text[len("tc:{") : -len("}:stats")]
                    if isinstance(found, Exception):
                        suspects.append(name)
                    elif isinstance(found, list) and None not in found:  # else another program's key of that shape
                        with contextlib.suppress(ConfigError):
                            names.add(check_namespace(name))
                if suspects:
                    kinds = node.pipeline(transaction=False)
                    for name in suspects:
                        kinds.type(f"tc:{{{name}}}:sizes")
                    link.count(1)
                    for name, kind in zip(suspects, kinds.execute(raise_on_error=False)):
                        if _text_of(kind) == "hash":
                            with contextlib.suppress(ConfigError):
                                names.add(check_namespace(name))
                if int(cursor) == 0:
                    break
        return sorted(names)

    try:
        return link.call(op, "list the namespaces")
    finally:
        link.close()
