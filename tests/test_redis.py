"""The Redis store against real servers: processes, a cluster, passwords, outages, full and evicting servers.

The contract every batched store meets runs in ``test_store_contract.py``; here is what
only a server has. Servers are real ``redis-server`` processes on loopback (see
``redis_servers.py``); the backoff runs on an injected clock, so nothing sleeps.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_python
from tests.redis_servers import RedisClusterServers, RedisServer, own_server, require_redis, shared
from tests.store_helpers import Reports, key, value
from torchcache.cli.main import main
from torchcache.errors import ConfigError, KeyingError, StoreError, StoreUnavailableError
from torchcache.stores.packed.format import encode_key, encode_record
from torchcache.stores.redis.link import BACKOFF_MAX, BACKOFF_START
from torchcache.stores.redis.store import RedisStore

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-Pa55word"


def as_bytes(values: list[bytes | memoryview | None]) -> list[bytes | None]:
    return [None if v is None else bytes(v) for v in values]


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """The shared standalone server, flushed after the test."""
    target = shared("redis")
    yield target
    target.flush()


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    """The shared 3-node cluster, flushed after the test."""
    target = shared("redis-cluster")
    yield target
    target.flush()


@pytest.fixture(params=["redis", "redis-cluster"])
def target(request: pytest.FixtureRequest) -> Iterator[RedisServer | RedisClusterServers]:
    """The shared server, then the shared cluster, flushed after the test."""
    servers = shared(str(request.param))
    yield servers
    servers.flush()


@pytest.fixture
def reports() -> Reports:
    return Reports()


# -- configuration --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:6379", "must start with"),
        ("redis://", "names no host"),
        ("redis://127.0.0.1:notaport", "invalid port"),
        ("redis://127.0.0.1:70000", "invalid port"),
        ("redis://127.0.0.1/abc", "database number"),
        ("redis+cluster://127.0.0.1:7000/3", "other than 0"),
        (f"redis://{PASSWORD}@127.0.0.1", "after a colon"),
        (f"redis://:{PASSWORD}@127.0.0.1:99999/0", "invalid port"),
        (f"redis://:{PASSWORD}@127.0.0.1?password={PASSWORD}", "unknown query parameter"),
        ("redis://127.0.0.1?ssl_cert_reqs=none", "not a rediss:// URL"),
        ("rediss://127.0.0.1?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("redis://127.0.0.1#frag", "fragment"),
        ("redis://127.0.0.1 :6379", "spaces"),
    ],
)
def test_bad_urls_give_config_errors_naming_the_argument(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisStore(url, "ns", "1MB")
    message = str(info.value)
    assert message.startswith("url ") and problem in message
    assert PASSWORD not in message


def test_good_urls_parse_without_connecting() -> None:
    require_redis()  # the redis package, imported when a store is made
    store = RedisStore(f"rediss+cluster://me:{PASSWORD}@cache.example:7000?ssl_cert_reqs=none", "ns", "1MB")
    assert store.address.tls and store.address.cluster and store.address.username == "me"
    assert store.address.password == PASSWORD and store.address.port == 7000
    assert store.url == "rediss+cluster://me:***@cache.example:7000"
    plain = RedisStore("redis://localhost/3", "ns", 1e6)
    assert (plain.address.port, plain.address.db, plain.address.tls) == (6379, 3, False)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"namespace": "a:b"}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"namespace": "x" * 65}, "namespace"),
        ({"namespace": "{tag}"}, "namespace"),
        ({"max_bytes": "lots"}, "max_bytes"),
        ({"max_bytes": -1}, "max_bytes"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], name: str) -> None:
    arguments: dict[str, Any] = {"url": "redis://127.0.0.1:6379/0", "namespace": "ns", "max_bytes": "1MB"}
    arguments.update(kwargs)
    with pytest.raises(ConfigError, match=f"^{name} "):
        RedisStore(**arguments)


def test_missing_redis_package_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'torchcache\[redis\]'"):
        RedisStore("redis://127.0.0.1:6379/0", "ns", "1MB")


# -- sharing ----------------------------------------------------------------------------
_WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from torchcache.stores.redis.store import RedisStore
store = RedisStore(sys.argv[2], "shared", "10MB")
n = store.put_many([(f"{i:032x}", bytes([i]) * 3072) for i in range(200)])
print(n)
"""


