"""Files planted in a cache directory by anyone who can write there.

One table of planted files (FIFOs, deeply nested JSON, decompression bombs, sparse
giants, random bytes, directories, symbolic links, out-of-range numbers): at the path of
a torchcache 1.0 entry (still read in place), in module metadata, at the packed store's
index, lock files and segment files, and as valid records of the store whose frame is
hostile. For each, a decorated module must return the right outputs, in bounded memory
and time, with exactly one CacheWarning where one is due and none otherwise, and every
``torchcache`` command must finish without a traceback and never touch a file outside
the cache. Every call that could block runs on a thread with
a deadline, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import gc
import io
import json
import os
import shutil
import stat
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from tests.helpers import Counting, assert_same, cached, gigabyte_of_zeros, run_python, traced_memory
from torchcache import CacheWarning
from torchcache.cli.main import main
from torchcache.codec import CODEC_BROTLI, MAGIC, encode_header
from torchcache.meta import META_NAME
from torchcache.stores.packed.format import parse_segment_name
from torchcache.stores.packed.index import INDEX_NAME
from torchcache.stores.packed.locks import INDEX_LOCK_NAME, LOCK_NAME
from torchcache.stores.packed.store import PackedStore
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
    """The long-form header (torchcache 1.0's) of a float32 output of ``size`` values per item (the module's has 16)."""
    return b'{"leaves":[{"dtype":"float32","offset":0,"shape":[' + str(size).encode() + b']}],"tree":"T"}'


def _short_header(size: int | str) -> bytes:
    """The short-form header of a float32 output of ``size`` values per item."""
    header = encode_header(Layout.of(*flatten(torch.zeros(1, 16)), None).to_header())
    assert header == b'{"l":[["f4",[16]]]}'
    return header.replace(b"[16]", b"[" + str(size).encode() + b"]")


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


def _replacing(plant: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    """Plant in place of the file at the path (removed first, if there is one)."""

    def replace(path: Path, scratch: Path) -> None:
        path.unlink(missing_ok=True)
        plant(path, scratch)

    return replace


def _truncated(path: Path, scratch: Path) -> None:
    os.truncate(path, path.stat().st_size // 3)


def _extended(path: Path, scratch: Path) -> None:
    """The real file, made a 1 GiB sparse file by extending it with a hole."""
    os.truncate(path, GIB)


def _record(data: bytes | Callable[[], bytes]) -> Callable[[Path, Path], None]:
    """Store a valid record holding ``data`` in the packed store, under the key the path names."""

    def plant(path: Path, scratch: Path) -> None:
        with PackedStore(path.parent, 1 << 40) as store:
            assert store.put_many([(path.name, data if isinstance(data, bytes) else data())]) == 1

    return plant


# -- the table ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A planted file and what torchcache must make of it.

    ``where`` is ``"entry"`` (at the path of a torchcache 1.0 entry, whose key the packed
    store no longer holds: the library never reads it, and says once that the directory
    holds 1.0 entry files if it is a regular file; the command line reads those), ``"record"`` (a valid
    record of the packed store, under the key of one item), ``"meta"`` (at the module's
    ``torchcache.json``), ``"shard"`` (a whole 1.0 shard directory), ``"module"`` (the
    module directory), or the name of a file of the packed store (``index.lmdb``, a
    segment, a lock file), planted where that file is (``plant`` removes it first if it
    must). ``warns``: one CacheWarning from the library (else none).
    ``recomputed``: items the first reader computes. ``entries``: what ``torchcache ls``
    counts (default: the store's entries and the regular 1.0 files). ``verify_ok``:
    ``torchcache verify`` finds nothing before any fix. ``fixable``: ``verify --fix``
    leaves no problem. ``in_process``: the library can meet it in this process (else a
    child process does, see :func:`test_a_truncated_index_never_kills_a_call`).
    """

    where: str
    plant: Callable[[Path, Path], None]
    warns: bool
    recomputed: int
    verify_ok: bool
    fixable: bool = True
    entries: int | None = None
    in_process: bool = True


