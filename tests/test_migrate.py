"""A cache written by torchcache 1.0 (one file per entry): `torchcache migrate` packs it, and only then is it read.

The 1.0 cache is built from real entries: a module runs once into a scratch root, and
its keys and frames, read back from the packed store, are written as 1.0 entry files
(``<3 hex digits>/<key>.tce``, a frame each) into a fresh root's module directory,
beside the same ``torchcache.json`` and with no packed store.
"""

from __future__ import annotations

import gc
import io
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import Counting, assert_same, cached, run_python, stored_entries
from torchcache import CacheWarning
from torchcache.cli.main import main
from torchcache.cli.verify import TMP_GRACE_SECONDS
from torchcache.codec import encode_frame
from torchcache.meta import META_NAME
from torchcache.stores.packed.index import INDEX_NAME
from torchcache.stores.packed.store import PackedStore
from torchcache.tree import Layout, flatten

ITEMS = 40


@dataclass(frozen=True)
class Legacy:
    """A torchcache 1.0 cache: its root, module directory, inputs, outputs and frames by key."""

    root: Path
    directory: Path
    x: torch.Tensor
    want: torch.Tensor
    frames: dict[str, bytes]

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("*/*.tce"))


def inputs(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def model(root: Path, **options: Any) -> Any:
    """A fresh decorated instance caching under ``root`` (only the disk: the memory tier is off)."""
    return cached(Counting, persistent=True, persistent_cache_dir=root, max_memory_cache_size=0, **options)()


def write_legacy_entry(directory: Path, key: str, frame: bytes) -> Path:
    """Write one entry as torchcache 1.0 did: its frame alone, at ``<3 hex digits>/<key>.tce``."""
    path = directory / key[:3] / f"{key}.tce"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(frame)
    return path


def build_legacy(tmp_path: Path, items: int = ITEMS, max_bytes: int | None = None) -> Legacy:
    """Write a real cache of ``items`` entries as torchcache 1.0 would have: one file per entry."""
    scratch, root = tmp_path / "scratch", tmp_path / "legacy"
    x = inputs(items)

    def fill() -> None:
        writer = model(scratch)
        writer(x)
        writer.cache_instance.flush()

    fill()
    gc.collect()  # the writer and its tier go: nothing of the scratch root stays open
    stored = stored_entries(scratch)
    (source,) = {path.parent for path in stored}
    directory = root / source.name
    directory.mkdir(parents=True)
    for path, frame in stored.items():
        write_legacy_entry(directory, path.name, frame)
    meta = json.loads((source / META_NAME).read_text())
    if max_bytes is not None:
        meta["max_bytes"] = max_bytes
    (directory / META_NAME).write_text(json.dumps(meta))
    shutil.rmtree(scratch)
    legacy = Legacy(root, directory, x, Counting()(x), {path.name: frame for path, frame in stored.items()})
    assert len(legacy.files()) == items and not (directory / INDEX_NAME).exists()
    assert sorted(p.name for p in directory.iterdir() if p.is_file()) == [META_NAME]
    return legacy


@pytest.fixture
def legacy(tmp_path: Path) -> Iterator[Legacy]:
    yield build_legacy(tmp_path)
    gc.collect()  # close what the test opened before its directory goes


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def packed(directory: Path) -> dict[str, bytes]:
    """The frames in the packed store of a module directory, by key."""
    return {path.name: frame for path, frame in stored_entries(directory).items()}


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# -- read once migrated --------------------------------------------------------------------------
_READ_IN_A_NEW_PROCESS = """
import sys, warnings
from pathlib import Path
import torch
from tests.helpers import Counting, assert_same, cached

root, n = Path(sys.argv[1]), int(sys.argv[2])
x = torch.randn(n, 4, generator=torch.Generator().manual_seed(5))
cache = cached(Counting, persistent=True, persistent_cache_dir=root, max_memory_cache_size=0)()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert_same(cache(x), Counting()(x))
print(cache.items, cache.cache_instance.stats().hits, sum("torchcache migrate" in str(w.message) for w in caught))
"""


@pytest.mark.slow
def test_a_1_0_cache_is_read_once_migrated_and_says_so_until_then(legacy: Legacy) -> None:
    before = run_python(_READ_IN_A_NEW_PROCESS, str(legacy.root), str(ITEMS))
    assert before.returncode == 0, before.stderr[-2000:]
    assert before.stdout.split() == [str(ITEMS), "0", "1"]  # every item computed, with one warning
    assert {p.stem: p.read_bytes() for p in legacy.files()} == legacy.frames  # the 1.0 files as they were
    assert cli("migrate", str(legacy.root))[0] == 0
    after = run_python(_READ_IN_A_NEW_PROCESS, str(legacy.root), str(ITEMS))
    assert after.returncode == 0, after.stderr[-2000:]
    assert after.stdout.split() == ["0", str(ITEMS), "0"]  # no item computed, every one a hit


def test_info_and_ls_show_a_1_0_cache(legacy: Legacy) -> None:
    code, out, err = cli("ls", str(legacy.root), "--json")
    (listed,) = json.loads(out)["caches"]
    assert (code, err) == (0, "")
    assert (listed["key"], listed["entries"], listed["legacy_entries"]) == (legacy.directory.name, ITEMS, ITEMS)
    assert listed["metadata_problem"] is None and listed["live_bytes"] == 0
    assert listed["bytes"] == sum(p.stat().st_size for p in legacy.directory.rglob("*") if p.is_file())
    code, out, _ = cli("ls", str(legacy.root))
    assert code == 0 and f"1 module cache, {ITEMS} entries, " in out
    code, out, _ = cli("info", legacy.directory.name, "--root", str(legacy.root))
    assert code == 0 and f"\nentries          {ITEMS}\n" in out
    assert f"\n1.0 entries      {ITEMS} (read once `torchcache migrate` packs them)\n" in out
    assert out.splitlines()[-1].split() == [str(ITEMS), "64", "B", "float32[16]"]  # layouts read from the files
    info = json.loads(cli("info", str(legacy.directory), "--json", "--sample", "5")[1])
    assert (info["entries"], info["legacy_entries"], info["sampled_entries"]) == (ITEMS, ITEMS, 5)
    code, out, _ = cli("verify", str(legacy.root))
    assert code == 0 and out.startswith(f"checked {ITEMS} entries in 1 module cache")
    assert len(legacy.files()) == ITEMS and not (legacy.directory / INDEX_NAME).exists()  # looking changes nothing


# -- migrate ------------------------------------------------------------------------------------
def test_migrate_packs_every_entry_and_removes_the_1_0_files(legacy: Legacy) -> None:
    (legacy.directory / "notes").mkdir()  # not torchcache's: kept
    reader = model(legacy.root)  # a process that uses the cache while the migration runs
    with pytest.warns(CacheWarning, match="torchcache migrate"):
        assert_same(reader(legacy.x[:5]), legacy.want[:5])
    code, out, err = cli("migrate", str(legacy.root))
    assert (code, err) == (0, "")
    assert out == f"packed {ITEMS} entries of 1 module cache under {legacy.root}\n"
    assert packed(legacy.directory) == legacy.frames  # the frames, byte for byte
    assert list(legacy.directory.rglob("*.tce")) == []
    assert sorted(p.name for p in legacy.directory.iterdir() if p.is_dir()) == ["notes"]  # shard directories gone
    assert_same(reader(legacy.x), legacy.want)
    assert reader.items == 5  # the running reader hits the packed entries (it computed its first five before)

    del reader
    gc.collect()
    fresh = model(legacy.root)
    assert_same(fresh(legacy.x), legacy.want)
    assert fresh.items == 0 and fresh.cache_instance.stats().hits == ITEMS
    listed = json.loads(cli("ls", str(legacy.root), "--json")[1])["caches"]
    assert [(c["entries"], c["legacy_entries"]) for c in listed] == [(ITEMS, 0)]
    assert cli("verify", str(legacy.root))[0] == 0


def test_a_migration_the_disk_stops_says_what_it_packed_and_why_and_finishes_when_run_again(
    legacy: Legacy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.cli import migrate
    from torchcache.errors import StoreError

    put_many, calls = PackedStore.put_many, []

    def filling(self: PackedStore, items: Any) -> int:
        calls.append(len(items))
        if len(calls) == 3:
            self._report("write", "cannot write the segment: [Errno 27] File too large")
            raise StoreError("the store directory cannot be written")
        return put_many(self, items)

    monkeypatch.setattr(migrate, "_MIGRATE_BATCH", 8)
    with monkeypatch.context() as full:
        full.setattr(PackedStore, "put_many", filling)
        code, out, err = cli("migrate", str(legacy.root))
    assert code == 1 and out.startswith("packed 16 entries of 1 module cache")
    assert "File too large" in err and "run `torchcache migrate` again" in err
    assert len(packed(legacy.directory)) == 16 and len(legacy.files()) == ITEMS - 16  # each file gone once packed
    assert cli("migrate", str(legacy.root))[:2] == (
        0,
        f"packed {ITEMS - 16} entries of 1 module cache under {legacy.root}\n",
    )
    assert packed(legacy.directory) == legacy.frames


def test_ls_counts_an_entry_packed_by_a_migration_killed_before_it_removed_its_file_once(legacy: Legacy) -> None:
    kept = {path: path.read_bytes() for path in legacy.files()[:10]}
    assert cli("migrate", str(legacy.root))[0] == 0
    for path, frame in kept.items():  # as a kill -9 between a batch's commit and its files' removal leaves them
        write_legacy_entry(legacy.directory, path.name.removesuffix(".tce"), frame)
    listed = json.loads(cli("ls", str(legacy.root), "--json")[1])["caches"]
    assert [(c["entries"], c["legacy_entries"]) for c in listed] == [(ITEMS, 10)]
    assert cli("migrate", str(legacy.root))[0] == 0 and legacy.files() == []


def test_large_entries_are_migrated_in_batches_of_bounded_bytes(
    legacy: Legacy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.cli import migrate

    sizes: list[int] = []
    put_many = PackedStore.put_many

    def counting(self: PackedStore, items: Any) -> int:
        sizes.append(sum(len(frame) for _, frame in items))
        return put_many(self, items)

    frame = len(next(iter(legacy.frames.values())))
    monkeypatch.setattr(migrate, "_BATCH_BYTES", 3 * frame)
    monkeypatch.setattr(PackedStore, "put_many", counting)
    assert cli("migrate", str(legacy.root))[0] == 0
    assert len(sizes) == -(-ITEMS // 3) and max(sizes) <= 3 * frame
    assert packed(legacy.directory) == legacy.frames


def test_migrate_twice_is_a_no_op(legacy: Legacy) -> None:
    assert cli("migrate", str(legacy.directory))[0] == 0  # a module directory works as well as a root
    before = packed(legacy.directory)
    files = sorted(p.name for p in legacy.directory.iterdir())
    code, out, err = cli("migrate", str(legacy.root))
    assert (code, err) == (0, "")
    assert (
        out == f"nothing to migrate: no torchcache 1.0 entries, 1.2 features files or 1.2 samples under {legacy.root}\n"
    )
    assert packed(legacy.directory) == before and len(before) == ITEMS
    assert sorted(p.name for p in legacy.directory.iterdir()) == files


def test_a_1_0_file_whose_name_is_no_key_is_left_as_damaged_and_the_others_migrated(legacy: Legacy) -> None:
    frame = next(iter(legacy.frames.values()))
    long = write_legacy_entry(legacy.directory, "ab" * 33, frame)  # 66 hex digits: no store key
    code, _, err = cli("migrate", str(legacy.root))
    assert code == 1 and "left 1 file it could not migrate" in err
    assert legacy.files() == [long] and set(packed(legacy.directory)) == set(legacy.frames)
    assert cli("verify", "--fix", str(legacy.root))[0] == 0 and not long.exists()


def test_migrate_leaves_a_damaged_file_names_it_and_verify_fix_removes_it(legacy: Legacy) -> None:
    bad = legacy.files()[7]
    flip_last_byte(bad)
    code, out, err = cli("migrate", str(legacy.root))
    assert code == 1
    assert out.startswith(f"packed {ITEMS - 1} entries of 1 module cache under {legacy.root}\n")
    (row,) = [line for line in out.splitlines() if str(bad.relative_to(legacy.root)) in line]
    assert "checksum mismatch" in row
    assert err == "torchcache: error: left 1 file it could not migrate; `torchcache verify --fix` removes them\n"
    assert legacy.files() == [bad] and set(packed(legacy.directory)) == set(legacy.frames) - {bad.stem}

    code, out, _ = cli("verify", str(legacy.root))
    assert code == 1 and str(bad.relative_to(legacy.root)) in out
    code, out, err = cli("verify", "--fix", str(legacy.root))
    assert (code, err) == (0, "") and "removed 1 file" in out and not bad.exists()
    assert cli("verify", str(legacy.root))[0] == 0
    assert cli("migrate", str(legacy.root))[1].startswith("nothing to migrate")
    fresh = model(legacy.root)
    assert_same(fresh(legacy.x), legacy.want)
    assert fresh.items == 1  # only the damaged entry is computed again


def test_links_and_fifos_at_1_0_names_are_reported_never_read_and_unlinked_by_verify_fix(
    legacy: Legacy, tmp_path: Path
) -> None:
    files = legacy.files()
    outside, elsewhere = tmp_path / "outside.tce", tmp_path / "elsewhere"
    shutil.move(files[0], outside)
    files[0].symlink_to(outside)  # a link to a good frame: not read (migrate reads regular files only)
    os.remove(files[1])
    os.mkfifo(files[1])
    shard = next(
        p for p in sorted(legacy.directory.iterdir()) if p.is_dir() and files[0].parent != p != files[1].parent
    )
    moved = {p.name for p in shard.iterdir()}
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)  # a linked subdirectory: not followed
    odd = [files[0], files[1], shard]
    code, out, err = cli("migrate", str(legacy.root))
    assert code == 1 and "could not migrate" in err
    assert all(str(p.relative_to(legacy.root)) in out for p in odd)
    kept = set(legacy.frames) - {files[0].stem, files[1].stem} - {name.removesuffix(".tce") for name in moved}
    assert set(packed(legacy.directory)) == kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "run torchcache migrate" for what it cannot migrate
        assert_same(model(legacy.root)(legacy.x), legacy.want)
    code, out, _ = cli("verify", str(legacy.root))
    assert code == 1 and all(str(p.relative_to(legacy.root)) in out for p in odd) and "not a file" in out
    assert cli("verify", "--fix", str(legacy.root))[0] == 0
    assert (
        not any(os.path.lexists(p) for p in odd) and outside.exists() and {p.name for p in elsewhere.iterdir()} == moved
    )
    assert cli("verify", str(legacy.root))[0] == 0


def test_a_file_not_named_as_a_1_0_entry_is_not_taken_for_one(legacy: Legacy) -> None:
    notes = legacy.files()[0].parent / "notes.tce"  # not <hex key>.tce: neither migrated nor asked about
    notes.write_text("mine")
    assert cli("migrate", str(legacy.root))[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "run torchcache migrate" for it, in the process that finds it
        assert_same(model(legacy.root)(legacy.x), legacy.want)
    assert notes.read_text() == "mine" and cli("migrate", str(legacy.root))[1].startswith("nothing to migrate")


def test_migrate_under_a_small_limit_reports_what_it_dropped(tmp_path: Path) -> None:
    legacy = build_legacy(tmp_path, items=600, max_bytes=1 << 16)  # room for about 200 of them
    code, out, err = cli("migrate", str(legacy.root))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    kept = packed(legacy.directory)
    assert 0 < len(kept) < 600
    assert lines == [
        f"packed {len(kept)} entries of 1 module cache under {legacy.root}",
        f"{600 - len(kept)} entries did not fit the size limit and were dropped",
    ]
    assert all(legacy.frames[key] == frame for key, frame in kept.items())
    assert list(legacy.directory.rglob("*.tce")) == []
    fresh = model(legacy.root, max_persistent_cache_size=1 << 16)
    assert_same(fresh(legacy.x), legacy.want)
    assert fresh.cache_instance.stats().hits == len(kept)
    gc.collect()


# -- verify on 1.0 files ------------------------------------------------------------------------
def test_verify_reports_and_fixes_damaged_1_0_files(legacy: Legacy) -> None:
    files = legacy.files()
    flipped, truncated, garbage, wrong_size, bad_header = files[:5]
    flip_last_byte(flipped)
    truncated.write_bytes(truncated.read_bytes()[:-3])
    garbage.write_bytes(b"garbage")
    spec, leaves = flatten(torch.zeros(1, 3))
    header = Layout.of(spec, leaves, None).to_header()
    wrong_size.write_bytes(encode_frame(header, b"\x00" * 12, None))  # 12 bytes, the layout says 16
    bad_header.write_bytes(encode_frame({"no": "leaves"}, b"\x00" * 16, None))
    old = time.time() - 2 * TMP_GRACE_SECONDS
    stray = files[5].parent / f".{files[5].stem}.123.deadbeef.tmp"
    stray.write_bytes(b"half an entry")
    os.utime(stray, (old, old))
    fresh_tmp = files[6].parent / ".fresh.999.tmp"
    fresh_tmp.write_bytes(b"being written")
    before = sorted(legacy.root.rglob("*"))

    code, out, err = cli("verify", str(legacy.root))
    assert code == 1 and err == "torchcache: error: 6 problems found; run `torchcache verify --fix` to fix them\n"
    reasons = {line.split()[-1]: line for line in out.splitlines()[2:8]}
    rel = {name: str(p.relative_to(legacy.root)) for name, p in locals().items() if isinstance(p, Path)}
    assert "checksum mismatch" in reasons[rel["flipped"]]
    assert "does not match its prefix" in reasons[rel["truncated"]]
    assert "truncated frame" in reasons[rel["garbage"]]
    assert "payload is 12 bytes, its header describes 16" in reasons[rel["wrong_size"]]
    assert "invalid header" in reasons[rel["bad_header"]]
    assert reasons[rel["stray"]].startswith("temporary")
    assert rel["fresh_tmp"] not in out and "left 1 recent temporary file alone" in out
    assert sorted(legacy.root.rglob("*")) == before  # reporting removes nothing

    code, out, err = cli("verify", "--fix", str(legacy.root))
    assert (code, err) == (0, "") and "removed 6 files" in out
    assert [p for p in (flipped, truncated, garbage, wrong_size, bad_header, stray, fresh_tmp) if p.exists()] == [
        fresh_tmp
    ]
    assert len(legacy.files()) == ITEMS - 5
    assert cli("migrate", str(legacy.root))[0] == 0
    reader = model(legacy.root)
    assert_same(reader(legacy.x), legacy.want)
    assert reader.items == 5  # the rest were packed, and are read


def test_migrate_refuses_a_store_whose_index_is_cut_short_until_verify_fix(legacy: Legacy) -> None:
    frames = list(legacy.frames.values())
    extra = {f"{i:032x}": frames[i % len(frames)] for i in range(300)}
    with PackedStore(legacy.directory, 1 << 40) as store:  # entries packed before, by another run
        assert store.put_many(list(extra.items())) == 300
    index = legacy.directory / INDEX_NAME
    os.truncate(index, index.stat().st_size // 3)  # LMDB would touch pages past the end: SIGBUS
    code, out, err = cli("migrate", str(legacy.root))
    assert code == 1 and out == f"packed 0 entries of 0 module caches under {legacy.root}\n"
    assert err.startswith(f"torchcache: error: cannot migrate {legacy.directory}: the index of ")
    assert "is cut short" in err and err.endswith("run `torchcache verify --fix` to rebuild it\n")
    assert len(legacy.files()) == ITEMS

    code, out, _ = cli("verify", str(legacy.root))
    assert code == 1 and f"cut short: {index.stat().st_size:,} bytes" in out
    assert cli("verify", "--fix", str(legacy.root))[0] == 0
    assert packed(legacy.directory) == extra  # rebuilt from the segment files
    code, out, _ = cli("migrate", str(legacy.root))
    assert code == 0 and out == f"packed {ITEMS} entries of 1 module cache under {legacy.root}\n"
    assert packed(legacy.directory) == {**extra, **legacy.frames}