@pytest.mark.slow
def test_entries_written_by_another_process_are_hits(server: RedisServer, reports: Reports) -> None:
    done = run_python(_WRITER, str(ROOT), server.url, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "200"
    store = RedisStore(server.url, "shared", "10MB", report=reports)
    got = store.get_many([f"{i:032x}" for i in range(205)])
    assert as_bytes(got) == [bytes([i]) * 3072 for i in range(200)] + [None] * 5
    assert len(store) == 200 and store.nbytes == 200 * 3072 and not reports.seen
    assert RedisStore.namespaces(server.url) == ["shared"]
    other = RedisStore(server.url, "other", "10MB")
    assert other.get(f"{0:032x}") is None  # namespaces do not see each other
    other.put(key(1), b"x")
    assert RedisStore.namespaces(server.url) == ["other", "shared"]
    store.clear()
    assert RedisStore.namespaces(server.url) == ["other"] and other.get(key(1)) == b"x"


def test_budget_holds_across_two_store_objects(server: RedisServer) -> None:
    budget = 60_000
    first = RedisStore(server.url, "budget", budget)
    second = RedisStore(server.url, "budget", budget)
    assert first.put_many([(key(i), value(i)) for i in range(30)]) == 30
    second.put_many([(key(i), value(i)) for i in range(100, 160)])
    assert first.nbytes == second.nbytes <= budget and len(first) == len(second) < 60
    # MRU by write time: the first object's entries, written earlier, all stay.
    assert as_bytes(second.get_many([key(i) for i in range(30)])) == [value(i) for i in range(30)]
    assert first.verify().ok


@pytest.mark.slow
def test_forked_child_makes_its_own_connection(server: RedisServer) -> None:
    store = RedisStore(server.url, "fork", "10MB")
    store.put_many([(key(i), value(i)) for i in range(10)])
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()

    def child() -> None:
        got = as_bytes(store.get_many([key(i) for i in range(10)]))
        stored = store.put_many([(key(i), value(i)) for i in range(10, 20)])
        queue.put((got == [value(i) for i in range(10)], stored, store._link._pid == os.getpid()))

    process = context.Process(target=child)
    process.start()
    process.join(timeout=60)
    assert process.exitcode == 0
    assert queue.get() == (True, 10, True)
    # The parent's connection was not touched by the child.
    assert as_bytes(store.get_many([key(i) for i in range(20)])) == [value(i) for i in range(20)]


# -- round trips ------------------------------------------------------------------------
@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the packed writes that redis-py puts on a socket (one per request or pipeline)."""
    import redis.connection

    counted: list[int] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        counted.append(self.port)
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    return counted


def test_a_batch_is_one_round_trip_on_a_server(server: RedisServer, sends: list[int]) -> None:
    store = RedisStore(server.url, "trips", "100MB")
    items = [(key(i), value(i, 3072)) for i in range(1024)]
    store.get(key(0))  # connect first
    before, sends[:] = store.round_trips, []
    assert store.put_many(items) == 1024
    assert store.round_trips - before == 1 and len(sends) == 1
    before, sends[:] = store.round_trips, []
    assert as_bytes(store.get_many([k for k, _ in items])) == [v for _, v in items]
    assert store.round_trips - before == 1 and len(sends) == 1


def test_cluster_spreads_keys_and_a_batch_costs_one_round_trip_per_node(
    cluster: RedisClusterServers, sends: list[int]
) -> None:
    store = RedisStore(cluster.url, "spread", "100MB")
    items = [(key(i), value(i, 3072)) for i in range(1024)]
    assert store.put_many(items) == 1024
    per_node = []
    for node in cluster.nodes:
        with node.client() as client:
            per_node.append(sum(1 for _ in client.scan_iter(match="tc:spread:*", count=1000)))
    assert sum(per_node) == 1024 and min(per_node) > 200  # no hash tag: every node holds about a third
    before, sends[:] = store.round_trips, []
    assert as_bytes(store.get_many([k for k, _ in items])) == [v for _, v in items]
    assert store.round_trips - before == 3
    assert sorted(sends) == sorted(node.port for node in cluster.nodes)
    before, sends[:] = store.round_trips, []
    store.put_many(items[:10])
    assert store.round_trips - before == len(set(sends)) == len(sends) <= 3
    assert len(store) == 1024 and store.verify().ok
    assert RedisStore.namespaces(cluster.url) == ["spread"]


def test_cluster_evictions_reach_every_node(cluster: RedisClusterServers) -> None:
    store = RedisStore(cluster.url, "evict", 40_000)
    for start in range(0, 200, 20):
        store.put_many([(key(i), value(i)) for i in range(start, start + 20)])
        assert store.nbytes <= 40_000
    assert 20 <= len(store) == len(list(store.keys())) <= 40
    assert store.verify().ok  # the evicted entries were unlinked from their nodes


# -- passwords ----------------------------------------------------------------------------
@pytest.mark.slow
def test_password_protected_server_and_the_password_never_shown(reports: Reports) -> None:
    with own_server(password=PASSWORD) as protected:
        store = RedisStore(protected.url, "locked", "1MB", report=reports)
        assert store.put_many([(key(i), value(i)) for i in range(5)]) == 5
        assert as_bytes(store.get_many([key(0), key(9)])) == [value(0), None]
        assert PASSWORD not in repr(store) and "***" in repr(store) and PASSWORD not in store.url
        wrong = RedisStore(protected.url.replace(PASSWORD, "not-" + PASSWORD), "locked", "1MB", report=reports)
        assert wrong.get_many([key(0)]) == [None]
        with pytest.raises(StoreError) as info:
            wrong.put_many([(key(1), b"x")])
        assert not isinstance(info.value, StoreUnavailableError)  # retrying will not help
        missing = RedisStore(protected.url.replace(f":{PASSWORD}@", ""), "locked", "1MB", report=reports)
        assert missing.get_many([key(0)]) == [None]
        with pytest.raises(StoreError) as info2:
            missing.put_many([(key(1), b"x")])
        protected.kill()
        with pytest.raises(StoreUnavailableError) as info3:
            store.put_many([(key(1), b"x")])
        assert store.get_many([key(0)]) == [None]
        shown = [str(info.value), str(info2.value), str(info3.value), repr(wrong), repr(store)]
        shown += [message for _, message in reports.seen]
        assert reports.kinds() == ["unavailable", "unavailable", "unavailable"]
        assert all(PASSWORD not in text for text in shown), shown


# -- outages ------------------------------------------------------------------------------
def test_unreachable_server_at_start(reports: Reports) -> None:
    require_redis()
    from tests.redis_servers import free_port

    clock = Clock()
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", "away", "1MB", report=reports, clock=clock)
    assert store.get_many([key(0), key(1)]) == [None, None]
    assert reports.kinds() == ["unavailable"]
    trips = store.round_trips
    with pytest.raises(StoreUnavailableError, match="next try in"):
        store.put_many([(key(0), b"x")])
    assert store.get_many([key(0)]) == [None] and len(store) == 0 and key(0) not in store
    assert list(store.keys()) == [] and store.nbytes == 0 and "unavailable" in repr(store)
    assert store.round_trips == trips  # waiting: nothing was sent
    assert reports.kinds() == ["unavailable"]  # once per outage


@pytest.mark.slow
def test_server_killed_mid_run_then_restarted(reports: Reports) -> None:
    clock = Clock()
    timeout = 2.0
    with own_server() as redis_server:
        store = RedisStore(redis_server.url, "crash", "10MB", report=reports, clock=clock, timeout=timeout)
        assert store.put_many([(key(i), value(i)) for i in range(50)]) == 50
        redis_server.kill()
        calls: list[Callable[[], object]] = [
            lambda: store.get_many([key(i) for i in range(50)]),
            lambda: store.put_many([(key(99), b"x")]),
            lambda: store.delete_many([key(1)]),
            store.clear,
            lambda: store.get_many([key(1)]),
        ]
        outcomes = []
        for call in calls:
            start = time.monotonic()
            try:
                outcomes.append(call())
            except StoreUnavailableError:
                outcomes.append("unavailable")
            assert time.monotonic() - start < timeout  # nothing blocks longer than the timeout
        assert outcomes == [[None] * 50, "unavailable", "unavailable", "unavailable", [None]]
        assert reports.kinds() == ["unavailable"]
        assert store._link.delay == BACKOFF_START
        redis_server.start(port=redis_server.port)
        trips = store.round_trips
        assert store.get(key(0)) is None  # still waiting: the server is up but not asked
        with pytest.raises(StoreUnavailableError):
            store.put(key(0), b"back")
        assert store.round_trips == trips
        clock.now += BACKOFF_START
        assert store.put(key(0), b"back") and store.get(key(0)) == b"back"
        assert store.round_trips > trips and store._link.delay == 0
        assert reports.kinds() == ["unavailable"]
        # A new outage is reported again and its wait starts afresh.
        redis_server.kill()
        assert store.get(key(0)) is None and reports.kinds() == ["unavailable", "unavailable"]
        assert store._link.delay == BACKOFF_START


def _open_sockets(client: Any) -> int:
    """The connections of a Redis or Redis Cluster client whose socket is open."""
    nodes = [node.redis_connection for node in client.get_nodes()] if hasattr(client, "get_nodes") else [client]
    pools = [node.connection_pool for node in nodes if node is not None]
    return sum(c._sock is not None for p in pools for c in [*p._available_connections, *p._in_use_connections])


@pytest.mark.slow
def test_cluster_node_killed(reports: Reports) -> None:
    require_redis()
    clock = Clock()
    servers = RedisClusterServers().start()
    try:
        store = RedisStore(servers.url, "node", "10MB", report=reports, clock=clock, timeout=2.0)
        assert store.put_many([(key(i), value(i)) for i in range(100)]) == 100
        first = store._link._client  # connected to every node
        assert first is not None and _open_sockets(first) > 0
        servers.nodes[1].kill()
        start = time.monotonic()
        assert store.get_many([key(i) for i in range(100)]) == [None] * 100
        with pytest.raises(StoreUnavailableError):
            store.put_many([(key(0), b"x")])
        clock.now += BACKOFF_START
        with pytest.raises(StoreUnavailableError, match="unreachable"):
            store.put_many([(key(i), b"x") for i in range(100)])  # keys on every node
        assert store._link.delay == 2 * BACKOFF_START
        assert time.monotonic() - start < 2.0
        assert reports.kinds() == ["unavailable"]
        # The client dropped at the failure held connections to the nodes that answer: closed once
        # no request uses it.
        assert store._link._dropped == [] and _open_sockets(first) == 0
        store.close()
    finally:
        servers.remove()


@pytest.fixture
def timeouts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The replies that timed out, by every Redis connection of the process (the address of each)."""
    from redis.connection import AbstractConnection
    from redis.exceptions import TimeoutError as RedisTimeout

    seen: list[str] = []
    read = AbstractConnection.read_response

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return read(self, *args, **kwargs)
        except RedisTimeout:
            seen.append(f"{self.host}:{self.port}")
            raise

    monkeypatch.setattr(AbstractConnection, "read_response", counted)
    return seen


@pytest.fixture
def own_cluster() -> Iterator[RedisClusterServers]:
    """A 3-node cluster of the test's own (paused, resharded), removed afterwards."""
    require_redis()
    servers = RedisClusterServers().start()
    try:
        yield servers
    finally:
        servers.remove()


@pytest.mark.slow
def test_cluster_node_paused_costs_a_batch_one_timeout(
    own_cluster: RedisClusterServers, reports: Reports, timeouts: list[str]
) -> None:
    """A node that hangs fails all a batch's commands on it together (redis-py alone re-sent each, each timing out)."""
    clock = Clock()
    store = RedisStore(own_cluster.url, "paused", "10MB", report=reports, clock=clock, timeout=0.5)
    keys = [key(i) for i in range(96)]  # about 32 on each node
    assert store.put_many([(k, value(i)) for i, k in enumerate(keys)]) == 96
    own_cluster.nodes[1].pause()
    try:
        assert store.get_many(keys) == [None] * 96
        assert timeouts == [f"127.0.0.1:{own_cluster.nodes[1].port}"]
        clock.now += BACKOFF_MAX
        with pytest.raises(StoreUnavailableError, match="Timeout"):
            store.put_many([(key(i), value(i)) for i in range(100, 196)])
        assert 1 <= len(timeouts) - 1 <= 2  # the write, and its undo if it reached the node again
    finally:
        own_cluster.nodes[1].resume()
    clock.now += BACKOFF_MAX
    assert as_bytes(store.get_many(keys)) == [value(i) for i in range(96)]
    assert reports.kinds() == ["unavailable"]


def _move_slot(servers: RedisClusterServers, name: str, finish: bool = True) -> tuple[Any, Any]:
    """Move the slot of ``name`` (and its keys) to another node, as a resharding does; ``finish=False`` stops midway.

    Returns the source and the target node's servers. Midway, the source answers ``ASK``
    for the keys moved and the target ``MOVED`` to plain reads.
    """
    with servers.client() as client:
        slot = client.keyslot(name)
        port = client.get_node_from_key(name).port
    source = next(n for n in servers.nodes if n.port == port)
    target = next(n for n in servers.nodes if n.port != port)
    with source.client() as src, target.client() as dst:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moving = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *moving)
    assert [m if isinstance(m, bytes) else m.encode() for m in moving] == [name.encode()]
    if finish:
        for node in servers.nodes:
            with node.client() as each:
                each.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    return source, target


