"""Features caches in a bucket (torchcache/features/remote.py), against a local S3 server (tests/object_servers.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_features import Images, Net
from torchcache import CacheWarning, ConfigError, FeatureDataset, extract_features
from torchcache.cli.main import main
from torchcache.faults import FaultLog
from torchcache.features import remote
from torchcache.features.probe import PROBE_INPUTS
from torchcache.stores.features.file import FEATURES_NAME


def _features(data: FeatureDataset) -> torch.Tensor:
    return torch.stack([data[i][0] for i in range(len(data))])


def _expected(net: Net, images: Images) -> torch.Tensor:
    with torch.no_grad():
        return net(images.images)


def _objects(fs: Any, bucket: str) -> list[str]:
    return [p for p in fs.find(bucket.removeprefix("s3://"))]


def test_features_extracted_into_a_bucket_serve_a_fresh_machine_without_the_backbone(
    bucket: str, tmp_path: Path
) -> None:
    url, net, images = f"{bucket}/probe", Net(), Images()
    first = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    assert net.seen[0] == len(images) + PROBE_INPUTS  # and the check that rows do not depend on the batch
    assert torch.allclose(_features(first), _expected(net, images), atol=1e-6)
    served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")  # no backbone, no dataset
    assert torch.equal(_features(served), _features(first))
    assert [served[i][1] for i in range(len(images))] == images.labels
    assert served.path is not None and served.path.is_relative_to(tmp_path / "m2")
    again = Net()
    again.load_state_dict(net.state_dict())
    third = extract_features(again, Images(), cache_dir=url, local_cache_dir=tmp_path / "m3", progress=False)
    assert again.seen[0] == 0 and torch.equal(_features(third), _features(first))


def test_a_file_of_many_pieces_is_put_back_whole(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3fs_of: Any
) -> None:
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    url, net, images = f"{bucket}/pieces", Net(), Images(n=200)
    first = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    assert first.path is not None and first.path.stat().st_size > 5000  # several pieces
    segments = [p for p in _objects(s3fs_of, bucket) if p.endswith(".tcs")]
    assert len(segments) == -(-first.path.stat().st_size // 1000) + 1  # the pieces and the head
    served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert served.path is not None and served.path.read_bytes() == first.path.read_bytes()


def test_an_upload_without_its_head_is_not_read_and_the_next_machine_uploads_again(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, images = f"{bucket}/cut", Images()
    real = remote.Head.encode

    def killed(self: remote.Head) -> bytes:
        raise OSError("killed before the head")

    monkeypatch.setattr(remote.Head, "encode", killed)
    first_net = Net()
    with pytest.warns(CacheWarning, match="cannot upload"):
        first = extract_features(first_net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    assert len(first) == len(images)  # kept locally
    monkeypatch.setattr(remote.Head, "encode", real)
    with pytest.raises(ConfigError, match="no whole features file"):
        FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    net = Net()
    net.load_state_dict(first_net.state_dict())
    second = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m2", progress=False)
    assert net.seen[0] == len(images) + PROBE_INPUTS  # computed: nothing whole was there
    served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m3")
    assert torch.equal(_features(served), _features(second))


@pytest.mark.parametrize("damage", ["piece", "head"])
def test_a_damaged_file_in_the_bucket_is_computed_again_and_replaced(
    bucket: str, tmp_path: Path, s3fs_of: Any, damage: str
) -> None:
    url, images = f"{bucket}/damaged", Images()
    net = Net()
    first = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    good = _features(first)
    segments = sorted(p for p in _objects(s3fs_of, bucket) if p.endswith(".tcs"))
    piece, _ = segments  # the piece went first, its head last
    if damage == "piece":
        data = bytearray(s3fs_of.cat_file(piece))
        data[len(data) // 2] ^= 0xFF
        s3fs_of.pipe_file(piece, bytes(data))
    else:  # a head that lies about the file's digest, its entry's own check passing
        assert first.path is not None
        folder = first.path.parent.name.rsplit("-", 1)[0]
        store = remote.FeaturesBucket(url, tmp_path / "x", None, FaultLog("t"))._store(folder, {"kind": "features"})
        body = json.loads(bytes(store.get(remote._HEAD_KEY) or b""))
        body["digest"] = "0" * 32
        store.put_many([(remote._HEAD_KEY, json.dumps(body).encode())])
        store.close()
    again = Net()
    again.load_state_dict(net.state_dict())
    with pytest.warns(CacheWarning):
        second = extract_features(again, Images(), cache_dir=url, local_cache_dir=tmp_path / "m2", progress=False)
    assert again.seen[0] == len(images) + PROBE_INPUTS and torch.equal(_features(second), good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the replaced file is whole
        served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m3")
    assert torch.equal(_features(served), good)


def test_a_bucket_that_is_away_leaves_features_right_and_a_whole_copy_of_a_folder_serves_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.object_servers import CREDENTIALS, _free_port, require_s3

    require_s3()
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    away = {
        "endpoint_url": f"http://127.0.0.1:{_free_port()}",
        "retries": 1,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    url, net, images = "s3://nowhere/feats", Net(), Images()
    local = tmp_path / "m1"
    with pytest.warns(CacheWarning, match="nowhere"):
        data = extract_features(net, images, cache_dir=url, local_cache_dir=local, storage_options=away, progress=False)
    assert torch.allclose(_features(data), _expected(net, images), atol=1e-6)
    assert data.path is not None
    folder = data.path.parent.name.rsplit("-", 1)[0]
    with pytest.raises(ConfigError, match=f"cannot list.*copies of {folder}"):  # the root may hold another by now
        FeatureDataset.open(url, local_cache_dir=local, storage_options=away)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole copy of the folder is read without the bucket
        served = FeatureDataset.open(f"{url}/{folder}", local_cache_dir=local, storage_options=away)
    assert torch.equal(_features(served), _features(data))
    with pytest.warns(CacheWarning, match="nowhere"), pytest.raises(ConfigError, match="no whole copy"):
        FeatureDataset.open(f"{url}/{folder}", local_cache_dir=tmp_path / "empty", storage_options=away)


def test_opening_a_root_of_two_caches_names_them_and_a_folder_url_opens_one(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/two"
    one = extract_features(Net(), Images(seed=1), cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    extract_features(Net(), Images(seed=2), cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    with pytest.raises(ConfigError, match="2 features caches"):
        FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert one.path is not None
    folder = one.path.parent.name.rsplit("-", 1)[0]  # features-<key>, without the digest of the URL
    served = FeatureDataset.open(f"{url}/{folder}", local_cache_dir=tmp_path / "m2")
    assert torch.equal(_features(served), _features(one))
    with pytest.raises(ConfigError, match="no features cache"):
        FeatureDataset.open(f"{bucket}/nothing", local_cache_dir=tmp_path / "m2")


def test_a_features_cache_on_a_redis_server_or_of_varying_shapes_in_a_bucket_is_refused(
    bucket: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="cache_dir: a features cache is a file"):
        extract_features(Net(), Images(), cache_dir="redis://127.0.0.1:1/0", progress=False)
    ragged = [(torch.randn(3, 8 + i % 2, 8), i) for i in range(6)]
    with pytest.raises(ConfigError, match="vary in shape"):
        extract_features(Net(), ragged, batch_size=2, cache_dir=f"{bucket}/r", local_cache_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="local_cache_dir"):
        extract_features(Net(), Images(), cache_dir=tmp_path / "a", local_cache_dir=tmp_path / "b", progress=False)
    with pytest.raises(ConfigError, match="storage_options"):
        FeatureDataset.open(tmp_path / "a", storage_options={"endpoint_url": "http://x"})


def test_the_command_line_lists_and_verifies_a_features_cache_in_a_bucket(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{bucket}/cli"
    extract_features(Net(), Images(), cache_dir=url, local_cache_dir=tmp_path, progress=False)
    assert main(["ls", url]) == 0
    assert "features-" in capsys.readouterr().out
    assert main(["verify", url]) == 0  # its entries are pieces of a file, not output frames
    assert "no problems found" in capsys.readouterr().out
    assert main(["prune", url, "--max-size", "0"]) == 0
    with pytest.raises(ConfigError, match="no whole features file"):
        FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")


@pytest.mark.slow  # the GCS emulator is a process of its own
def test_features_in_a_gcs_bucket_serve_a_fresh_machine(gcs_bucket: str, tmp_path: Path) -> None:
    url, net, images = f"{gcs_bucket}/probe", Net(), Images()
    first = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert torch.equal(_features(served), _features(first))
    assert torch.allclose(_features(served), _expected(net, images), atol=1e-6)


_READER = """
import os, signal, sys
import torchcache.features.remote as remote
from torchcache import FeatureDataset

