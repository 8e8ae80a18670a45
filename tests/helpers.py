"""Small frozen modules and helpers shared by the behaviour tests.

Modules get their weights from a seeded generator, so equal init arguments give equal
weights in every process (the cross-process tests rely on that).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import brotli
import torch
from torch import nn

from tests import zygote
from torchcache import torchcache
from torchcache.codec import decode_frame
from torchcache.stores.packed.index import INDEX_NAME
from torchcache.stores.packed.store import PackedStore
from torchcache.tiers.writer import flush_all


def _weights(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with elementwise ops only, so each row's result is bit-identical
    whatever the batch holds (BLAS kernels differ between batch sizes)."""
    out = x[:, :1] * weight[:, 0]
    for k in range(1, x.shape[1]):
        out = out + x[:, k : k + 1] * weight[:, k]
    return out


class Seen(list):  # type: ignore[type-arg]
    """The batch sizes a module's forward received: bookkeeping, never part of a key.

    A module's attributes are part of its key when it is taken (the first call, and again
    after ``.to()`` or ``load_state_dict()``): a list that grows would give a new key each
    time. Its ``__torchcache_key__()`` says that it computes nothing.
    """

    def __torchcache_key__(self) -> str:
        return "bookkeeping"


class Tally(dict):  # type: ignore[type-arg]
    """A dict of counts that tests keep beside their modules and datasets, never part of a key.

    Methods that read a global are keyed by its value: a counter they update would change
    their key at every call. Its ``__torchcache_key__()`` says that it computes nothing.
    """

    def __torchcache_key__(self) -> str:
        return "a tally of calls"


