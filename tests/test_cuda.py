"""Modules and backbones on a CUDA device: hits come back where a real call would put them.

Skipped without a CUDA device.
"""

from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchcache import CacheWarning, MissingFeatureError, extract_features, torchcache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Encoder(torch.nn.Module):
    """A small frozen conv net."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        self.fc = torch.nn.Linear(8, 16)
        self.requires_grad_(False)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).relu().mean((2, 3)))


@torchcache(persistent=True)
class CachedEncoder(Encoder):
    pass


def images(n: int = 40) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def test_disk_hits_come_back_on_the_device_equal_to_the_module(cache_root: Path) -> None:
    torch.manual_seed(1)
    model = CachedEncoder().cuda()
    torch.manual_seed(1)
    plain = Encoder().cuda()
    x = images().cuda()
    first = model(x)
    model.cache_instance.flush()
    torch.manual_seed(1)
    fresh = CachedEncoder().cuda()  # a new instance: its memory tier is empty, its hits come from disk
    again = fresh(x)
    assert again.device == x.device and again.dtype == first.dtype
    assert torch.equal(again, first) and torch.equal(first, plain(x))
    assert fresh.cache_instance.stats().disk.hits == len(x)  # type: ignore[union-attr]


def test_a_weight_changed_in_place_on_the_device_is_seen(cache_root: Path) -> None:
    model = torchcache()(Encoder)().cuda()
    x = images().cuda()
    before = model(x)
    with torch.no_grad():
        model.fc.bias.add_(1.0)
    after = model(x)
    assert torch.allclose(after, before + 1.0, atol=1e-5)


def test_features_of_a_cuda_backbone_equal_its_outputs(tmp_path: Path) -> None:
    backbone = Encoder().cuda()
    data = TensorDataset(images(), torch.arange(40))
    features = extract_features(backbone, data, batch_size=8, cache_dir=tmp_path, progress=False)
    with torch.no_grad():
        expected = torch.cat([backbone(images()[i : i + 8].cuda()) for i in range(0, 40, 8)]).cpu()
    got = torch.stack([features[i][0] for i in range(40)])
    assert got.device.type == "cpu" and torch.equal(got, expected)
    loader = DataLoader(features, batch_size=16, num_workers=2, multiprocessing_context="fork")
    seen = torch.cat([x for x, _ in loader])
    assert torch.equal(seen, expected)


def _read_in_forked_child(features: Any, queue: Any) -> None:
    warnings.simplefilter("ignore", CacheWarning)  # the damaged row's warning: the error is what is checked
    try:
        features[3]
    except MissingFeatureError as exc:
        queue.put(f"MissingFeatureError: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put(f"{type(exc).__name__}: {exc}")
    else:
        queue.put("no error")


def test_a_row_damaged_later_in_a_forked_child_of_a_cuda_process_is_a_clear_error(tmp_path: Path) -> None:
    backbone = Encoder().cuda()
    data = TensorDataset(images(), torch.arange(40))
    features = extract_features(backbone, data, batch_size=8, cache_dir=tmp_path, progress=False)
    assert features.path is not None
    with open(features.path, "r+b") as raw:
        raw.seek(features.file.rows_at + 3 * features.file.stride)
        raw.write(b"\xff" * 8)
    queue: Any = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=_read_in_forked_child, args=(features, queue))
    child.start()
    child.join(60)
    answer = queue.get(timeout=10)
    assert answer.startswith("MissingFeatureError") and "spawn" in answer, answer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # the child marked it not written: no second warning
        x, label = features[3]  # the main process computes it on the device
    with torch.no_grad():
        want = backbone(images()[3:4].cuda()).cpu()[0]
    assert torch.allclose(x, want, atol=1e-5) and int(label) == 3


class Sequences(torch.utils.data.Dataset[Any]):
    """Sequences of three lengths, with a string label."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4 + i % 3, 6, generator=g), f"item {i}"


def test_features_of_varying_shape_from_a_cuda_backbone_are_kept_whole(tmp_path: Path) -> None:

    backbone = torch.nn.Linear(6, 3).requires_grad_(False).cuda()
    data = Sequences()
    features = extract_features(backbone, data, batch_size=4, cache_dir=tmp_path, progress=False)
    assert features.info["layout"] == "variable"
    for i in range(len(data)):
        x, label = features[i]
        with torch.no_grad():
            want = backbone(data[i][0][None].cuda())[0].cpu()
        assert x.device.type == "cpu" and x.shape == (4 + i % 3, 3) and label == f"item {i}"
        assert torch.allclose(x, want, atol=1e-6)


def test_a_changed_dataset_with_a_cuda_backbone_takes_the_older_rows_and_computes_the_rest(tmp_path: Path) -> None:
    backbone = Encoder().cuda()
    calls = [0]
    backbone.register_forward_hook(lambda module, args, output: calls.__setitem__(0, calls[0] + len(args[0])))
    base = images()
    first = TensorDataset(base, torch.arange(40))
    before = extract_features(backbone, first, batch_size=8, cache_dir=tmp_path, progress=False)
    changed = base.clone()
    changed[[5, 21]] += 1
    extra = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    data = TensorDataset(torch.cat([changed, extra]), torch.arange(44) + 100)
    calls[0] = 0
    after = extract_features(backbone, data, batch_size=8, cache_dir=tmp_path, progress=False)
    assert calls[0] == 2 + 4  # the changed and the added samples alone reach the device
    with torch.no_grad():
        want = backbone(data.tensors[0].cuda()).cpu()
    for i in range(44):
        x, label = after[i]
        assert x.device.type == "cpu" and int(label) == i + 100
        assert torch.allclose(x, want[i], atol=1e-5)
        if i < 40 and i not in (5, 21):
            assert torch.equal(x, before[i][0])  # the very row the older cache holds


def test_hits_come_back_on_the_device_their_own_call_gives() -> None:
    @torchcache()
    def moved(x: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 2).to(device), x + 1  # a leaf on the device asked for, a leaf where the input is

    x = torch.randn(3, 2)
    assert [t.device.type for t in moved(x, "cuda")] == ["cuda", "cpu"]
    assert [t.device.type for t in moved(x, "cpu")] == ["cpu", "cpu"]
    for _ in range(2):  # hits, for each context
        assert [t.device.type for t in moved(x, "cuda")] == ["cuda", "cpu"]
        assert [t.device.type for t in moved(x, "cpu")] == ["cpu", "cpu"]
    assert moved.cache_instance.stats().hits == 12


def test_an_item_hashed_on_the_host_from_the_device_keeps_a_key_of_its_own() -> None:
    from torchcache.keys import hash_items

    x = torch.randn(3, 8)  # fewer elements than subsample_count: hashed whole, on the host
    assert hash_items(b"ctx", [x.cuda()], subsample_count=64) != hash_items(b"ctx", [x], subsample_count=64)
    assert hash_items(b"ctx", [x.cuda()], subsample_count=64) == hash_items(b"ctx", [x.cuda()], subsample_count=64)
