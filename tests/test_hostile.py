"""Files planted in a cache directory by anyone who can write there.

One table of planted files (FIFOs, deeply nested JSON, decompression bombs, sparse
giants, random bytes, directories, symbolic links, out-of-range numbers), in entries and
in module metadata. For each, a decorated module must return the right outputs, in
bounded memory and time, with exactly one CacheWarning where one is due, and every
``torchcache`` command must finish without a traceback and never touch a file outside
the cache. Every call that could block runs on a thread with a deadline, so a
regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import stat
import struct
import threading
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brotli
import pytest
import torch
import xxhash

from tests.helpers import Counting, assert_same, cached
from torchcache import CacheWarning
from torchcache.cli import main
from torchcache.codec import CODEC_BROTLI, MAGIC
from torchcache.meta import META_NAME
from torchcache.tree import Layout, flatten

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="plants FIFOs")

N = 8
DEADLINE = 60.0
#: Python allocations a call may make: a planted file that is read whole, or inflated,
#: costs a gigabyte.
MEMORY_LIMIT = 64 << 20
GIB = 1 << 30


# -- building blocks ----------------------------------------------------------------------------
def _sealed(header: bytes, stored: bytes, raw_len: int, codec: int = CODEC_BROTLI) -> bytes:
    """A frame with the given fields and a valid checksum (anyone can compute one)."""
    head = struct.pack("<4sBBHIQQ", MAGIC, 1, codec, 0, len(header), len(stored), raw_len)
    digest = xxhash.xxh3_64(head)
    digest.update(header)
    digest.update(stored)
    return head + struct.pack("<Q", digest.intdigest()) + header + stored


def _header(size: int) -> bytes:
    """The header of a float32 output of ``size`` values per item (the module's own has 16)."""
    spec, leaves = flatten(torch.zeros(1, 16))
    header = json.dumps(Layout.of(spec, leaves, None).to_header(), separators=(",", ":"), sort_keys=True).encode()
    return header.replace(b'"shape":[16]', b'"shape":[' + str(size).encode() + b"]")


@functools.lru_cache(maxsize=1)
def _gigabyte_of_zeros() -> bytes:
    return brotli.compress(b"\x00" * GIB, quality=5, lgwin=24)


def _sparse(path: Path, size: int, start: bytes = b"") -> None:
    with open(path, "wb") as file:
        file.write(start)
        file.truncate(size)


def _fifo(path: Path, scratch: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path, scratch: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"not torchcache's")


def _link_to(target: str) -> Callable[[Path, Path], None]:
    def plant(path: Path, scratch: Path) -> None:
        os.symlink(target, path)

    return plant


def _link_outside(make: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    def plant(path: Path, scratch: Path) -> None:
        outside = scratch / "outside"
        make(outside)
        os.symlink(outside, path)

    return plant


def _bytes(data: bytes | Callable[[], bytes]) -> Callable[[Path, Path], None]:
    def plant(path: Path, scratch: Path) -> None:
        path.write_bytes(data if isinstance(data, bytes) else data())

    return plant


def _meta(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path, Path], None]:
    def plant(path: Path, scratch: Path) -> None:
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return plant


def _with(field: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda meta: {**meta, field: value}


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# -- the table ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A planted file and what torchcache must make of it.

    ``where`` is ``"entry"`` (planted at the path of one entry, replacing it), ``"meta"``
    (at the module's ``torchcache.json``), ``"shard"`` (a whole shard directory) or
    ``"module"`` (the module directory). ``warns``: one CacheWarning from the library.
    ``recomputed``: items the first reader computes. ``verify_ok``: ``torchcache verify``
    finds nothing before any fix. ``fixable``: ``verify --fix`` leaves no problem.
    """

    where: str
    plant: Callable[[Path, Path], None]
    warns: bool
    recomputed: int
    verify_ok: bool
    fixable: bool = True


ENTRY_CORRUPT = {"warns": True, "recomputed": 1, "verify_ok": False}
ENTRY_IGNORED = {"recomputed": 1, "verify_ok": True}
META_DAMAGED = {"warns": True, "recomputed": 0, "verify_ok": False}

CASES: dict[str, Case] = {
    # entries
    "entry: FIFO": Case("entry", _fifo, warns=False, **ENTRY_IGNORED),
    "entry: directory": Case("entry", _directory, warns=True, **ENTRY_IGNORED),
    "entry: link to /dev/zero": Case("entry", _link_to("/dev/zero"), warns=False, **ENTRY_IGNORED),
    "entry: link to a FIFO outside": Case("entry", _link_outside(lambda p: os.mkfifo(p)), warns=False, **ENTRY_IGNORED),
    "entry: dangling link": Case("entry", _link_to("/nonexistent/torchcache-entry"), warns=False, **ENTRY_IGNORED),
    "entry: link to random bytes outside": Case(
        "entry", _link_outside(lambda p: p.write_bytes(os.urandom(3000))), warns=True, **ENTRY_IGNORED
    ),
    "entry: 5,000 nested arrays as header": Case("entry", _bytes(_sealed(_nested(5000), b"", 0, 0)), **ENTRY_CORRUPT),
    "entry: 5,000 nested objects in the tree": Case(
        "entry",
        _bytes(_sealed(b'{"leaves":[],"tree":' + b'{"a":' * 5000 + b"1" + b"}" * 5001, b"", 0, 0)),
        **ENTRY_CORRUPT,
    ),
    "entry: brotli bomb, 1 GiB behind a 4 kB declared size": Case(
        "entry", _bytes(lambda: _sealed(_header(1024), _gigabyte_of_zeros(), 4096)), **ENTRY_CORRUPT
    ),
    "entry: brotli bomb declaring 1 GiB against its header": Case(
        "entry", _bytes(lambda: _sealed(_header(16), _gigabyte_of_zeros(), GIB)), **ENTRY_CORRUPT
    ),
    "entry: brotli bomb whose header declares 1 GiB": Case(
        "entry", _bytes(lambda: _sealed(_header(GIB // 4), _gigabyte_of_zeros(), GIB)), **ENTRY_CORRUPT
    ),
    "entry: 1 GiB sparse file": Case("entry", lambda p, s: _sparse(p, GIB), **ENTRY_CORRUPT),
    "entry: 1 GiB sparse file with a valid small prefix": Case(
        "entry", lambda p, s: _sparse(p, GIB, _sealed(_header(16), b"\x00" * 64, 64, 0)), **ENTRY_CORRUPT
    ),
    "entry: random bytes": Case("entry", _bytes(lambda: os.urandom(5000)), **ENTRY_CORRUPT),
    "entry: empty file": Case("entry", _bytes(b""), **ENTRY_CORRUPT),
    "entry: shape of 10**30 elements": Case(
        "entry", _bytes(lambda: _sealed(_header(10**30), b"\x00" * 64, 64, 0)), **ENTRY_CORRUPT
    ),
    "entry: NaN offset": Case(
        "entry",
        _bytes(lambda: _sealed(_header(16).replace(b'"offset":0', b'"offset":NaN'), b"\x00" * 64, 64, 0)),
        **ENTRY_CORRUPT,
    ),
    # module metadata
    "meta: FIFO": Case("meta", lambda p, s: (p.unlink(), os.mkfifo(p)), **META_DAMAGED),
    "meta: 5,000 nested arrays": Case("meta", _bytes(_nested(5000)), **META_DAMAGED),
    "meta: 200 MB sparse file": Case("meta", lambda p, s: _sparse(p, 200_000_000, b'{"a": "'), **META_DAMAGED),
    "meta: created in milliseconds": Case(
        "meta", _meta(lambda m: {**m, "created": m["created"] * 1000}), **META_DAMAGED
    ),
    "meta: created 1e300": Case("meta", _meta(_with("created", 1e300)), **META_DAMAGED),
    "meta: created NaN": Case("meta", _meta(_with("created", float("nan"))), **META_DAMAGED),
    "meta: created a 400-digit number": Case("meta", _meta(_with("created", 10**400)), **META_DAMAGED),
    "meta: max_bytes -1": Case("meta", _meta(_with("max_bytes", -1)), **META_DAMAGED),
    "meta: foreign object": Case("meta", _bytes(b'{"name": "x"}'), **META_DAMAGED),
    "meta: random bytes": Case("meta", _bytes(lambda: os.urandom(300)), **META_DAMAGED),
    "meta: link to /dev/zero": Case("meta", lambda p, s: (p.unlink(), os.symlink("/dev/zero", p)), **META_DAMAGED),
    "meta: directory": Case("meta", lambda p, s: (p.unlink(), _directory(p, s)), fixable=False, **META_DAMAGED),
    "meta: deleted": Case("meta", lambda p, s: p.unlink(), warns=False, recomputed=0, verify_ok=False),
    # links to directories outside the cache
    "shard: link to a directory outside": Case("shard", lambda p, s: None, warns=False, recomputed=0, verify_ok=True),
    "module: link to a directory outside": Case("module", lambda p, s: None, warns=False, recomputed=0, verify_ok=True),
}


# -- running things with a deadline and a memory bound -------------------------------------------
@contextmanager
def _released(root: Path) -> Iterator[None]:
    """On the way out, open every FIFO under ``root`` for writing, so that a reader stuck on one returns."""
    try:
        yield
    finally:
        for path in root.rglob("*"):
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


def _bounded(fn: Callable[[], Any]) -> Any:
    """Call ``fn`` on a thread; fail on a deadline, and if it allocates more than MEMORY_LIMIT."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    tracemalloc.start()
    try:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(DEADLINE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if thread.is_alive():
        pytest.fail(f"the call did not return within {DEADLINE} s")
    if errors:
        raise errors[0]
    assert peak < MEMORY_LIMIT, f"the call allocated {peak:,} bytes"
    return result[0]


def _call(fn: Callable[[], Any], warns: bool) -> Any:
    """Call ``fn`` (bounded); exactly one CacheWarning if ``warns``, else none."""
    if warns:
        with pytest.warns(CacheWarning) as record:
            out = _bounded(fn)
        caught = [str(w.message) for w in record if issubclass(w.category, CacheWarning)]
        assert len(caught) == 1, caught
    else:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = _bounded(fn)
        assert [str(w.message) for w in record if issubclass(w.category, CacheWarning)] == []
    return out


def _cli(*argv: str) -> tuple[int, str, str]:
    """Run ``torchcache`` (bounded); it must return a status, never raise."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with redirect_stdout(out), redirect_stderr(err):
            return main(list(argv))

    code = _bounded(run)
    assert "Traceback" not in err.getvalue() and "Traceback" not in out.getvalue()
    return code, out.getvalue(), err.getvalue()


def _strict_json(text: str) -> Any:
    """Parse JSON that other tools can parse too (no NaN or Infinity)."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in JSON output")

    return json.loads(text, parse_constant=refuse)


# -- fixtures -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Template:
    root: Path
    key: str
    x: torch.Tensor
    want: torch.Tensor


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """A cache of N items, built once and copied for each case."""
    root = tmp_path_factory.mktemp("template")
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(11))
    model = cached(Counting, persistent=True, persistent_cache_dir=root)()
    model(x)
    model.cache_instance.flush()
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    assert len(list(directory.glob("*/*.tce"))) == N
    return Template(root, directory.name, x, Counting()(x))


def _snapshot(scratch: Path) -> dict[str, bytes | str]:
    """What lies outside the cache: names and contents (FIFOs by kind)."""
    seen: dict[str, bytes | str] = {}
    for path in sorted(scratch.rglob("*")):
        mode = os.lstat(path).st_mode
        seen[str(path)] = path.read_bytes() if stat.S_ISREG(mode) else stat.filemode(mode)
    return seen


def _planted(template: Template, case: Case, root: Path, scratch: Path) -> Path:
    """Copy the template cache to ``root`` and plant the case's file; return the module directory."""
    shutil.copytree(template.root, root)
    directory = root / template.key
    if case.where == "entry":
        target = sorted(directory.glob("*/*.tce"))[0]
        target.unlink()
        case.plant(target, scratch)
    elif case.where == "meta":
        case.plant(directory / META_NAME, scratch)
    elif case.where == "shard":
        shard = sorted(p for p in directory.iterdir() if p.is_dir())[0]
        shutil.move(shard, scratch / "shard")
        (scratch / "shard" / "victim.txt").write_text("outside the cache")
        os.symlink(scratch / "shard", shard)
    else:
        shutil.move(directory, scratch / "module")
        (scratch / "module" / "victim.txt").write_text("outside the cache")
        os.symlink(scratch / "module", directory)
    return directory


def _listed_entries(directory: Path) -> list[Path]:
    """Regular entry files in shard directories that are not links."""
    return [
        entry
        for shard in directory.iterdir()
        if stat.S_ISDIR(os.lstat(shard).st_mode)
        for entry in shard.glob("*.tce")
        if stat.S_ISREG(os.lstat(entry).st_mode)
    ]


def _torchcache_files(root: Path) -> list[Path]:
    """Regular entry and metadata files under ``root`` (not through links)."""
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if stat.S_ISREG(os.lstat(path).st_mode) and (name.endswith(".tce") or name == META_NAME):
                found.append(path)
    return found


# -- the test -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_a_planted_file_never_breaks_a_call_nor_the_cli(name: str, template: Template, tmp_path: Path) -> None:
    case = CASES[name]
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    # The library: right outputs, bounded, one warning where one is due, later calls too.
    root = tmp_path / "library"
    directory = _planted(template, case, root, scratch)
    outside = _snapshot(scratch)
    with _released(tmp_path):
        model = cached(Counting, persistent=True, persistent_cache_dir=root)()

        def call_and_flush() -> Any:  # the flush reports what the background writes met
            out = model(template.x)
            model.cache_instance.flush()
            return out

        assert_same(_call(call_and_flush, case.warns), template.want)
        assert model.items == case.recomputed
        assert_same(_call(call_and_flush, warns=False), template.want)
        again = cached(Counting, persistent=True, persistent_cache_dir=root, max_memory_cache_size=0)()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)  # a fresh instance may report a path it cannot write
            assert_same(_bounded(lambda: again(template.x)), template.want)
        assert again.items <= case.recomputed
    assert _snapshot(scratch) == outside

    # The command line, on a freshly planted copy: no traceback, no file outside touched.
    root = tmp_path / "cli"
    shutil.rmtree(scratch)
    scratch.mkdir()
    directory = _planted(template, case, root, scratch)
    outside = _snapshot(scratch)
    regular = len(_listed_entries(directory))
    with _released(tmp_path):
        code, out, _ = _cli("ls", str(root), "--json")
        caches = _strict_json(out)["caches"]
        if case.where == "module":
            assert code == 0 and caches == []  # a linked module directory is not listed (nor removed)
        else:
            assert code == 0 and [(c["key"], c["entries"]) for c in caches] == [(template.key, regular)]
            assert (caches[0]["metadata_problem"] is None) == (case.where != "meta")
            assert _cli("info", template.key, "--root", str(root))[0] == 0
            code, out, _ = _cli("info", template.key, "--root", str(root), "--json")
            assert code == 0 and _strict_json(out)["key"] == template.key
        assert _cli("ls", str(root))[0] == 0
        code, out, _ = _cli("verify", str(root), "--json")
        assert code == (0 if case.verify_ok else 1) and _strict_json(out)["ok"] is case.verify_ok
        assert _cli("prune", str(root), "--keep", "0", "--dry-run")[0] == 0
        assert _cli("prune", str(root), "--max-size", "1", "--dry-run", "--json")[0] == 0
        code, _, err = _cli("verify", str(root), "--fix")
        assert code == (0 if case.fixable else 1), err
        assert _cli("verify", str(root))[0] == (0 if case.fixable else 1)
        assert _cli("clear", "--all", "--root", str(root), "-y")[0] == 0
        assert _cli("prune", str(root), "--keep", "0")[0] == 0
    if case.where != "module":
        assert _torchcache_files(root) == []  # every cache was removed, whatever its metadata
    assert _snapshot(scratch) == outside
