"""Caches in an object store bucket (S3 through a local moto server): stores, datasets, the decorator."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import zygote
from tests.helpers import Counting, cached
from tests.object_servers import s3_endpoint
from tests.store_helpers import Reports, key, value
from torchcache import CachedDataset, CacheWarning, ConfigError, WindowSampler
from torchcache import torchcache as torchcache_decorator
from torchcache.errors import StoreUnavailableError
from torchcache.faults import Fault
from torchcache.stores.objects import ObjectStore
from torchcache.stores.objects.index import Index
from torchcache.stores.objects.manifests import pack, ranged_reads, tombstone
from torchcache.stores.packed.format import HEADER
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES
from torchcache.stores.unsent import Unsent

pytestmark = pytest.mark.usefixtures("reads_counted")  # the tests here count the dataset's reads


def _store(url: str, max_bytes: int = 10**7, reports: Reports | None = None, **options: Any) -> ObjectStore:
    storage = {"endpoint_url": s3_endpoint(), "key": "testing", "secret": "testing"}
    return ObjectStore(f"{url}/cache", "ns", max_bytes, storage_options=storage, report=reports, **options)


def _objects(fs: Any, url: str) -> list[str]:
    return sorted(path.rsplit("/", 1)[-1] for path in fs.find(url.removeprefix("s3://")))


class Images(torch.utils.data.Dataset[Any]):
    def __init__(self, n: int = 12) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.calls += 1
        return torch.full((3, 4, 4), i % 251, dtype=torch.uint8), i


# -- the store ----------------------------------------------------------------------------
def test_writers_on_two_machines_see_each_others_entries_after_a_listing(bucket: str) -> None:
    one, two = _store(bucket), _store(bucket)
    one.put_many([(key(i), value(i)) for i in range(10)])
    two.put_many([(key(i), value(i)) for i in range(10, 20)])
    third = _store(bucket)
    assert [bytes(v or b"") for v in third.get_many([key(i) for i in range(20)])] == [value(i) for i in range(20)]
    assert third.bucket.requests == 5  # one listing, one read per manifest, one ranged read per segment


def test_an_upload_without_its_manifest_is_invisible_and_prune_sweeps_it(bucket: str, s3fs_of: Any) -> None:
    store = _store(bucket)
    store.put_many([(key(1), value(1))])
    prefix = store.bucket.prefix
    s3fs_of.pipe_file(f"{prefix}/00000000000000000001-deadbeefdeadbeef.tcs", value(2))  # a writer killed here
    assert _store(bucket).get(key(2)) is None and len(_store(bucket)) == 1
    assert store.prune(10**7, sweep_seconds=0) == 1
    assert not any(name.startswith("00000000000000000001") for name in _objects(s3fs_of, bucket))
    assert bytes(_store(bucket).get(key(1)) or b"") == value(1)


def test_prune_aborts_a_large_upload_that_a_killed_writer_left(bucket: str) -> None:
    import boto3

    from tests.object_servers import _boto_credentials

    name = bucket.removeprefix("s3://")
    client = boto3.client("s3", endpoint_url=s3_endpoint(), **_boto_credentials())
    try:
        for path in ("cache/ns/01-segment.tcs", "elsewhere/01-segment.tcs"):  # a part stored, never completed
            upload = client.create_multipart_upload(Bucket=name, Key=path)["UploadId"]
            client.upload_part(Bucket=name, Key=path, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
        store = _store(bucket)
        store.put_many([(key(1), value(1))])
        store.prune(10**7, sweep_seconds=None)  # no sweep
        assert len(client.list_multipart_uploads(Bucket=name).get("Uploads", [])) == 2
        store.prune(10**7)  # moto dates every upload in 2010: over an hour old
        left = [u["Key"] for u in client.list_multipart_uploads(Bucket=name).get("Uploads", [])]
        assert left == ["elsewhere/01-segment.tcs"]  # another prefix's upload is not this cache's
        assert store.get(key(1)) == value(1)
    finally:
        client.close()


def test_a_bucket_that_refuses_to_list_uploads_still_takes_writes(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(bucket, max_bytes=3 * len(value(1)))  # every write past the third prunes
    call_s3 = store.bucket.fs.call_s3

    def refusing(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "list_multipart_uploads":
            raise PermissionError("AccessDenied: s3:ListBucketMultipartUploads")
        return call_s3(method, *args, **kwargs)

    monkeypatch.setattr(store.bucket.fs, "call_s3", refusing)
    monkeypatch.setattr(store.bucket.fs, "list_multipart_uploads", lambda *a, **k: refusing("list_multipart_uploads"))
    for i in range(6):
        assert store.put_many([(key(i), value(i))]) == 1
    assert store.get(key(5)) == value(5)
    assert store.bucket._next_sweep - time.monotonic() < 120  # tried again soon, not in an hour


def test_damaged_segment_bytes_are_misses_never_wrong_bytes(bucket: str, s3fs_of: Any) -> None:
    _store(bucket).put_many([(key(i), value(i)) for i in range(4)])
    segment = next(p for p in s3fs_of.find(bucket.removeprefix("s3://")) if p.endswith(".tcs"))
    data = bytearray(s3fs_of.cat_file(segment))
    data[1500] ^= 0xFF  # inside the second entry
    s3fs_of.pipe_file(segment, bytes(data))
    reports = Reports()
    found = _store(bucket, reports=reports).get_many([key(i) for i in range(4)])
    assert [None if v is None else bytes(v) for v in found] == [value(0), None, value(2), value(3)]
    assert reports.kinds() == [Fault.CORRUPT]


def test_a_segment_cut_short_is_damage_not_a_bucket_away(bucket: str, s3fs_of: Any) -> None:
    _store(bucket).put_many([(key(i), value(i)) for i in range(4)])
    segment = next(p for p in s3fs_of.find(bucket.removeprefix("s3://")) if p.endswith(".tcs"))
    s3fs_of.pipe_file(segment, s3fs_of.cat_file(segment)[: 3 * len(value(0))])  # the last entry cut off
    reports = Reports()
    store = _store(bucket, reports=reports)
    store.prefetch = False  # no local copy with room: the last entry's range starts past the end (416)
    assert store.get_many([key(3)]) == [None]
    assert reports.kinds() == [Fault.CORRUPT] and not store.reads_failing()
    assert bytes(store.get(key(0)) or b"") == value(0)


@pytest.mark.parametrize(
    "manifest",
    [
        b"not json",
        b'{"format": "torchcache-objects", "version": 2, "bytes": 10, "entries": [["abcd", 5, 10, 0]]}',
        b'{"format": "torchcache-objects", "version": 1, "bytes": 0, "entries": []}',  # its digests bind no key
        b'{"format": "torchcache-objects", "version": 2, "bytes": 10, "entries": [["../x", 0, 1, 0]]}',
        b"[" * 100_000 + b"]" * 100_000,  # nested past the JSON parser's depth
    ],
)
def test_a_planted_or_lying_manifest_is_reported_and_not_used(bucket: str, s3fs_of: Any, manifest: bytes) -> None:
    store = _store(bucket)
    store.put_many([(key(1), value(1))])
    s3fs_of.pipe_file(f"{store.bucket.prefix}/00000000000000000002-0123456789abcdef.tcs", b"\0" * 10)
    s3fs_of.pipe_file(f"{store.bucket.prefix}/00000000000000000002-0123456789abcdef.tcm", manifest)
    reports = Reports()
    reader = _store(bucket, reports=reports)
    assert bytes(reader.get(key(1)) or b"") == value(1) and reader.get("abcd") is None
    assert reports.kinds() == [Fault.INDEX]


def test_a_manifest_whose_digest_lies_gives_a_miss(bucket: str, s3fs_of: Any) -> None:
    store = _store(bucket)
    planted = {"format": "torchcache-objects", "version": 2, "bytes": 4, "entries": [["abcd", 0, 4, 12345]]}
    s3fs_of.pipe_file(f"{store.bucket.prefix}/00000000000000000002-0123456789abcdef.tcs", b"evil")
    s3fs_of.pipe_file(f"{store.bucket.prefix}/00000000000000000002-0123456789abcdef.tcm", json.dumps(planted).encode())
    reports = Reports()
    assert _store(bucket, reports=reports).get("abcd") is None
    assert reports.kinds() == [Fault.CORRUPT]


def _manifest_name(fs: Any, store: ObjectStore) -> str:
    return next(path for path in fs.find(store.bucket.prefix) if path.endswith(".tcm"))


def test_a_manifest_that_gives_a_key_another_entrys_bytes_gives_a_miss(bucket: str, s3fs_of: Any) -> None:
    store = _store(bucket)
    store.put_many([(key(1), value(1)), (key(2), value(2))])
    path = _manifest_name(s3fs_of, store)
    manifest = json.loads(s3fs_of.cat_file(path))
    entries = {entry[0]: entry for entry in manifest["entries"]}
    entries[key(1)][1:] = entries[key(2)][1:]  # key 1 pointed at key 2's offset, length and digest
    s3fs_of.pipe_file(path, json.dumps(manifest).encode())
    reports = Reports()
    reader = _store(bucket, reports=reports)
    assert reader.get(key(1)) is None and bytes(reader.get(key(2)) or b"") == value(2)
    assert reports.kinds() == [Fault.CORRUPT]


def test_a_segment_pruned_since_the_listing_is_listed_again_and_its_keys_read_from_the_newer(
    bucket: str, s3fs_of: Any
) -> None:
    first = _store(bucket)
    first.put_many([(key(1), value(1))])
    reader = _store(bucket)
    assert len(reader) == 1  # listed: key 1 is in the first segment
    old = _manifest_name(s3fs_of, first).removesuffix(".tcm")
    _store(bucket).put_many([(key(1), value(1))])  # another writer keeps it in a newer segment...
    s3fs_of.rm([old + ".tcm", old + ".tcs"])  # ...and prunes the first
    assert bytes(reader.get(key(1)) or b"") == value(1)


def test_a_segment_gone_while_its_manifest_stays_is_listed_again_once_not_at_every_read(
    bucket: str, s3fs_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(bucket)
    store.put_many([(key(1), value(1))])
    s3fs_of.rm(_manifest_name(s3fs_of, store).removesuffix(".tcm") + ".tcs")  # its manifest is still listed
    store.put_many([(key(2), value(2))])
    reader = _store(bucket)
    listings = []
    real = reader.refresh
    monkeypatch.setattr(reader, "refresh", lambda: listings.append(1) or real())
    for _ in range(5):
        assert reader.get_many([key(1), key(2)]) == [None, value(2)]
    assert len(listings) <= 2  # the first listing, then one at the segment found gone


def test_a_reader_that_left_entries_out_for_its_own_faults_uploads_no_checkpoint(bucket: str, s3fs_of: Any) -> None:
    _store(bucket).put_many([(key(1), value(1))])
    segment = next(path for path in s3fs_of.find(bucket.removeprefix("s3://")) if path.endswith(".tcs"))
    s3fs_of.pipe_file(segment, b"\xff" * len(value(1)))  # read as damaged (as a fault in transit would be)
    reports = Reports()
    reader = _store(bucket, reports=reports)
    assert reader.get(key(1)) is None and reports.kinds() == [Fault.CORRUPT]
    for i in range(2, 40):  # past the manifests that make a checkpoint due
        reader.put_many([(key(i), value(i))])
    assert not [name for name in _objects(s3fs_of, bucket) if name.endswith(".tci")]
    reader.clear()  # what it left out is gone: its index is whole again
    for i in range(40, 60):
        reader.put_many([(key(i), value(i))])
    assert [name for name in _objects(s3fs_of, bucket) if name.endswith(".tci")]


def test_a_segment_whose_manifest_could_not_be_uploaded_is_removed(
    bucket: str, s3fs_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(bucket)
    real = store.bucket.fs.pipe_file

    def throttled(path: str, data: bytes, **kwargs: Any) -> Any:
        if path.endswith(".tcm"):
            raise OSError("SlowDown: Please reduce your request rate")
        return real(path, data, **kwargs)

    monkeypatch.setattr(store.bucket.fs, "pipe_file", throttled)
    with pytest.raises(StoreUnavailableError):
        store.put_many([(key(1), value(1))])
    assert not [name for name in _objects(s3fs_of, bucket) if name.endswith(".tcs")]  # nothing left to count


def test_the_budget_removes_the_oldest_segments_first(bucket: str, s3fs_of: Any) -> None:
    store = _store(bucket, max_bytes=25_000)
    for batch in range(10):
        store.put_many([(key(batch * 5 + i), value(batch * 5 + i, 1000)) for i in range(5)])
    assert store.disk_bytes <= 25_000
    segments = [name for name in _objects(s3fs_of, bucket) if name.endswith(".tcs")]
    assert sum(s3fs_of.size(f"{store.bucket.prefix}/{name}") for name in segments) <= 25_000  # what the bucket holds
    reader = _store(bucket)
    kept = [i for i, v in enumerate(reader.get_many([key(i) for i in range(50)])) if v is not None]
    assert kept == list(range(50 - len(kept), 50)) and len(kept) >= 20  # the newest batches


def test_a_deleted_entry_stays_deleted_for_other_readers_until_written_again(bucket: str) -> None:
    store = _store(bucket)
    store.put_many([(key(1), b"one"), (key(2), b"two")])
    assert store.delete_many([key(1)]) == 1
    assert _store(bucket).get(key(1)) is None and bytes(_store(bucket).get(key(2)) or b"") == b"two"
    store.put_many([(key(1), b"again")])
    assert bytes(_store(bucket).get(key(1)) or b"") == b"again"


def test_a_delete_reaches_an_entry_another_writer_made_since_the_listing(bucket: str) -> None:
    deleter, writer = _store(bucket), _store(bucket)
    deleter.put_many([(key(1), b"one")])
    assert key(1) in deleter  # listed
    writer.put_many([(key(2), b"two")])
    assert deleter.delete_many([key(2), key(3)]) == 1
    assert _store(bucket).get(key(2)) is None and bytes(_store(bucket).get(key(1)) or b"") == b"one"


def test_an_empty_value_is_not_stored_so_that_every_reader_misses_it_alike(bucket: str) -> None:
    store = _store(bucket)
    assert store.put_many([(key(0), b""), (key(1), b"one")]) == 1
    for i in range(2, 40):  # enough manifests for a checkpoint, which a reader starting from nothing reads
        store.put_many([(key(i), value(i))])
    for reader in (store, _store(bucket)):
        assert key(0) not in reader and reader.get(key(0)) is None and bytes(reader.get(key(1)) or b"") == b"one"


def _checkpoints(fs: Any, bucket: str) -> list[str]:
    return [name for name in _objects(fs, bucket) if name.endswith(".tci")]


def test_a_reader_starting_from_nothing_reads_the_newest_checkpoint_and_the_manifests_it_does_not_cover(
    bucket: str, s3fs_of: Any
) -> None:
    writer = _store(bucket)
    for batch in range(40):  # checkpoints after 16 and 32 manifests; the first is removed by the writer
        writer.put_many([(key(batch * 3 + i), value(batch * 3 + i)) for i in range(3)])
    assert len(_checkpoints(s3fs_of, bucket)) == 1
    reader = _store(bucket)
    reads: list[list[str]] = []
    cat = reader.bucket.cat
    reader.bucket.cat = lambda names: reads.append(list(names)) or cat(names)  # type: ignore[method-assign]
    keys = [key(i) for i in range(120)]
    assert [bytes(v or b"") for v in reader.get_many(keys)] == [value(i) for i in range(120)]
    # one listing, the checkpoint, one read of the 8 manifests it does not cover, one ranged read per segment
    assert reader.bucket.requests == 1 + 1 + 8 + 40
    # the manifests named after the checkpoint are read with it, in one round trip
    assert len(reads) == 1 and len(reads[0]) == 9 and reads[0][0].endswith(".tci")


def test_a_checkpoint_keeps_tombstones_and_forgets_segments_pruned_after_it(bucket: str, s3fs_of: Any) -> None:
    writer = _store(bucket)
    writer.put_many([(key(0), value(0))])
    writer.delete_many([key(0)])
    for batch in range(1, 17):
        writer.put_many([(key(batch), value(batch, 1000))])
    assert len(_checkpoints(s3fs_of, bucket)) == 1
    # a manifest stamped before the tombstone, uploaded late: the checkpoint's tombstone still hides it
    segment, manifest = pack({key(0): b"old"})
    s3fs_of.pipe_file(f"{writer.bucket.prefix}/00000000000000000001-0123456789abcdef.tcs", segment)
    s3fs_of.pipe_file(f"{writer.bucket.prefix}/00000000000000000001-0123456789abcdef.tcm", manifest)
    assert _store(bucket).get(key(0)) is None
    _store(bucket).prune(8_000, sweep_seconds=None)  # another machine removes the oldest segments
    assert len(_checkpoints(s3fs_of, bucket)) == 1  # the checkpoint now names segments that are gone
    reader = _store(bucket)
    kept = [i for i, v in enumerate(reader.get_many([key(i) for i in range(17)])) if v is not None]
    assert kept == list(range(17 - len(kept), 17)) and 0 < len(kept) < 16
    assert len(reader) == len(kept) and reader.disk_bytes <= 8_000


@pytest.mark.parametrize(
    "checkpoint",
    [
        b"not json",
        b'{"format": "torchcache-objects", "version": 2, "covers": ["../x.tcm"], "segments": [], "deleted": []}',
        b'{"format": "torchcache-objects", "version": 2, "covers": [], "segments": [["../x.tcs", 4, []]], '
        b'"deleted": []}',
        b'{"format": "torchcache-objects", "version": 2, "covers": [], "segments": [], "deleted": [["abcd", 1]]}',
    ],
)
def test_a_planted_checkpoint_is_reported_and_the_manifests_are_read_instead(
    bucket: str, s3fs_of: Any, checkpoint: bytes
) -> None:
    writer = _store(bucket)
    for batch in range(3):
        writer.put_many([(key(batch), value(batch))])
    s3fs_of.pipe_file(f"{writer.bucket.prefix}/99999999999999999999-0123456789abcdef.tci", checkpoint)
    reports = Reports()
    reader = _store(bucket, reports=reports)
    assert [bytes(v or b"") for v in reader.get_many([key(i) for i in range(3)])] == [value(i) for i in range(3)]
    assert reports.kinds() == [Fault.INDEX]


@pytest.fixture
def away(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Storage options of an S3 server that is away: a free port on 127.0.0.1, nothing listening."""
    from tests.object_servers import CREDENTIALS, _free_port, require_s3

    require_s3()
    for name, val in CREDENTIALS.items():
        monkeypatch.setenv(name, val)
    return {"endpoint_url": f"http://127.0.0.1:{_free_port()}"}