remote.CHUNK_BYTES = 1000
real_get = remote.ObjectStore.get
got = [0]


def get(self, key):  # killed as the fourth piece is read
    got[0] += 1
    if got[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_get(self, key)


remote.ObjectStore.get = get
FeatureDataset.open(sys.argv[1], local_cache_dir=sys.argv[2])
"""


@pytest.mark.slow  # a reader process, killed mid-download
def test_a_reader_killed_mid_download_leaves_a_local_copy_the_next_one_reads_whole(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import subprocess
    import sys

    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    url, images = f"{bucket}/killed", Images(n=300)
    first = extract_features(Net(), images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    local = tmp_path / "m2"
    done = subprocess.run([sys.executable, "-c", _READER, url, str(local)], env=dict(os.environ), timeout=120)
    assert done.returncode == -9
    assert list(local.rglob("*.part")) and not list(local.rglob(FEATURES_NAME))  # no reader takes a part file
    served = FeatureDataset.open(url, local_cache_dir=local)
    assert torch.equal(_features(served), _features(first))
    assert not list(local.rglob("*.part"))  # the killed reader's, swept


def _folder(data: FeatureDataset) -> str:
    assert data.path is not None
    return data.path.parent.name.rsplit("-", 1)[0]  # features-<key>, without the digest of the URL


def test_a_local_copy_with_a_damaged_row_is_read_again_from_the_bucket(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/rows"
    first = extract_features(Net(), Images(), cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert served.path is not None
    served.close()
    with open(served.path, "r+b") as file:  # a byte of the last row
        file.seek(-3, 2)
        byte = file.read(1)
        file.seek(-3, 2)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(CacheWarning, match="1 rows are damaged"):
        again = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert torch.equal(_features(again), _features(first))


def test_a_folder_holding_another_caches_file_is_not_served(bucket: str, tmp_path: Path, s3fs_of: Any) -> None:
    url = f"{bucket}/swap"
    a = extract_features(Net(), Images(seed=1), cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    b = extract_features(Net(), Images(seed=2), cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    prefix = url.removeprefix("s3://")
    s3fs_of.rm(f"{prefix}/{_folder(b)}", recursive=True)
    s3fs_of.copy(f"{prefix}/{_folder(a)}", f"{prefix}/{_folder(b)}", recursive=True)  # b's folder holds a's file
    with pytest.warns(CacheWarning, match="made for another key"), pytest.raises(ConfigError, match="no whole copy"):
        FeatureDataset.open(f"{url}/{_folder(b)}", local_cache_dir=tmp_path / "m2")


def test_a_replaced_file_leaves_one_file_in_its_folder(bucket: str, tmp_path: Path, s3fs_of: Any) -> None:
    url, images = f"{bucket}/once", Images(n=300)
    net = Net()
    first = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    assert first.path is not None
    prefix = f"{url.removeprefix('s3://')}/{_folder(first)}"
    piece = sorted(p for p in s3fs_of.find(prefix) if p.endswith(".tcs"))[0]
    data = bytearray(s3fs_of.cat_file(piece))
    data[len(data) // 2] ^= 0xFF
    s3fs_of.pipe_file(piece, bytes(data))
    again = Net()
    again.load_state_dict(net.state_dict())
    with pytest.warns(CacheWarning, match="not used"):
        extract_features(again, Images(n=300), cache_dir=url, local_cache_dir=tmp_path / "m2", progress=False)
    assert again.seen[0] == len(images) + PROBE_INPUTS  # computed, then uploaded in place of the damaged file
    segments = sum(s3fs_of.size(p) for p in s3fs_of.find(prefix) if p.endswith(".tcs"))
    assert first.path.stat().st_size <= segments <= first.path.stat().st_size + 4096


def _made(tmp_path: Path, n: int = 37) -> tuple[FeatureDataset, str, dict[str, Any]]:
    """Features extracted locally, their folder's name and description: what a machine uploads."""
    made = extract_features(Net(), Images(n=n), cache_dir=tmp_path / "local", progress=False)
    assert made.path is not None
    return made, made.path.parent.name, json.loads((made.path.parent / "torchcache.json").read_text())


def _race(url: str, folder: str, made: FeatureDataset, meta: Any, tmp_path: Path, a_done: Any = None) -> None:
    """Machines A and B upload ``made``'s file into ``folder`` at once, each from a thread of that name."""
    import threading

    def machine(name: str) -> None:
        assert made.path is not None
        remote.FeaturesBucket(url, tmp_path / name, None, FaultLog(name)).upload(folder, made.path, meta)
        if name == "A" and a_done is not None:
            a_done.set()

    machines = [threading.Thread(target=machine, args=(name,), name=name) for name in "AB"]
    for thread in machines:
        thread.start()
    for thread in machines:
        thread.join(60)


def test_two_machines_uploading_one_file_at_once_leave_a_whole_one(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from torchcache.stores.objects import ObjectStore

    url = f"{bucket}/race"
    made, folder, meta = _made(tmp_path)
    real, a_piece, b_head = ObjectStore.put_many, threading.Event(), threading.Event()

    def interleaved(self: ObjectStore, items: Any) -> int:  # A's piece, B's piece, B's head, A's head
        me, head = threading.current_thread().name, items[0][0] == remote._HEAD_KEY
        if (me, head) in (("B", False), ("A", True)):
            (a_piece if me == "B" else b_head).wait(30)
        done = real(self, items)
        if (me, head) in (("A", False), ("B", True)):
            (a_piece if me == "A" else b_head).set()
        return done

    monkeypatch.setattr(ObjectStore, "put_many", interleaved)
    _race(url, folder, made, meta, tmp_path)
    monkeypatch.setattr(ObjectStore, "put_many", real)
    assert torch.equal(_features(FeatureDataset.open(url, local_cache_dir=tmp_path / "C")), _features(made))


def test_an_upload_whose_first_piece_another_machine_removed_puts_it_back(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from torchcache.stores.objects import ObjectStore

    monkeypatch.setattr(remote, "CHUNK_BYTES", 1000)
    url = f"{bucket}/slow"
    made, folder, meta = _made(tmp_path, 40)
    assert made.path is not None and made.path.stat().st_size > 2000  # several pieces
    real, b_started, a_done = ObjectStore.put_many, threading.Event(), threading.Event()

    def interleaved(self: ObjectStore, items: Any) -> int:  # B's first piece, then all of A's upload, then B's rest
        me = threading.current_thread().name
        if me == "A":
            b_started.wait(30)
        done = real(self, items)
        if me == "B" and not b_started.is_set():
            b_started.set()
            a_done.wait(30)
        return done

    monkeypatch.setattr(ObjectStore, "put_many", interleaved)
    _race(url, folder, made, meta, tmp_path, a_done)
    monkeypatch.setattr(ObjectStore, "put_many", real)
    assert torch.equal(_features(FeatureDataset.open(url, local_cache_dir=tmp_path / "C")), _features(made))


def test_a_machine_that_removed_a_piece_of_a_newer_head_puts_its_own_file_back(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from torchcache.stores.objects import ObjectStore

    url = f"{bucket}/late"
    made, folder, meta = _made(tmp_path)
    real, real_remove = ObjectStore.put_many, remote.remove_segments
    a_piece, b_removing, a_done = threading.Event(), threading.Event(), threading.Event()

    def interleaved(self: ObjectStore, items: Any) -> int:  # A's piece, B's piece and head, then A's head
        me, head = threading.current_thread().name, items[0][0] == remote._HEAD_KEY
        if me == "B" and not a_piece.is_set():
            a_piece.wait(30)
        if me == "A" and head:
            b_removing.wait(30)
        done = real(self, items)
        if me == "A" and not head:
            a_piece.set()
        return done

    def removing(store: Any, segments: Any, others: Any = ()) -> None:  # B removes A's piece once A is done
        if threading.current_thread().name == "B" and not b_removing.is_set():
            b_removing.set()
            a_done.wait(30)
        real_remove(store, segments, others)

    monkeypatch.setattr(ObjectStore, "put_many", interleaved)
    monkeypatch.setattr(remote, "remove_segments", removing)
    _race(url, folder, made, meta, tmp_path, a_done)
    monkeypatch.setattr(ObjectStore, "put_many", real)
    assert torch.equal(_features(FeatureDataset.open(url, local_cache_dir=tmp_path / "C")), _features(made))


def test_a_root_named_like_a_folder_is_a_root(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/features-run1"
    first = extract_features(Net(), Images(), cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert torch.equal(_features(served), _features(first))


def test_copies_read_from_a_bucket_keep_the_local_roots_budget(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/budget"
    made = [
        extract_features(Net(), Images(seed=s), cache_dir=f"{url}/{s}", local_cache_dir=tmp_path / "m1", progress=False)
        for s in range(3)
    ]
    assert made[0].path is not None
    one = made[0].path.stat().st_blocks * 512  # on disk
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", str(int(1.5 * one)))
    local = tmp_path / "m2"
    for s in range(3):
        FeatureDataset.open(f"{url}/{s}", local_cache_dir=local).close()
    used = sum(p.stat().st_blocks * 512 for p in local.rglob("*") if p.is_file())
    assert one <= used <= 1.5 * one, (used, one)  # the newest copy, and none of those read before it


def test_verify_fix_lets_the_machine_that_holds_the_features_upload_a_damaged_file_again(
    bucket: str, tmp_path: Path, s3fs_of: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url, net, images = f"{bucket}/repair", Net(), Images()
    first = extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    prefix = f"{url.removeprefix('s3://')}/{_folder(first)}"
    piece = sorted(p for p in s3fs_of.find(prefix) if p.endswith(".tcs"))[0]
    data = bytearray(s3fs_of.cat_file(piece))
    data[len(data) // 2] ^= 0xFF
    s3fs_of.pipe_file(piece, bytes(data))
    assert main(["verify", url]) == 1  # found
    assert main(["verify", url, "--fix"]) == 0
    capsys.readouterr()
    extract_features(net, images, cache_dir=url, local_cache_dir=tmp_path / "m1", progress=False)
    assert net.seen[0] == len(images) + PROBE_INPUTS  # not computed again: its whole copy is uploaded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        served = FeatureDataset.open(url, local_cache_dir=tmp_path / "m2")
    assert torch.equal(_features(served), _features(first))
