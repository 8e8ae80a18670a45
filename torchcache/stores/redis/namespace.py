"""The requests a Redis store sends for one namespace: each method is one batch on the wire.

Every method takes the connected client and counts its round trips on the link; the
store runs it through :meth:`~torchcache.stores.redis.link.RedisLink.call`, which turns
failures into store errors. On a single server a batch is one request: ``MGET`` to read,
``MULTI`` with the ``SET``s (or ``DEL``) and a bookkeeping script to write, so a write
and its evictions are applied together or, when the server refuses one command (out of
memory), not at all. On a cluster a batch is one pipeline, sent to every node holding
its keys at once; there the entries a write evicts are unlinked by a second pipeline,
and a refused write is undone as far as the server lets us.
"""

from __future__ import annotations

import contextlib

from ..packed.format import encode_records, is_key
from .keys import FORGET, PUT, Keyspace, parse_count
from .link import Client, RedisLink, node_clients, run_pipeline

__all__ = ["SCAN_COUNT", "Namespace"]

#: Names asked for per ``SCAN``.
SCAN_COUNT = 1000
#: The most a Redis string holds: no entry's payload is larger.
_MAX_VALUE_BYTES = 512 << 20

#: ``(key, packed key, payload)`` of an entry to write.
Item = tuple[str, bytes, "bytes | memoryview"]


