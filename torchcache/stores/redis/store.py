"""A Redis store: entries on a Redis server or cluster, shared by every process and machine that reach it.

Each entry is one Redis string, ``tc:<namespace>:<key>``, holding the same checked
record as a packed segment (header, key, payload; an xxh3 checksum over key, length and
payload), so a value truncated, flipped, copied under another key or planted by another
client is a miss, reported once and deleted. Nothing is unpickled. Entry names carry no
hash tag, so a cluster spreads them over its nodes; the namespace's bookkeeping (a sorted
set of keys by write clock, a hash of sizes and the totals, see
:mod:`~torchcache.stores.redis.keys`) shares one hash tag and is updated by Lua scripts,
so the byte budget holds across processes and machines. When a write passes the budget
the most recently written entries go first (MRU), as in the packed store.

A batch is one round trip: ``MGET`` to read; ``MULTI``, the ``SET``s and the bookkeeping
script to write (one atomic step, which a full server refuses as a whole). On a cluster
a batch is one pipeline, one round trip per node holding its keys, and the entries a
write evicts are unlinked by a second one. :attr:`RedisStore.round_trips` counts them.

The server may evict entries itself (its ``maxmemory-policy``): they are misses, and
the bookkeeping counts them until :meth:`RedisStore.verify` with ``fix`` reconciles it.
A server that is down, or goes away, makes reads misses (reported once per outage) and
writes raise :class:`~torchcache.errors.StoreUnavailableError`; then the store leaves
the server alone for a while (see :mod:`~torchcache.stores.redis.link`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

from ..._fork import renew_lock_after_fork
from ..._log import logger
from ...errors import ConfigError, KeyingError, StoreError
from ...faults import Fault, Report
from ...policy import format_size, parse_size, plural
from ..batched import BatchedStore, VerifyReport
from ..packed.format import check_record, encode_key, encode_keys, is_key
from .keys import Keyspace, charge
from .link import Client, RedisLink, node_clients
from .namespace import Item, Namespace
from .url import check_namespace, parse_url
from .verify import list_namespaces, verify

__all__ = ["MAX_ENTRY_BYTES", "RedisStore"]

#: The largest payload stored (a Redis string holds at most 512 MiB).
MAX_ENTRY_BYTES = (512 << 20) - 1024
#: Keys and bytes per request; larger batches take several round trips.
_CHUNK_KEYS = 4096
_CHUNK_BYTES = 64 << 20
T = TypeVar("T")


def _default_report(kind: str, message: str) -> None:
    logger.warning("%s: %s", kind, message)


class RedisStore(BatchedStore):
    """Entries in a namespace of a Redis server or cluster, under a byte budget.

    Args:
        url: ``redis://[:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://`` for TLS,
            ``redis+cluster://`` or ``rediss+cluster://`` for a Redis Cluster (see
            :func:`~torchcache.stores.redis.url.parse_url`).
        namespace: Prefix of every key (1 to 64 of ``[0-9A-Za-z_.-]``; a module or data
            set fingerprint), so that several caches share a server.
        max_bytes: The namespace's budget, in bytes or as a string such as ``"2GB"``: the
            values torchcache writes plus their names and bookkeeping (see
            :func:`~torchcache.stores.redis.keys.charge`). The server's own memory per
            entry is higher; its ``maxmemory`` is a separate limit.
        report: Called with ``(kind, message)``: ``"corrupt"`` (an entry failed its
            checks: a miss, deleted; once per key) or ``"unavailable"`` (the server could not be
            read: misses; once per outage). Logged as warnings by default.
        timeout: Seconds to wait for a connection or a reply.
        clock: Monotonic seconds, for the wait after a failure (for tests).

    Raises:
        ConfigError: If an argument is invalid or the redis package is missing. An
            unreachable server is not an error here.

    Example:
        >>> store = RedisStore("redis://:pw@127.0.0.1:6379/0", "3f9a0c1d", "2GB")  # does not connect
        >>> store.url, store.max_bytes
        ('redis://:***@127.0.0.1:6379/0', 2000000000)
    """

    remote = True

    def __init__(
        self,
        url: str,
        namespace: str,
        max_bytes: int | float | str,
        *,
        report: Report | None = None,
        timeout: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.address = parse_url(url)
        self.namespace = check_namespace(namespace)
        self.max_bytes = parse_size(max_bytes, "max_bytes")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._report_fn = report if report is not None else _default_report
        self._reported: set[str] = set()
        self._lock = threading.RLock()
        renew_lock_after_fork(self, "_lock")
        self._link = RedisLink(self.address, float(timeout), clock or time.monotonic, self._report_fn)
        self._space = Keyspace(self.namespace)
        self._ns = Namespace(self._link, self._space, self.max_bytes)
        self._last_usage = (0, 0)  # what len() and nbytes say while the server is away

    @property
    def round_trips(self) -> int:
        """Requests sent to the server so far (one per node on a cluster), failed ones included."""
        return self._link.round_trips

    @round_trips.setter
    def round_trips(self, value: int) -> None:
        self._link.round_trips = value

    @property
    def url(self) -> str:
        """The server's URL, with the password shown as ``***``."""
        return self.address.safe_url

    def __repr__(self) -> str:
        try:
            count, payload = self._link.call(self._ns.usage, "read the totals")
            used = f"{format_size(payload)} in {count} entries"
        except Exception:  # noqa: BLE001 - a repr must not raise, whatever the server holds
            used = "unavailable"
        return (
            f"RedisStore({self.url!r}, namespace={self.namespace!r}, "
            f"max_bytes={format_size(self.max_bytes)}, used={used})"
        )

    @classmethod
    def namespaces(cls, url: str, timeout: float = 5.0) -> list[str]:
        """The namespaces that hold entries on a server, sorted (for ``torchcache ls redis://...``).

        Raises:
            ConfigError: If the URL is invalid.
            StoreError: If the server cannot be read.
        """
        return list_namespaces(parse_url(url), timeout)

    # -- reads --------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The stored bytes of each key, ``None`` for a miss: one round trip (per node) per 4,096 keys.

        A server that cannot be read gives misses (reported once per outage).

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """
        keys = list(keys)
        kbs = encode_keys(keys)
        out: list[bytes | memoryview | None] = [None] * len(keys)
        bad: list[str] = []
        for start in range(0, len(keys), _CHUNK_KEYS):
            names = [self._space.name(key) for key in keys[start : start + _CHUNK_KEYS]]
            try:
                values = self._link.call(partial(self._ns.fetch, names=names), "read entries")
            except StoreError as exc:
                self._link.read_failed(exc)
                break
            for i, value in enumerate(values, start):
                if value is None:
                    continue
                checked = check_record(value, kbs[i], None) if isinstance(value, bytes) else None
                if checked is None:
                    bad.append(keys[i])
                else:
                    out[i] = checked[1]
        if bad:
            self._discard(bad)
        return out

    def _discard(self, keys: list[str]) -> None:
        """Report damaged entries (once per key) and delete them."""
        keys = list(dict.fromkeys(keys))
        with self._lock:
            new = [key for key in keys if key not in self._reported]
            self._reported.update(new)
        for key in new:
            self._report_fn(Fault.CORRUPT, f"entry {key} of namespace {self.namespace} at {self.url} failed its checks")
        try:
            self._link.call(partial(self._ns.remove, keys=keys), "delete damaged entries")
        except StoreError as exc:
            self._link.read_failed(exc)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            encode_key(key)
        except KeyingError:
            return False
        return self._ask(partial(self._ns.exists, name=self._space.name(key)), "look up an entry", False)

    def keys(self) -> Iterator[str]:
        """Iterate over the keys whose entries are on the server (``SCAN``, per node on a cluster)."""
        try:
            nodes = self._link.call(partial(node_clients, cluster=self._link.cluster), "list the nodes")
        except StoreError as exc:
            self._link.read_failed(exc)
            return
        for node in nodes:
            cursor = 0
            while True:
                scan = partial(self._ns.scan_on, node=node, cursor=cursor)
                try:
                    cursor, names = self._link.call(scan, "list entries")
                except StoreError as exc:
                    self._link.read_failed(exc)
                    return
                for name in names:
                    key = self._space.key_of(name)
                    if key is not None and is_key(key):
                        yield key
                if cursor == 0:
                    break

    def __len__(self) -> int:
        """Entries in the bookkeeping: written by torchcache and not removed (the server may have evicted some).

        While the server cannot be read, the count last read (0 if none was).
        """
        return self._usage()[0]

    @property
    def nbytes(self) -> int:
        """Payload bytes of the entries in the bookkeeping (see :meth:`__len__`)."""
        return self._usage()[1]

    def _usage(self) -> tuple[int, int]:
        """Entries and payload bytes; the last ones read while the server cannot be read."""
        usage = self._ask(self._ns.usage, "read the totals", None)
        if usage is None:
            return self._last_usage
        self._last_usage = usage
        return usage

    @property
    def disk_bytes(self) -> int:
        """Always 0: the server's files are its own."""
        return 0

    def _ask(self, fn: Callable[[Client], T], what: str, default: T) -> T:
        """What ``fn`` returns, or ``default`` if the server cannot be read."""
        try:
            return self._link.call(fn, what)
        except StoreError as exc:
            self._link.read_failed(exc)
            return default

    # -- writes -------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Store entries, evicting the most recently written ones while over the budget.

        One atomic round trip per 4,096 items (64 MiB) on a single server; on a cluster,
        one per node, and one more per node holding entries to evict. When a larger batch
        fails part way, the requests before the failure stay stored.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreUnavailableError: If the server cannot be reached (now or recently).
            StoreError: If the server refused the write (out of memory, read-only).
        """
        kbs = encode_keys([key for key, _ in items])
        plan: dict[str, tuple[bytes, bytes | memoryview]] = {}
        prefix_len = len(self._space.prefix)
        for kb, (key, data) in zip(kbs, items):
            plan.pop(key, None)
            if len(data) <= MAX_ENTRY_BYTES and charge(prefix_len, key, len(data)) <= self.max_bytes:
                plan[key] = (kb, data)
        evicted: set[str] = set()
        batch: list[Item] = []
        size = 0
        for i, (key, (kb, data)) in enumerate(plan.items(), 1):
            batch.append((key, kb, data))
            size += len(data)
            if len(batch) >= _CHUNK_KEYS or size >= _CHUNK_BYTES or i == len(plan):
                evicted |= self._link.call(partial(self._ns.write, batch=batch), f"write {plural(len(batch), 'entry')}")
                batch, size = [], 0
        self.evicted_by_last_put = len(evicted.difference(plan))
        return len(plan) - len(evicted.intersection(plan))

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove entries; return how many were on the server.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreUnavailableError: If the server cannot be reached (now or recently).
            StoreError: If the server refused the request.
        """
        keys = list(dict.fromkeys(keys))
        encode_keys(keys)
        removed = 0
        for start in range(0, len(keys), _CHUNK_KEYS):
            chunk = keys[start : start + _CHUNK_KEYS]
            removed += self._link.call(partial(self._ns.remove, keys=chunk), "delete entries")
        return removed

    def clear(self) -> None:
        """Remove every entry of the namespace and its bookkeeping.

        Raises:
            StoreUnavailableError: If the server cannot be reached (now or recently).
            StoreError: If the server refused the request.
        """
        self._link.call(self._ns.clear, f"clear namespace {self.namespace}")
        self._last_usage = (0, 0)
        with self._lock:
            self._reported.clear()

    def flush(self) -> None:
        """Nothing to do: writes are on the server when :meth:`put_many` returns."""

    def close(self) -> None:
        """Close the connections; the store reconnects if used again."""
        self._link.close()

    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every entry of the namespace and the bookkeeping; with ``fix``, repair them.

        Damaged values are deleted; bookkeeping of entries no longer on the server
        (evicted by it) is dropped; intact values missing from the bookkeeping are
        recorded as new writes (evicting to keep the budget); totals are recomputed.
        Run it while no job writes to the namespace.

        Raises:
            StoreUnavailableError: If the server cannot be reached.
            StoreError: If the server refused a request.
        """
        return self._link.call(partial(verify, namespace=self._ns, fix=fix), f"verify namespace {self.namespace}")
