"""The batched store contract, run against every batched store.

A new store is tested by adding one parameter to the ``store_kind`` fixture and one
branch to ``make_store``. ``ReferenceStore`` (in ``tests/store_helpers.py``) is the
contract in plain Python: a dict with a byte budget and whole-entry MRU eviction by
write time.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.store_helpers import ReferenceStore, key, value
from torchcache.errors import KeyingError
from torchcache.stores.batched import BatchedStore
from torchcache.stores.objects import ObjectStore
from torchcache.stores.packed.store import PackedStore
from torchcache.stores.redis.store import RedisStore
from torchcache.tiers.layered import LayeredStore

StoreFactory = Callable[[int], BatchedStore]


@pytest.fixture(
    params=[
        "reference",
        "packed",
        "redis",
        "redis-cluster",
        "layered",
        "s3",
        pytest.param("gcs", marks=pytest.mark.slow),
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(store_kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreFactory]:
    made: list[BatchedStore] = []
    count = iter(range(1000))
    server = None
    if store_kind.startswith("redis") or store_kind == "layered":
        from tests.redis_servers import shared  # skips (or fails under CI) without redis-server

        server = shared("redis" if store_kind == "layered" else store_kind)

    def make(max_bytes: int) -> BatchedStore:
        if store_kind == "s3":
            from tests.object_servers import make_bucket, s3_endpoint  # skips (or fails under CI) without moto

            endpoint = s3_endpoint()
            options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
            url = f"s3://{make_bucket(endpoint)}/cache"
            store: BatchedStore = ObjectStore(url, "contract", max_bytes, storage_options=options, report=_no_reports)
        elif store_kind == "gcs":
            from tests.object_servers import new_gcs_bucket

            url = f"{new_gcs_bucket(monkeypatch)}/cache"  # sets STORAGE_EMULATOR_HOST for this test
            options = {"token": "anon", "project": "test"}
            store = ObjectStore(url, "contract", max_bytes, storage_options=options, report=_no_reports)
        elif store_kind == "reference":
            store = ReferenceStore(max_bytes)
        elif store_kind == "packed":
            store = PackedStore(tmp_path / f"store{next(count)}", max_bytes, report=_no_reports)
        else:
            store = RedisStore(server.url, f"contract{next(count)}", max_bytes, report=_no_reports)
            if store_kind == "layered":  # a local copy in front of the server
                near = PackedStore(tmp_path / f"store{next(count)}", max_bytes, report=_no_reports)
                store = LayeredStore(near, store, report=_no_reports)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
    if server is not None:
        server.flush()


def _no_reports(kind: str, message: str) -> None:
    raise AssertionError(f"unexpected report {kind}: {message}")


def _as_bytes(values: list[bytes | memoryview | None]) -> list[bytes | None]:
    return [None if v is None else bytes(v) for v in values]


def test_round_trip_misses_and_order(make_store: StoreFactory) -> None:
    store = make_store(10**7)
    assert store.put_many([(key(i), value(i)) for i in range(50)]) == 50
    asked = [key(3), key(99), key(0), key(3), key(49)]
    assert _as_bytes(store.get_many(asked)) == [value(3), None, value(0), value(3), value(49)]
    assert store.get_many([]) == [] and store.put_many([]) == 0 and store.delete_many([]) == 0
    assert bytes(store.get(key(7)) or b"") == value(7)


def test_len_contains_keys_nbytes(make_store: StoreFactory) -> None:
    store = make_store(10**7)
    store.put_many([(key(i), value(i, 100 + i)) for i in range(20)])
    assert len(store) == 20
    assert set(store.keys()) == {key(i) for i in range(20)}
    assert store.nbytes == sum(100 + i for i in range(20))
    assert key(5) in store and key(50) not in store
    assert "not a key" not in store and 17 not in store


def test_replace_delete_and_clear(make_store: StoreFactory) -> None:
    store = make_store(10**7)
    store.put_many([(key(1), b"old1"), (key(2), b"old2")])
    assert store.put_many([(key(1), b"new"), (key(3), b"x"), (key(3), b"last wins")]) == 2
    assert _as_bytes(store.get_many([key(1), key(2), key(3)])) == [b"new", b"old2", b"last wins"]
    assert store.nbytes == len(b"new") + len(b"old2") + len(b"last wins")
    assert store.delete_many([key(2), key(2), key(9)]) == 1
    assert store.get(key(2)) is None and len(store) == 2 and store.delete(key(2)) is False
    store.clear()
    assert len(store) == 0 and store.nbytes == 0 and list(store.keys()) == []
    assert store.put(key(4), memoryview(b"from a view")) and bytes(store.get(key(4)) or b"") == b"from a view"


@pytest.mark.parametrize("bad", ["ABCD", "abc", "xyz1", "a" * 65, " abcd", "abcd ", "", "ab cd"])
def test_invalid_keys_are_refused(make_store: StoreFactory, bad: str) -> None:
    store = make_store(10**6)
    with pytest.raises(KeyingError):
        store.put_many([(bad, b"x")])
    with pytest.raises(KeyingError):
        store.get_many([bad])
    with pytest.raises(KeyingError):
        store.delete_many([bad])
    assert bad not in store


@pytest.mark.parametrize("length", [4, 5, 31, 33, 63, 64])
def test_any_hex_key_length(make_store: StoreFactory, length: int) -> None:
    store = make_store(10**6)
    keys = [hashlib.sha256(str(i).encode()).hexdigest()[:length] for i in range(3)]
    store.put_many([(k, k.encode()) for k in keys])
    assert _as_bytes(store.get_many(keys)) == [k.encode() for k in keys]
    assert set(store.keys()) == set(keys)


def test_budget_holds_and_oversized_items_are_skipped(make_store: StoreFactory) -> None:
    budget = 200_000
    store = make_store(budget)
    assert store.put_many([(key(0), b"x" * (budget + 1))]) == 0
    assert len(store) == 0
    for start in range(0, 1000, 50):
        store.put_many([(key(i), value(i)) for i in range(start, start + 50)])
        assert store.nbytes <= budget
    assert 100 <= len(store) <= 200
    found = store.get_many([key(i) for i in range(1000)])
    assert all(v is None or bytes(v) == value(i) for i, v in enumerate(found))


# A bucket's budget removes its oldest segments first (tests/test_objects.py); its local copy is MRU.
@pytest.mark.parametrize("store_kind", ["reference", "packed", "redis", "redis-cluster", "layered"])
def test_mru_keeps_a_stable_subset_over_shuffled_epochs(make_store: StoreFactory) -> None:
    budget = 4_000_000  # room for about 3,600 of the 9,000 items
    store = make_store(budget)
    items = list(range(9000))
    rng = random.Random(0)
    survivors: list[set[int]] = []
    for _ in range(3):
        rng.shuffle(items)
        for start in range(0, len(items), 100):
            batch = items[start : start + 100]
            hits = store.get_many([key(i) for i in batch])
            store.put_many([(key(i), value(i)) for i, hit in zip(batch, hits) if hit is None])
        found = store.get_many([key(i) for i in range(9000)])
        survivors.append({i for i, v in enumerate(found) if v is not None})
    assert len(survivors[0]) >= 3000
    # Most of what the first epoch kept is still there after two more epochs.
    assert len(survivors[0] & survivors[2]) >= 0.9 * len(survivors[0])


def test_threads_read_and_write_at_once(make_store: StoreFactory) -> None:
    store = make_store(10**8)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for start in range(offset, offset + 400, 40):
                store.put_many([(key(i), value(i, 300)) for i in range(start, start + 40)])
                got = store.get_many([key(i) for i in range(offset, start + 40)])
                assert _as_bytes(got) == [value(i, 300) for i in range(offset, start + 40)]
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n * 1000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(store) == 1600


def test_verify_healthy_and_repr(make_store: StoreFactory, store_kind: str) -> None:
    store = make_store(10**6)
    store.put_many([(key(i), value(i)) for i in range(10)])
    report = store.verify()
    assert report.ok and report.entries == 10
    if store_kind != "reference":
        assert "max_bytes" in repr(store) and "10 entries" in repr(store)
    store.flush()
    store.close()
    assert bytes(store.get(key(1)) or b"") == value(1)  # usable again after close


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "delete"]),
            st.lists(st.integers(0, 15), min_size=0, max_size=6),
            st.binary(max_size=40),
        ),
        max_size=25,
    )
)
def test_behaves_like_a_dict_within_budget(make_store: StoreFactory, ops: list[tuple[str, list[int], bytes]]) -> None:
    store = make_store(10**7)
    store.clear()
    model: dict[str, bytes] = {}
    for op, ids, data in ops:
        keys = [key(i) for i in ids]
        if op == "put":
            assert store.put_many([(k, data + k.encode()) for k in keys]) == len(set(keys))
            model.update((k, data + k.encode()) for k in keys)
        elif op == "get":
            assert _as_bytes(store.get_many(keys)) == [model.get(k) for k in keys]
        else:
            assert store.delete_many(keys) == sum(1 for k in set(keys) if k in model)
            for k in keys:
                model.pop(k, None)
        assert len(store) == len(model) and store.nbytes == sum(map(len, model.values()))