@pytest.mark.slow
def test_cluster_slot_moved_is_followed(own_cluster: RedisClusterServers, reports: Reports) -> None:
    """A batch that meets a slot moved to another node after the client learnt the slots reads it there."""
    store = RedisStore(own_cluster.url, "moved", "10MB", report=reports)
    keys = [key(i) for i in range(60)]
    assert store.put_many([(k, value(i)) for i, k in enumerate(keys)]) == 60
    _move_slot(own_cluster, store._space.name(keys[0]))
    assert as_bytes(store.get_many(keys)) == [value(i) for i in range(60)]
    assert reports.kinds() == []
    assert store.verify().ok


@pytest.mark.slow
def test_cluster_verify_fix_while_a_slot_moves_deletes_nothing(
    own_cluster: RedisClusterServers, reports: Reports
) -> None:
    """Midway through a resharding an entry answers MOVED where it was listed: unsure, never damaged."""
    store = RedisStore(own_cluster.url, "moving", "10MB", report=reports)
    keys = [key(i) for i in range(60)]
    assert store.put_many([(k, value(i)) for i, k in enumerate(keys)]) == 60
    _move_slot(own_cluster, store._space.name(keys[0]), finish=False)
    assert store.verify().problems == []  # not taken for an entry gone from the server either
    report = store.verify(fix=True)
    assert report.bad == [] and not report.fixed and report.unsure and "moving" in report.unsure[0]
    assert as_bytes(store.get_many(keys)) == [value(i) for i in range(60)]
    assert len(store) == 60 and reports.kinds() == []