def test_a_server_that_is_away_gives_misses_and_write_errors_quickly(away: dict[str, str]) -> None:
    reports = Reports()
    store = ObjectStore("s3://nowhere/cache", "ns", 10**6, storage_options=away, report=reports)
    assert store.get_many([key(1), key(2)]) == [None, None]
    assert store.get_many([key(1)]) == [None]
    assert store.placement([key(1), key(2)]) == [None, None]  # a sampler's order: a plain shuffle
    assert len(store) == 0  # what a cache's stats() reads: never listed, and no raise
    assert reports.kinds() == [Fault.UNAVAILABLE]  # once per outage
    with pytest.raises(StoreUnavailableError):
        store.put_many([(key(1), b"x")])


def test_the_stats_of_a_dataset_cache_whose_bucket_is_away_do_not_raise(away: dict[str, str], tmp_path: Path) -> None:
    with pytest.warns(CacheWarning):
        cached = CachedDataset(Images(4), "s3://nowhere/cache", storage_options=away, local_cache_dir=tmp_path)
        assert [label for _, label in cached.__getitems__([0, 1])] == [0, 1]
        stats = cached.stats()
    assert stats.misses == 2 and stats.disk is not None and stats.disk.entries == 0


def test_the_stats_of_a_decorated_module_whose_bucket_is_away_from_the_start_do_not_raise(
    away: dict[str, str], tmp_path: Path
) -> None:
    model = cached(Counting, persistent=True, persistent_cache_dir="s3://nowhere/x", storage_options=away,
                   local_cache_dir=tmp_path)()  # fmt: skip
    with pytest.warns(CacheWarning):
        model(torch.randn(4, 4))
        stats = model.cache_instance.stats()  # the exit summary reads them too
    assert stats.misses == 4 and stats.disk is not None and stats.disk.entries == 0