class Counting(nn.Module):
    """A frozen linear map that records the batch size of every forward call."""

    def __init__(self, dim_in: int = 4, dim_out: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(_weights(dim_out, dim_in, seed=seed))
        self.bias = nn.Parameter(_weights(dim_out, seed=seed + 1))
        self.seen = Seen()
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return _linear(x, self.weight) + self.bias

    @property
    def items(self) -> int:
        """Items the forward received, over every call."""
        return sum(self.seen)


class MultiOut(nn.Module):
    """Nested outputs of mixed dtypes and shapes: a dict holding a tuple holding a list."""

    def __init__(self, dim_in: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.proj = nn.Parameter(_weights(6, dim_in, seed=seed))
        self.seen = Seen()
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        self.seen.append(x.shape[0])
        h = _linear(x, self.proj)
        return {
            "emb": h,
            "pair": (h.double().reshape(-1, 2, 3), [(h > 0).sum(dim=1), h[:, 0] > 0]),
        }

    @property
    def items(self) -> int:
        return sum(self.seen)


class ConvBackbone(nn.Module):
    """A tiny conv net on ``(B, 3, 8, 8)`` images, returning ``(B, 16)`` features."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        with torch.no_grad():
            for i, p in enumerate(self.net.parameters()):
                p.copy_(_weights(*p.shape, seed=seed + i))
        self.seen = Seen()
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        # one item at a time: conv kernels give other bits for a batch of one
        return torch.cat([self.net(x[i : i + 1]) for i in range(x.shape[0])])

    @property
    def items(self) -> int:
        return sum(self.seen)


def cached(base: type[nn.Module], **options: Any) -> type[Any]:
    """A decorated subclass of ``base`` (``base`` itself stays the plain twin).

    The check that items are independent is off unless asked for: its extra forward
    would count in ``seen``, and these modules are per item by construction
    (``tests/test_independence.py`` tests the check).
    """
    sub = type(f"{base.__name__}Cached", (base,), {"__module__": base.__module__})
    options.setdefault("check_items", False)
    return torchcache(**options)(sub)


def stored_entries(root: Path) -> dict[Path, bytes]:
    """Every entry in the packed stores under ``root``, as ``<module dir>/<key>``: its frame."""
    found: dict[Path, bytes] = {}
    for index in sorted(root.rglob(INDEX_NAME)):
        with PackedStore(index.parent, 1 << 40) as store:
            keys = sorted(store.keys())
            for key, data in zip(keys, store.get_many(keys)):
                if data is not None:
                    found[index.parent / key] = bytes(data)
    return found


def entry_files(root: Path) -> list[Path]:
    """Every entry under ``root`` (packed entries as ``<module dir>/<key>``, 1.0 files as themselves)."""
    return sorted([*stored_entries(root), *root.rglob("*.tce")])


def disk_bytes(root: Path) -> int:
    """Sum of the frame sizes of the entries under ``root``."""
    return sum(map(len, stored_entries(root).values())) + sum(p.stat().st_size for p in root.rglob("*.tce"))


def assert_all_entries_decode(root: Path) -> None:
    """Every entry under ``root`` is a whole, valid frame."""
    for data in stored_entries(root).values():
        decode_frame(data)
    for path in root.rglob("*.tce"):
        decode_frame(path.read_bytes())


def assert_same(got: Any, want: Any) -> None:
    """Same structure, and tensors equal in values, dtype, shape and device."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert got.device == want.device
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)


REPO = Path(__file__).resolve().parents[1]


def python_env(*paths: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports this checkout (and ``paths``) first.

    What ``PYTHONPATH`` held already stays after them: packages installed there are still found.
    """
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths), str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def run_python(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120, path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c script args`` from the repository root; return the completed process.

    With ``path``, the script is written there and run as a file instead (``spawn``
    children of multiprocessing need a main module they can import again). The child is
    a fork of a process that has imported torch (:mod:`tests.zygote`).
    """
    full_env = python_env() if env is None else env
    if path is not None:
        path.write_text(script)
    argv = ["-c", script, *args] if path is None else [str(path), *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = zygote.start(argv, env=full_env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, *argv], code, out.read(), err.read())


class ProcessGroup:
    """``python -c code`` in a session of its own, spoken to over stdin and stdout, one line a message.

    The process and everything it forks are killed by :meth:`close`, and after ``timeout``
    seconds by a watchdog: a hang fails the test instead of stopping the run.
    """

    def __init__(self, code: str, stderr: Path, timeout: float = 300) -> None:
        self.stderr = stderr
        with open(stderr, "w") as err:
            self.proc = zygote.start(
                ["-c", code],
                cwd=REPO,
                env=python_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,  # its process group holds what it forks too
            )
        self.closed = False
        self.watchdog = threading.Timer(timeout, self.close)
        self.watchdog.start()

    def send(self, *words: object) -> None:
        """Write one line of words to the process."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def readline(self) -> str:
        """The next line the process printed (fails the test if it ended or timed out)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the process ended or timed out:\n{self.stderr.read_text()[-3000:]}"
        return line

    def close(self) -> None:
        """Kill the process and everything it forked."""
        self.watchdog.cancel()
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


#: A script that reads the 24 samples of a small dataset through ``CachedDataset(ramp,
#: argv[1], local_cache_dir=argv[2] if given)`` and prints how many were computed and
#: how many came from the disk tier.
RAMP_DATASET = """
import json, sys, torch
from torchcache import CachedDataset

class Ramp(torch.utils.data.Dataset):
    def __init__(self):
        self.calls = 0
    def __len__(self):
        return 24
    def __getitem__(self, i):
        self.calls += 1
        return torch.arange(6, dtype=torch.int16) * i, i

ramp = Ramp()
local = sys.argv[2] if len(sys.argv) > 2 else None
data = CachedDataset(ramp, sys.argv[1], max_memory_size=0, local_cache_dir=local, check_samples=False)
seen = [(int(x.sum()), int(y)) for x, y in (data[i] for i in range(24))]
assert seen == [(15 * i, i) for i in range(24)], seen
data.close()
print(json.dumps({"calls": ramp.calls, "disk_hits": data.stats().disk.hits}))
"""


# -- workers that run at the same time, coordinated through their pipes ----------------------
# Imports torch once, then forks a worker per "start NAME ARGS" line (an interpreter per worker
# costs seconds). A worker runs work(name, *args, say=..., ask=...): say() prints one line
# "NAME words" (in one write, so lines of several workers never mix), ask() reads the next
# line the test sent it with "tell NAME words". "wait NAME" prints "NAME status CODE".
FORK_SERVER = textwrap.dedent(
    """
    import os, sys, traceback

    def say(*words):
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())

    def serve(work):
        workers = {}
        for line in sys.stdin:
            command, name, *rest = line.split()
            if command == "start":
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(write)
                    orders = os.fdopen(read)
                    code = 0
                    try:
                        work(name, *rest, say=lambda *words: say(name, *words), ask=lambda: orders.readline().strip())
                    except BaseException:
                        traceback.print_exc()
                        say(name, "error")
                        code = 3
                    os._exit(code)
                os.close(read)
                workers[name] = (pid, os.fdopen(write, "w"))
                say(name, "pid", pid)
            elif command == "tell":
                workers[name][1].write(" ".join(rest) + "\\n")
                workers[name][1].flush()
            elif command == "wait":
                _, status = os.waitpid(workers[name][0], 0)
                say(name, "status", os.waitstatus_to_exitcode(status))
    """
)


def load_module(path: Path, name: str, source: str) -> ModuleType:
    """Write ``source`` to ``path`` and import it as the module ``name`` (in ``sys.modules``)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fault_under(patch: Any, root: Path, name: str, fake: Any) -> None:
    """Patch ``os.<name>`` (with ``patch``, a ``MonkeyPatch``) to call ``fake`` on files under ``root``.

    ``os`` is shared by every thread of the test process: a writer thread of an earlier test
    may still be flushing into its own store, and its calls must neither fail nor count here.
    """
    real = getattr(os, name)

    def call(fd: int, *args: Any) -> Any:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root):
            return fake(fd, *args)
        return real(fd, *args)

    patch.setattr(os, name, call)


def pwrite_fault(kind: str) -> Any:
    """A stand-in for ``os.pwrite`` that fails as ``kind`` says: ``"EIO"``, ``"ENOSPC"``,
    ``"no progress"`` (writes nothing), or ``"short, then ENOSPC"``; its ``calls`` count them."""
    real = os.pwrite
    calls: list[int] = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(1)
        if len(calls) > 1000:  # a loop waiting for progress would never end: stop it here
            raise RuntimeError("pwrite was called 1000 times and wrote nothing")
        if kind == "no progress":
            return 0
        if kind == "short, then ENOSPC" and len(calls) == 1:
            return real(fd, bytes(data)[: len(data) // 2], offset)
        code = errno.EIO if kind == "EIO" else errno.ENOSPC
        raise OSError(code, os.strerror(code))

    pwrite.calls = calls  # type: ignore[attr-defined]
    return pwrite


@contextlib.contextmanager
def traced_memory() -> Iterator[Callable[[], tuple[int, int]]]:
    """Trace Python allocations in the block; yields ``tracemalloc.get_traced_memory``.

    Tracing stops only once torchcache's background writers are idle: CPython 3.11's
    ``tracemalloc.stop()`` can crash the process when another thread reports a numpy
    allocation at that moment (python/cpython#128679, fixed in 3.12.9 and 3.13.2).
    """
    tracemalloc.start()
    try:
        yield tracemalloc.get_traced_memory
    finally:
        flush_all()
        tracemalloc.stop()


def refuse_reading(monkeypatch: Any, path: Path) -> None:
    """Make torchcache's bounded reads of ``path`` fail with EACCES, as for a file of mode 000 (root reads any)."""
    from torchcache import meta

    real = meta.read_bounded

    def refusing(where: Path, limit: int) -> bytes | None:
        if Path(where) == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(where))
        return real(where, limit)

    monkeypatch.setattr(meta, "read_bounded", refusing)


@functools.cache
def gigabyte_of_zeros() -> bytes:
    """A brotli stream of about 800 bytes that inflates to 1 GiB (a decompression bomb), made without holding 1 GiB."""
    compressor, chunk = brotli.Compressor(quality=5, lgwin=24), bytes(1 << 24)
    return b"".join([*(compressor.process(chunk) for _ in range(64)), compressor.finish()])


def fake_extension(directory: Path, name: str, monkeypatch: Any) -> Path:
    """A user's compiled extension module ``name``, built in place (not installed): its file, to rewrite."""
    import types

    built = directory / f"{name}.cpython-311-x86_64-linux-gnu.so"
    built.write_bytes(b"\x7fELF version 1")
    extension = types.ModuleType(name)
    extension.__file__ = str(built)
    monkeypatch.setitem(sys.modules, name, extension)
    return built