#: A 1.0 entry file: the library never reads one, and says once that the directory holds such files.
ENTRY_CORRUPT = {"warns": True, "recomputed": 1, "verify_ok": False}
#: A link or FIFO at a 1.0 entry's name (or a linked shard): never read, reported by migrate and verify, unlinked.
NOT_A_FILE = {"warns": False, "recomputed": 1, "verify_ok": False}
META_DAMAGED = {"warns": True, "recomputed": 0, "verify_ok": False}
#: A hostile index: the store moves it away and rebuilds the index from the segments.
INDEX_REBUILT = {"warns": True, "recomputed": 0}
#: A segment the index knows, unreadable: its entries are misses.
SEGMENT_LOST = {"warns": True, "recomputed": N, "verify_ok": False}
#: A segment file the index does not know: the store's next writer removes it; verify reports it.
UNKNOWN = {"warns": False, "recomputed": 0, "verify_ok": False}
#: A file the store does not need as it is: nothing lost, nothing to report.
HARMLESS = {"warns": False, "recomputed": 0, "verify_ok": True}
SEGMENT = "seg-00000001.tcs"
UNKNOWN_SEGMENT = "seg-000000ff.tcs"

CASES: dict[str, Case] = {
    # torchcache 1.0 entries, read by the command line only
    "entry: FIFO": Case("entry", _fifo, **NOT_A_FILE),
    "entry: directory": Case("entry", _directory, warns=False, recomputed=1, verify_ok=True),  # never touched
    "entry: link to /dev/zero": Case("entry", _link_to("/dev/zero"), **NOT_A_FILE),
    "entry: link to a FIFO outside": Case("entry", _link_outside(lambda p: os.mkfifo(p)), **NOT_A_FILE),
    "entry: dangling link": Case("entry", _link_to("/nonexistent/torchcache-entry"), **NOT_A_FILE),
    "entry: link to random bytes outside": Case(
        "entry", _link_outside(lambda p: p.write_bytes(os.urandom(3000))), **NOT_A_FILE
    ),
    "entry: 5,000 nested arrays as header": Case("entry", _bytes(_sealed(_nested(5000), b"", 0, 0)), **ENTRY_CORRUPT),
    "entry: 5,000 nested objects in the tree": Case(
        "entry",
        _bytes(_sealed(b'{"leaves":[],"tree":' + b'{"a":' * 5000 + b"1" + b"}" * 5001, b"", 0, 0)),
        **ENTRY_CORRUPT,
    ),
    "entry: brotli bomb, 1 GiB behind a 4 kB declared size": Case(
        "entry", _bytes(lambda: _sealed(_header(1024), gigabyte_of_zeros(), 4096)), **ENTRY_CORRUPT
    ),
    "entry: brotli bomb declaring 1 GiB against its header": Case(
        "entry", _bytes(lambda: _sealed(_header(16), gigabyte_of_zeros(), GIB)), **ENTRY_CORRUPT
    ),
    "entry: brotli bomb whose header declares 1 GiB": Case(
        "entry", _bytes(lambda: _sealed(_header(GIB // 4), gigabyte_of_zeros(), GIB)), **ENTRY_CORRUPT
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
    # valid records of the packed store holding hostile frames
    "record: brotli bomb, 1 GiB behind a 4 kB declared size": Case(
        "record", _record(lambda: _sealed(_header(1024), gigabyte_of_zeros(), 4096)), **ENTRY_CORRUPT
    ),
    "record: brotli bomb declaring 1 GiB against its header": Case(
        "record", _record(lambda: _sealed(_header(16), gigabyte_of_zeros(), GIB)), **ENTRY_CORRUPT
    ),
    "record: brotli bomb whose header declares 1 GiB": Case(
        "record", _record(lambda: _sealed(_header(GIB // 4), gigabyte_of_zeros(), GIB)), **ENTRY_CORRUPT
    ),
    "record: 5,000 nested arrays as header": Case(
        "record", _record(_sealed(_nested(5000), b"", 0, 0)), **ENTRY_CORRUPT
    ),
    "record: shape of 10**30 elements": Case(
        "record", _record(lambda: _sealed(_header(10**30), b"\x00" * 64, 64, 0)), **ENTRY_CORRUPT
    ),
    "record: NaN offset": Case(
        "record",
        _record(lambda: _sealed(_header(16).replace(b'"offset":0', b'"offset":NaN'), b"\x00" * 64, 64, 0)),
        **ENTRY_CORRUPT,
    ),
    "record: short header, shape of 10**30 elements": Case(
        "record", _record(lambda: _sealed(_short_header(10**30), b"\x00" * 64, 64, 0)), **ENTRY_CORRUPT
    ),
    "record: short header, NaN in a shape": Case(
        "record", _record(lambda: _sealed(_short_header("NaN"), b"\x00" * 64, 64, 0)), **ENTRY_CORRUPT
    ),
    "record: random bytes": Case("record", _record(lambda: os.urandom(5000)), **ENTRY_CORRUPT),
    # the packed store's index
    # (the command line reads an index as it is: a damaged one counts no entry until `verify --fix` rebuilds it)
    "index: random bytes": Case(
        INDEX_NAME, _bytes(lambda: os.urandom(50_000)), verify_ok=False, entries=0, **INDEX_REBUILT
    ),
    "index: cut short": Case(INDEX_NAME, _truncated, verify_ok=False, entries=0, in_process=False, **INDEX_REBUILT),
    "index: 1 GiB sparse file": Case(
        INDEX_NAME, _replacing(lambda p, s: _sparse(p, GIB)), verify_ok=False, entries=0, **INDEX_REBUILT
    ),
    # (the command line does not open an index that is not a regular file: it counts no entry until `verify --fix`)
    "index: FIFO": Case(INDEX_NAME, _replacing(_fifo), verify_ok=False, entries=0, **INDEX_REBUILT),
    "index: link to /dev/zero": Case(
        INDEX_NAME, _replacing(_link_to("/dev/zero")), verify_ok=False, entries=0, **INDEX_REBUILT
    ),
    "index: directory": Case(INDEX_NAME, _replacing(_directory), verify_ok=False, entries=0, **INDEX_REBUILT),
    # its lock files (verify reads the index as it is: a lock file that is not a file is a problem until --fix)
    "index lock: FIFO": Case(INDEX_NAME + "-lock", _replacing(_fifo), verify_ok=False, **INDEX_REBUILT),
    "index lock: directory": Case(INDEX_NAME + "-lock", _replacing(_directory), verify_ok=False, **INDEX_REBUILT),
    "compaction lock: FIFO": Case(LOCK_NAME, _replacing(_fifo), **HARMLESS),
    "compaction lock: directory": Case(LOCK_NAME, _replacing(_directory), **HARMLESS),
    "opening lock: FIFO": Case(INDEX_LOCK_NAME, _replacing(_fifo), **HARMLESS),
    "opening lock: directory": Case(INDEX_LOCK_NAME, _replacing(_directory), **HARMLESS),
    # a segment the index knows, and one it does not
    "segment: random bytes": Case(SEGMENT, _bytes(lambda: os.urandom(5000)), **SEGMENT_LOST),
    "segment: FIFO": Case(SEGMENT, _replacing(_fifo), **SEGMENT_LOST),
    "segment: directory": Case(SEGMENT, _replacing(_directory), **SEGMENT_LOST),
    "segment: link to a copy outside": Case(
        SEGMENT, lambda p, s: (shutil.move(p, s / "outside"), os.symlink(s / "outside", p)), **SEGMENT_LOST
    ),
    "segment: 1 GiB sparse file": Case(SEGMENT, _replacing(lambda p, s: _sparse(p, GIB)), **SEGMENT_LOST),
    "segment: extended to 1 GiB": Case(SEGMENT, _extended, **HARMLESS),
    # (a segment file the index does not know is reported, and removed by `verify --fix` or the next writer)
    "unknown segment: random bytes": Case(UNKNOWN_SEGMENT, _bytes(lambda: os.urandom(5000)), **UNKNOWN),
    "unknown segment: FIFO": Case(UNKNOWN_SEGMENT, _fifo, **UNKNOWN),  # reported, and unlinked by --fix
    "unknown segment: directory": Case(UNKNOWN_SEGMENT, _directory, **HARMLESS),
    "unknown segment: link to random bytes outside": Case(
        UNKNOWN_SEGMENT, _link_outside(lambda p: p.write_bytes(os.urandom(3000))), **UNKNOWN
    ),
    "unknown segment: 1 GiB sparse file": Case(UNKNOWN_SEGMENT, lambda p, s: _sparse(p, GIB), **UNKNOWN),
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
    # (a linked 1.0 shard is not read, nor listed)
    "shard: link to a directory outside": Case("shard", lambda p, s: None, **NOT_A_FILE),
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

    with traced_memory() as traced:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(DEADLINE)
        peak = traced()[1]
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
    item: str
    frame: bytes


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """A packed cache of N items, built once and copied for each case; its writer is done."""
    root = tmp_path_factory.mktemp("template")
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(11))

    def build() -> None:
        model = cached(Counting, persistent=True, persistent_cache_dir=root)()
        model(x)
        model.cache_instance.flush()

    build()
    gc.collect()  # the model's tier goes, and with it the lock on the segment it wrote
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    with PackedStore(directory, 1 << 40) as store:  # seals the segment of the writer that is done
        keys = sorted(store.keys())
        frames = store.get_many(keys)
    assert len(keys) == N and all(frames)
    names = [LOCK_NAME, INDEX_LOCK_NAME, INDEX_NAME, INDEX_NAME + "-lock", SEGMENT, META_NAME]
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)
    return Template(root, directory.name, x, Counting()(x), keys[0], bytes(frames[0]))  # type: ignore[arg-type]


def _snapshot(scratch: Path, readers: bool = True) -> dict[str, bytes | str]:
    """What lies outside the cache: names and contents (FIFOs by kind).

    Without ``readers``, the contents of LMDB lock files are left out: their reader
    table records every process that reads the index.
    """
    seen: dict[str, bytes | str] = {}
    for path in sorted(scratch.rglob("*")):
        mode = os.lstat(path).st_mode
        if not readers and path.name == INDEX_NAME + "-lock":
            seen[str(path)] = "lock file"
        else:
            seen[str(path)] = path.read_bytes() if stat.S_ISREG(mode) else stat.filemode(mode)
    return seen


def _planted(template: Template, case: Case, root: Path, scratch: Path) -> Path:
    """Copy the template cache to ``root`` and plant the case's file; return the module directory."""
    shutil.copytree(template.root, root)
    directory = root / template.key
    key = template.item
    if case.where in ("entry", "shard"):  # the store no longer holds the item: its read falls back to 1.0 files
        with PackedStore(directory, 1 << 40) as store:
            assert store.delete_many([key]) == 1
    if case.where == "entry":
        target = directory / key[:3] / f"{key}.tce"
        target.parent.mkdir()
        case.plant(target, scratch)
    elif case.where == "record":
        case.plant(directory / key, scratch)
    elif case.where == "meta":
        case.plant(directory / META_NAME, scratch)
    elif case.where == "shard":
        outside = scratch / "shard"
        outside.mkdir()
        (outside / f"{key}.tce").write_bytes(template.frame)  # a sound 1.0 entry
        (outside / "victim.txt").write_text("outside the cache")
        os.symlink(outside, directory / key[:3])
    elif case.where == "module":
        shutil.move(directory, scratch / "module")
        (scratch / "module" / "victim.txt").write_text("outside the cache")
        os.symlink(scratch / "module", directory)
    else:
        case.plant(directory / case.where, scratch)
    return directory


def _listed_entries(directory: Path) -> list[Path]:
    """Regular 1.0 entry files in shard directories that are not links."""
    return [
        entry
        for shard in directory.iterdir()
        if stat.S_ISDIR(os.lstat(shard).st_mode)
        for entry in shard.glob("*.tce")
        if stat.S_ISREG(os.lstat(entry).st_mode)
    ]


def _is_torchcache_file(name: str) -> bool:
    return (
        name.endswith(".tce")
        or name in (META_NAME, INDEX_NAME, INDEX_NAME + "-lock", LOCK_NAME, INDEX_LOCK_NAME)
        or parse_segment_name(name) is not None
    )


def _torchcache_files(root: Path) -> list[Path]:
    """Regular files of torchcache's (1.0 entries, metadata, the packed store's) under ``root``, not through links."""
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if stat.S_ISREG(os.lstat(path).st_mode) and _is_torchcache_file(name):
                found.append(path)
    return found


# -- the tests ----------------------------------------------------------------------------------
def _library_meets(case: Case, template: Template, tmp_path: Path, scratch: Path) -> None:
    """A decorated module on a planted copy: right outputs, bounded, one warning where one is due, later calls too."""
    root = tmp_path / "library"
    _planted(template, case, root, scratch)
    # A linked module directory is where the library was told to cache: it reads its index there.
    readers = case.where != "module"
    outside = _snapshot(scratch, readers)
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
    assert _snapshot(scratch, readers) == outside


@pytest.mark.parametrize("name", list(CASES))
def test_a_planted_file_never_breaks_a_call_nor_the_cli(name: str, template: Template, tmp_path: Path) -> None:
    case = CASES[name]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case.in_process:
        _library_meets(case, template, tmp_path, scratch)
        shutil.rmtree(scratch)
        scratch.mkdir()

    # The command line, on a freshly planted copy: no traceback, no file outside touched.
    root = tmp_path / "cli"
    directory = _planted(template, case, root, scratch)
    outside = _snapshot(scratch)
    stored = N - (case.where in ("entry", "shard"))
    entries = stored + len(_listed_entries(directory)) if case.entries is None else case.entries
    with _released(tmp_path):
        code, out, _ = _cli("ls", str(root), "--json")
        caches = _strict_json(out)["caches"]
        if case.where == "module":
            assert code == 0 and caches == []  # a linked module directory is not listed (nor removed)
        else:
            assert code == 0 and [(c["key"], c["entries"]) for c in caches] == [(template.key, entries)]
            assert (caches[0]["metadata_problem"] is None) == (case.where != "meta")
            assert _cli("info", template.key, "--root", str(root))[0] == 0
            code, out, _ = _cli("info", template.key, "--root", str(root), "--json")
            assert code == 0 and _strict_json(out)["key"] == template.key
        assert _cli("ls", str(root))[0] == 0
        code, out, _ = _cli("verify", str(root), "--json")
        assert code == (0 if case.verify_ok else 1) and _strict_json(out)["ok"] is case.verify_ok
        assert _cli("prune", str(root), "--keep", "0", "--dry-run")[0] == 0
        assert _cli("prune", str(root), "--max-size", "1B", "--dry-run", "--json")[0] == 0
        code, _, err = _cli("migrate", str(root))  # packs the sound 1.0 entries, leaves the damaged ones
        damaged_entry = case.where == "entry" and case.warns and not case.verify_ok  # a regular 1.0 file, unreadable
        assert code == (1 if damaged_entry else 0), err  # a link alone leaves nothing to migrate: verify reports it
        code, _, err = _cli("verify", str(root), "--fix")
        assert code == (0 if case.fixable else 1), err
        assert _cli("verify", str(root))[0] == (0 if case.fixable else 1)
        if case.where == INDEX_NAME:  # rebuilt from the segment files: nothing was lost
            code, out, _ = _cli("ls", str(root), "--json")
            assert [c["entries"] for c in _strict_json(out)["caches"]] == [N]
        assert _cli("clear", "--all", "--root", str(root), "-y")[0] == 0
        assert _cli("prune", str(root), "--keep", "0")[0] == 0
    if case.where != "module":
        assert _torchcache_files(root) == []  # every cache was removed, whatever its metadata
    assert _snapshot(scratch) == outside


_CALL_ON_A_CUT_INDEX = """
import os, sys, warnings
from pathlib import Path
import torch
from tests.helpers import Counting, assert_same, cached, run_python
from torchcache import CacheWarning

root = Path(sys.argv[1])
index = next(root.glob("*/index.lmdb"))
os.truncate(index, index.stat().st_size // 3)
x = torch.randn(int(sys.argv[2]), 4, generator=torch.Generator().manual_seed(11))
model = cached(Counting, persistent=True, persistent_cache_dir=root)()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert_same(model(x), Counting()(x))
print(model.items, sum(issubclass(w.category, CacheWarning) for w in caught))
"""


@pytest.mark.slow
def test_a_truncated_index_never_kills_a_call(template: Template, tmp_path: Path) -> None:
    """The library part of the "index: cut short" case, in a child process: in this one, it would end the suite."""
    root = tmp_path / "library"
    shutil.copytree(template.root, root)
    done = run_python(_CALL_ON_A_CUT_INDEX, str(root), str(N), timeout=DEADLINE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1"]  # the index is rebuilt from the segments, with one warning