# -- the products -------------------------------------------------------------------------
def test_a_dataset_cache_warmed_into_a_bucket_is_read_by_a_fresh_machine(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/datasets"
    data = Images()
    first = CachedDataset(data, url, max_memory_size=0, local_cache_dir=tmp_path / "machine1")
    assert [label for _, label in first.__getitems__(list(range(12)))] == list(range(12))
    first.close()
    fresh = Images()
    second = CachedDataset(fresh, url, max_memory_size=0, local_cache_dir=tmp_path / "machine2")
    samples = second.__getitems__(list(range(12)))
    assert fresh.calls == 0 and second.stats().disk.hits == 12
    assert all(torch.equal(image, torch.full((3, 4, 4), i, dtype=torch.uint8)) for i, (image, _) in enumerate(samples))
    assert any((tmp_path / "machine2").rglob("seg-*.tcs"))  # kept locally: later epochs read the local copy
    second.close()


def test_a_bucket_url_is_never_taken_for_a_local_path(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cache = CachedDataset(Images(), f"{bucket}/x", max_memory_size=0, local_cache_dir=tmp_path / "copy")
    cache.__getitems__([0, 1])
    cache.close()
    assert not (tmp_path / "s3:").exists()


def _machine(bucket: str, copy: Path) -> Any:
    """A decorated module keeping its outputs in ``bucket``, with its own local copy (a machine of its own)."""
    options = {"persistent_cache_dir": f"{bucket}/modules", "local_cache_dir": str(copy), "max_memory_cache_size": 0}
    return cached(Counting, persistent=True, **options)()


def _outputs_kept(bucket: str, copy: Path, x: torch.Tensor) -> torch.Tensor:
    """The outputs of ``x``, computed on a machine of their own and kept in ``bucket``."""
    model = _machine(bucket, copy)
    expected = model(x)
    model.cache_instance.flush()
    return expected


def test_the_decorator_keeps_outputs_in_a_bucket_across_machines(bucket: str, tmp_path: Path) -> None:
    x = torch.randn(8, 4)
    expected = _outputs_kept(bucket, tmp_path / "one", x)
    other = _machine(bucket, tmp_path / "two")
    out = other(x)  # a CacheWarning is an error here (the tests' filterwarnings)
    assert torch.equal(out, expected) and list(other.seen) == []
    assert other.cache_instance.stats().disk.hits == 8


@pytest.mark.slow
def test_forked_dataloader_workers_read_the_decorators_bucket(bucket: str, tmp_path: Path) -> None:
    x = torch.randn(16, 4)
    expected = _outputs_kept(bucket, tmp_path / "one", x)
    model = _machine(bucket, tmp_path / "two")
    model(torch.randn(1, 4))  # the bucket is opened here, before the workers are forked

    class Rows(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return model(x[i : i + 1])[0], model.items  # items computed in this worker, with the parent's one

    loader = torch.utils.data.DataLoader(Rows(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    got = list(loader)  # a CacheWarning is an error here (the tests' filterwarnings)
    assert torch.equal(torch.cat([rows for rows, _ in got]), expected)
    assert torch.cat([items for _, items in got]).tolist() == [1] * len(x)  # every row read, none computed


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(ConfigError, match=r"torchcache\[gcs\]"):
        CachedDataset(Images(), "gs://bucket/prefix")


def test_a_gcs_server_that_is_away_costs_two_bounded_tries_not_gcsfs_six(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gcsfs")
    import gcsfs

    from torchcache.stores.objects import filesystem as filesystem_module
    from torchcache.stores.objects import open_filesystem

    raw = gcsfs.GCSFileSystem._request.__wrapped__
    tries: list[str] = []

    async def counted(fs: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        tries.append(method)
        return await raw(fs, method, path, *args, **kwargs)

    decorated = gcsfs.GCSFileSystem._request
    monkeypatch.setattr(gcsfs.GCSFileSystem, "_request", lambda *a, **k: decorated(*a, **k))
    gcsfs.GCSFileSystem._request.__wrapped__ = counted  # type: ignore[attr-defined]
    monkeypatch.setattr(filesystem_module, "_GCS_PAUSE", 0.0)
    with socket.socket() as closed:  # a port nobody listens on: every connection is refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    options = {"token": "anon", "project": f"p{uuid.uuid4().hex[:8]}", "endpoint_url": endpoint}
    fs, _ = open_filesystem("gs://away/prefix", options)
    assert fs.requests_timeout == 15  # a server that hangs costs seconds, not aiohttp's 300
    with pytest.raises(Exception):  # noqa: B017 - whatever gcsfs raises for a refused connection
        fs.ls("away/prefix")
    assert tries == ["GET", "GET"]


def test_s3_responses_are_checked_once_by_the_entries_digests_not_again_by_botocore(bucket: str) -> None:
    from torchcache.stores.objects import open_filesystem

    fs, _ = open_filesystem(bucket)
    assert fs.config_kwargs["response_checksum_validation"] == "when_required"
    assert fs.config_kwargs["read_timeout"] == 15
    own, _ = open_filesystem(bucket, {"config_kwargs": {"read_timeout": 60}})  # the user's client options win
    assert own.config_kwargs == {"read_timeout": 60}
    store = ObjectStore(bucket, "e5f6", 1 << 20)
    store.put_many([(key(1), value(1))])
    fresh = ObjectStore(bucket, "e5f6", 1 << 20)
    assert fresh.get_many([key(1)]) == [value(1)]


def test_every_store_of_a_url_shares_one_filesystem_and_its_session(bucket: str) -> None:
    from torchcache.stores.objects import open_filesystem

    first = ObjectStore(bucket, "a1b2", 1 << 20)
    first.put_many([(key(1), value(1))])  # the library rewrites the client options it is given
    assert open_filesystem(bucket)[0] is first.bucket.fs
    assert ObjectStore(bucket, "c3d4", 1 << 20).bucket.fs is first.bucket.fs


@pytest.mark.slow
def test_a_forked_child_reads_and_writes_with_a_filesystem_of_its_own_while_a_thread_held_the_store(
    bucket: str,
) -> None:
    store = _store(bucket)
    store.put_many([(key(i), value(i)) for i in range(4)])
    assert [bytes(v or b"") for v in store.get_many([key(0)])] == [value(0)]
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    held, forked = threading.Event(), threading.Event()

    def holder() -> None:  # as a background writer listing the bucket when a DataLoader worker is forked
        with store._lock, store._known._lock, store.bucket._stamp_lock:
            held.set()
            forked.wait(30)

    def child() -> None:
        got = [bytes(v or b"") for v in store.get_many([key(i) for i in range(4)])]
        store.put_many([(key(9), value(9))])
        writer.send((got, store.bucket.fs is not parent_fs, store.reads_failing()))

    thread, parent_fs = threading.Thread(target=holder), store.bucket.fs
    thread.start()
    assert held.wait(30)
    process = multiprocessing.get_context("fork").Process(target=child)
    try:
        process.start()
    finally:
        forked.set()
        thread.join(30)
    assert reader.poll(60), "the child hung"
    assert reader.recv() == ([value(i) for i in range(4)], True, False)
    process.join(30)
    assert [bytes(v or b"") for v in _store(bucket).get_many([key(9)])] == [value(9)]


@pytest.mark.parametrize("url", ["s3://", "s3:///abs", "gs://", "s3://b//x", "gs://b/x//y/"])
def test_a_url_without_a_bucket_is_refused_naming_the_argument(url: str) -> None:
    with pytest.raises(ConfigError, match="cache_dir"):
        CachedDataset(Images(), url)


def test_a_warmed_bucket_serves_a_machine_without_the_dataset(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/warmed"
    warm = CachedDataset(Images(), url, max_memory_size=0, local_cache_dir=tmp_path / "warm")
    expected = warm.__getitems__(list(range(12)))
    warm.close()
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    assert len(served) == 12 and served.fingerprint == warm.fingerprint
    samples = served.__getitems__(list(range(12)))
    assert all(torch.equal(a, b) and i == j for (a, i), (b, j) in zip(samples, expected))
    served.close()


@pytest.mark.parametrize("recorded", ["yes", "no", "by-a-smaller-first-run"])
def test_serving_a_bucket_without_a_dataset_keeps_the_writers_budget(
    recorded: str, bucket: str, s3fs_of: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/budget"
    if recorded == "by-a-smaller-first-run":  # its budget is the one torchcache.json records
        trial = CachedDataset(Images(40), url, max_memory_size=0, max_disk_size="1KB", local_cache_dir=tmp_path / "t")
        trial.__getitems__([0])
        trial.close()
    warm = CachedDataset(Images(40), url, max_memory_size=0, max_disk_size="10MB", local_cache_dir=tmp_path / "w")
    warm.__getitems__(list(range(40)))
    warm.close()
    objects = s3fs_of.find(url.removeprefix("s3://"))
    if recorded == "no":
        (meta,) = [p for p in objects if p.endswith("torchcache.json")]
        fields = json.loads(s3fs_of.cat(meta))
        s3fs_of.pipe(meta, json.dumps({k: v for k, v in fields.items() if k != "max_bytes"}).encode())
    segments = sum(s3fs_of.size(p) for p in objects if p.endswith(".tcs"))
    monkeypatch.setattr("torchcache.datasets.dataset.DEFAULT_DISK_SIZE", "1KB")  # a default below the cache's size
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    assert [label for _, label in served.__getitems__(list(range(40)))] == list(range(40))
    served.close()  # it wrote nothing: the bucket keeps every segment
    s3fs_of.invalidate_cache()
    assert sum(s3fs_of.size(p) for p in s3fs_of.find(url.removeprefix("s3://")) if p.endswith(".tcs")) == segments


def _far(cached: CachedDataset) -> Any:
    """The bucket's store behind a dataset cache's local copy."""
    return next(tier for tier in cached.cache._open() if tier.name == "disk").store.far


def _warmed(url: str, n: int, batches: list[list[int]], local: Path) -> None:
    """Warm the bucket cache at ``url`` of ``Images(n)`` with ``batches``, one segment each."""
    warm = CachedDataset(Images(n), url, max_memory_size=0, local_cache_dir=local)
    for batch in batches:
        warm.__getitems__(batch)
    warm.close()


@pytest.mark.parametrize("memory", [0, "1MB"], ids=["no-ram-tier", "ram-tier"])
def test_warmup_uploads_what_the_bucket_missed_while_it_was_away(
    memory: int | str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, away, images = f"{bucket}/outage", [True], Images(32)
    cached = CachedDataset(images, url, max_memory_size=memory, local_cache_dir=tmp_path / "copy")
    far = _far(cached)
    put_many = far.put_many

    def flaky(items: Any) -> int:
        if away[0]:
            raise StoreUnavailableError("the bucket is away")
        return int(put_many(items))

    monkeypatch.setattr(far, "put_many", flaky)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        cached.__getitems__(list(range(16)))  # kept locally (and in RAM), not in the bucket
        away[0] = False
        cached.cache._open()[-1].store.unsent = Unsent(None)  # as a copy made before keys waited to be sent
        cached.__getitems__(list(range(16, 32)))
        cached.warmup(num_workers=0, progress=False)
    assert images.calls == 32  # sent from the local copy, not computed again
    cached.close()
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    assert [label for _, label in served.__getitems__(list(range(32)))] == list(range(32))
    served.close()


def _warmed_while_writes_fail(url: str, local: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[CachedDataset, Any]:
    """16 samples warmed while every write to the bucket failed (the local copy keeps them); the real upload."""
    cached = CachedDataset(Images(16), url, max_memory_size=0, local_cache_dir=local)
    fs = _far(cached).bucket.fs
    pipe_file = fs.pipe_file

    def away(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the bucket is away")

    monkeypatch.setattr(fs, "pipe_file", away)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        cached.__getitems__(list(range(16)))  # the bucket's writes back off
    return cached, pipe_file


def test_closing_soon_after_an_outage_sends_what_waited(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/back-at-close"
    cached, pipe_file = _warmed_while_writes_fail(url, tmp_path / "copy", monkeypatch)
    monkeypatch.setattr(_far(cached).bucket.fs, "pipe_file", pipe_file)  # back, within the backoff
    cached.close()  # one try now, whatever the backoff
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    assert [label for _, label in served.__getitems__(list(range(16)))] == list(range(16))
    served.close()


def test_a_close_whose_last_send_failed_does_not_wait_on_the_bucket_again(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached, _ = _warmed_while_writes_fail(f"{bucket}/away-at-close", tmp_path / "c", monkeypatch)
    store = _far(cached)
    listed: list[int] = []
    monkeypatch.setattr(store.bucket, "names", lambda: listed.append(1) or set())
    before = store.bucket.requests
    cached.close()  # one try to send what waited, which fails: no prune, no listing after it
    assert store.bucket.requests == before + 1 and listed == []


def test_only_a_range_past_the_listed_end_of_an_object_is_taken_for_damage(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket_of = _store(bucket).bucket
    bucket_of.sizes = {"a.tcs": 100, "b.tcs": 1000}
    no_answer = [TimeoutError("the server does not answer")] * 2
    monkeypatch.setattr(bucket_of.fs, "cat_ranges", lambda *args, **kwargs: no_answer)
    with pytest.raises(StoreUnavailableError):  # a timed out past a's end, b timed out: the bucket is away
        bucket_of.ranges(["a.tcs", "b.tcs"], [0, 0], [200, 50])
    assert bucket_of.reads_failing(retry=True)
    with pytest.raises(StoreUnavailableError):  # a's range starts past its end: damage; b's alone failed
        bucket_of.ranges(["a.tcs", "b.tcs"], [100, 0], [200, 50])
    bucket_of.reads_failing(retry=True)
    monkeypatch.setattr(bucket_of.fs, "cat_ranges", lambda *args, **kwargs: [no_answer[0], b"x" * 50])
    assert bucket_of.ranges(["a.tcs", "b.tcs"], [100, 0], [200, 50]) == [b"", b"x" * 50]
    assert not bucket_of.reads_failing()
    inside = bucket_of.ranges(["a.tcs", "b.tcs"], [50, 0], [100, 50])  # within a: its failure is no damage
    assert isinstance(inside[0], TimeoutError) and inside[1] == b"x" * 50


def test_a_cache_cleared_while_it_was_warmed_is_described_again_at_close(
    bucket: str, s3fs_of: Any, tmp_path: Path
) -> None:
    url, images = f"{bucket}/cleared-warming", Images(16)
    cached = CachedDataset(images, url, max_memory_size=0, local_cache_dir=tmp_path / "copy")
    cached.__getitems__(list(range(8)))
    s3fs_of.rm(url.removeprefix("s3://"), recursive=True)  # torchcache clear, from another machine
    cached.__getitems__(list(range(8, 16)))  # not listed again so soon: nothing describes the cache yet
    cached.close()
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    assert [label for _, label in served.__getitems__(list(range(8, 16)))] == list(range(8, 16))
    served.close()


def test_a_bucket_that_refuses_writes_is_still_read(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/readonly"
    _warmed(url, 32, [list(range(start, start + 8, 2)) for start in range(0, 32, 8)], tmp_path / "warm")  # evens
    images = Images(32)
    cached = CachedDataset(images, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    bucket_of = _far(cached).bucket

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError("403 AccessDenied")

    monkeypatch.setattr(bucket_of.fs, "pipe_file", refused)  # read-only credentials
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        for start in range(0, 32, 8):  # each batch's upload is refused; the next batch still reads
            assert [label for _, label in cached.__getitems__(list(range(start, start + 8)))] == list(
                range(start, start + 8)
            )
    assert images.calls == 16  # only the odd ones computed
    cached.close()


def test_serving_without_a_dataset_waits_out_a_short_outage_of_the_bucket(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/outage-served"
    _warmed(url, 16, [list(range(16))], tmp_path / "warm")
    monkeypatch.setattr("torchcache.datasets.dataset._RETRY_EVERY", 0.01)
    monkeypatch.setattr("torchcache.datasets.dataset.SERVE_WAIT", 5.0)  # the bucket's own backoff would pass it
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    fs = _far(served).bucket.fs
    real, failures = fs.cat_ranges, [6]  # the bucket's backoff alone would wait 0.5 + 1 + ... + 16 s

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("the bucket is away")
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "cat_ranges", flaky)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert [label for _, label in served.__getitems__(list(range(16)))] == list(range(16))
    assert failures == [0]
    served.close()


def test_serving_an_empty_bucket_without_a_dataset_names_the_url(bucket: str) -> None:
    with pytest.raises(ConfigError, match="holds none"):
        CachedDataset(None, f"{bucket}/empty")


@pytest.mark.slow  # the GCS emulator
@pytest.mark.parametrize("server", ["s3", "gcs"])
def test_serving_a_bucket_that_does_not_exist_is_a_configuration_error(
    server: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("bucket" if server == "s3" else "gcs_bucket")
    with pytest.raises(ConfigError, match=r"CachedDataset\(None, .*(no such bucket|holds none)"):
        CachedDataset(None, f"{url}-missing/x")  # gcsfs raises FileNotFoundError, s3fs lists nothing


def test_the_command_line_lists_verifies_prunes_and_clears_a_bucket(
    bucket: str, s3fs_of: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main

    url = f"{bucket}/cli"
    cache = CachedDataset(Images(), url, max_memory_size=0, local_cache_dir=tmp_path / "copy")
    cache.__getitems__(list(range(12)))
    cache.close()
    model = cached(Counting, persistent=True, persistent_cache_dir=url, local_cache_dir=str(tmp_path / "m"))()
    model(torch.randn(8, 4))
    model.cache_instance.flush()
    assert main(["ls", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["caches"]
    assert sorted(c["entries"] for c in listed) == [8, 12]
    described = [p for p in s3fs_of.find(url.removeprefix("s3://")) if p.endswith("/torchcache.json")]
    kinds = sorted(json.loads(s3fs_of.cat_file(p))["kind"] for p in described)
    assert kinds == ["dataset", "module"]  # each cache says what it holds: verify checks a module's frames
    assert main(["verify", url]) == 0 and "no problems found" in capsys.readouterr().out
    assert main(["prune", url, "--max-size", "0", "--dry-run"]) == 0
    assert "would remove 2 segments" in capsys.readouterr().out
    assert main(["prune", url, "--max-size", "0"]) == 0 and "removed 2 segments" in capsys.readouterr().out
    assert main(["clear", "--all", "--root", url, "--yes"]) == 0
    capsys.readouterr()
    assert main(["ls", url, "--json"]) == 0 and json.loads(capsys.readouterr().out)["caches"] == []


def _four_samples(url: str, tmp_path: Path) -> str:
    """``url``, where a dataset cache of four samples was warmed."""
    cache = CachedDataset(Images(4), url, max_memory_size=0, local_cache_dir=tmp_path / "warm")
    cache.__getitems__(list(range(4)))
    cache.close()
    return url


def test_the_command_line_lists_and_clears_only_caches_leaving_other_objects_under_the_url(
    bucket: str, s3fs_of: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main

    url = _four_samples(f"{bucket}/shared", tmp_path)
    (folder,) = s3fs_of.ls(url.removeprefix("s3://"), detail=False)
    s3fs_of.pipe_file(f"{folder}/notes.txt", b"mine")  # the user's, inside the cache's folder
    s3fs_of.pipe_file(f"{url.removeprefix('s3://')}/c3-mine/data.bin", b"mine")  # the user's, beside it
    assert main(["ls", url, "--json"]) == 0
    assert [c["entries"] for c in json.loads(capsys.readouterr().out)["caches"]] == [4]
    assert main(["clear", "--all", "--root", url, "--yes"]) == 0 and "removed 1 cache" in capsys.readouterr().out
    assert main(["clear", "c3", "--root", url, "--yes"]) == 1  # not a cache: no key starts with it
    assert _objects(s3fs_of, url) == ["data.bin", "notes.txt"]


def test_verify_fix_of_a_dataset_cache_whose_description_is_gone_keeps_its_entries(
    bucket: str, s3fs_of: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main

    url = _four_samples(f"{bucket}/undescribed", tmp_path)
    (meta,) = [path for path in s3fs_of.find(url.removeprefix("s3://")) if path.endswith("torchcache.json")]
    s3fs_of.rm_file(meta)  # its upload failed: a writer killed, an outage
    assert main(["verify", "--fix", url]) == 0
    capsys.readouterr()
    assert main(["ls", url, "--json"]) == 0
    assert [c["entries"] for c in json.loads(capsys.readouterr().out)["caches"]] == [4]


def test_the_command_line_reports_a_damaged_manifest_and_its_fix(
    bucket: str, s3fs_of: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main

    url = _four_samples(f"{bucket}/damaged", tmp_path)
    (manifest,) = [path for path in s3fs_of.find(url.removeprefix("s3://")) if path.endswith(".tcm")]
    s3fs_of.pipe_file(manifest, b"{not json")
    assert main(["verify", url]) == 1 and "is not a valid index object" in capsys.readouterr().out
    assert main(["verify", "--fix", url]) == 0 and capsys.readouterr().out.rstrip().endswith("fixed")
    assert main(["verify", url]) == 0 and "no problems found" in capsys.readouterr().out
    assert not [path for path in s3fs_of.find(url.removeprefix("s3://")) if path.endswith((".tcm", ".tcs"))]


def test_the_command_line_on_a_bucket_that_does_not_exist_says_so(
    bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main

    for command in (["ls"], ["verify"]):
        assert main([*command, f"{bucket}-missing/p"]) == 1
        assert "does not exist" in capsys.readouterr().err
        assert main([*command, f"{bucket}/p?versionId=1"]) == 1  # one object's version, not a folder
        assert "without a query" in capsys.readouterr().err


@pytest.mark.slow  # the GCS emulator is a process of its own
def test_a_dataset_cache_in_a_gcs_bucket_serves_a_fresh_machine_without_the_dataset(
    gcs_bucket: str, tmp_path: Path
) -> None:
    url = f"{gcs_bucket}/datasets"
    warm = CachedDataset(Images(), url, max_memory_size=0, local_cache_dir=tmp_path / "one")
    expected = warm.__getitems__(list(range(12)))
    warm.close()
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "two")
    samples = served.__getitems__(list(range(12)))
    assert all(torch.equal(a, b) and i == j for (a, i), (b, j) in zip(samples, expected))
    assert served.stats().disk.hits == 12
    served.close()


_WRITER = """
import os, sys
from torchcache.stores.objects import ObjectStore
from torchcache.stores.objects.index import Index
from torchcache.stores.objects.manifests import pack, ranged_reads, tombstone
from torchcache.stores.packed.format import HEADER
from torchcache.stores.packed.store import INDEX_ENTRY_BYTES
store = ObjectStore(sys.argv[1], "ns", 10**9, storage_options={"endpoint_url": sys.argv[2]})
for batch in range(10**6):
    store.put_many([(f"{batch:08x}{i:08x}", bytes([i % 251]) * 300_000) for i in range(8)])
    print(batch, flush=True)
"""


@pytest.mark.slow  # a writer process, killed
def test_a_writer_killed_mid_upload_leaves_nothing_a_reader_sees_and_prune_sweeps_it(bucket: str, s3fs_of: Any) -> None:
    import signal
    import subprocess

    from tests.helpers import REPO, python_env

    url = f"{bucket}/cache"
    env = python_env(**{name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    writer = zygote.start(["-c", _WRITER, url, s3_endpoint()], cwd=REPO, env=env, stdout=subprocess.PIPE)
    assert writer.stdout is not None
    for _ in range(3):  # three batches complete, the fourth is under way
        writer.stdout.readline()
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=60)
    writer.stdout.close()
    reader = _store(bucket)
    keys = list(reader.keys())
    assert len(keys) >= 24 and len(keys) % 8 == 0  # whole batches only
    for name, data in zip(keys, reader.get_many(keys)):
        assert data is not None and bytes(data) == bytes([int(name[8:], 16) % 251]) * 300_000
    reader.prune(10**12, sweep_seconds=0)
    names = _objects(s3fs_of, bucket)
    segments = {n.removesuffix(".tcs") for n in names if n.endswith(".tcs")}
    assert segments == {n.removesuffix(".tcm") for n in names if n.endswith(".tcm")}


def test_a_bucket_of_thousands_of_objects_is_listed_and_pruned_to_its_budget(bucket: str, s3fs_of: Any) -> None:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    store = _store(bucket)
    name, prefix = bucket.removeprefix("s3://"), store.bucket.prefix.split("/", 1)[1]
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]  # planted in the server's memory: uploads take minutes
    for n in range(2475):  # 2,450 uploads that killed writers left, 25 whole segments with their manifests
        segment, manifest = pack({key(n): value(n, 100)})
        stem = f"{prefix}/{1_000_000_000_000 + n:020d}-{n:016x}"
        backend.put_object(name, stem + ".tcs", segment)
        if n >= 2450:
            backend.put_object(name, stem + ".tcm", manifest)
    pruner = _store(bucket)  # one listing of 2,500 objects (three pages), then bulk deletes (three)
    assert pruner.prune(1_000, sweep_seconds=0) == 15 + 2450
    assert len(pruner) == 10 and pruner.disk_bytes == 1_000
    kept = [n for n, v in zip(range(2450, 2475), _store(bucket).get_many([key(n) for n in range(2450, 2475)])) if v]
    assert kept == list(range(2465, 2475))  # the newest whole segments
    assert len(_objects(s3fs_of, bucket)) == 20


def test_storage_options_passed_as_an_argument_reach_the_bucket_and_are_never_written(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3fs_of: Any
) -> None:
    monkeypatch.delenv("TORCHCACHE_STORAGE_OPTIONS")
    options = {"endpoint_url": s3_endpoint(), "key": "testing", "secret": "s3cret-value"}
    url = f"{bucket}/args"
    data = CachedDataset(Images(), url, max_memory_size=0, local_cache_dir=tmp_path / "a", storage_options=options)
    data.__getitems__(list(range(12)))
    data.close()
    served = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "b", storage_options=options)
    assert len(served) == 12 and served.__getitems__([3])[0][1] == 3
    served.close()
    model = cached(Counting, persistent=True, persistent_cache_dir=url, storage_options=options)()
    model(torch.randn(4, 4))
    model.cache_instance.flush()
    assert model.cache_instance.stats().disk.entries == 4
    written = b"".join(s3fs_of.cat_file(p) for p in s3fs_of.find(bucket.removeprefix("s3://")) if p.endswith(".json"))
    written += b"".join(p.read_bytes() for p in tmp_path.rglob("*.json"))
    assert b"s3cret-value" not in written and b"torchcache" in written


@pytest.mark.parametrize("options", [["endpoint_url"], {1: "x"}, "endpoint_url=x", {"endpoint_url": 5}])
def test_storage_options_that_are_not_a_dict_are_refused_naming_the_argument(options: Any) -> None:
    with pytest.raises(ConfigError, match="storage_options"):
        CachedDataset(Images(), "s3://bucket/prefix", storage_options=options)
    with pytest.raises(ConfigError, match="storage_options"):
        cached(Counting, persistent=True, persistent_cache_dir="s3://bucket/prefix", storage_options=options)


@pytest.mark.parametrize("where", ["a directory", "a Redis URL", None])
def test_storage_options_without_a_bucket_are_refused(where: str | None, tmp_path: Path) -> None:
    cache_dir = {"a directory": tmp_path, "a Redis URL": "redis://127.0.0.1:1/0", None: None}[where]
    with pytest.raises(ConfigError, match="storage_options are the fsspec options of a bucket URL"):
        CachedDataset(Images(), cache_dir, storage_options={"anon": True})


def test_a_local_copy_of_half_the_cache_keeps_a_stable_half_over_shuffled_epochs(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/half"
    n = 400
    warm = CachedDataset(Images(n), url, max_memory_size=0, local_cache_dir=tmp_path / "warm")
    for start in range(0, n, 50):
        warm.__getitems__(list(range(start, start + 50)))
    size = warm.stats().disk.bytes + n * (HEADER.size + 16 + INDEX_ENTRY_BYTES)  # the whole cache in a local store
    warm.close()
    half = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "half", max_local_size=size // 2)
    layered = half.cache._open()[0].store
    rng = torch.Generator().manual_seed(0)
    shares = []
    for _ in range(4):
        before = list(layered.served)
        order = torch.randperm(n, generator=rng).tolist()
        for start in range(0, n, 50):
            batch = order[start : start + 50]
            assert [label for _, label in half.__getitems__(batch)] == batch
        near, far = (now - then for now, then in zip(layered.served, before))
        shares.append(near / (near + far))
    assert all(0.35 <= share <= 0.65 for share in shares[1:]), shares  # about half, every epoch
    half.close()


def test_a_segment_a_batch_spans_is_read_whole_with_exactly_its_visible_entries_not_asked_for() -> None:
    index = Index()
    index.apply("01-a.tcm", pack({key(i): value(i, 100) for i in range(4)})[1])
    index.apply("02-b.tcm", pack({key(i): value(i, 100) for i in range(4, 6)})[1])
    reads = ranged_reads([key(0), key(3), key(4)], index, whole=False)
    assert [(r.segment, r.start, r.end) for r in reads] == [("01-a.tcs", 0, 400), ("02-b.tcs", 0, 100)]
    assert sorted(k for k, *_ in reads[0].others) == sorted([key(1), key(2)]) and reads[1].others == []
    index.apply("03-c.tcd", tombstone([key(1)]))  # hidden: no longer handed over
    reads = ranged_reads([key(0), key(3)], index, whole=False)
    assert [k for k, *_ in reads[0].others] == [key(2)]
    index.apply("04-d.tcm", pack({key(2): value(2, 50)})[1])  # written again elsewhere: not in segment a now
    assert ranged_reads([key(0), key(3)], index, whole=False)[0].others == []
    assert [(r.start, r.end) for r in ranged_reads([key(0)], index, whole=False)] == [(0, 100)]  # a narrow batch


def _bytes_per_epoch(cache: CachedDataset, orders: list[list[int]]) -> list[int]:
    """Bytes read from the bucket in each epoch of ``orders`` (batches of 50), every label checked."""
    bucket, received = cache.cache._open()[0].store.far.bucket, []
    for order in orders:
        before = bucket.received
        for start in range(0, len(order), 50):
            batch = order[start : start + 50]
            assert [label for _, label in cache.__getitems__(batch)] == batch
        received.append(bucket.received - before)
    return received


@pytest.mark.slow
def test_the_bucket_budget_holds_over_what_dataloader_workers_wrote(bucket: str, s3fs_of: Any, tmp_path: Path) -> None:
    budget = 40_000  # what each worker writes fits, what they write together does not
    cached = CachedDataset(Images(400), f"{bucket}/cache", max_memory_size=0, max_disk_size=budget,
                           local_cache_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        loader = torch.utils.data.DataLoader(cached, batch_size=8, num_workers=2)
        assert sum(len(labels) for _, labels in loader) == 400
    cached.close()  # keeps the budget over a fresh listing: each worker saw only its own writes
    segments = [p for p in s3fs_of.find(bucket.removeprefix("s3://")) if p.endswith(".tcs")]
    assert 0 < sum(s3fs_of.size(p) for p in segments) <= budget


def test_a_window_sampler_reads_each_segment_once_an_epoch_where_a_shuffle_reads_them_again_and_again(
    bucket: str, tmp_path: Path
) -> None:
    url, n = f"{bucket}/windows", 800
    warm = CachedDataset(Images(n), url, max_memory_size=0, local_cache_dir=tmp_path / "warm")
    for start in range(0, n, 50):  # 16 segments of 50 samples
        warm.__getitems__(list(range(start, start + 50)))
    size = warm.stats().disk.bytes + n * (HEADER.size + 16 + INDEX_ENTRY_BYTES)
    warm.close()
    received = {}
    for order in ("shuffle", "windows"):
        half = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / order, max_local_size=size // 2)
        layered = half.cache._open()[0].store
        assert len(layered.far) == n  # listed: the segments' bytes are known
        segments = layered.far.disk_bytes
        layered.stash.max_bytes = segments // 8  # two segments: a small stash, as 64 MiB is beside a large cache
        sampler = WindowSampler(half, seed=1, window_bytes=segments // 8)
        rng = torch.Generator().manual_seed(1)
        orders = [list(sampler) if order == "windows" else torch.randperm(n, generator=rng).tolist() for _ in range(4)]
        received[order] = _bytes_per_epoch(half, orders)[1:]  # the first epoch also fills the local copy
        assert layered.stash.nbytes <= layered.stash.max_bytes
        half.close()
    assert all(got <= 0.8 * segments for got in received["windows"]), (received, segments)  # the half not held here
    assert all(got >= 2 * segments for got in received["shuffle"]), (received, segments)


def test_a_bucket_that_does_not_exist_leaves_outputs_right_with_a_warning(bucket: str, tmp_path: Path) -> None:
    url = bucket.replace("s3://", "s3://missing-") + "/x"  # 404 on every request
    x = torch.randn(4, 4)
    with pytest.warns(CacheWarning, match="cannot write"):
        model = cached(Counting, persistent=True, persistent_cache_dir=url, local_cache_dir=str(tmp_path / "c"))()
        assert torch.equal(model(x), Counting()(x))
        model.cache_instance.flush()
    with pytest.warns(CacheWarning, match="does not exist"):
        data = CachedDataset(Images(), url, max_memory_size=0, local_cache_dir=tmp_path / "d")
        assert [label for _, label in data.__getitems__([0, 1, 2, 3])] == [0, 1, 2, 3]
        order = list(WindowSampler(data, seed=0))  # the placement of nothing: a plain shuffle
    assert sorted(order) == list(range(len(data)))
    assert [label for _, label in data.__getitems__(order)] == order
    data.close()


@pytest.mark.parametrize("fault", [PermissionError("403 Forbidden"), OSError("503 SlowDown")])
def test_a_bucket_that_refuses_mid_run_gives_misses_computed_right_and_one_warning(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: Exception
) -> None:
    url = f"{bucket}/faults"
    for batch in ([0, 1], list(range(2, 12))):  # 0 and 1 in a segment of their own: read whole, it brings no others
        warm = CachedDataset(Images(), url, max_memory_size=0, local_cache_dir=tmp_path / "warm")
        warm.__getitems__(batch)
        warm.close()
    data = Images()
    served = CachedDataset(data, url, max_memory_size=0, local_cache_dir=tmp_path / "fresh")
    assert [label for _, label in served.__getitems__([0, 1])] == [0, 1] and data.calls == 0
    far = served.cache._open()[0].store.far

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise fault

    monkeypatch.setattr(far.bucket.fs, "cat_ranges", refuse)
    monkeypatch.setattr(far.bucket.fs, "pipe_file", refuse)
    with pytest.warns(CacheWarning) as caught:
        for start in range(2, 12, 5):
            batch = list(range(start, min(start + 5, 12)))
            samples = served.__getitems__(batch)
            assert all(
                torch.equal(img, torch.full((3, 4, 4), i, dtype=torch.uint8)) for (img, _), i in zip(samples, batch)
            )
    assert data.calls == 10 and len([w for w in caught if "cannot" in str(w.message)]) <= 2  # once per kind
    served.close()


_SHARD_WRITER = """
import sys, torch
from torchcache import CachedDataset

class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i

first, local = int(sys.argv[1]), sys.argv[2]
cache = CachedDataset(Images(), sys.argv[3], max_memory_size=0, local_cache_dir=local)
for start in range(first, 40, 10):  # every other block of ten
    cache.__getitems__(list(range(start, start + 5)))
    cache.__getitems__(list(range(start + 5, start + 10)))
cache.close()
"""


@pytest.mark.slow  # two writer processes
def test_two_processes_write_one_bucket_and_a_third_reads_everything(bucket: str, tmp_path: Path) -> None:
    import subprocess

    from tests.helpers import REPO, python_env

    url = f"{bucket}/shared"
    writers = [  # at once, each with a local copy of its own
        zygote.start(
            ["-c", _SHARD_WRITER, str(first), str(tmp_path / f"w{first}"), url],
            cwd=REPO,
            env=python_env(),
            stderr=subprocess.PIPE,
        )
        for first in (0, 10)
    ]
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
    reader = CachedDataset(None, url, max_memory_size=0, local_cache_dir=tmp_path / "reader")  # a third machine
    samples = reader.__getitems__(list(range(40)))
    assert all(torch.equal(img, torch.full((3, 4, 4), i, dtype=torch.uint8)) for i, (img, _) in enumerate(samples))
    assert [label for _, label in samples] == list(range(40))
    assert len(reader) == 40 and reader.stats().disk.hits == 40
    reader.close()


def test_the_decorators_local_copy_of_a_bucket_keeps_its_own_budget(bucket: str, tmp_path: Path) -> None:
    from torchcache.stores.packed.store import PackedStore

    budget = 200_000
    options = {"persistent_cache_dir": f"{bucket}/small", "local_cache_dir": str(tmp_path / "copy")}
    model = cached(Counting, persistent=True, max_local_cache_size=budget, **options)(dim_out=256)
    for _ in range(8):
        model(torch.randn(64, 4))
    model.cache_instance.flush()
    assert model.cache_instance.stats().disk.entries == 512  # the bucket holds every entry
    (directory,) = {index.parent for index in (tmp_path / "copy").rglob("index.lmdb")}
    with PackedStore(directory, 1 << 40) as copy:
        assert 0 < copy.nbytes <= budget and len(copy) < 512


# -- what a listing, a fault or another URL must not do ----------------------------------------------------------
def test_a_manifest_claiming_a_huge_segment_counts_its_real_bytes_and_a_reader_removes_nothing(
    bucket: str, s3fs_of: Any
) -> None:
    store = _store(bucket, max_bytes=50_000)
    for batch in range(4):
        store.put_many([(key(batch), value(batch, 1000))])
    body = json.dumps({"format": "torchcache-objects", "version": 2, "bytes": (1 << 62) - 1, "entries": []})
    s3fs_of.pipe_file(f"{store.bucket.prefix}/09000000000000000000-0123456789abcdef.tcm", body.encode())
    reader = _store(bucket, max_bytes=50_000)
    assert bytes(reader.get(key(0)) or b"") == value(0, 1000)
    assert reader.disk_bytes == 4_000  # what the bucket holds, not what the manifest claims
    reader.close()
    assert sum(name.endswith(".tcs") for name in _objects(s3fs_of, bucket)) == 4
    inspector = _store(bucket, max_bytes=1_000, keep_budget=False)  # torchcache ls: over its budget, it reads
    assert len(inspector) == 4
    inspector.close()
    assert sum(name.endswith(".tcs") for name in _objects(s3fs_of, bucket)) == 4


def test_a_readers_store_over_its_budget_removes_nothing_even_as_it_writes(bucket: str, s3fs_of: Any) -> None:
    writer = _store(bucket)
    for batch in range(4):
        writer.put_many([(key(batch), value(batch, 1000))])
    reader = _store(bucket, max_bytes=1_000, keep_budget=False)  # CachedDataset(None, url) sending unsent entries
    assert reader.put_many([(key(9), value(9, 900))]) == 1
    reader.close()
    assert sum(name.endswith(".tcs") for name in _objects(s3fs_of, bucket)) == 5
    assert [bytes(v or b"") for v in _store(bucket).get_many([key(0), key(9)])] == [value(0, 1000), value(9, 900)]


def test_a_read_whose_every_range_timed_out_starts_the_backoff(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _store(bucket).put_many([(key(i), value(i)) for i in range(4)])
    reports = Reports()
    reader = _store(bucket, reports=reports)
    reader.placement([key(0)])  # listed while the server answers
    sent: list[int] = []

    def hung(paths: list[str], starts: Any, ends: Any, on_error: str = "raise") -> list[object]:
        sent.append(len(paths))  # each range answered with its timeout, as a server that hangs makes them
        return [TimeoutError("timed out")] * len(paths)

    monkeypatch.setattr(reader.bucket.fs, "cat_ranges", hung)
    assert reader.get_many([key(i) for i in range(4)]) == [None] * 4 and reader.reads_failing()
    assert reader.get_many([key(i) for i in range(4)]) == [None] * 4 and len(sent) == 1  # backing off: not sent
    assert len(reports.seen) == 1


def test_verify_fix_hides_only_damaged_entries_never_those_a_fault_left_unread(
    bucket: str, s3fs_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.stores.objects.bucket import Bucket

    store = _store(bucket)
    for batch in range(2):
        store.put_many([(key(batch * 4 + i), value(batch * 4 + i)) for i in range(4)])
    ranges = Bucket.ranges

    def throttled(self: Bucket, names: Any, starts: Any, ends: Any) -> list[object]:
        blobs = ranges(self, names, starts, ends)
        return [OSError("503 SlowDown"), *blobs[1:]]  # one range out of retries, as s3fs returns it

    monkeypatch.setattr(Bucket, "ranges", throttled)
    report = _store(bucket, reports=Reports()).verify(fix=True)
    assert report.bad == [] and not report.fixed and any("could not be read" in p for p in report.unsure)
    assert not report.ok and report.problems == []  # nothing a fix could mend: verify again
    monkeypatch.setattr(Bucket, "ranges", ranges)
    reader = _store(bucket)
    assert all(reader.get_many([key(i) for i in range(8)]))
    (first,) = [name for name in _objects(s3fs_of, bucket) if name.endswith(".tcs")][:1]
    path = f"{store.bucket.prefix}/{first}"
    s3fs_of.pipe_file(path, b"\xff" + s3fs_of.cat_file(path)[1:])  # the first entry's first byte flipped
    fixed = _store(bucket, reports=Reports()).verify(fix=True)
    assert len(fixed.bad) == 1 and fixed.fixed
    again = _store(bucket, reports=Reports()).verify()
    assert again.bad == [] and again.problems == [] and again.entries == 7  # hidden behind a tombstone


def test_entries_of_a_segment_removed_from_the_bucket_are_reported_hidden_by_a_fix_and_kept_out_of_checkpoints(
    bucket: str, s3fs_of: Any
) -> None:
    from torchcache.stores.objects.manifests import parse_checkpoint

    store = _store(bucket)
    for batch in range(2):
        store.put_many([(key(batch * 4 + i), value(batch * 4 + i)) for i in range(4)])
    first = sorted(name for name in _objects(s3fs_of, bucket) if name.endswith(".tcs"))[0]
    s3fs_of.rm_file(f"{store.bucket.prefix}/{first}")  # a lifecycle rule, or a hand, removed it; its manifest stays
    report = _store(bucket, reports=Reports()).verify()
    assert report.problems == ["4 entries are in segments removed from the bucket"] and report.unsure == []
    checkpoint = _store(bucket, reports=Reports())._known
    assert not isinstance(parse_checkpoint(checkpoint.checkpoint()), str)  # one every reader takes
    assert _store(bucket, reports=Reports()).verify(fix=True).fixed
    again = _store(bucket, reports=Reports()).verify()
    assert again.ok and again.entries == 4


@pytest.mark.parametrize("kind", ["newer", "larger"])
def test_an_index_object_of_a_newer_torchcache_is_never_removed_by_verify(
    bucket: str, s3fs_of: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from torchcache.stores.objects import manifests

    store = _store(bucket)
    store.put_many([(key(0), value(0))])
    newer = {"format": "torchcache-objects", "version": 3, "bytes": 4, "entries": [], "what": "a later layout"}
    if kind == "larger":  # past what this version reads: perhaps a later one reads more
        monkeypatch.setattr(manifests, "_MAX_MANIFEST", 1 << 16)
        newer = {**newer, "version": 2, "padding": "x" * (1 << 17)}
    name = "00000000000000000002-0123456789abcdef.tcm"
    s3fs_of.pipe_file(f"{store.bucket.prefix}/{name}", json.dumps(newer).encode())
    reports = Reports()
    report = _store(bucket, reports=reports).verify(fix=True)
    assert report.problems == [] and not report.fixed and not report.ok
    said = "written by a newer torchcache (format version 3)"
    said = said if kind == "newer" else "larger than this torchcache reads"
    assert said in report.unsure[0] and said in reports.seen[0][1] and "not a valid" not in reports.seen[0][1]
    assert name in _objects(s3fs_of, bucket)


def test_prune_leaves_a_newer_torchcaches_checkpoint(bucket: str, s3fs_of: Any) -> None:
    writer = _store(bucket)
    newer = {"format": "torchcache-objects", "version": 3, "covers": [], "segments": [], "deleted": []}
    name = "00000000000000000002-0123456789abcdef.tci"
    s3fs_of.pipe_file(f"{writer.bucket.prefix}/{name}", json.dumps(newer).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the newer checkpoint is reported as not used
        for i in range(20):  # a checkpoint of its own, which is the newest
            writer.put_many([(key(i), value(i))])
        writer.prune(10**7)
    assert name in _objects(s3fs_of, bucket) and len(_checkpoints(s3fs_of, bucket)) == 2


def test_a_writer_that_clears_its_cache_describes_it_again_at_its_next_write(bucket: str, s3fs_of: Any) -> None:
    writer = _store(bucket, meta={"kind": "dataset"})
    writer.put_many([(key(0), value(0))])
    writer.clear()
    assert _objects(s3fs_of, bucket) == []
    writer.put_many([(key(1), value(1))])
    assert "torchcache.json" in _objects(s3fs_of, bucket)


def test_verify_beside_a_process_that_prunes_counts_nothing_as_unread(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(bucket)
    for batch in range(4):
        store.put_many([(key(batch * 4 + i), value(batch * 4 + i)) for i in range(4)])
    get_many, pruned = ObjectStore.get_many, []

    def pruning_meanwhile(self: ObjectStore, keys: Any) -> list[Any]:
        if not pruned:  # after verify listed the bucket, before it reads: another process keeps its budget
            pruned.append(_store(bucket).prune(2 * len(value(0)) * 4, sweep_seconds=None))
        return get_many(self, keys)

    monkeypatch.setattr(ObjectStore, "get_many", pruning_meanwhile)
    report = _store(bucket, reports=Reports()).verify()
    assert pruned == [2] and report.ok, report


def test_a_writer_describes_the_cache_again_once_a_clear_removed_its_description(bucket: str, s3fs_of: Any) -> None:
    writer = _store(bucket, meta={"kind": "dataset"}, refresh_seconds=0)
    writer.put_many([(key(0), value(0))])
    _store(bucket).clear()  # `torchcache clear` from another machine while the writer warms the cache
    writer.put_many([(key(1), value(1))])
    writer.put_many([(key(2), value(2))])  # the listing this write makes sees the description gone
    assert "torchcache.json" in _objects(s3fs_of, bucket)
    later = _store(f"{bucket}/fresh", meta={"kind": "dataset"})  # lists the bucket at its first write only
    later.put_many([(key(3), value(3))])  # described
    requests = later.bucket.requests
    later.put_many([(key(4), value(4))])
    assert later.bucket.requests - requests == 2  # a segment and its manifest: the description is not looked for


@pytest.mark.parametrize("kind", [".tcm", ".tcd"])
def test_an_index_object_whose_read_failed_is_read_again_never_taken_for_damage(
    bucket: str, s3fs_of: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from torchcache.stores.objects.bucket import Bucket

    store = _store(bucket)
    for batch in range(3):
        store.put_many([(key(batch * 4 + i), value(batch * 4 + i)) for i in range(4)])
    store.delete_many([key(0)])  # a tombstone
    flaky = sorted(name for name in _objects(s3fs_of, bucket) if name.endswith(kind))[-1]
    cat = Bucket.cat

    def throttled(self: Bucket, names: Any) -> dict[str, object]:
        found = cat(self, names)
        return {name: OSError("503 SlowDown") if name == flaky else body for name, body in found.items()}

    with monkeypatch.context() as patched:
        patched.setattr(Bucket, "cat", throttled)
        reports = Reports()
        reader = _store(bucket, reports=reports)
        reader.get_many([key(1)])
        report = _store(bucket, reports=Reports()).verify(fix=True)
    assert reports.kinds() == [Fault.UNAVAILABLE]
    assert not report.ok and not report.fixed and report.problems == []
    assert report.unsure and "index objects could not be read" in report.unsure[-1]
    assert flaky in _objects(s3fs_of, bucket)  # nothing removed
    reader._listed_at = float("-inf")  # the next listing, once the bucket answers
    got = reader.get_many([key(i) for i in range(12)])
    assert [bytes(v) if v is not None else None for v in got] == [None] + [value(i) for i in range(1, 12)]
    assert _store(bucket, reports=Reports()).verify().ok


@pytest.mark.parametrize("damage", ["manifest", "tombstone"])
def test_verify_reports_a_damaged_index_object_and_a_fix_removes_it_with_its_segment(
    bucket: str, s3fs_of: Any, damage: str
) -> None:
    store = _store(bucket)
    for batch in range(3):
        store.put_many([(key(batch * 4 + i), value(batch * 4 + i)) for i in range(4)])
    store.delete_many([key(0)])  # a tombstone
    suffix = ".tcm" if damage == "manifest" else ".tcd"
    damaged = sorted(name for name in _objects(s3fs_of, bucket) if name.endswith(suffix))[-1]
    s3fs_of.pipe_file(f"{store.bucket.prefix}/{damaged}", b"{not json")
    reports = Reports()
    checker = _store(bucket, reports=reports)
    report = checker.verify()
    assert not report.ok and len(report.problems) == 1 and "is not a valid index object" in report.problems[0]
    assert damaged in report.problems[0] and reports.kinds() == [Fault.INDEX]
    read, cat = [], checker.bucket.cat
    checker.bucket.cat = lambda names: read.extend(names) or cat(names)  # type: ignore[method-assign]
    assert not checker.verify().ok and read == []  # objects never change: not read again, still reported
    fixed = _store(bucket, reports=Reports()).verify(fix=True)
    assert fixed.fixed
    left = _objects(s3fs_of, bucket)
    assert damaged not in left
    if damage == "manifest":  # its segment cannot be read without it: gone with it
        assert damaged.removesuffix(".tcm") + ".tcs" not in left
    again = _store(bucket, reports=Reports()).verify()
    assert again.ok and again.problems == [] and checker.verify().ok  # what another process removed is gone here too
    expected = 7 if damage == "manifest" else 12  # a lost tombstone shows the entry it hid again, intact
    assert again.entries == expected
    reader = _store(bucket, reports=Reports())
    read = reader.get_many([key(i) for i in range(12)])
    assert sum(bytes(v or b"") == value(i) for i, v in enumerate(read)) == expected


def test_verify_of_a_url_says_what_it_could_not_check_and_fails_even_with_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import contextlib

    from torchcache.cli import remote
    from torchcache.cli.main import main
    from torchcache.stores.batched import VerifyReport

    class Away:
        def verify(self, fix: bool) -> VerifyReport:
            return VerifyReport(entries=3, unsure=["3 entries could not be read (the bucket refused or was away)"])

    monkeypatch.setattr(remote, "remote_namespaces", lambda url: ["ns"])
    monkeypatch.setattr(remote, "open_remote", lambda url, namespace: contextlib.nullcontext(Away()))
    monkeypatch.setattr(remote, "_entry_check", lambda store: None)
    assert main(["verify", "s3://bucket/cache", "--fix"]) == 1  # nothing was fixed: no "fixed", no success
    out, err = capsys.readouterr()
    assert "could not be read" in out and "fixed" not in out and "could not be made" in err


def test_caches_of_one_name_at_two_urls_keep_separate_local_copies(bucket: str, tmp_path: Path) -> None:
    def model(prefix: str, scale: float) -> Any:
        @torchcache_decorator(
            persistent=True, persistent_cache_dir=f"{bucket}/{prefix}", local_cache_dir=str(tmp_path),
            persistent_module_hash="encoder", max_memory_cache_size=0,
        )  # fmt: skip
        class Scaled(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * scale

        return Scaled()

    x = torch.arange(4.0).reshape(4, 1)
    first = model("project-a", 1.0)
    assert torch.equal(first(x), x)
    first.cache_instance.flush()
    second = model("project-b", 100.0)
    assert torch.equal(second(x), x * 100)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


@pytest.mark.parametrize("fail_at", [1, 2])  # the manifests' removal, or the segments' after it
def test_a_prune_whose_removal_fails_keeps_counting_those_segments_and_removes_them_later(
    bucket: str, s3fs_of: Any, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    from torchcache.stores.objects.bucket import Bucket

    reports = Reports()
    store = _store(bucket, max_bytes=6_000, reports=reports)
    for batch in range(6):
        store.put_many([(key(batch), value(batch, 1000))])
    remove, calls = Bucket.remove, []

    def refusing(self: Bucket, names: Any) -> None:
        calls.append(names)
        if len(calls) == fail_at:
            raise StoreUnavailableError("cannot remove objects: 503 SlowDown")
        remove(self, names)

    monkeypatch.setattr(Bucket, "remove", refusing)
    assert store.put_many([(key(6), value(6, 1000))]) == 1  # visible: the failed prune is one report, not an error
    assert len(calls) == fail_at and Fault.BUDGET in reports.kinds()
    assert store.disk_bytes == 7_000  # still counted
    store.put_many([(key(7), value(7, 1000))])
    segments = [name for name in _objects(s3fs_of, bucket) if name.endswith(".tcs")]
    assert sum(s3fs_of.size(f"{store.bucket.prefix}/{name}") for name in segments) <= 6_000


def test_a_local_copy_is_named_by_its_url_without_its_password() -> None:
    from torchcache.stores.remote import local_copy_dir

    root, name = Path("/copies"), "a" * 32
    assert local_copy_dir(root, name, "redis://:old@db:6379/0") == local_copy_dir(root, name, "redis://:new@db:6379/0")
    assert local_copy_dir(root, name, "s3://b/x/") == local_copy_dir(root, name, "S3://b/x")
    assert local_copy_dir(root, name, "s3://b/x") != local_copy_dir(root, name, "s3://b/y")


def test_a_bucket_url_with_a_query_is_refused(bucket: str) -> None:
    with pytest.raises(ConfigError, match="without a query"):
        CachedDataset(Images(), f"{bucket}/cache?versionId=1")