def test_cluster_verify_fix_keeps_an_entry_whose_slot_moved_between_the_scans_of_two_nodes(
    cluster: RedisClusterServers, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scanned on neither node (it moved from one not scanned yet to one scanned): looked up again, kept."""
    from torchcache.stores.redis.namespace import Namespace

    store = RedisStore(cluster.url, "between", "10MB", report=reports)
    assert store.put_many([(key(i), value(i)) for i in range(20)]) == 20
    moving = store._space.name(key(0)).encode()
    scan = Namespace.scan

    def missed(self: Namespace, node: Any, cursor: int) -> tuple[int, list[bytes]]:
        cursor, names = scan(self, node, cursor)
        return cursor, [name for name in names if name != moving]

    with monkeypatch.context() as racing:
        racing.setattr(Namespace, "scan", missed)
        report = store.verify(fix=True)
    assert report.problems == [] and not report.fixed and report.unsure
    assert as_bytes(store.get_many([key(i) for i in range(20)])) == [value(i) for i in range(20)]
    assert len(store) == 20 and store.verify().ok


def test_a_redirected_command_whose_new_node_is_away_gets_the_error_as_its_reply() -> None:
    """The replies of the first pass stand (a write undoes from them), whatever the second pass meets."""
    from types import SimpleNamespace

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import MovedError

    from torchcache.stores.redis.link import run_pipeline

    class Pipe:
        def __init__(self) -> None:
            self._execution_strategy = SimpleNamespace(command_queue=["get a", "get b", "get c"])
            self.sent: list[tuple[list[str], bool]] = []

        def send_cluster_commands(self, stack: list[str], raise_on_error: bool, allow_redirections: bool = True) -> Any:
            self.sent.append((stack, allow_redirections))
            if len(self.sent) == 1:
                return [b"a", MovedError("866 127.0.0.1:7001"), b"c"]
            raise RedisConnectionError("Connection refused")

        def reset(self) -> None:
            pass

    pipe = Pipe()
    replies = run_pipeline(pipe, cluster=True, raise_on_error=False)
    assert replies[0] == b"a" and isinstance(replies[1], RedisConnectionError) and replies[2] == b"c"
    assert pipe.sent == [(["get a", "get b", "get c"], False), (["get b"], True)]  # only the redirected one again
    with pytest.raises(RedisConnectionError):
        run_pipeline(Pipe(), cluster=True)


def test_cluster_error_reply_is_not_taken_for_damage(
    cluster: RedisClusterServers, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a key of another type is damage: another error reply (a slot moving) fails the read, deletes nothing."""
    from redis.exceptions import ResponseError

    from torchcache.stores.redis import namespace

    store = RedisStore(cluster.url, "odd", "1MB", report=reports)
    assert store.put_many([(key(i), value(i)) for i in range(4)]) == 4
    sent = namespace.run_pipeline

    def moving(pipe: Any, cluster: bool, raise_on_error: bool = True) -> list[Any]:
        return [ResponseError("ASK 866 127.0.0.1:7001"), *sent(pipe, cluster, raise_on_error)[1:]]

    with monkeypatch.context() as patched:
        patched.setattr(namespace, "run_pipeline", moving)
        assert store.get_many([key(i) for i in range(4)]) == [None] * 4
    assert reports.kinds() == ["unavailable"] and "ASK 866" in reports.seen[0][1]
    assert as_bytes(store.get_many([key(i) for i in range(4)])) == [value(i) for i in range(4)]
    assert len(store) == 4


def test_backoff_doubles_up_to_its_cap(reports: Reports) -> None:
    require_redis()
    from tests.redis_servers import free_port

    clock = Clock()
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", "away", "1MB", report=reports, clock=clock)
    delays = []
    for _ in range(10):
        store.get(key(0))
        delays.append(store._link.delay)
        trips = store.round_trips
        clock.now += delays[-1] - 0.25
        store.get(key(0))
        assert store.round_trips == trips  # not yet
        clock.now += 0.25
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX]
    assert reports.kinds() == ["unavailable"]


