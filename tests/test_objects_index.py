"""The index of an object store cache (manifests.py): merging manifests, tombstones and checkpoints."""

from __future__ import annotations

import gc
import json
import secrets
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.stores.objects.index import Index
from torchcache.stores.objects.manifests import CHECKPOINT, MANIFEST, SEGMENT, TOMBSTONE, Entry, pack, tombstone

HEX = "0123456789abcdef"


def _name(stamp: int, suffix: str) -> str:
    return f"{stamp:020d}-{stamp:x}{suffix}"


def _manifest(stamp: int, keys: list[str]) -> tuple[str, bytes]:
    """A manifest of ``keys``, each with a payload of its own (so each entry's place is known)."""
    return _name(stamp, MANIFEST), pack({key: (key + str(stamp)).encode() for key in keys})[1]


def _expected(objects: list[tuple[str, int, list[str]]]) -> dict[str, tuple[str, int]]:
    """For each key, the segment and stamp of its newest manifest, unless a newer tombstone names it."""
    newest: dict[str, tuple[str, int]] = {}
    deleted: dict[str, int] = {}
    for kind, stamp, keys in objects:
        for key in keys:
            if kind == "manifest" and (key not in newest or newest[key][1] < stamp):
                newest[key] = (_name(stamp, SEGMENT), stamp)
            if kind == "tombstone":
                deleted[key] = max(deleted.get(key, -1), stamp)
    return {key: place for key, place in newest.items() if deleted.get(key, -1) < place[1]}


def _apply(index: Index, kind: str, stamp: int, keys: list[str]) -> None:
    if kind == "manifest":
        name, body = _manifest(stamp, keys)
    else:
        name, body = _name(stamp, TOMBSTONE), tombstone(keys)
    assert index.apply(name, body) is None


_keys = st.lists(st.text(HEX, min_size=4, max_size=64), min_size=1, max_size=12, unique=True)


@settings(max_examples=150, deadline=None)
@given(
    pool=_keys,
    plan=st.lists(
        st.tuples(st.sampled_from(["manifest", "manifest", "tombstone"]), st.lists(st.integers(0, 11)), st.booleans()),
        min_size=1,
        max_size=10,
    ),
    order=st.randoms(use_true_random=False),
)
def test_any_order_of_manifests_and_tombstones_gives_each_key_its_newest_visible_entry(
    pool: list[str], plan: list[tuple[str, list[int], bool]], order: object
) -> None:
    # keys of every width from 4 to 64, with prefixes of one another: none may stand for another
    pool = pool + [key[:-1] for key in pool if len(key) > 4] + [key + "0" for key in pool if len(key) < 64]
    objects = [
        (kind, stamp + 1, sorted({pool[i % len(pool)] for i in picks})) for stamp, (kind, picks, _) in enumerate(plan)
    ]
    applied = list(zip(objects, [ask for *_, ask in plan]))
    order.shuffle(applied)  # type: ignore[attr-defined]
    index = Index()
    for (kind, stamp, keys), ask in applied:
        _apply(index, kind, stamp, keys)
        if ask:  # a question between merges settles what was merged so far
            index.find(pool)
    expected = _expected(objects)
    fresh = Index()
    assert fresh.apply(_name(len(plan) + 1, CHECKPOINT), index.checkpoint()) is None
    for merged in (index, fresh):
        found = merged.find(pool)
        assert {key: entry.segment for key, entry in zip(pool, found) if entry is not None} == {
            key: segment for key, (segment, _) in expected.items() if key in pool
        }
        assert sorted(merged.keys()) == sorted(expected) and len(merged) == len(expected)
        assert merged.nbytes() == sum(len(key) + len(str(stamp)) for key, (_, stamp) in expected.items())
        for key, entry in zip(pool, found):
            if entry is not None:  # the length its manifest gave
                assert entry.length == len(key) + len(str(expected[key][1]))


def test_a_segment_forgotten_takes_its_entries_with_it_and_older_copies_stay_gone() -> None:
    index = Index()
    _apply(index, "manifest", 1, ["aaaa", "bbbb"])
    _apply(index, "manifest", 2, ["bbbb", "cccc"])
    index.forget({_name(2, SEGMENT)})
    assert [e is not None for e in index.find(["aaaa", "bbbb", "cccc"])] == [True, False, False]
    kept = index.find(["aaaa"])[0]
    assert kept is not None and kept == Entry(_name(1, SEGMENT), 0, 5, kept.digest)
    assert index.members(_name(1, SEGMENT)) == [("aaaa", 0, 5, kept.digest)]
    index.forget(set(), ["aaaa"])
    assert len(index) == 0 and index.missing(["aaaa"])


def test_a_key_longer_or_shorter_than_the_stored_ones_is_never_cut_to_match() -> None:
    index = Index()
    _apply(index, "manifest", 1, ["abcd" * 8])
    assert index.find(["abcd" * 8 + "0", "abcd" * 7, "abcd" * 8]) == [None, None, index.find(["abcd" * 8])[0]]
    assert "abcd" * 8 + "ab" not in index and "abcd" * 8 in index


def test_an_object_whose_stamp_is_not_a_number_of_63_bits_is_refused() -> None:
    index = Index()
    body = pack({"aaaa": b"x"})[1]
    assert index.apply("xyz-1.tcm", body) is not None
    assert index.apply(f"{1 << 63:020d}-1.tcm", body) is not None
    checkpoint = json.loads(Index().checkpoint())
    checkpoint["segments"] = [[f"{99999999999999999999:020d}-ab.tcs", 1, [["aaaa", 0, 1, 0]]]]
    assert index.load(json.dumps(checkpoint).encode()) is not None
    assert len(index) == 0


def test_the_index_keeps_no_python_object_per_entry() -> None:
    index = Index()
    for stamp in range(1, 21):
        _apply(index, "manifest", stamp, [secrets.token_hex(16) for _ in range(500)])
    gc.collect()
    before = len(gc.get_objects())
    assert len(index) == 10_000  # merged now
    gc.collect()
    assert len(gc.get_objects()) - before < 100


def test_a_cache_folder_cleared_while_the_bucket_is_listed_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchcache.stores.objects import bucket as object_store

    class Listing:
        """A bucket with two cache folders, one of which another process clears as it is listed."""

        def ls(self, path: str, detail: bool = True) -> list[Any]:
            if path == "b/root":
                return [{"name": "b/root/kept", "type": "directory"}, {"name": "b/root/gone", "type": "directory"}]
            raise FileNotFoundError(path)

        def exists(self, path: str) -> bool:
            if path.startswith("b/root/gone/"):
                raise FileNotFoundError(path)
            return True

    monkeypatch.setattr(object_store, "open_filesystem", lambda url, options=None: (Listing(), "b/root"))
    assert object_store.bucket_namespaces("s3://b/root") == ["kept"]


def test_a_checkpoint_leaves_out_a_segment_the_listing_no_longer_shows() -> None:
    from torchcache.stores.objects.manifests import parse_checkpoint

    index = Index()
    _apply(index, "manifest", 1, ["aaaa", "bbbb"])
    _apply(index, "manifest", 2, ["cccc"])
    index.sized({_name(2, SEGMENT): 5})  # the first segment's object was removed from the bucket
    body = index.checkpoint()
    assert not isinstance(parse_checkpoint(body), str)  # a checkpoint every reader takes
    fresh = Index()
    assert fresh.load(body) is None
    assert [e is not None for e in fresh.find(["aaaa", "bbbb", "cccc"])] == [False, False, True]