class Namespace:
    """The entries and bookkeeping of one namespace, over a link.

    Args:
        link: The connection (counts round trips; knows whether it is a cluster).
        space: The namespace's names.
        max_bytes: The budget the bookkeeping script keeps.
    """

    def __init__(self, link: RedisLink, space: Keyspace, max_bytes: int) -> None:
        self.link = link
        self.space = space
        self.max_bytes = max_bytes

    # -- reads --------------------------------------------------------------------
    def fetch(self, client: Client, names: list[str]) -> list[object]:
        """The values of entries (``None`` where absent): one round trip, one per node on a cluster.

        On a cluster a value may be an exception: a key of another type (``WRONGTYPE``) is
        left in the list, to be reported and removed; any other (a node away, a slot
        still moving after its redirection was followed) is raised, and nothing is removed.
        """
        if not self.link.cluster:
            self.link.count(1)
            return list(client.mget(names))
        self.link.count(self.nodes_of(client, names))
        pipe = client.pipeline()
        for name in names:
            pipe.get(name)
        values = run_pipeline(pipe, cluster=True, raise_on_error=False)
        for value in values:
            if isinstance(value, BaseException) and (self.link.is_away(value) or "WRONGTYPE" not in str(value)):
                raise value
        return values

    def exists(self, client: Client, name: str) -> bool:
        """Whether an entry is on the server."""
        self.link.count(1)
        return bool(client.exists(name))

    def usage(self, client: Client) -> tuple[int, int]:
        """Entries and payload bytes in the bookkeeping.

        Totals that fail their check (not a non-negative integer, payload bytes above
        the bytes charged, bytes above the budget, or more payload than the entries can
        hold) are recomputed from the sizes hash.
        """
        self.link.count(1)
        order, sizes, stats = self.space.meta
        pipe = client.pipeline(transaction=False)
        pipe.zcard(order)
        pipe.hmget(stats, "bytes", "payload")
        count, (used_raw, payload_raw) = run_pipeline(pipe, self.link.cluster)
        entries = parse_count(count) or 0
        used, payload = parse_count(used_raw or 0), parse_count(payload_raw or 0)
        if (
            used is None
            or payload is None
            or payload > used
            or used > self.max_bytes
            or payload > entries * _MAX_VALUE_BYTES
        ):
            self.link.count(1)
            payload = sum(parse_count(n) or 0 for n in client.hvals(sizes))
        return entries, payload

    def scan(self, node: Client, cursor: int) -> tuple[int, list[bytes]]:
        """One page of entry names on one node: ``(next cursor, names)``."""
        self.link.count(1)
        cursor, names = node.scan(cursor, match=self.space.pattern, count=SCAN_COUNT)
        return int(cursor), list(names)

    def scan_on(self, client: Client, node: Client, cursor: int) -> tuple[int, list[bytes]]:
        """:meth:`scan`, in the form :meth:`~torchcache.stores.redis.link.RedisLink.call` takes."""
        return self.scan(node, cursor)

    # -- writes -------------------------------------------------------------------
    def write(self, client: Client, batch: list[Item]) -> set[str]:
        """Write entries and record them; return the keys evicted to keep the budget."""
        cluster, space = self.link.cluster, self.space
        records = encode_records([kb for _, kb, _ in batch], [data for _, _, data in batch])
        pipe = client.pipeline() if cluster else client.pipeline(transaction=True)
        for (key, _, _), (head, data) in zip(batch, records):
            pipe.set(space.name(key), head + data)
        self._eval(client, pipe, PUT, *self._put_args([(key, len(data)) for key, _, data in batch]))
        names = [space.name(key) for key, _, _ in batch]
        self.link.count(1 if not cluster else self.nodes_of(client, [*names, space.meta[0]]))
        results = run_pipeline(pipe, cluster, raise_on_error=False)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # undo what was written, if the server lets us: a transaction that failed while it ran
            with contextlib.suppress(*self.link.errors):  # (bookkeeping another client replaced) keeps its SETs
                self.remove(client, [key for key, _, _ in batch])
            raise errors[0]
        if not cluster:
            return {_text(v) for v in results[-1]}
        return self._unlink(client, results[-1])

    def account(self, client: Client, sizes: list[tuple[str, int]]) -> set[str]:
        """Record ``(key, payload length)`` of entries already on the server; return the keys evicted."""
        self.link.count(1)
        evicted = client.eval(PUT, 3, *self.space.meta, *self._put_args(sizes))
        return self._unlink(client, list(evicted))

    def remove(self, client: Client, keys: list[str]) -> int:
        """Delete entries (distinct keys) and drop them from the bookkeeping; return how many were on the server."""
        if not keys:
            return 0
        names = [self.space.name(key) for key in keys]
        if not self.link.cluster:
            pipe = client.pipeline(transaction=True)
            pipe.delete(*names)
            self._eval(client, pipe, FORGET, len(self.space.prefix), *keys)
            self.link.count(1)
            return int(pipe.execute()[0])
        pipe = client.pipeline()
        for name in names:
            pipe.delete(name)
        self._eval(client, pipe, FORGET, len(self.space.prefix), *keys)
        self.link.count(self.nodes_of(client, [*names, self.space.meta[0]]))
        return sum(r for r in run_pipeline(pipe, cluster=True)[:-1] if isinstance(r, int))

    def clear(self, client: Client) -> None:
        """Delete the bookkeeping, then every entry found on every node.

        The bookkeeping goes first: a write racing with the clear then leaves counts for
        an entry that is gone (reconciled by a verify), never an entry nobody counts.
        Only names that are entries (a key of hex digits after the prefix) are removed:
        another program's names under the same prefix stay.
        """
        self.link.count(1)
        client.delete(*self.space.meta)
        for node in node_clients(client, self.link.cluster):
            cursor = 0
            while True:
                cursor, names = self.scan(node, cursor)
                names = [n for n in names if is_key(self.space.key_of(n) or "")]  # others: not ours
                if names:
                    pipe = node.pipeline(transaction=False)
                    for name in names:
                        pipe.unlink(name)
                    self.link.count(1)
                    pipe.execute()
                if cursor == 0:
                    break

    # -- helpers ------------------------------------------------------------------
    def nodes_of(self, client: Client, names: list[str]) -> int:
        """How many cluster nodes hold ``names``."""
        return len({client.get_node_from_key(name).name for name in names})

    def _put_args(self, sizes: list[tuple[str, int]]) -> list[str | int]:
        unlink = "" if self.link.cluster else self.space.prefix
        args: list[str | int] = [len(self.space.prefix), self.max_bytes, unlink]
        for key, size in sizes:
            args += [key, size]
        return args

    def _unlink(self, client: Client, evicted: list[object]) -> set[str]:
        """Unlink the entries the bookkeeping evicted (on a single server its script already did)."""
        victims = {_text(v) for v in evicted}
        if victims and self.link.cluster:
            names = [self.space.name(key) for key in victims]
            pipe = client.pipeline()
            for name in names:
                pipe.unlink(name)
            self.link.count(self.nodes_of(client, names))
            run_pipeline(pipe, cluster=True)
        return victims

    def _eval(self, client: Client, pipe: Client, script: str, *args: str | int) -> None:
        """Queue a bookkeeping script.

        On a cluster it is sent straight to the bookkeeping's node: left to itself, redis-py
        would first ask a node which keys the script names, one more round trip.
        """
        if self.link.cluster:
            node = client.get_node_from_key(self.space.meta[0])
            pipe.execute_command("EVAL", script, 3, *self.space.meta, *args, target_nodes=node)
        else:
            pipe.execute_command("EVAL", script, 3, *self.space.meta, *args)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
