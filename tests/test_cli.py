from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import refuse_reading, stored_entries
from tests.store_helpers import poison_index_leaves
from torchcache import CacheWarning, torchcache
from torchcache.catalog.removal import remove_cache
from torchcache.cli.main import main, parse_duration
from torchcache.cli.output import Progress as _Progress
from torchcache.cli.output import iso, short_keys
from torchcache.cli.verify import TMP_GRACE_SECONDS
from torchcache.codec import encode_frame
from torchcache.meta import META_NAME
from torchcache.policy import format_size
from torchcache.stores.packed.format import encode_key, record_size
from torchcache.stores.packed.index import INDEX_NAME
from torchcache.stores.packed.store import PackedStore
from torchcache.tree import Layout, flatten


@torchcache(persistent=True)
class Tiny(nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(4, out).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def make_cache(out: int = 3, items: int = 6) -> tuple[Tiny, torch.Tensor, Path]:
    model = Tiny(out)
    x = torch.randn(items, 4)
    model(x)
    model.cache_instance.flush()
    directory = model.cache_instance.cache_dir
    assert directory is not None and (directory / META_NAME).is_file()
    return model, x, directory


def make_dir(out: int = 3, items: int = 6) -> Path:
    """A cache whose writer is done, as after its process ended: its segment is no longer locked."""
    directory = make_cache(out, items)[2]
    gc.collect()  # the model and its tier go, and with them the lock on the segment they wrote
    return directory


def twin(model: Tiny) -> Tiny:
    """A new instance with the same init arguments and weights, so the same module key."""
    other = Tiny(model.linear.out_features)
    other.load_state_dict(model.state_dict())
    return other


def frames(directory: Path) -> dict[str, bytes]:
    """The frames in the packed store of a module directory, by key."""
    return {path.name: data for path, data in stored_entries(directory).items()}


def count_entries(directory: Path) -> int:
    return len(stored_entries(directory))


def record_bytes(key: str, frame: bytes) -> int:
    """Bytes the record of one entry takes in a segment file."""
    return record_size(encode_key(key), len(frame))


def settled_sizes(directory: Path) -> tuple[int, int]:
    """Logical bytes and allocated bytes of every file in a module directory."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), sum(p.stat().st_blocks * 512 for p in files)


def set_last_used(directory: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(directory / META_NAME, (t, t))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- general ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["ls"], ["info"], ["verify"], ["prune"], ["clear"], ["migrate"]])
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    assert out.startswith(f"usage: torchcache {' '.join(command)}".rstrip())


def test_usage_errors_are_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("torchcache: error: ")
    code, _, err = run(capsys, "prune", "--older-than", "3x")
    assert code == 2
    assert err.splitlines()[-1].startswith("torchcache: error: argument --older-than: invalid duration '3x'")
    code, _, err = run(capsys, "prune", "--keep", "1", "--max-size", "1GB")
    assert code == 2 and "not allowed with argument" in err
    for option, value in (("--older-than", "-3d"), ("--keep", "-1"), ("--max", "-5")):  # a negative value, named
        code, _, err = run(capsys, "prune", option, value)
        assert code == 2 and f"{value}'" in err.splitlines()[-1] and "expected one argument" not in err
    for digits in ("\u00b2", "\u0663"):  # a superscript two and an Arabic-Indic three: digits to str.isdigit()
        code, _, err = run(capsys, "prune", "--keep", digits)
        assert code == 2 and err.splitlines()[-1].endswith(f"expected a whole number (0 or more), got {digits!r}")


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "2w", "45s", "1.5H")] == [
        30 * 86400,
        12 * 3600,
        90 * 60,
        14 * 86400,
        45,
        5400,
    ]
    for bad in ("", "30", "d", "-1d", "3x", "1d2h"):
        with pytest.raises(ValueError, match="invalid duration"):
            parse_duration(bad)


# -- ls --------------------------------------------------------------------------------
def test_ls_empty_and_missing_root(
    capsys: pytest.CaptureFixture[str], cache_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code, out, err = run(capsys, "ls")
    assert (code, err) == (0, "") and out == f"no caches under {cache_root}\n"
    code, out, _ = run(capsys, "ls", "--json")
    assert code == 0 and json.loads(out) == {"root": str(cache_root), "caches": []}
    monkeypatch.setenv("TORCHCACHE_DIR", str(tmp_path / "never-used"))
    assert run(capsys, "ls")[0] == 0  # a default root that does not exist yet holds nothing
    code, out, err = run(capsys, "ls", str(tmp_path / "missing"))
    assert code == 1 and out == ""
    assert err == f"torchcache: error: {tmp_path / 'missing'} does not exist\n"


def make_unrelated(root: Path) -> list[Path]:
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("keep me")
    (root / "broken").mkdir()
    (root / "broken" / META_NAME).write_text("{not json")
    (root / "listy").mkdir()
    (root / "listy" / META_NAME).write_text("[1, 2]")
    (root / "listy" / "abc").mkdir()
    (root / "listy" / "abc" / "abcdef.tce").write_bytes(b"not ours")
    (root / "foreign").mkdir()
    (root / "foreign" / META_NAME).write_text('{"name": "another tool"}')
    (root / "README").write_text("a file at the root")
    made = [root / "notes", root / "broken", root / "listy", root / "foreign", root / "README"]
    return sorted([*made, *(p for d in made for p in d.rglob("*"))])


def test_ls_ignores_unrelated_directories(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    _, _, directory = make_cache(items=5)
    unrelated = make_unrelated(cache_root)
    code, out, _ = run(capsys, "ls")
    assert code == 0
    lines = out.splitlines()
    headers = ["KEY", "NAME", "KIND", "ENTRIES", "SIZE", "ON", "DISK", "CREATED", "LAST", "USED", "VERSION"]
    assert lines[0].split() == headers
    assert lines[1].split()[:4] == [directory.name[:12], f"{Tiny.__module__}.Tiny", "module", "5"]
    assert lines[-1].startswith("1 module cache, 5 entries, ")
    caches = json.loads(run(capsys, "ls", "--json")[1])["caches"]
    assert [c["key"] for c in caches] == [directory.name]
    assert caches[0]["entries"] == 5 and caches[0]["torchcache_version"] is not None
    assert caches[0]["bytes"] == sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    assert all(p.exists() for p in unrelated)


def test_ls_sorts_by_last_used(capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [make_cache(out=n)[2] for n in (2, 3, 4)]
    for age, directory in zip((50, 10, 300), dirs):
        set_last_used(directory, age)
    caches = json.loads(run(capsys, "ls", "--json")[1])["caches"]
    assert [c["key"] for c in caches] == [dirs[1].name, dirs[0].name, dirs[2].name]


# -- info ------------------------------------------------------------------------------
def test_info_by_prefix_directory_and_json(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    _, _, directory = make_cache(items=7)
    code, out, _ = run(capsys, "info", directory.name[:5])
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines()[:2])
    assert fields == {"directory": str(directory), "module": f"key       {directory.name}"}
    assert "size limit       10.0 GB" in out and "\nentries          7\n" in out
    assert out.splitlines()[-1].split() == ["7", "12", "B", "float32[3]"]
    code, out, _ = run(capsys, "info", str(directory), "--json", "--sample", "3")
    data = json.loads(out)
    assert code == 0 and data["key"] == directory.name and data["max_bytes"] == int(10e9)
    assert data["meta"]["kind"] == "module" and data["sampled_entries"] == 3
    assert data["layouts"] == [{"layout": "float32[3]", "entries": 3, "item_bytes": 12}]


@pytest.mark.parametrize("command", ["ls", "info", "prune", "clear", "clear-asked"])
def test_names_from_metadata_reach_the_terminal_escaped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cache_root: Path, command: str
) -> None:
    _, _, directory = make_cache()
    meta = json.loads((directory / META_NAME).read_text())
    planted = "\x1b]0;pwned\x07\x1b[2J\ud800"  # a window title, a cleared screen, a lone surrogate
    meta.update(name=planted, torchcache_version=planted)
    (directory / META_NAME).write_text(json.dumps(meta))  # ASCII JSON: the escapes are valid there
    if command == "clear-asked":
        monkeypatch.setattr(sys, "stdin", FakeTty("n\n"))
    args = {
        "ls": ["ls", str(cache_root)],
        "info": ["info", str(directory)],
        "prune": ["prune", str(cache_root), "--keep", "0", "--dry-run"],
    }
    errors = sys.stdout.errors, sys.stderr.errors
    code, out, err = run(capsys, *args.get(command, ["clear", str(directory)]))
    shown = err if command.startswith("clear") else out
    assert code == (1 if command.startswith("clear") else 0) and directory.exists()
    assert "\\x1b]0;pwned\\x07" in shown and "\\ud800" in shown
    assert not any(ch in out + err for ch in "\x1b\x07\ud800")
    assert (sys.stdout.errors, sys.stderr.errors) == errors  # the streams are put back


def test_info_lookup_errors(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    _, _, directory = make_cache()
    for name in ("abcd0001", "abcd0002"):
        shutil.copytree(directory, cache_root / name)
    code, out, err = run(capsys, "info", "abcd")
    assert code == 1 and out == ""
    assert err.startswith("torchcache: error: 'abcd' matches 2 module caches") and err.count("\n") == 1
    assert run(capsys, "info", "abcd0002")[0] == 0
    code, _, err = run(capsys, "info", "ffff" if not directory.name.startswith("ffff") else "eeee")
    assert code == 1 and "has a key starting with" in err
    (cache_root / "plain").mkdir()
    code, _, err = run(capsys, "info", str(cache_root / "plain"))
    assert code == 1 and "is not a torchcache module cache" in err


# -- verify ----------------------------------------------------------------------------
def test_verify_clean_cache(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    make_cache(items=4)
    _, _, other = make_cache(out=5, items=3)
    code, out, err = run(capsys, "verify")
    assert (code, err) == (0, "")
    assert out == f"checked 7 entries in 2 module caches under {cache_root}\nno problems found\n"
    code, out, _ = run(capsys, "verify", str(other))
    assert code == 0 and out.startswith("checked 3 entries in 1 module cache under")


def test_verify_finds_an_index_whose_pages_point_outside_it_and_fix_rebuilds_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = make_dir(items=400)
    poison_index_leaves(directory / INDEX_NAME)
    code, out, _ = run(capsys, "info", str(directory))  # the index is not opened: reading it could kill this process
    assert code == 0 and "entries" in out
    code, out, _ = run(capsys, "verify", str(directory))
    assert code == 1 and "has a value outside it; the index must be rebuilt from the segment files" in out
    assert out.startswith("checked 0 entries")  # an index that cannot be read: nothing in it was checked
    code, out, _ = run(capsys, "verify", "--fix", str(directory))
    assert code == 0 and len(stored_keys(directory)) == 400 and out.startswith("checked 400 entries")
    code, out, _ = run(capsys, "verify", str(directory))
    assert code == 0 and "no problems found" in out


def test_ls_and_info_name_an_index_that_cannot_be_opened(capsys: pytest.CaptureFixture[str]) -> None:
    directory = make_dir(items=30)
    index = directory / INDEX_NAME
    index.write_bytes(os.urandom(index.stat().st_size))  # garbage: its entries cannot be counted
    code, out, _ = run(capsys, "ls", str(directory.parent))
    assert code == 0 and "(damaged index)" in out and "1 module cache with a damaged index" in out
    code, out, _ = run(capsys, "info", str(directory))
    index_line = next(line for line in out.splitlines() if line.startswith("index "))
    assert code == 0 and "`torchcache verify --fix` rebuilds it" in index_line
    assert run(capsys, "verify", "--fix", str(directory))[0] == 0 and len(stored_keys(directory)) == 30
    code, out, _ = run(capsys, "ls", str(directory.parent))
    assert "damaged" not in out


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_verify_reports_a_link_or_fifo_at_a_segment_name_and_fix_unlinks_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, planted: str
) -> None:
    directory = make_dir(items=4)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"someone's file")
    name = directory / "seg-00000099.tcs"
    name.symlink_to(outside) if planted == "link" else os.mkfifo(name)
    code, out, _ = run(capsys, "verify", str(directory))
    assert code == 1 and f"{name} is a link or special file at a segment's name" in out
    code, out, _ = run(capsys, "verify", "--fix", str(directory))
    assert code == 0 and not os.path.lexists(name) and outside.read_bytes() == b"someone's file"
    assert run(capsys, "verify", str(directory))[0] == 0


@pytest.mark.parametrize("command", [["clear", "-y"], ["info"], ["verify", "--fix"], ["migrate"], ["ls"]])
def test_a_module_directory_that_is_a_link_is_never_followed(
    capsys: pytest.CaptureFixture[str], cache_root: Path, tmp_path: Path, command: list[str]
) -> None:
    directory = make_dir(items=4)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(directory, elsewhere)  # a cache outside the root, and a link to it planted inside
    directory.symlink_to(elsewhere)
    before = sorted((p.name, p.stat().st_size) for p in elsewhere.iterdir())
    code, _, err = run(capsys, command[0], str(directory), *command[1:])
    assert code != 0 and "is a link: torchcache does not follow links" in err
    assert sorted((p.name, p.stat().st_size) for p in elsewhere.iterdir()) == before and directory.is_symlink()
    with pytest.raises(OSError, match="is a link"):
        remove_cache(directory)  # nor by the removal itself, whoever calls it
    assert sorted((p.name, p.stat().st_size) for p in elsewhere.iterdir()) == before


def stored_keys(directory: Path) -> list[str]:
    """The keys in the index of a module directory's packed store (no record is read)."""
    with PackedStore(directory, 1 << 40) as store:
        return sorted(store.keys())


def untouched(root: Path) -> tuple[dict[str, bytes | None], dict[str, list[str]]]:
    """What a report must leave as it is: every file but the index (its contents too) and the stored keys."""
    files = {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in root.rglob("*")
        if not p.name.startswith("index.lmdb")
    }
    keys = {str(p.parent.relative_to(root)): stored_keys(p.parent) for p in root.rglob("index.lmdb")}
    return files, keys


def flip_record_byte(directory: Path, key: str, frame: bytes) -> None:
    """Flip the last byte of an entry's record in its segment file (the store's checksum covers it)."""
    (segment,) = [p for p in directory.glob("seg-*.tcs") if frame in p.read_bytes()]
    data = segment.read_bytes()
    assert data.count(frame) == 1
    at = data.index(frame) + len(frame) - 1
    with open(segment, "r+b") as file:
        file.seek(at)
        file.write(bytes([data[at] ^ 0xFF]))


def damage(directory: Path) -> dict[str, Path]:
    """Damage a cache in every way verify knows; return the bad entries (``<module dir>/<key>``) and files by kind."""
    stored = frames(directory)
    record, flipped, truncated, garbage, wrong_size, bad_header, spare = sorted(stored)[:7]
    flip_record_byte(directory, record, stored[record])
    # Valid records that hold damaged frames: the store's checks pass, the frame's fail.
    frame = bytearray(stored[flipped])
    frame[-1] ^= 0xFF
    spec, leaves = flatten(torch.zeros(1, 3))
    header = Layout.of(spec, leaves, None).to_header()
    with PackedStore(directory, 1 << 40) as store:
        store.put_many(
            [
                (flipped, bytes(frame)),
                (truncated, stored[truncated][:-3]),
                (garbage, b"garbage"),
                (wrong_size, encode_frame(header, b"\x00" * 12, None)),  # 12 bytes, the layout says 16
                (bad_header, encode_frame({"no": "leaves"}, b"\x00" * 16, None)),
            ]
        )
    old = time.time() - 2 * TMP_GRACE_SECONDS
    stray = directory / f".{spare}.123.deadbeef.tmp"
    stray.write_bytes(b"half an entry")
    os.utime(stray, (old, old))
    stray_meta = directory / ".torchcache.json.123.456.tmp"
    stray_meta.write_text("{")
    os.utime(stray_meta, (old, old))
    fresh = directory / ".fresh.999.tmp"
    fresh.write_bytes(b"being written")
    return {
        "record": directory / record,
        "flipped": directory / flipped,
        "truncated": directory / truncated,
        "garbage": directory / garbage,
        "wrong_size": directory / wrong_size,
        "bad_header": directory / bad_header,
        "stray": stray,
        "stray_meta": stray_meta,
        "fresh": fresh,
    }


def test_verify_fix_counts_the_problems_of_a_store_apart_from_damaged_entries(
    capsys: pytest.CaptureFixture[str], cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchcache.cli.commands as commands
    from torchcache.cli.verify import Problem

    directory = make_dir(items=4)

    def verify_store(path: Path, fix: bool, *args: Any) -> tuple[int, list[Problem], bool]:
        entry = Problem(path / ("a" * 32), "corrupt", "record failed its checks", 0)
        return 4, [entry, Problem(path, "store", "a segment row without its file", 0)], fix

    monkeypatch.setattr(commands, "verify_store", verify_store)
    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 0 and "removed or repaired 1 damaged entry" in out and str(directory.name) in out
    assert "repaired 1 problem of the stores' index and files" in out


def test_verify_reports_and_fixes_damaged_entries_and_temporary_files(
    capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    model, x, directory = make_cache(items=12)
    healthy = make_dir(out=2, items=3)
    bad = damage(directory)
    (directory / "notes.txt").write_text("not torchcache's")
    before = untouched(cache_root)

    code, out, err = run(capsys, "verify")
    assert code == 1
    assert err == "torchcache: error: 8 problems found; run `torchcache verify --fix` to fix them\n"
    assert "checked 15 entries in 2 module caches" in out
    reasons = {line.split()[-1]: line for line in out.splitlines()[2:10]}
    rel = {k: str(p.relative_to(cache_root)) for k, p in bad.items()}
    assert "record failed its checks" in reasons[rel["record"]]
    assert "checksum mismatch" in reasons[rel["flipped"]]
    assert "does not match its prefix" in reasons[rel["truncated"]]
    assert "truncated frame" in reasons[rel["garbage"]]
    assert "payload is 12 bytes, its header describes 16" in reasons[rel["wrong_size"]]
    assert "invalid header" in reasons[rel["bad_header"]]
    assert reasons[rel["stray"]].startswith("temporary") and rel["stray_meta"] in reasons
    assert rel["fresh"] not in out and "left 1 recent temporary file alone" in out
    assert untouched(cache_root) == before  # reporting removes nothing, not even a record that failed its checks

    report = json.loads(run(capsys, "verify", "--json")[1])
    assert report["ok"] is False and report["entries_checked"] == 15
    assert {Path(p["path"]) for p in report["problems"]} == {p for k, p in bad.items() if k != "fresh"}
    assert not any(p["removed"] or p["fixed"] for p in report["problems"])
    assert untouched(cache_root) == before

    code, out, err = run(capsys, "verify", "--fix")
    assert (code, err) == (0, "") and "removed or repaired 6 damaged entries" in out and "removed 2 files (14 B)" in out
    damaged_keys = {p.name for k, p in bad.items() if p.parent == directory and not p.name.startswith(".")}
    assert stored_keys(directory) == sorted(set(frames(directory)) - damaged_keys)
    assert len(damaged_keys) == 6 and len(stored_keys(directory)) == 6 and len(stored_keys(healthy)) == 3
    assert [k for k in ("stray", "stray_meta", "fresh") if bad[k].exists()] == ["fresh"]
    assert (directory / "notes.txt").exists() and (directory / META_NAME).exists()
    assert run(capsys, "verify") == (
        0,
        f"checked 9 entries in 2 module caches under {cache_root}\n"
        "left 1 recent temporary file alone (a write may be in progress)\n"
        "no problems found\n",
        "",
    )

    # The entries left are sound: a fresh instance with the same weights reads them back,
    # and recomputes (and stores again) the ones removed.
    fresh = twin(model)
    torch.testing.assert_close(fresh(x), model.linear(x))
    stats = fresh.cache_instance.stats()
    assert (stats.hits, stats.misses) == (6, 6)
    fresh.cache_instance.flush()
    assert len(stored_keys(directory)) == 12
    assert run(capsys, "verify", str(directory))[0] == 0


def test_progress_is_plain_off_a_terminal_and_a_bar_on_one() -> None:
    plain = io.StringIO()
    progress = _Progress(4, "verify", stream=plain, interval=0.0)
    for _ in range(4):
        progress.update()
    progress.close()
    assert plain.getvalue().splitlines() == [f"verify: {i}/4 entries ({i / 4:.0%})" for i in range(1, 5)]
    quiet = io.StringIO()
    progress = _Progress(4, "verify", stream=quiet)  # the default interval: nothing for a short run
    progress.update(4)
    progress.close()
    assert quiet.getvalue() == ""
    tty = FakeTty()
    progress = _Progress(4, "verify", stream=tty)
    progress.update(4)
    progress.close()
    assert tty.getvalue().startswith("\rverify:") and "/4 [" in tty.getvalue()


# -- prune -----------------------------------------------------------------------------
def make_three(ages: tuple[float, float, float] = (3000, 2000, 1000)) -> list[Path]:
    dirs = [make_dir(out=n, items=4) for n in (2, 3, 4)]
    for age, directory in zip(ages, dirs):
        set_last_used(directory, age)
    return dirs


def cache_sizes(capsys: pytest.CaptureFixture[str]) -> dict[str, int]:
    return {c["key"]: c["bytes"] for c in json.loads(run(capsys, "ls", "--json")[1])["caches"]}


def test_prune_max_size_keeps_the_most_recently_used(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    oldest, middle, newest = make_three()
    unrelated = make_unrelated(cache_root)
    sizes = cache_sizes(capsys)
    limit = sizes[middle.name] + sizes[newest.name]

    code, out, _ = run(capsys, "prune", "--max-size", f"{limit}B", "--dry-run")
    assert code == 0 and oldest.exists()
    lines = out.splitlines()
    assert lines[0] == f"would remove 1 module cache ({format_size(sizes[oldest.name])}):"
    assert lines[1].split()[:2] == ["KEY", "NAME"] and lines[2].startswith(oldest.name[:12]) and lines[3] == ""
    assert lines[4].startswith("left 2 module caches, 8 entries, ") and len(lines) == 5

    code, out, _ = run(capsys, "prune", "--max-size", f"{limit}B")
    assert code == 0 and not oldest.exists() and middle.exists() and newest.exists(), (out, _)
    assert out.splitlines()[0] == f"removed 1 module cache ({format_size(sizes[oldest.name])}):"
    assert out.splitlines()[2].startswith(oldest.name[:12]) and "left 2 module caches" in out
    shutil.rmtree(middle.parent)
    cache_root.mkdir()
    oldest, middle, newest = make_three()
    unrelated = make_unrelated(cache_root)
    sizes = cache_sizes(capsys)
    limit = sizes[middle.name] + sizes[newest.name]

    code, out, _ = run(capsys, "prune", "--max-size", f"{limit}B", "--json")
    data = json.loads(out)
    assert code == 0 and data["dry_run"] is False and data["in_use"] == []
    assert [c["key"] for c in data["removed"]] == [oldest.name]
    assert [c["key"] for c in data["kept"]] == [newest.name, middle.name]
    assert data["freed_bytes"] == sizes[oldest.name]
    assert not oldest.exists() and middle.exists() and newest.exists()
    assert all(p.exists() for p in unrelated)

    code, out, _ = run(capsys, "prune", "--max-size", f"{limit}B")
    assert code == 0 and out.startswith("nothing to prune: 2 module caches, 8 entries")
    assert run(capsys, "prune", "--max-size", "1B")[0] == 0
    assert cache_sizes(capsys) == {}
    assert sorted(p for p in cache_root.rglob("*")) == unrelated


def test_prune_older_than_and_keep(capsys: pytest.CaptureFixture[str]) -> None:
    oldest, middle, newest = make_three(ages=(40 * 86400, 10 * 86400, 60))
    code, out, _ = run(capsys, "prune", "--older-than", "30d")
    assert code == 0 and "removed 1 module cache" in out
    assert not oldest.exists() and middle.exists()
    assert run(capsys, "prune", "--older-than", "2w")[0] == 0 and middle.exists()
    assert run(capsys, "prune", "--keep", "1")[0] == 0
    assert not middle.exists() and newest.exists()


# -- clear -----------------------------------------------------------------------------
def test_clear_refuses_without_yes_when_not_interactive(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = make_dir()
    before = sorted(directory.iterdir())
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = run(capsys, "clear", directory.name)
    assert code == 1 and out == ""
    assert err.startswith("torchcache: error: refusing to remove module cache") and err.count("\n") == 1
    assert "pass --yes" in err and count_entries(directory) == 6 and sorted(directory.iterdir()) == before
    assert run(capsys, "clear", "--all")[0] == 1 and directory.exists()


def test_clear_asks_on_a_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, directory = make_cache()
    monkeypatch.setattr(sys, "stdin", FakeTty("n\n"))
    code, _, err = run(capsys, "clear", directory.name[:6])
    assert code == 1 and "? [y/N] aborted; nothing removed" in err and directory.exists()
    monkeypatch.setattr(sys, "stdin", FakeTty("y\n"))
    code, out, _ = run(capsys, "clear", directory.name[:6])
    assert code == 0 and out.startswith("removed 1 module cache (") and not directory.exists()


def test_clear_removes_only_torchcache_files(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    directory = make_dir()
    other = make_dir(out=5)
    key, frame = sorted(frames(directory).items())[0]
    shard = directory / key[:3]  # a torchcache 1.0 entry, with a file of someone else's beside it
    shard.mkdir()
    (shard / f"{key}.tce").write_bytes(frame)
    (shard / "mine.txt").write_text("not torchcache's")
    (directory / "compact.lock").touch()
    old = time.time() - 2 * TMP_GRACE_SECONDS
    for temporary in (directory / ".torchcache.json.1.2.tmp", shard / f".{key}.1.2.tmp", directory / ".x.3.tmp"):
        temporary.write_bytes(b"half")
    os.utime(directory / ".x.3.tmp", (old, old))
    unknown = [
        "data",
        "data/x.tce",
        "index.lmdb.bak",
        "seg-notes.txt",
        "seg-0000000g.tcs",
        shard.name,
        f"{shard.name}/mine.txt",
    ]
    (directory / "data").mkdir()
    (directory / "data" / "x.tce").write_text("not in a shard directory")
    for name in ("index.lmdb.bak", "seg-notes.txt", "seg-0000000g.tcs"):
        (directory / name).write_text("not torchcache's")
    assert {p.name for p in directory.glob("seg-0*.tcs")} == {"seg-00000001.tcs", "seg-0000000g.tcs"}

    code, out, err = run(capsys, "clear", str(directory), "--yes")
    assert code == 0 and out.startswith("removed 1 module cache")
    assert err == f"torchcache: kept {directory}: it holds files that torchcache did not write\n"
    left = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    assert left == sorted(unknown)
    assert other.exists() and count_entries(other) == 6
    assert [c["key"] for c in json.loads(run(capsys, "ls", "--json")[1])["caches"]] == [other.name]


def test_clear_all_leaves_unrelated_directories(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    make_three()
    unrelated = make_unrelated(cache_root)
    code, out, _ = run(capsys, "clear", "--all", "-y")
    assert code == 0 and out.startswith("removed 3 module caches (")
    assert sorted(p for p in cache_root.rglob("*")) == unrelated
    assert run(capsys, "clear", "--all", "-y")[1] == f"nothing to clear: no caches under {cache_root}\n"


def test_clearing_a_cache_in_use_keeps_its_user_correct(capsys: pytest.CaptureFixture[str]) -> None:
    model, x, directory = make_cache()
    reader = twin(model)
    reader(x[:2])  # the reader's disk tier is open
    assert run(capsys, "clear", directory.name, "-y")[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # its later writes may be turned off
        torch.testing.assert_close(reader(x), model.linear(x))
    assert reader.cache_instance.stats().misses == 4


# -- as a program ----------------------------------------------------------------------
def run_module(*argv: str, root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCHCACHE_DIR": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "torchcache", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_python_dash_m_ls_json(cache_root: Path) -> None:
    _, _, directory = make_cache(items=3)
    done = run_module("ls", "--json", root=cache_root)
    assert (done.returncode, done.stderr) == (0, "")
    assert [(c["key"], c["entries"]) for c in json.loads(done.stdout)["caches"]] == [(directory.name, 3)]


@pytest.mark.slow
def test_python_dash_m_clear_refuses_without_a_terminal(cache_root: Path) -> None:
    _, _, directory = make_cache(items=3)
    done = run_module("clear", "--all", root=cache_root)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("torchcache: error: refusing to remove 1 module cache (")
    assert done.stderr.count("\n") == 1
    assert count_entries(directory) == 3


# -- damaged metadata, lookups, sizes -----------------------------------------------------------
DAMAGES = {
    "overwritten": lambda meta: meta.write_bytes(os.urandom(64)),
    "truncated": lambda meta: meta.write_bytes(meta.read_bytes()[:20]),
    "emptied": lambda meta: meta.write_bytes(b""),
    "deleted": lambda meta: meta.unlink(),
    "foreign": lambda meta: meta.write_text('{"name": "x"}'),
    "created in milliseconds": lambda meta: meta.write_text(
        json.dumps({**json.loads(meta.read_text()), "created": time.time() * 1000})
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_metadata_never_hides_a_cache(
    capsys: pytest.CaptureFixture[str], cache_root: Path, damage: str
) -> None:
    model, x, directory = make_cache(items=5)
    _, _, healthy = make_cache(out=2, items=2)
    DAMAGES[damage](directory / META_NAME)
    used = time.time() - 3600  # an hour ago: looking at a cache must not make it look used
    for path in directory.iterdir():
        os.utime(path, (used, used))

    code, out, _ = run(capsys, "ls")
    assert code == 0 and "2 module caches, 7 entries" in out
    assert "(damaged metadata)" in out and "1 module cache with damaged metadata" in out
    listed = {c["key"]: c for c in json.loads(run(capsys, "ls", "--json")[1])["caches"]}
    assert listed[directory.name]["entries"] == 5 and listed[directory.name]["metadata_problem"]
    assert listed[directory.name]["last_used"] == iso(used)
    assert listed[healthy.name]["metadata_problem"] is None
    assert run(capsys, "info", directory.name)[0] == 0

    code, out, err = run(capsys, "verify")
    assert code == 1 and "checked 7 entries in 2 module caches" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("metadata ")]
    assert len(rows) == 1 and rows[0][-1] == f"{directory.name}/{META_NAME}" and "1 problem found" in err
    code, out, err = run(capsys, "verify", "--fix")
    assert (code, err) == (0, "") and "rebuilt the metadata of 1 module cache" in out
    assert run(capsys, "verify")[0] == 0
    meta = json.loads((directory / META_NAME).read_text())
    assert meta["module_key"] == directory.name and meta["rebuilt"] is True
    after = {c["key"]: c for c in json.loads(run(capsys, "ls", "--json")[1])["caches"]}[directory.name]
    assert after["last_used"] == listed[directory.name]["last_used"]  # a fix does not make it look used

    fresh = twin(model)  # the library reads the rebuilt cache
    torch.testing.assert_close(fresh(x), model.linear(x))
    assert fresh.cache_instance.stats().hits == 5


@pytest.mark.parametrize("how", ["clear", "prune"])
def test_clear_and_prune_remove_caches_with_damaged_metadata(
    capsys: pytest.CaptureFixture[str], cache_root: Path, how: str
) -> None:
    directory = make_dir(items=4)
    (directory / META_NAME).write_bytes(b"\x00" * 10)
    argv = ["clear", "--all", "-y"] if how == "clear" else ["prune", "--keep", "0"]
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "") and "removed 1 module cache" in out
    assert not directory.exists()


def test_the_library_rewrites_metadata_the_cli_would_report(
    capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    model, x, directory = make_cache(items=3)
    (directory / META_NAME).write_text('{"name": "x"}')
    reader, want = twin(model), model.linear(x)
    del model  # the reader opens the directory anew (a process shares a directory's tier between its caches)
    gc.collect()
    with pytest.warns(CacheWarning, match="replaced the damaged metadata file"):
        torch.testing.assert_close(reader(x), want)
    caches = json.loads(run(capsys, "ls", "--json")[1])["caches"]
    assert [(c["key"], c["metadata_problem"]) for c in caches] == [(directory.name, None)]
    assert caches[0]["name"] == f"{Tiny.__module__}.Tiny"


def test_metadata_that_cannot_be_read_is_left_as_it_is_by_the_library_and_by_verify_fix(
    capsys: pytest.CaptureFixture[str], cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x, directory = make_cache(items=3)
    path = directory / META_NAME
    before = path.read_bytes()
    reader, want = twin(model), model.linear(x)
    del model
    gc.collect()
    refuse_reading(monkeypatch, path)
    with pytest.warns(CacheWarning, match="cannot read torchcache.json: Permission denied; it is left as it is"):
        torch.testing.assert_close(reader(x), want)
    code, out, _ = run(capsys, "verify", "--fix")
    assert code != 0 and "Permission denied" in out
    assert path.read_bytes() == before  # neither replaced nor rebuilt


def test_metadata_that_is_a_link_to_itself_is_damage_that_verify_fix_rebuilds(
    capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    _, _, directory = make_cache(items=3)
    path = directory / META_NAME
    path.unlink()
    path.symlink_to(META_NAME)  # a loop: never readable, whatever its mode
    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 0 and "rebuilt the metadata of 1 module cache" in out
    assert json.loads(path.read_text())["rebuilt"] is True


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="plants a FIFO")
@pytest.mark.parametrize("plant", ["an empty directory", "a FIFO"])
def test_metadata_that_is_not_a_file_is_damage_that_verify_fix_rebuilds(
    capsys: pytest.CaptureFixture[str], cache_root: Path, plant: str
) -> None:
    _, _, directory = make_cache(items=3)
    path = directory / META_NAME
    path.unlink()
    path.mkdir() if plant == "an empty directory" else os.mkfifo(path)
    assert run(capsys, "verify")[0] == 1
    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 0 and "rebuilt the metadata of 1 module cache" in out
    assert json.loads(path.read_text())["rebuilt"] is True and run(capsys, "verify")[0] == 0


@pytest.mark.parametrize(("budget", "kept"), [(123_456_789, 123_456_789), ("a lot", None), (-1, None)])
def test_verify_fix_keeps_the_budget_damaged_metadata_still_names(
    capsys: pytest.CaptureFixture[str], cache_root: Path, budget: object, kept: int | None
) -> None:
    _, _, directory = make_cache(items=3)
    path = directory / META_NAME
    path.write_text(json.dumps({"name": "x", "max_bytes": budget}))  # no torchcache_version: damaged
    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 0 and "rebuilt the metadata of 1 module cache" in out
    meta = json.loads(path.read_text())
    assert meta["rebuilt"] is True and meta["name"] == "x" and meta.get("max_bytes") == kept
    assert run(capsys, "verify")[0] == 0


@pytest.mark.parametrize("command", ["clear", "info"])
def test_a_key_with_root_is_looked_up_under_that_root_only(
    capsys: pytest.CaptureFixture[str], cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    _, _, directory = make_cache(items=3)
    other_root = tmp_path / "other"
    other = other_root / directory.name
    shutil.copytree(directory, other)
    monkeypatch.chdir(cache_root)  # the working directory holds a cache of the same key
    argv = ["clear", directory.name, "--root", str(other_root), "-y"] if command == "clear" else []
    if command == "info":
        argv = ["info", directory.name, "--root", str(other_root), "--json"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    if command == "info":
        assert json.loads(out)["directory"] == str(other)
    else:
        assert not other.exists()
    assert count_entries(directory) == 3  # the cache in the working directory is untouched
    code, out, _ = run(capsys, "info", directory.name, "--json")  # without --root: the directory here
    assert code == 0 and Path(json.loads(out)["directory"]).resolve() == directory.resolve()


@pytest.mark.parametrize("size", ["1e999999999", "1e40GB", "9" * 500])
def test_prune_with_a_size_too_large_is_a_usage_error(capsys: pytest.CaptureFixture[str], size: str) -> None:
    _, _, directory = make_cache(items=2)
    code, out, err = run(capsys, "prune", "--max-size", size)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("torchcache: error: argument --max-size: --max-size must be at most")
    assert directory.exists()


@pytest.mark.parametrize(
    "words",
    [["20", "GB"], ["20GB"], ["20G"], ["20", "G"], ["20", "gib"], ["20 GB"], ["--max-size=20", "GB"], ["1.5", "TB"]],
)
def test_prune_max_size_takes_a_unit_in_the_same_word_or_the_next(
    capsys: pytest.CaptureFixture[str], cache_root: Path, words: list[str]
) -> None:
    directory = make_dir(items=2)
    argv = ["prune", *words] if words[0].startswith("--") else ["prune", "--max-size", *words]
    code, out, err = run(capsys, *argv, "--dry-run", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["root"] == str(cache_root) and [c["key"] for c in data["kept"]] == [directory.name]
    code, out, err = run(capsys, *argv, str(cache_root), "--dry-run")  # a root after the unit is still the root
    assert (code, err) == (0, "") and out.startswith("nothing to prune: 1 module cache")


def test_prune_max_size_with_a_unit_it_cannot_read_says_how_to_write_it(
    capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    directory = make_dir(items=2)
    for words in (["20", "gigs"], ["1.5"], ["20"]):  # bytes without a unit: every cache would go
        code, out, err = run(capsys, "prune", "--max-size", *words)
        assert code == 2 and out == "" and "has no unit: write 20GB, 500MiB, or 20B for bytes" in err
    assert directory.is_dir()
    code, _, err = run(capsys, "prune", "--max-size", "20gigs")
    assert code == 2 and "(no unit 'gigs': B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)" in err.splitlines()[-1]
    for size, said in (("-1", "a size of 0 or more"), ("-1B", "a size of 0 or more"), ("nan", "with its unit")):
        code, _, err = run(capsys, "prune", "--max-size", size)  # a unit would not help
        assert code == 2 and said in err and "1e9" not in err and "one word" not in err
    code, _, err = run(capsys, "ls", "ftp://host/cache")
    assert code == 1 and "must be a local directory, a Redis URL" in err


def test_caches_of_one_name_are_told_apart_by_their_short_keys(
    capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    first, second = make_dir(out=2, items=2), make_dir(out=5, items=3)  # two Tiny instances, other init arguments
    other = "1" if first.name[12] == "0" else "0"  # keys alike in 12 hex digits, then in all but the last
    lookalikes = [cache_root / f"{first.name[:12]}{other * 19}{n}" for n in (1, 2)]
    for path in lookalikes:
        shutil.copytree(first, path)
    code, out, _ = run(capsys, "ls")
    rows = [line.split() for line in out.splitlines()[1:5]]
    assert code == 0 and {row[1] for row in rows} == {f"{Tiny.__module__}.Tiny"}  # one name on every row
    want = {second.name[:12], first.name[:13], *(path.name for path in lookalikes)}
    assert {row[0] for row in rows} == want  # each key as long as it takes to tell it from the others
    for key in want:  # and each names its cache
        code, out, _ = run(capsys, "info", key, "--json")
        assert code == 0 and json.loads(out)["key"].startswith(key)
    listed = json.loads(run(capsys, "ls", "--json")[1])["caches"]
    assert len({c["key"] for c in listed}) == 4 and all(c["created"] and c["last_used"] for c in listed)


def test_short_keys() -> None:
    keys = ["features-0a1b2c3d", "features-0a1b2c9e", "abc", "5f3c9a1d2e4b6f7a9c"]
    assert short_keys(keys) == ["features-0a1b2c3", "features-0a1b2c9", "abc", "5f3c9a1d2e4b"]
    assert short_keys(["5f3c9a1d2e4b6f7a"], among=["5f3c9a1d2e4b6f00"]) == ["5f3c9a1d2e4b6f7"]
    assert short_keys([]) == []


def test_ls_and_info_report_bytes_on_disk(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    directory = make_dir(items=20)
    cache = json.loads(run(capsys, "ls", "--json")[1])["caches"][0]
    logical, on_disk = settled_sizes(directory)  # after `ls`: the files as it measured them
    assert on_disk != logical  # the lock file is sparse, the segment takes a whole block
    assert (cache["bytes"], cache["disk_bytes"]) == (logical, on_disk)
    info = json.loads(run(capsys, "info", directory.name, "--json")[1])
    assert (info["bytes"], info["disk_bytes"]) == (logical, on_disk)
    code, out, _ = run(capsys, "info", directory.name)
    assert code == 0
    assert f"on disk          {format_size(on_disk)} ({on_disk:,} bytes)" in out
    assert f"size             {format_size(logical)} ({logical:,} bytes)" in out
    assert f"({format_size(on_disk)} on disk)" in run(capsys, "ls")[1]
    assert settled_sizes(directory) == (logical, on_disk)  # looking changes nothing


def test_info_reports_live_and_reclaimable_bytes(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    directory = make_dir(items=10)
    stored = frames(directory)
    records = {key: record_bytes(key, frame) for key, frame in stored.items()}
    keys = sorted(stored)

    def info() -> dict[str, Any]:
        return json.loads(run(capsys, "info", directory.name, "--json")[1])

    fresh = info()
    assert (fresh["entries"], fresh["live_bytes"], fresh["reclaimable_bytes"]) == (10, sum(records.values()), 0)
    with PackedStore(directory, 1 << 40) as store:
        assert store.delete_many(keys[:3]) == 3
        assert store.put_many([(key, stored[key]) for key in keys[3:5]]) == 2  # replaced: the old records are dead
    dead = sum(records[key] for key in keys[:5])
    live = sum(records[key] for key in keys[3:])
    after = info()
    assert (after["entries"], after["live_bytes"], after["reclaimable_bytes"]) == (7, live, dead)
    listed = json.loads(run(capsys, "ls", "--json")[1])["caches"][0]
    assert (listed["live_bytes"], listed["reclaimable_bytes"], listed["legacy_entries"]) == (live, dead, 0)
    code, out, _ = run(capsys, "info", directory.name)
    assert code == 0 and "\nentries          7\n" in out
    assert f"\nlive             {format_size(live)} ({live:,} bytes)\n" in out
    assert f"\nreclaimable      {format_size(dead)} ({dead:,} bytes)\n" in out
    assert frames(directory) == {key: stored[key] for key in keys[3:]}


def test_prune_says_what_it_removed_when_one_cache_cannot_be_removed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchcache.cli.commands as cli_module

    oldest, middle, newest = make_three()
    real_remove = cli_module.remove_unused_cache

    def remove(directory: Path, strict: bool = True) -> tuple[int, Path | None] | None:
        if directory == middle:
            raise PermissionError(13, "Permission denied")
        return real_remove(directory, strict)

    monkeypatch.setattr(cli_module, "remove_unused_cache", remove)
    code, out, err = run(capsys, "prune", "--keep", "0")
    assert code == 1
    assert f"torchcache: error: cannot remove {middle}: Permission denied" in err
    assert "removed 2 module caches" in out and oldest.name[:12] in out and middle.name[:12] not in out
    assert "left 1 module cache, 4 entries" in out
    assert not oldest.exists() and middle.exists() and not newest.exists()


# -- a damaged cache whatever is at its metadata's name ------------------------------------------
def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _every_file_a_fifo(meta: Path) -> None:
    for path in meta.parent.iterdir():
        _fifo(path)


def _directory(meta: Path) -> None:
    meta.unlink()
    meta.mkdir()


UNREADABLE = {
    "FIFO": _fifo,
    "every file a FIFO": _every_file_a_fifo,
    "directory": _directory,
    "garbage": lambda meta: meta.write_bytes(b"\xff{{{ not json"),
    "no permission": lambda meta: meta.chmod(0),
}


def _bounded(argv: list[str]) -> tuple[int, str, str]:
    """Run the command on a thread that must end within a minute (a read of a FIFO would block)."""
    out, err = io.StringIO(), io.StringIO()
    result: list[int] = []

    def target() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result.append(main(argv))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"torchcache {' '.join(argv)} blocked"
    return result[0], out.getvalue(), err.getvalue()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="plants FIFOs")
@pytest.mark.parametrize("damage", list(UNREADABLE))
def test_a_cache_with_unreadable_metadata_is_damaged_for_every_command(cache_root: Path, damage: str) -> None:
    if damage == "no permission" and os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    directory = make_dir(items=4)
    healthy = make_dir(out=2, items=2)
    UNREADABLE[damage](directory / META_NAME)
    try:
        code, out, _ = _bounded(["ls", "--json"])
        listed = {c["key"]: c for c in json.loads(out)["caches"]}
        assert code == 0 and set(listed) == {directory.name, healthy.name}
        assert listed[directory.name]["metadata_problem"] and listed[healthy.name]["metadata_problem"] is None
        code, out, _ = _bounded(["ls"])
        assert code == 0 and "(damaged metadata)" in out and "1 module cache with damaged metadata" in out

        code, out, err = _bounded(["verify"])
        assert code == 1 and "no problems found" not in out and "problem" in err
        rows = [line.split() for line in out.splitlines() if line.startswith("metadata ")]
        assert [row[-1] for row in rows] == [f"{directory.name}/{META_NAME}"]

        code, out, err = _bounded(["clear", directory.name, "-y"])
        assert (code, err) == (0, "") and out.startswith("removed 1 module cache")
        assert not directory.exists() and count_entries(healthy) == 2
    finally:
        if directory.exists():
            os.chmod(directory / META_NAME, 0o644)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="plants FIFOs")
def test_clear_all_and_prune_remove_caches_of_fifos(cache_root: Path) -> None:
    caches = [make_dir(out=n, items=3) for n in (2, 3)]
    for directory in caches:
        _every_file_a_fifo(directory / META_NAME)
    code, out, _ = _bounded(["prune", "--keep", "1"])
    assert code == 0 and out.startswith("removed 1 module cache (0 B):")
    code, out, _ = _bounded(["clear", "--all", "-y"])
    assert code == 0 and out.startswith("removed 1 module cache")
    assert list(cache_root.iterdir()) == []


# -- the budget of the root ------------------------------------------------------------------------------
def test_info_shows_the_root_budget(
    capsys: pytest.CaptureFixture[str], cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHCACHE_MAX_SIZE", raising=False)
    directory, other = make_dir(items=4), make_dir(out=2, items=2)
    used = sum(cache_sizes(capsys).values())
    code, out, _ = run(capsys, "info", directory.name)
    line = next(line for line in out.splitlines() if line.startswith("root budget"))
    assert code == 0 and line == (
        f"root budget      50.0 GB (the default; TORCHCACHE_MAX_SIZE sets it); {format_size(used)} used by "
        f"2 caches in {cache_root} (0.0%)"
    )
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "1MB")
    code, out, _ = run(capsys, "info", directory.name, "--json")
    budget = json.loads(out)["root_budget"]
    assert budget == {
        "root": str(cache_root),
        "max_bytes": 10**6,
        "source": "TORCHCACHE_MAX_SIZE",
        "used_bytes": used,
        "module_caches": 2,
    }
    assert f"1.0 MB (TORCHCACHE_MAX_SIZE); {format_size(used)} used by 2 caches" in run(capsys, "info", other.name)[1]
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "0")
    assert "root budget      none (TORCHCACHE_MAX_SIZE is 0); " in run(capsys, "info", other.name)[1]
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "much")
    code, out, _ = run(capsys, "info", other.name)
    assert code == 0 and "root budget      none (TORCHCACHE_MAX_SIZE must be a byte count such as 1e9" in out
    assert "no budget is kept" in out


def test_prune_keeps_a_cache_this_process_has_open(capsys: pytest.CaptureFixture[str], cache_root: Path) -> None:
    oldest = make_dir(items=3)
    model, _, open_dir = make_cache(out=2, items=2)  # open here, as in another process
    os.utime(open_dir / META_NAME, (time.time() - 600,) * 2)
    os.utime(oldest / META_NAME, (time.time() - 300,) * 2)
    code, out, _ = run(capsys, "prune", "--keep", "0", "--dry-run")
    assert code == 0 and out.startswith("would remove 1 module cache (") and open_dir.exists()
    code, out, _ = run(capsys, "prune", "--keep", "0")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("removed 1 module cache (") and lines[2].startswith(oldest.name[:12])
    assert "kept 1 module cache in use by a running process:" in out and open_dir.name[:12] in lines[-3]
    assert not oldest.exists() and open_dir.exists()
    data = json.loads(run(capsys, "prune", "--max-size", "1B", "--json")[1])
    assert data["removed"] == [] and [c["key"] for c in data["in_use"]] == [open_dir.name]
    del model
    gc.collect()
    assert run(capsys, "prune", "--keep", "0")[0] == 0 and not open_dir.exists()


def test_prune_still_removes_where_directories_cannot_be_locked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchcache.catalog.budget as root_budget_module

    oldest, middle, newest = make_three()
    real_flock = fcntl.flock

    def flock(fd: int, operation: int) -> None:  # as on a network file system that cannot lock directories
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real_flock(fd, operation)

    monkeypatch.setattr(root_budget_module.fcntl, "flock", flock)
    assert root_budget_module.enforce_root_budget(oldest.parent, 1) == []  # the budget removes nothing it cannot lock
    code, out, _ = run(capsys, "prune", "--keep", "1")
    assert code == 0 and out.startswith("removed 2 module caches (")
    assert not oldest.exists() and not middle.exists() and newest.exists()


def test_an_option_a_command_does_not_know_is_said_with_that_commands_usage(
    capsys: pytest.CaptureFixture[str], cache_root: Path
) -> None:
    code, out, err = run(capsys, "ls", "--jsn")
    assert code == 2 and out == ""
    assert err.startswith("usage: torchcache ls") and "unrecognized arguments: --jsn" in err


def test_no_command_prints_the_whole_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert code == 2 and out == ""
    assert all(f"\n    {name} " in err for name in ("ls", "info", "verify", "prune", "clear", "migrate"))


def test_a_default_root_that_is_a_file_is_an_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("TORCHCACHE_DIR", str(tmp_path / "afile"))
    code, out, err = run(capsys, "ls")
    assert (code, out) == (
        1,
        "",
    ) and err == f"torchcache: error: the cache root {tmp_path / 'afile'} is not a directory\n"
    monkeypatch.setenv("TORCHCACHE_DIR", str(tmp_path / "not made yet"))
    code, out, _ = run(capsys, "ls")
    assert code == 0 and out.startswith("no caches under")


@pytest.mark.parametrize("copy_of", ["redis://server:6379/0", 5, None])
def test_a_local_copy_says_what_its_server_has_not_taken_whatever_its_metadata_says(
    capsys: pytest.CaptureFixture[str], cache_root: Path, copy_of: object
) -> None:
    directory = make_dir(items=4)
    keys = [path.name for path in stored_entries(cache_root)]
    (directory / "unsent-7-0a1b2c3d.keys").write_text("\n".join([*keys[:3], keys[0], "not a key"]) + "\n")
    meta = json.loads((directory / META_NAME).read_text())
    (directory / META_NAME).write_text(json.dumps({**meta, "copy_of": copy_of}))
    assert main(["ls", str(cache_root), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["caches"]
    assert (listed["unsent_entries"], listed["copy_of"]) == (3, copy_of if isinstance(copy_of, str) else None)
    assert main(["info", str(directory)]) == 0
    assert "3 entries held here only" in capsys.readouterr().out
    assert main(["clear", directory.name, "--root", str(cache_root)]) == 1  # not confirmed: names what would go
    assert "with 3 entries its server has not taken yet" in capsys.readouterr().err
    assert main(["prune", str(cache_root), "--keep", "0", "--dry-run"]) == 0
    assert "3 entries of those local copies have not reached their servers yet" in capsys.readouterr().err


def test_planted_unsent_files_are_counted_up_to_what_a_process_holds(tmp_path: Path) -> None:
    from torchcache.stores.unsent import MAX_KEYS, count_unsent

    lines = "".join(f"{i:06x}\n" for i in range(MAX_KEYS + 1000))  # short keys: many lines in few bytes
    for token in ("0a1b2c3d", "1a1b2c3d"):
        (tmp_path / f"unsent-7-{token}.keys").write_text(lines)
    (tmp_path / "unsent-7-2a1b2c3d.keys.tmp").write_text("abcd\n")  # a save in progress: not counted
    assert count_unsent(sorted(tmp_path.iterdir())) == MAX_KEYS