@pytest.mark.slow
def test_frozen_server_times_out(reports: Reports) -> None:
    clock = Clock()
    with own_server() as redis_server:
        store = RedisStore(redis_server.url, "frozen", "1MB", report=reports, clock=clock, timeout=0.3)
        store.put(key(0), b"x")
        redis_server.pause()
        try:
            start = time.monotonic()
            assert store.get_many([key(0)]) == [None]
            clock.now += 1
            with pytest.raises(StoreUnavailableError, match="Timeout"):
                store.put(key(1), b"y")
            assert time.monotonic() - start < 2.0  # two calls, each bounded by the 0.3 s timeout
        finally:
            redis_server.resume()
        clock.now += 10
        assert store.get(key(0)) == b"x"
        assert reports.kinds() == ["unavailable"]


@pytest.mark.slow
def test_full_server_refuses_writes_but_reads_go_on(reports: Reports) -> None:
    with own_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as full:
        store = RedisStore(full.url, "full", "1GB", report=reports)
        written = 0
        with pytest.raises(StoreError) as info:
            for start in range(0, 10_000, 100):
                assert store.put_many([(key(i), value(i, 10_000)) for i in range(start, start + 100)]) == 100
                written = start + 100
        assert not isinstance(info.value, StoreUnavailableError)
        assert "OOM" in str(info.value) and "maxmemory" in str(info.value)
        assert written > 0
        assert as_bytes(store.get_many([key(i) for i in range(written)])) == [value(i, 10_000) for i in range(written)]
        assert len(store) == written and store.verify().ok  # the refused batch left nothing behind
        assert store.delete_many([key(0)]) == 1  # removing works on a full server
        assert not reports.seen and store._link.delay == 0


