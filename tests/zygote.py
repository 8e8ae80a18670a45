"""Python children forked from a process that has imported torch once: ``python -c`` without the import cost.

Most tests that need a second process run a short script in a fresh ``python``, and
about three quarters of such a child's time goes to ``import torch``. A *zygote* is a
Python process (one per test process, started at its first use) that has imported torch
and numpy and then only forks: each child gets the argv, environment, working directory,
``sys.path`` and standard streams that ``python -c code`` or ``python script`` would
have, and runs the code as ``__main__`` through the interpreter's own exit (threads
joined, ``atexit`` handlers run, exit code as Python sets it). What differs from a fresh
interpreter: torch and numpy are already imported (torchcache is not), the child's
parent is the zygote, and interpreter options read from the environment at start-up
(``PYTHONHASHSEED``, ``PYTHONWARNINGS``) are the zygote's.

``TORCHCACHE_TEST_FRESH_PYTHON=1`` starts every child as a new interpreter instead.

Protocol: a request is one message on a ``SOCK_SEQPACKET`` socket pair (JSON, with the
child's stdin, stdout and stderr and a status pipe passed as file descriptors); the
zygote writes the child's pid to the status pipe, and its exit status when it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any, Union

__all__ = ["Child", "Process", "start"]

_FRESH = os.environ.get("TORCHCACHE_TEST_FRESH_PYTHON") == "1"
_MAX_MESSAGE = 1 << 20


class Child:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s interface the tests use."""

    def __init__(self, args: list[str], pid: int, status: int, pipes: list[IO[str] | None]) -> None:
        self.args = args
        self.pid = pid
        self.stdin, self.stdout, self.stderr = pipes
        self.returncode: int | None = None
        self._status = status

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Write ``input`` and close stdin, read stdout and stderr to their ends, wait; the two outputs.

        Raises:
            subprocess.TimeoutExpired: If the child is still running after ``timeout`` seconds.
        """
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        outputs: list[str | None] = [None, None]

        def read(i: int, stream: IO[str]) -> None:
            outputs[i] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=read, args=(i, stream), daemon=True)
            for i, stream in enumerate((self.stdout, self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
        return outputs[0], outputs[1]

    def poll(self) -> int | None:
        """The exit code if the child ended, else ``None``."""
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to end; its exit code (minus the signal that killed it).

        Raises:
            subprocess.TimeoutExpired: If it is still running after ``timeout`` seconds.
        """
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return None
        data = b""
        while chunk := os.read(self._status, 64):
            data += chunk
        os.close(self._status)
        self.returncode = int(data.decode() or "-9")  # no status: the zygote itself was killed
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child unless it ended."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """``SIGKILL`` the child."""
        self.send_signal(signal.SIGKILL)


class _Zygote:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its sys.path is a bare interpreter's
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for pytest does not reach it
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the zygote (the children it started live on until they end)."""
        self.sock.close()  # it reads the end of the stream and returns
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def fork(self, request: dict[str, Any], fds: Sequence[int]) -> tuple[int, int]:
        """Send a request; the child's pid and the read end of its status pipe."""
        status_r, status_w = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [*fds, status_w])
        finally:
            os.close(status_w)
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(status_r, 1)
            if not chunk:
                os.close(status_r)
                raise RuntimeError("the zygote ended before it started the child")
            line += chunk
        return int(line), status_r


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        return _zygote


#: What :func:`start` returns.
Process = Union[Child, "subprocess.Popen[str]"]


def start(
    args: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | os.PathLike[str],
    stdin: IO[Any] | int | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    start_new_session: bool = False,
) -> Process:
    """Start ``python args`` (``-c code ...`` or ``script ...``): a fork of the zygote, or a new interpreter.

    Each stream takes ``subprocess.PIPE`` (a text pipe), ``subprocess.DEVNULL`` or an open
    file; ``None`` inherits this process's.
    """
    if _FRESH:
        return subprocess.Popen(
            [sys.executable, *args],
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=start_new_session,
        )
    streams: list[int] = []
    ours: list[IO[str] | None] = [None, None, None]
    to_close: list[int] = []
    for i, (stream, mode) in enumerate(((stdin, "w"), (stdout, "r"), (stderr, "r"))):
        if stream is None:
            streams.append(i)
        elif stream == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            streams.append(fd)
            to_close.append(fd)
        elif stream == subprocess.PIPE:
            r, w = os.pipe()
            child_end, our_end = (r, w) if i == 0 else (w, r)
            streams.append(child_end)
            to_close.append(child_end)
            ours[i] = open(our_end, mode, encoding="utf-8")  # noqa: SIM115 - the Child owns it
        else:
            assert not isinstance(stream, int), f"unsupported stream {stream!r}"
            streams.append(stream.fileno())
    request: dict[str, Any] = {
        "args": list(args),
        "env": env,
        "cwd": os.fspath(cwd),
        "session": start_new_session,
    }
    try:
        pid, status = _the_zygote().fork(request, streams)
    finally:
        for fd in to_close:
            os.close(fd)
    return Child([sys.executable, *args], pid, status, ours)


# -- the zygote's side --------------------------------------------------------------------
class _Run(BaseException):
    """Raised in a new child to leave the zygote's loop and run the request at the top level."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request


def _serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status pipe)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
                if not message:
                    return  # the test process went away; children live on until they end
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    sock.close()
                    for pidfd, (_, status) in children.items():
                        os.close(pidfd)
                        os.close(status)
                    os.close(fds[3])
                    _become(request, fds[:3])
                    raise _Run(request)
                for stream in fds[:3]:
                    os.close(stream)
                os.write(fds[3], b"%d\n" % pid)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, fds[3])
                sel.register(pidfd, selectors.EVENT_READ, pid)
            else:
                pidfd = key.fd
                sel.unregister(pidfd)
                pid, status = children.pop(pidfd)
                os.close(pidfd)
                _, code = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    os.write(status, str(os.waitstatus_to_exitcode(code)).encode())
                os.close(status)


def _become(request: dict[str, Any], streams: list[int]) -> None:
    """In a new child: take the request's streams, session, directory, environment, argv and path."""
    if request["session"]:
        os.setsid()
    for target, fd in enumerate(streams):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(streams):
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    args = request["args"]
    first = "" if args[0] == "-c" else os.path.dirname(os.path.realpath(args[0]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    sys.argv = ["-c", *args[2:]] if args[0] == "-c" else list(args)
    import numpy as np

    np.random.seed()  # a new interpreter seeds numpy's global generator from the OS


def _run(request: dict[str, Any]) -> None:
    """Run the request's code as ``__main__``, with the module attributes ``python`` gives it."""
    import builtins
    import importlib.machinery
    import types

    args = request["args"]
    main = types.ModuleType("__main__")
    main.__annotations__ = {}
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    if args[0] == "-c":
        main.__loader__ = importlib.machinery.BuiltinImporter  # type: ignore[assignment]
        code = compile(args[1], "<string>", "exec", dont_inherit=True)
    else:
        main.__file__ = args[0]
        main.__cached__ = None  # type: ignore[attr-defined]
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", args[0])
        with open(args[0], "rb") as f:
            code = compile(f.read(), args[0], "exec", dont_inherit=True)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


_BASE_PATH: list[str] = []

if __name__ == "__main__":
    _BASE_PATH = sys.path[1:]  # the zygote's own folder is not a child's
    import numpy  # noqa: F401
    import torch  # noqa: F401

    child: dict[str, Any] | None = None
    try:
        _serve(int(sys.argv[1]))
    except _Run as run:
        child = run.request
    if child is not None:  # outside the handler: the child's code runs with no exception in flight
        _run(child)
