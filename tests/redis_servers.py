"""Real Redis servers for the tests: started on free loopback ports, stopped afterwards.

Servers bind 127.0.0.1 only, keep nothing on disk (``--save ''``, ``--appendonly no``, a
temporary ``--dir``) and die with the test process (``PR_SET_PDEATHSIG``) even if it is
killed. A standalone server and a 3-node cluster are shared by the test modules that
use them (:func:`shared`), started on first use and stopped at exit; tests that stop,
fill or reconfigure a server start their own (:class:`RedisServer`). Without
``redis-server`` or the ``redis`` package the tests are skipped, or fail when ``CI`` is set.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

STARTUP_SECONDS = 20.0
_shared: dict[str, Any] = {}


def require_redis() -> None:
    """Skip the calling test when redis-server or the redis package is missing (fail under CI)."""
    missing = []
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing.append("redis-server and redis-cli (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("the redis package (pip install 'torchcache[redis]')")
    if missing:
        message = "Redis tests need " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
        pytest.skip(message)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A loopback port nobody listens on; for a cluster node, its bus port (+10000) is free too."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(20000, 55000)
        if _bindable(port) and (not cluster or _bindable(port + 10000)):
            return port
    raise RuntimeError("no free port found")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RedisServer:
    """One ``redis-server`` process.

    Args:
        *args: Extra server arguments (``"--maxmemory", "4mb"``).
        password: Set as ``requirepass``.
        cluster: Start as a cluster node.
    """

    def __init__(self, *args: str, password: str | None = None, cluster: bool = False) -> None:
        self.args = list(args)
        self.password = password
        self.cluster = cluster
        self.directory = Path(tempfile.mkdtemp(prefix="torchcache-redis-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None) -> RedisServer:
        """Start (on ``port``, or a free one) and wait until it answers PING."""
        for _ in range(5):
            self.port = port or free_port(self.cluster)
            command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            command += ["--appendonly", "no", "--dir", str(self.directory), "--daemonize", "no"]
            if self.password:
                command += ["--requirepass", self.password]
            if self.cluster:
                command += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
                command += ["--cluster-node-timeout", "5000"]
            log = open(self.directory / f"server-{self.port}.log", "ab")  # noqa: SIM115 - the child keeps it
            self.process = subprocess.Popen(
                command + self.args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
            log.close()
            if self._wait_ready():
                return self
            self.stop()
            if port is not None:
                break
        log_text = "".join(p.read_text(errors="replace")[-2000:] for p in self.directory.glob("*.log"))
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log_text}")

    def _wait_ready(self) -> bool:
        import redis

        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                with redis.Redis(port=self.port, password=self.password, socket_timeout=1) as client:
                    if client.ping():
                        return True
            except redis.exceptions.ConnectionError:
                pass
            time.sleep(0.01)  # polling for start-up, not timing anything
        return False

    def client(self) -> Any:
        """A plain redis-py client of this server."""
        import redis

        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class RedisClusterServers:
    """A Redis Cluster of ``size`` primaries and no replicas on loopback."""

    def __init__(self, size: int = 3) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(size)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        # What `redis-cli --cluster create` does, without its pauses of a second: each node takes an equal
        # range of the 16384 slots, and the first meets the others.
        bounds = [len(self.nodes) and i * 16384 // len(self.nodes) for i in range(len(self.nodes) + 1)]
        for node, start, end in zip(self.nodes, bounds, bounds[1:]):
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end - 1)
        with self.nodes[0].client() as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + STARTUP_SECONDS
        while not all(self._ready(node) for node in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)  # polling for start-up, not timing anything
        return self

    def _ready(self, node: RedisServer) -> bool:
        with node.client() as client:
            info = client.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            slots = client.execute_command("CLUSTER", "SLOTS")
        return "cluster_state:ok" in text and sum(int(s[1]) - int(s[0]) + 1 for s in slots) == 16384

    def client(self) -> Any:
        """A redis-py cluster client."""
        import redis.cluster

        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5)

    def flush(self) -> None:
        for node in self.nodes:
            node.flush()

    def remove(self) -> None:
        for node in self.nodes:
            node.remove()


def shared(kind: str) -> Any:
    """The standalone server (``"redis"``) or the cluster (``"redis-cluster"``) shared by the tests.

    Started on first use (skipping or failing as :func:`require_redis` does), stopped at exit.
    """
    require_redis()
    if kind not in _shared:
        target: Any = RedisServer() if kind == "redis" else RedisClusterServers()
        atexit.register(target.remove)
        _shared[kind] = target.start()
    return _shared[kind]


@contextlib.contextmanager
def own_server(*args: str, password: str | None = None) -> Any:
    """A server of the calling test's own, removed when the block ends."""
    require_redis()
    server = RedisServer(*args, password=password)
    try:
        yield server.start()
    finally:
        server.remove()


@contextlib.contextmanager
def another_protocol_server() -> Any:
    """``redis://`` URL of a loopback server that speaks Redis's protocol but is no Redis (it answers ``["hello"]``)."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def commands(buffer: bytes) -> tuple[int, bytes]:
        count = 0
        while buffer.startswith(b"*"):
            try:
                head, rest = buffer.split(b"\r\n", 1)
                for _ in range(int(head[1:])):
                    size, rest = rest.split(b"\r\n", 1)
                    if len(rest) < int(size[1:]) + 2:
                        return count, buffer
                    rest = rest[int(size[1:]) + 2 :]
            except ValueError:
                return count, buffer
            buffer, count = rest, count + 1
        return count, buffer

    def answer(connection: socket.socket) -> None:
        buffer = b""
        with contextlib.suppress(OSError), connection:
            while data := connection.recv(65536):
                count, buffer = commands(buffer + data)
                connection.sendall(b"*1\r\n$5\r\nhello\r\n" * count)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                connection, _ = listener.accept()
                threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        listener.close()