@pytest.mark.slow
def test_entries_the_server_evicts_are_misses(reports: Reports) -> None:
    with own_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru") as evicting:
        store = RedisStore(evicting.url, "lru", "1GB", report=reports)
        for start in range(0, 2000, 100):
            store.put_many([(key(i), value(i, 5000)) for i in range(start, start + 100)])
        got = store.get_many([key(i) for i in range(2000)])
        hits = [i for i, v in enumerate(got) if v is not None]
        assert 0 < len(hits) < 1500
        assert all(bytes(got[i] or b"") == value(i, 5000) for i in hits)
        assert not reports.seen
        with evicting.client() as client:
            client.config_set("maxmemory", "64mb")  # so that nothing more goes while verify runs
        report = store.verify(fix=True)
        # Mostly "not on the server"; the server may also have evicted some of the bookkeeping.
        assert report.fixed and report.problems
        assert store.verify().ok and 0 < len(store) == len(list(store.keys())) <= len(hits)
        assert set(store.keys()) <= {key(i) for i in hits}  # valid entries were kept, not dropped


# -- damaged and planted values ------------------------------------------------------------
def test_damaged_or_planted_values_are_reported_misses(
    target: RedisServer | RedisClusterServers, reports: Reports
) -> None:
    store = RedisStore(target.url, "damage", "10MB", report=reports)
    store.put_many([(key(i), value(i)) for i in range(10)])
    name = store._space.name
    with target.client() as client:
        good = client.get(name(key(0)))
        client.set(name(key(1)), good)  # a copy under another key
        client.set(name(key(2)), client.get(name(key(2)))[:-1])  # truncated
        flipped = bytearray(client.get(name(key(3))))
        flipped[-7] ^= 0x10
        client.set(name(key(3)), bytes(flipped))
        client.set(name(key(20)), b"garbage")  # planted
        client.set(name(key(21)), pickle.dumps(RuntimeError("boom")))  # a pickle is only bytes here
        kb = encode_key(key(22))
        client.set(name(key(22)), encode_record(kb, b"long payload") + b"short")  # a length that lies
        client.rpush(name(key(23)), b"a list")  # another type
    asked = [key(i) for i in (0, 1, 2, 3, 4, 20, 21, 22, 23)]
    assert as_bytes(store.get_many(asked)) == [value(0), None, None, None, value(4), None, None, None, None]
    # The list is a plain miss for MGET; a cluster's GET finds it unreadable, reports and deletes it.
    damaged = (1, 2, 3, 20, 21, 22, 23) if isinstance(target, RedisClusterServers) else (1, 2, 3, 20, 21, 22)
    assert reports.kinds() == ["corrupt"] * len(damaged)
    assert store.get_many(asked) == store.get_many(asked)  # once per key
    assert reports.kinds() == ["corrupt"] * len(damaged)
    with target.client() as client:
        assert [client.exists(name(key(i))) for i in damaged] == [0] * len(damaged)
    assert len(store) == 7 and store.nbytes == 7 * 1000  # the damaged ones left the bookkeeping


def test_verify_finds_and_fixes_damage(target: RedisServer | RedisClusterServers, reports: Reports) -> None:
    store = RedisStore(target.url, "verify", "10MB", report=reports)
    store.put_many([(key(i), value(i)) for i in range(20)])
    name = store._space.name
    with target.client() as client:
        client.set(name(key(0)), b"garbage")
        client.set("tc:verify:not-a-key", b"planted")
        client.set(name(key(50)), encode_record(encode_key(key(50)), b"stray") + b"stray")  # valid, unaccounted
        client.delete(name(key(5)))  # gone behind the bookkeeping's back
        client.hset("tc:{verify}:stats", "payload", 1)
    report = store.verify()
    assert report.entries == 20 and report.bad == [key(0)]  # a name that is no key is another program's
    assert len(report.problems) == 3 and not report.fixed
    fixed = store.verify(fix=True)
    assert fixed.fixed and sorted(fixed.bad) == sorted(report.bad)
    after = store.verify()
    assert after.ok and after.entries == 19 and len(store) == 19 and store.nbytes == 18 * 1000 + len(b"stray")
    # The damaged and the vanished entries are gone; the intact stray one was adopted; the other name stays.
    assert sorted(store.keys()) == sorted([key(50)] + [key(i) for i in range(20) if i not in (0, 5)])
    assert store.get(key(50)) == b"stray"
    store.clear()
    with target.client() as client:
        assert client.get("tc:verify:not-a-key") == b"planted"
    assert not reports.seen  # verify returns what it finds; it does not report


