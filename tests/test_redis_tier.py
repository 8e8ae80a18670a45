"""``persistent_cache_dir="redis://..."``: the persistent tier of ``@torchcache`` on a real Redis server or cluster."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import RAMP_DATASET, Counting, cached, run_python
from tests.redis_servers import RedisClusterServers, RedisServer, another_protocol_server, own_server, shared
from torchcache import CacheWarning, ConfigError, torchcache

_SCRIPT = """
import json, sys, torch
from tests.helpers import Counting, cached
model = cached(Counting, persistent=True, persistent_cache_dir=sys.argv[1], max_memory_cache_size=0)()
x = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))
y = model(x)
model.cache_instance.flush()
print(json.dumps({"items": model.items, "sum": float(y.sum()), "hits": model.cache_instance.stats().hits}))
"""


@pytest.fixture(params=["redis", "redis-cluster"])
def target(request: pytest.FixtureRequest) -> Iterator[RedisServer | RedisClusterServers]:
    servers = shared(str(request.param))
    servers.flush()  # whatever an earlier test of this worker left there
    yield servers
    servers.flush()


def _run(url: str) -> dict[str, Any]:
    done = run_python(_SCRIPT, url)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_hits_what_the_first_stored(target: RedisServer | RedisClusterServers) -> None:
    first, second = _run(target.url), _run(target.url)
    assert first["items"] == 32 and first["hits"] == 0
    assert second["items"] == 0 and second["hits"] == 32  # the module never ran
    assert second["sum"] == first["sum"]


def test_hits_come_back_equal_and_the_key_namespace_is_the_module_key(server_url: str) -> None:
    model = cached(Counting, persistent=True, persistent_cache_dir=server_url, max_memory_cache_size=0)()
    plain = Counting()
    x = torch.randn(16, 4)
    assert torch.equal(model(x), plain(x))
    model.cache_instance.flush()
    assert torch.equal(model(x), plain(x))
    stats = model.cache_instance.stats()
    assert model.items == 16 and stats.hits == 16 and stats.disk is not None and stats.disk.entries == 16
    assert model.cache_instance.cache_dir is None  # not a local directory
    from torchcache.stores.redis.store import RedisStore

    assert RedisStore.namespaces(server_url) == [model.cache_instance.module_hash]


@pytest.fixture
def server_url() -> Iterator[str]:
    server = shared("redis")
    server.flush()  # whatever an earlier test of this worker left there
    yield server.url
    server.flush()


def test_bad_urls_and_a_missing_package_fail_at_decoration(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="persistent_cache_dir"):
        torchcache(persistent=True, persistent_cache_dir="redis://127.0.0.1:notaport/0")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "redis" else real(name, *a))
    with pytest.raises(ConfigError, match=r"torchcache\[redis\]"):
        torchcache(persistent=True, persistent_cache_dir="redis://127.0.0.1:6379/0")


def test_torchcache_dir_may_be_a_redis_url(server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHCACHE_DIR", server_url)
    model = cached(Counting, persistent=True, max_memory_cache_size=0)()
    x = torch.randn(8, 4)
    model(x)
    model.cache_instance.flush()
    model(x)
    assert model.items == 8 and model.cache_instance.stats().disk.hits == 8  # type: ignore[union-attr]


def _calls_survive(model: Any, plain: Counting, x: torch.Tensor) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(model(x), plain(x))
        model.cache_instance.flush()
        assert torch.equal(model(x), plain(x))
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


@pytest.mark.slow
def test_a_server_that_goes_away_and_comes_back_never_breaks_a_call() -> None:
    password = "s3cret-pw"
    with own_server(password=password) as server:
        model = cached(Counting, persistent=True, persistent_cache_dir=server.url, max_memory_cache_size="1MB")()
        plain = Counting()
        x = torch.randn(8, 4)
        assert _calls_survive(model, plain, x) == []
        port = server.port
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        started = time.monotonic()
        messages = _calls_survive(model, plain, torch.randn(8, 4))  # new items: misses, writes refused
        assert time.monotonic() - started < 30  # bounded by the connection timeout, no hang
        assert len(messages) == 1 and "redis" in messages[0].lower()
        assert password not in messages[0] and password not in repr(model.cache_instance)
        server.start(port)
        deadline = time.monotonic() + 60  # the store retries after its backoff (0.5 s, doubling)
        stored = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            while stored == 0 and time.monotonic() < deadline:
                model(torch.randn(4, 4))
                model.cache_instance.flush()
                stats = model.cache_instance.stats().disk
                stored = 0 if stats is None else stats.entries
        assert stored > 0


@pytest.mark.slow
def test_a_full_server_refuses_writes_but_calls_stay_right() -> None:
    with own_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as server:
        model = cached(Counting, persistent=True, persistent_cache_dir=server.url)(dim_out=4096)
        plain = Counting(dim_out=4096)
        seen: list[str] = []
        for _ in range(4):  # 64 KiB items: the server fills after a few dozen
            seen += _calls_survive(model, plain, torch.randn(32, 4))
        assert len(seen) == 1 and "not stored" in seen[0]
        x = torch.randn(4, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            assert torch.equal(model(x), plain(x))


@pytest.mark.slow
def test_the_command_line_lists_verifies_and_clears_caches_on_a_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torchcache.cli.main import main
    from torchcache.stores.redis.store import RedisStore

    password = "cli-s3cret"
    with own_server(password=password) as server:
        model = cached(Counting, persistent=True, persistent_cache_dir=server.url, max_memory_cache_size=0)()
        model(torch.randn(6, 4))
        model.cache_instance.flush()
        key = model.cache_instance.module_hash
        assert main(["ls", server.url, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert listed["caches"] == [{"key": key, "entries": 6, "bytes": listed["caches"][0]["bytes"]}]
        assert password not in listed["root"]
        assert main(["info", key[:6], "--root", server.url]) == 0
        assert password not in capsys.readouterr().out
        assert main(["verify", server.url]) == 0
        capsys.readouterr()
        with RedisStore(server.url, key, 1 << 30) as store:
            victim = sorted(store.keys())[0]
            store.put_many([(victim, b"not a frame")])  # a valid record holding a bad frame
        assert main(["verify", server.url]) == 1
        assert victim in capsys.readouterr().out
        assert main(["verify", "--fix", server.url]) == 0
        with RedisStore(server.url, key, 1 << 30) as store:
            assert len(store) == 5 and victim not in store
        assert main(["clear", "--all", "--root", server.url]) == 1  # without --yes
        assert main(["clear", "--all", "--yes", "--root", server.url]) == 0
        assert RedisStore.namespaces(server.url) == []
        out = capsys.readouterr()
        assert password not in out.out + out.err


def test_entries_stored_after_a_write_the_server_refused_are_not_counted_as_unstored(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.errors import StoreUnavailableError
    from torchcache.stores.redis.store import RedisStore

    model = cached(Counting, persistent=True, persistent_cache_dir=server_url, max_memory_cache_size=0)()
    real, refused = RedisStore.put_many, []

    def put_many(self: RedisStore, items: Any) -> int:
        if not refused:  # the server away for one write
            refused.append(True)
            raise StoreUnavailableError("the server is away")
        return real(self, items)

    monkeypatch.setattr(RedisStore, "put_many", put_many)
    x = torch.cat([torch.randn(8, 4)] * 2)  # each item twice: 8 entries
    with pytest.warns(CacheWarning, match="; 8 entries not stored"):
        model(x)
        model.cache_instance.flush()
        model(x)  # a miss again, its writes taken this time
        model.cache_instance.flush()
    disk = model.cache_instance._disk
    assert refused and disk is not None and len(disk.unstored) == 0 and model.cache_instance.stats().disk.entries == 8


_UNSTORED = """
import sys, torch
from tests.helpers import Counting, cached
model = cached(Counting, persistent=True, persistent_cache_dir=sys.argv[1], max_memory_cache_size=0)()
model(torch.randn(16, 4))  # no flush: the writes are pending when the process exits
"""


@pytest.mark.slow
def test_writes_a_server_never_took_are_counted_at_exit() -> None:
    with own_server() as server:
        url = server.url
    done = run_python(_UNSTORED, url)  # the server is gone: every write fails, at exit at the latest
    assert done.returncode == 0, done.stderr[-3000:]
    assert "16 entries computed in this process could not be stored" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_dataset_cache_on_a_server_serves_a_second_process(target: RedisServer | RedisClusterServers) -> None:
    runs = []
    for _ in range(2):
        done = run_python(RAMP_DATASET, target.url)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0] == {"calls": 24, "disk_hits": 0}
    assert runs[1] == {"calls": 0, "disk_hits": 24}  # every sample from the server


@pytest.mark.slow
def test_verify_checks_a_dataset_cache_on_a_server_as_samples_and_fix_keeps_them(
    server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main
    from torchcache.stores.redis.store import RedisStore

    done = run_python(RAMP_DATASET, server_url)  # samples of a tensor and an int label
    assert done.returncode == 0, done.stderr[-3000:]
    (namespace,) = RedisStore.namespaces(server_url)
    assert main(["verify", server_url]) == 0 and "no problems found" in capsys.readouterr().out
    with RedisStore(server_url, namespace, 1 << 30) as store:
        victim = sorted(store.keys())[0]
        store.put_many([(victim, b"neither a frame nor a sample")])
    assert main(["verify", server_url]) == 1 and victim in capsys.readouterr().out
    assert main(["verify", "--fix", server_url]) == 0
    with RedisStore(server_url, namespace, 1 << 30) as store:
        assert len(store) == 23 and victim not in store  # the damaged one only
    again = run_python(RAMP_DATASET, server_url)
    assert json.loads(again.stdout.strip().splitlines()[-1]) == {"calls": 1, "disk_hits": 23}


@pytest.mark.slow
def test_a_server_of_another_kind_on_the_port_never_breaks_a_read_a_call_or_the_stats(tmp_path: Path) -> None:
    from torchcache import CachedDataset

    samples = [(torch.arange(6.0) * i, i) for i in range(16)]
    with another_protocol_server() as url, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = CachedDataset(samples, url, max_memory_size=0, check_samples=False)
        data.warmup()
        for i in (*range(16), *range(16)):
            x, y = data[i]
            assert torch.equal(x, samples[i][0]) and y == i
        assert data.stats().disk is not None
        data.close()
        # With a local copy: without one, the second call finds the first's rows only while
        # they wait to be written (a write the server refuses drops them), so its hits would
        # depend on the writer thread's timing.
        model = cached(
            Counting, persistent=True, persistent_cache_dir=url, max_memory_cache_size=0, local_cache_dir=tmp_path
        )()
        x = torch.randn(4, 4)
        for _ in range(2):
            assert torch.equal(model(x), Counting()(x))
        model.cache_instance.flush()
        stats = model.cache_instance.stats()
        assert (stats.misses, stats.hits) == (4, 4)  # the second call from the local copy
    assert caught and all(issubclass(w.category, CacheWarning) for w in caught)
    assert any("not as Redis does" in str(w.message) for w in caught)


def test_planted_bookkeeping_never_breaks_a_call_or_the_stats(server_url: str) -> None:
    model = cached(Counting, persistent=True, persistent_cache_dir=server_url, max_memory_cache_size=0)()
    plain = Counting()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    model(x)
    model.cache_instance.flush()
    namespace = model.cache_instance.module_hash
    with shared("redis").client() as client:
        client.hset(f"tc:{{{namespace}}}:stats", mapping={"bytes": -100000000000, "payload": "x", "clock": "1.5"})
        client.hset(f"tc:{{{namespace}}}:sizes", "planted", "not a size")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert torch.equal(model(x), plain(x)) and torch.equal(model(y), plain(y))
        model.cache_instance.flush()
        repr(model.cache_instance)
        stats = model.cache_instance.stats()
        model.cache_instance.summary()
    assert model.items == 16 and stats.disk is not None and stats.disk.entries == 16
    assert stats.disk.bytes == model.cache_instance._disk.store.nbytes > 0  # type: ignore[union-attr]


def test_totals_planted_as_another_kind_of_value_are_counted_again_and_listed(server_url: str) -> None:
    from torchcache.stores.redis.store import RedisStore

    model = cached(Counting, persistent=True, persistent_cache_dir=server_url, max_memory_cache_size=0)()
    model(torch.randn(8, 4))
    model.cache_instance.flush()
    namespace = model.cache_instance.module_hash
    with shared("redis").client() as client:
        clock = int(client.hget(f"tc:{{{namespace}}}:stats", "clock"))
        client.delete(f"tc:{{{namespace}}}:stats")
        client.set(f"tc:{{{namespace}}}:stats", "planted")  # a string where the totals' hash was
        assert namespace in RedisStore.namespaces(server_url)  # still listed (its sizes are torchcache's)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)
            model(torch.randn(8, 4))  # written: the totals are counted again, not refused for good
            model.cache_instance.flush()
        assert client.type(f"tc:{{{namespace}}}:stats") == b"hash"
        newest = client.zrange(f"tc:{{{namespace}}}:order", -8, -1, withscores=True)
        assert min(score for _, score in newest) > clock  # the write clock resumed from the order, not from 0
    with RedisStore(server_url, namespace, 1 << 30) as store:
        assert len(store) == 16 and store.verify().ok


@pytest.mark.slow
def test_with_the_server_away_the_stats_keep_the_last_count() -> None:
    with own_server() as server:
        model = cached(Counting, persistent=True, persistent_cache_dir=server.url, max_memory_cache_size=0)()
        model(torch.randn(8, 4))
        model.cache_instance.flush()
        before = model.cache_instance.stats().disk
        assert before is not None and before.entries == 8
        server.kill()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            after = model.cache_instance.stats().disk
            summary = model.cache_instance.summary()
        assert after is not None and (after.entries, after.bytes) == (8, before.bytes)
        assert "8 entries" in summary


def _server_away(patch: pytest.MonkeyPatch, store: Any) -> None:
    """``store``'s reads miss and its writes fail, as while its server is away."""
    from torchcache.errors import StoreUnavailableError

    def away(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("the server is away")

    patch.setattr(store, "get_many", lambda keys: [None] * len(keys))
    patch.setattr(store, "put_many", away)


def _with_a_copy(url: str, local: Any) -> Any:
    """A decorated module on the server at ``url``, with a local copy in ``local`` and no memory tier."""
    return cached(Counting, persistent=True, persistent_cache_dir=url, local_cache_dir=local, max_memory_cache_size=0)()


def test_entries_read_back_from_the_server_are_not_counted_as_unstored_at_exit(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = cached(Counting, persistent=True, persistent_cache_dir=server_url, max_memory_cache_size=0)()
    x = torch.randn(4, 4)
    model(x)
    model.cache_instance.flush()
    disk = model.cache_instance._disk
    with monkeypatch.context() as outage, warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        _server_away(outage, disk.store)
        model(x)  # computed again; the write is refused
        model.cache_instance.flush()
    assert len(disk.unstored) == 4
    model(x)  # the server answers: its entries were there all along
    assert model.items == 8 and len(disk.unstored) == 0


def test_hits_of_the_local_copy_leave_what_the_server_did_not_take_counted(
    server_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    model = _with_a_copy(server_url, tmp_path)
    x = torch.randn(4, 4)
    with monkeypatch.context() as outage, warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        model(torch.randn(1, 4))  # the tier opens
        disk = model.cache_instance._disk
        _server_away(outage, disk.store.far)
        model(x)
        model.cache_instance.flush()
        unstored = len(disk.unstored)
        model(x)  # a hit of the copy: the server still lacks them
        assert model.items == 5 and unstored >= 4 and len(disk.unstored) == unstored


def test_with_the_local_copy_off_hits_of_the_server_are_not_counted_as_unstored(
    server_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from torchcache.errors import StoreError

    model = _with_a_copy(server_url, tmp_path)
    x = torch.randn(4, 4)
    model(x)
    model.cache_instance.flush()
    disk = model.cache_instance._disk
    layered = disk.store

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("no space left on the local disk")

    with monkeypatch.context() as outage, warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        outage.setattr(layered.near, "get_many", failing)  # the copy fails: off for this process
        outage.setattr(layered.near, "put_many", failing)
        _server_away(outage, layered.far)
        model(x)
        model.cache_instance.flush()
    assert not layered.near_enabled and len(disk.unstored) == 4
    model(x)  # read from the server, which held them all along
    assert model.items == 8 and len(disk.unstored) == 0


def test_a_redis_tier_fed_one_sample_at_a_time_stops_writing_once_it_evicts(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache import CachedDataset
    from torchcache.stores.redis.store import RedisStore

    real, evictions = RedisStore.put_many, []

    def put_many(self: RedisStore, items: Any) -> int:
        kept = real(self, items)
        evictions.append(self.evicted_by_last_put)
        return kept

    monkeypatch.setattr(RedisStore, "put_many", put_many)
    samples = [torch.full((1000,), float(i)) for i in range(40)]  # about 4 KB each, 10 to a 40 KB budget
    data = CachedDataset(samples, server_url, max_memory_size=0, max_disk_size="40KB", check_samples=False)
    for i in range(40):  # no DataLoader: one sample per write
        assert torch.equal(data[i], samples[i])
    assert 5 < len(evictions) < 40 and evictions[-1] > 0 and not any(evictions[:-1]), evictions
    writes = len(evictions)
    for i in range(40):  # what the server kept is read back whole; nothing more is written
        assert torch.equal(data[i], samples[i])
    stats = data.stats()
    assert stats.disk is not None and 5 < stats.disk.hits < 12 and len(evictions) == writes, (stats, evictions)
    data.close()
