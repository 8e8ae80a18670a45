"""The connection of a Redis store: made lazily, remade after a fork, and left alone while down.

The client is made on first use, never in a constructor, so a store whose server is
down at start is still made (its reads miss and its writes raise). A forked child (a
DataLoader worker) makes its own client rather than write to its parent's sockets.

Every call goes through :meth:`RedisLink.call`, which turns the client library's
exceptions into :class:`~torchcache.errors.StoreError` (the server refused: out of
memory, read-only, wrong password) or :class:`~torchcache.errors.StoreUnavailableError`
(connection refused, reset or timed out; cluster down). After an unavailable server
the link waits before it tries again: 0.5 s, doubled after each failure up to 30 s,
and back to nothing after a success; meanwhile calls fail at once, without touching the
network. The client itself never retries or sleeps, so no call blocks much longer than
the timeout. Messages show the URL and server replies with the password as ``***``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import quote

from ..._fork import renew_lock_after_fork
from ...errors import ConfigError, StoreError, StoreUnavailableError
from ...faults import Fault, Report
from .url import RedisAddress

#: The command redis-py quotes in a pipeline's error ("Command # 3 (SET key <payload>) of pipeline caused error: ").
_PIPELINE_COMMAND = re.compile(r"Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)

__all__ = [
    "BACKOFF_MAX",
    "BACKOFF_START",
    "Client",
    "RedisLink",
    "connect",
    "fetch_on_node",
    "import_redis",
    "node_clients",
    "run_pipeline",
]

#: Seconds to wait after the first failure; doubled after each further one.
BACKOFF_START = 0.5
#: The longest wait between tries.
BACKOFF_MAX = 30.0

#: A ``redis.Redis`` or ``redis.cluster.RedisCluster``. Typed loosely: redis-py types every
#: reply as ``Awaitable | Any``, and the store checks the replies it gets itself.
Client = Any
T = TypeVar("T")


def import_redis() -> ModuleType:
    """The ``redis`` package, imported on first use.

    Raises:
        ConfigError: If it is not installed, or older than 5.
    """
    try:
        module = importlib.import_module("redis")
        importlib.import_module("redis.cluster")
    except ImportError:
        raise ConfigError(
            "a Redis store (redis:// URL) requires the redis package: pip install 'torchcache[redis]'"
        ) from None
    version = str(getattr(module, "__version__", "0"))
    major = version.split(".")[0]
    if major.isdigit() and int(major) < 5:
        raise ConfigError(f"a Redis store requires redis>=5, found redis {version}: pip install 'torchcache[redis]'")
    return module


def connect(address: RedisAddress, timeout: float) -> Client:
    """A client for ``address`` that never retries by itself (no connection is made yet for a single server).

    Raises:
        ConfigError: If the redis package is missing.
        redis.exceptions.RedisError: If a cluster's nodes cannot be discovered.
    """
    module = import_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options: dict[str, Any] = {
        "username": address.username,
        "password": address.password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 0,
    }
    if address.tls:
        options["ssl"] = True
        options.update(address.tls_options)
    if address.cluster:
        cluster: Client = module.cluster.RedisCluster(
            host=address.host, port=address.port, retry=Retry(NoBackoff(), 0), **options
        )
        return cluster
    single: Client = module.Redis(
        host=address.host, port=address.port, db=address.db, retry=Retry(NoBackoff(), 0), **options
    )
    return single


class RedisLink:
    """One process's connection to a Redis server or cluster.

    Args:
        address: Where the server is.
        timeout: Seconds to wait for a connection or a reply.
        clock: Monotonic seconds, for the backoff (injectable for tests).
        report: Called with ``("unavailable", message)`` for the first failed read of an outage.

    Raises:
        ConfigError: If the redis package is missing.
    """

    def __init__(self, address: RedisAddress, timeout: float, clock: Callable[[], float], report: Report) -> None:
        module = import_redis()
        exceptions = module.exceptions
        self.address = address
        self.timeout = timeout
        #: Requests sent to a server (one per node on a cluster), including failed ones.
        self.round_trips = 0
        self._clock = clock
        self._report = report
        #: What the client library raises (OSError too: a socket may fail outside its wrappers).
        self.errors: tuple[type[BaseException], ...] = (
            exceptions.RedisError,
            exceptions.RedisClusterException,
            OSError,
            *_GARBLED,
        )
        self._full: tuple[type[BaseException], ...] = tuple(
            error for error in (getattr(exceptions, "OutOfMemoryError", None),) if error is not None
        )
        self._refused: tuple[type[BaseException], ...] = (
            exceptions.AuthenticationError,
            getattr(exceptions, "AuthorizationError", exceptions.AuthenticationError),
        )
        self._away: tuple[type[BaseException], ...] = (
            exceptions.ConnectionError,
            exceptions.TimeoutError,
            exceptions.ClusterError,
            exceptions.ClusterDownError,
            exceptions.TryAgainError,
            exceptions.RedisClusterException,
            OSError,
            *_GARBLED,  # another server on the port: waited for, as one that is away
        )
        password = address.password or ""
        self._secrets = sorted({s for s in (password, quote(password, safe="")) if s}, key=len, reverse=True)
        self._client: Client | None = None
        #: Clients dropped at a failure: closed once no request of this process is using them.
        self._dropped: list[Client] = []
        self._busy: dict[int, int] = {}  # requests in flight, by the id of their client
        self._pid = os.getpid()
        self._delay = 0.0
        self._retry_at = float("-inf")
        self._troubled = False
        self._lock = threading.RLock()
        renew_lock_after_fork(self, "_lock")

    @property
    def cluster(self) -> bool:
        """Whether the server is a Redis Cluster."""
        return self.address.cluster

    @property
    def delay(self) -> float:
        """Seconds the link waits after the latest failure (0 while the server answers)."""
        return self._delay

    def redact(self, text: str) -> str:
        """``text`` with the password replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def count(self, trips: int) -> None:
        """Count requests about to be sent."""
        with self._lock:
            self.round_trips += trips

    def client(self) -> Client:
        """The client of this process, made if needed (a forked child makes its own)."""
        with self._lock:
            if self._pid != os.getpid():
                self._client, self._dropped, self._busy = None, [], {}  # the parent's: closing would shut its sockets
                self._pid = os.getpid()
            if self._client is not None:
                return self._client
            self._client = connect(self.address, self.timeout)
            return self._client

    def _sweep(self) -> None:
        """Close the dropped clients that no request is using."""
        with self._lock:
            done = [old for old in self._dropped if id(old) not in self._busy]
            self._dropped = [old for old in self._dropped if id(old) in self._busy]
        self._close(done)

    def close(self) -> None:
        """Close the connections (a later call reconnects)."""
        with self._lock:
            clients = self._dropped + ([self._client] if self._client is not None else [])
            self._client, self._dropped = None, []
            forked = self._pid != os.getpid()
        if not forked:
            self._close(clients)

    def _close(self, clients: list[Client]) -> None:
        for client in clients:
            with contextlib.suppress(*self.errors):  # closing a connection to a vanished server
                client.close()

    def call(self, op: Callable[[Client], T], what: str) -> T:
        """Run ``op`` with the client, unless the server is being waited for.

        Args:
            op: Sends requests (counting them with :meth:`count`) and returns the result.
            what: What ``op`` does, for messages ("write 1024 entries").

        Raises:
            StoreUnavailableError: If the server cannot be reached (now or recently).
            StoreError: If the server refused the request.
        """
        with self._lock:
            wait = self._retry_at - self._clock()
            if wait > 0:
                raise StoreUnavailableError(
                    f"cannot {what}: the Redis server {self.address.safe_url} was unreachable; next try in {wait:.1f} s"
                )
        try:
            client = self.client()
        except self.errors as exc:  # a cluster's client connects when made
            raise self.failure(exc, what) from None
        with self._lock:
            self._busy[id(client)] = self._busy.get(id(client), 0) + 1
        try:
            result = op(client)
        except StoreError:
            raise
        except self.errors as exc:
            raise self.failure(exc, what) from None
        finally:
            with self._lock:
                left = self._busy.pop(id(client)) - 1
                if left:
                    self._busy[id(client)] = left
            if self._dropped:
                self._sweep()
        with self._lock:
            self._delay, self._retry_at, self._troubled = 0.0, float("-inf"), False
        return result

    def is_away(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the server cannot be reached (rather than that it refused)."""
        return isinstance(exc, self._away) and not isinstance(exc, self._refused)

    def failure(self, exc: BaseException, what: str) -> StoreError:
        """The store error for a client exception; an unreachable server starts or extends the wait."""
        # A pipeline's error quotes the failed command, payload bytes and all: only the reply is kept.
        reply = _PIPELINE_COMMAND.sub("", str(exc))
        detail = self.redact(f"{type(exc).__name__}: {reply}")[:500]
        if isinstance(exc, _GARBLED):
            detail = f"it answers, but not as Redis does: {detail}"
        where = self.address.safe_url
        if not self.is_away(exc):
            hint = ""
            if isinstance(exc, self._full) or "OOM" in str(exc):
                hint = " (OOM: the server is full; raise its maxmemory, lower max_bytes, or use an evicting policy)"
            elif "WRONGTYPE" in str(exc):
                hint = " (a bookkeeping key holds another kind of value; `torchcache verify --fix` repairs it)"
            return StoreError(f"cannot {what}: the Redis server {where} refused: {detail}{hint}")
        with self._lock:
            now = self._clock()
            if now >= self._retry_at:  # not for each thread whose request failed in the same outage
                self._delay = BACKOFF_START if self._delay == 0 else min(self._delay * 2, BACKOFF_MAX)
                self._retry_at = now + self._delay
            if self._client is not None:  # the next call connects again; closed later: a thread may be sending on it
                self._dropped.append(self._client)
                self._client = None
            delay = self._delay
        return StoreUnavailableError(
            f"cannot {what}: the Redis server {where} is unreachable ({detail}); next try in {delay:.1f} s"
        )

    def read_failed(self, exc: StoreError) -> None:
        """Report a failed read, once until the server answers again."""
        with self._lock:
            if self._troubled:
                return
            self._troubled = True
        self._report(Fault.UNAVAILABLE, str(exc))


#: What redis-py raises on replies that are not Redis's (a server of another kind on the port).
_GARBLED = (AttributeError, TypeError, ValueError, IndexError, KeyError)


def run_pipeline(pipe: Client, cluster: bool, raise_on_error: bool = True) -> list[Any]:
    """Send a pipeline's commands and return their replies (an exception as a reply, without ``raise_on_error``).

    On a cluster each node gets its commands at once, and a node that does not answer
    fails them together, after one timeout. redis-py alone would then send each of them
    again on its own, each waiting for its own timeout (a batch of 48 keys met a paused
    node for 85 s). Only commands a node redirected (``MOVED``, ``ASK``, ``TRYAGAIN``:
    the cluster is moving slots) are sent again, the way redis-py follows redirections.

    Raises:
        redis.exceptions.RedisError: The first failed command's error, with ``raise_on_error``.
    """
    if not cluster:
        return list(pipe.execute(raise_on_error=raise_on_error))
    strategy = getattr(pipe, "_execution_strategy", None)  # redis-py 6+; 5 queues on the pipeline
    queued = list(strategy.command_queue if strategy is not None else pipe.command_stack)
    try:
        replies = list(pipe.send_cluster_commands(queued, raise_on_error=False, allow_redirections=False))
        errors = import_redis().exceptions
        redirected = (errors.MovedError, errors.AskError, errors.TryAgainError)
        moved = [i for i, reply in enumerate(replies) if isinstance(reply, redirected)]
        if moved:
            try:
                again = list(pipe.send_cluster_commands([queued[i] for i in moved], raise_on_error=False))
            except (errors.RedisError, errors.RedisClusterException, OSError) as exc:  # the others stand: callers
                again = [exc] * len(moved)  # undo what they must from the replies
            for i, reply in zip(moved, again):
                replies[i] = reply
    finally:
        pipe.reset()
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
    return replies


def node_clients(client: Client, cluster: bool) -> list[Client]:
    """The clients of every primary node of a cluster, or ``[client]`` for a single server."""
    if not cluster:
        return [client]
    return [node.redis_connection for node in client.get_primaries() if node.redis_connection is not None]


def fetch_on_node(node: Client, names: list[bytes] | list[str], cluster: bool) -> list[object]:
    """The values of entries that all live on ``node``: one ``MGET``, or one pipeline of ``GET`` on a cluster node.

    On a cluster a reply may be an exception (a key of another type, a slot that moved).
    """
    if not cluster:
        return list(node.mget(names))
    pipe = node.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return list(pipe.execute(raise_on_error=False))