def test_keys_skip_names_that_are_no_keys(server: RedisServer) -> None:
    store = RedisStore(server.url, "names", "1MB")
    store.put(key(1), b"one")
    with server.client() as client:
        client.set("tc:names:XYZ", b"planted")
        client.set("tc:namesake:" + key(2), b"another namespace")
    assert list(store.keys()) == [key(1)]
    assert "XYZ" not in store and key(2) not in store
    with pytest.raises(KeyingError):
        store.get_many(["XYZ"])


# -- planted bookkeeping ---------------------------------------------------------------------
PLANTS: dict[str, dict[str, Any]] = {
    "negative totals": {"bytes": -100000000000, "payload": -100000000000},
    "huge totals": {"bytes": 100000000000, "payload": 100000000000},
    "payload above bytes": {"bytes": 10, "payload": 10**6},
    "not integers": {"bytes": "1.5", "payload": "lots", "clock": "x"},
    "not numbers": {"bytes": "\x00\xff", "payload": "9" * 400, "clock": "-7"},
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_totals_are_recomputed_and_eviction_keeps_the_budget(
    target: RedisServer | RedisClusterServers, plant: str
) -> None:
    budget = 20_000
    store = RedisStore(target.url, "planted", budget)
    store.put_many([(key(i), value(i)) for i in range(10)])
    with target.client() as client:
        client.hset("tc:{planted}:stats", mapping=PLANTS[plant])
    shown = repr(store)
    assert "10 entries" in shown, shown
    assert len(store) == 10 and store.nbytes == 10 * 1000
    for start in range(10, 100, 10):  # writes go on, and evict to keep the budget
        assert store.put_many([(key(i), value(i)) for i in range(start, start + 10)]) > 0
        assert 0 < store.nbytes <= budget
    report = store.verify()
    assert report.ok, report.problems
    assert 10 <= len(store) <= budget // 1000 and store.nbytes == 1000 * len(store)
    written = {key(i): value(i) for i in range(100)}
    kept = sorted(store.keys())
    assert as_bytes(store.get_many(kept)) == [written[k] for k in kept]


def test_planted_sizes_count_as_nothing_and_verify_fixes_them(target: RedisServer | RedisClusterServers) -> None:
    store = RedisStore(target.url, "sizes", 50_000)
    store.put_many([(key(i), value(i)) for i in range(10)])
    with target.client() as client:
        client.hset("tc:{sizes}:sizes", mapping={key(3): "abc", key(4): -5, key(77): "1e400"})
        client.hset("tc:{sizes}:stats", "bytes", "abc")
    assert "entries" in repr(store) and len(store) == 10
    assert store.delete_many([key(3), key(5)]) == 2  # the scripts take the planted sizes as 0
    store.put_many([(key(4), value(4, 2000))])  # replaces an entry with a planted size
    report = store.verify()
    assert not report.ok and any("not byte counts" in p for p in report.problems)
    assert store.verify(fix=True).fixed and store.verify().ok
    assert len(store) == 8 and store.nbytes == 7 * 1000 + 2000


def test_planted_totals_do_not_break_the_command_line(server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    from torchcache.cli.main import main

    store = RedisStore(server.url, "cli0planted", "1MB")
    store.put_many([(key(i), value(i)) for i in range(5)])
    with server.client() as client:
        client.hset("tc:{cli0planted}:stats", mapping={"bytes": "1.5", "payload": "-3"})
        client.hset("tc:{cli0planted}:sizes", key(1), "many")
    assert main(["ls", server.url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["caches"] == [{"key": "cli0planted", "entries": 5, "bytes": 4000}]
    assert main(["info", "cli0planted", "--root", server.url]) == 0
    assert "4.0 kB" in capsys.readouterr().out
    assert main(["verify", server.url]) == 1  # the planted size (and values that are not frames)
    assert "not byte counts" in capsys.readouterr().out
    assert main(["verify", "--fix", server.url]) == 0
    assert main(["verify", server.url]) == 0
    capsys.readouterr()
    assert store.verify().ok and store.nbytes == 1000 * len(store)


@pytest.mark.slow
def test_with_the_server_away_the_count_is_the_last_one_read(reports: Reports) -> None:
    with own_server() as redis_server:
        store = RedisStore(redis_server.url, "away", "10MB", report=reports, clock=Clock(), timeout=2.0)
        assert store.put_many([(key(i), value(i)) for i in range(30)]) == 30
        assert (len(store), store.nbytes) == (30, 30_000)
        redis_server.kill()
        assert (len(store), store.nbytes) == (30, 30_000)  # not 0: the server did not lose them
        assert "unavailable" in repr(store) and reports.kinds() == ["unavailable"]


def test_a_foreign_key_shaped_like_bookkeeping_is_not_taken_for_a_namespace(server: RedisServer) -> None:
    store = RedisStore(server.url, "mine", "10MB")
    store.put(key(1), b"x")
    with server.client() as client:
        client.hset("tc:{sessions:eu}:stats", "n", 1)  # another program's key
        client.set("tc:{app}:stats", b"hits=3")  # of a namespace's shape, but not totals torchcache keeps
        client.hset("tc:{apps}:stats", "clock", 1)
        client.set("tc:app:1234abcd", b"user data")
    assert RedisStore.namespaces(server.url) == ["mine"]
    assert main(["clear", "--all", "--yes", "--root", server.url]) == 0
    with server.client() as client:
        left = {name.decode() for name in client.keys("*")}
    assert left == {"tc:{sessions:eu}:stats", "tc:{app}:stats", "tc:{apps}:stats", "tc:app:1234abcd"}


def test_a_connection_failure_leaves_the_client_other_threads_use_open(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    store = RedisStore(server.url, "shared-client", "10MB")
    store.put(key(1), b"x")
    client, closed = store._link.client(), []
    monkeypatch.setattr(client, "close", lambda: closed.append(True))
    store._link.failure(redis.exceptions.ConnectionError("reset"), "read entries")
    # Closing it in place cut off threads sending on it (errors no store error names: writes turned off).
    assert not closed and store._link.client() is not client


def test_verify_counts_an_entry_evicted_between_its_scan_and_its_read_as_a_miss_not_damage(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchcache.stores.redis.verify as verify

    store = RedisStore(server.url, "evicting", "10MB")
    store.put_many([(key(i), value(i)) for i in range(4)])
    fetch = verify.fetch_on_node

    def evicted(node: Any, names: Any, cluster: bool) -> list[Any]:
        return [None, *fetch(node, names, cluster)[1:]]  # the first gone, as under maxmemory allkeys-lru

    monkeypatch.setattr(verify, "fetch_on_node", evicted)
    report = store.verify()
    assert report.bad == [] and report.entries == 3


def test_writes_meeting_bookkeeping_another_client_replaced_leave_no_entry_behind_and_verify_rebuilds_it(
    server: RedisServer,
) -> None:
    store = RedisStore(server.url, "replaced", "10MB")
    store.put(key(0), value(0))
    with server.client() as client:
        client.delete("tc:{replaced}:order")
        client.set("tc:{replaced}:order", "not a sorted set")  # the transaction's script fails while it runs
    with pytest.raises(StoreError):
        store.put_many([(key(i), value(i)) for i in range(1, 20)])
    with server.client() as client:
        entries = client.keys("tc:replaced:*")  # entries are named tc:<namespace>:<key>, bookkeeping tc:{...}:...
    assert len(entries) == 1  # the SETs applied before the script failed are removed again
    report = store.verify()
    assert any("tc:{replaced}:order" in problem for problem in report.problems) and not report.fixed
    assert store.verify(fix=True).fixed
    assert store.verify().ok
    store.put_many([(key(i), value(i)) for i in range(1, 20)])
    assert len(store) == 20 and store.get(key(0)) == value(0)


def test_a_client_dropped_at_a_failure_is_closed_only_once_no_request_uses_it(
    server: RedisServer, reports: Reports
) -> None:
    import threading

    import redis

    clock = Clock()
    store = RedisStore(server.url, "busy", "1MB", report=reports, clock=clock)
    link = store._link
    holding, release, seen = threading.Event(), threading.Event(), []

    def slow(client: Any) -> Any:  # a long request, made of several round trips
        seen.append(client)
        client.ping()
        holding.set()
        release.wait(10)
        return client.ping()

    worker = threading.Thread(target=lambda: seen.append(link.call(slow, "wait")))
    worker.start()
    assert holding.wait(10)
    link.failure(redis.exceptions.ConnectionError("another thread's request failed"), "read")
    clock.now += BACKOFF_START
    assert store.put(key(1), b"x")  # a new client: the dropped one is still in use
    assert seen[0] is not link._client and _open_sockets(seen[0]) > 0 and link._dropped == [seen[0]]
    release.set()
    worker.join(10)
    assert seen[-1] is True  # its request finished on its own client
    assert link._dropped == [] and _open_sockets(seen[0]) == 0  # closed once it was done
    store.close()


def test_requests_that_fail_in_one_outage_wait_once(reports: Reports) -> None:
    require_redis()
    import redis

    from tests.redis_servers import free_port

    clock = Clock()
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", "away", "1MB", report=reports, clock=clock)
    link = store._link
    for _ in range(16):  # sixteen threads' requests sent before the server went, failing one after another
        link.failure(redis.exceptions.ConnectionError("gone"), "read")
    assert link.delay == BACKOFF_START
    clock.now += BACKOFF_START  # the next try fails too: the wait grows
    link.failure(redis.exceptions.ConnectionError("gone"), "read")
    assert link.delay == 2 * BACKOFF_START
