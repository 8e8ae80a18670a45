"""extract_features and FeatureDataset: outputs, keys, resuming, processes, damage, hostile files."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchcache
from tests import zygote
from tests.helpers import Tally, python_env
from torchcache import CacheWarning, ConfigError, FeatureDataset, MissingFeatureError, extract_features
from torchcache.errors import CorruptEntryError
from torchcache.features.probe import PROBE_INPUTS
from torchcache.stores.features.file import FEATURES_NAME, open_features
from torchcache.stores.rows import RowsFile

READS = Tally()


class Images(Dataset[Any]):
    """``(image, label)`` samples from one tensor of images."""

    def __init__(self, n: int = 37, seed: int = 1, shape: tuple[int, ...] = (3, 8, 8)) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, *shape, generator=g)
        self.labels = (torch.arange(n) * 7 % 5).tolist()
        READS[id(self)] = 0

    def __len__(self) -> int:
        return len(self.images)

    @property
    def reads(self) -> int:
        """Samples read (not an attribute: one that changes would change the dataset's key)."""
        return READS[id(self)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        READS[id(self)] += 1
        return self.images[i], self.labels[i]


class Fields(Dataset[Any]):
    """Dict samples with fields of every storable kind."""

    def __init__(self, n: int = 11) -> None:
        self.x = torch.randn(n, 6, generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "id": i * 3,
            "x": self.x[i],
            "weight": i / 2,
            "flag": i % 2 == 0,
            "mask": torch.arange(3) < i % 4,
            "box": np.full((2,), i, np.float32),
            "grade": np.int16(i),
        }


COUNTS = Tally()


def count_samples(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    COUNTS[id(module)][0] += len(args[0])


class Net(torch.nn.Module):
    """A small conv net, frozen, that counts the samples it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, 5)
        self.requires_grad_(False)
        self.eval()
        COUNTS[id(self)] = [0]
        self.register_forward_hook(count_samples)

    @property
    def seen(self) -> list[int]:
        """Samples seen, counted by a hook: a changing attribute would change the key, as it should."""
        return COUNTS[id(self)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).relu().mean((2, 3)))


class Scale(torch.nn.Module):
    """Elementwise, so its outputs do not depend on the batch."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def extract(backbone: torch.nn.Module, dataset: Any, **kwargs: Any) -> FeatureDataset:
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("progress", False)
    return extract_features(backbone, dataset, **kwargs)


def feature_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("features-"))


# -- outputs ---------------------------------------------------------------------------
def test_outputs_equal_the_backbone_over_the_same_batches(cache_root: Path) -> None:
    net, data = Net(), Images()
    features = extract(net, data, batch_size=8)
    with torch.no_grad():
        expected = torch.cat([net(data.images[i : i + 8]) for i in range(0, len(data), 8)])
        single = torch.cat([net(data.images[i : i + 1]) for i in range(len(data))])
    assert len(features) == len(data)
    for i in range(len(data)):
        x, y = features[i]
        assert torch.equal(x, expected[i])  # bit-exact: the same batches as the uncached run
        assert torch.allclose(x, single[i], atol=1e-6)  # other batch sizes: up to rounding
        assert type(y) is int and y == data.labels[i]
    x, y = features[-1]
    assert torch.equal(x, expected[-1]) and y == data.labels[-1]


def test_features_made_under_autocast_are_not_served_without_it(cache_root: Path) -> None:
    net, data = Net(), Images()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = extract(net, data)
    exact = extract(net, data)
    with torch.no_grad():
        expected = torch.cat([net(data.images[i : i + 8]) for i in range(0, len(data), 8)])
    assert lowered[0][0].dtype == torch.bfloat16 and len(feature_dirs(cache_root)) == 2
    assert all(torch.equal(exact[i][0], expected[i]) for i in range(len(data)))


def test_batched_reads_through_a_dataloader(cache_root: Path) -> None:
    net, data = Net(), Images(n=50)
    features = extract(net, data)
    with torch.no_grad():
        expected = torch.cat([net(data.images[i : i + 8]) for i in range(0, len(data), 8)])
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(3)).tolist()
    loader = DataLoader(features, batch_size=16, sampler=order)
    got_x, got_y = zip(*loader, strict=True)
    assert torch.equal(torch.cat(got_x), expected[order])
    assert torch.cat(got_y).tolist() == [data.labels[i] for i in order]
    batch = features.__getitems__([5, -1, 5])
    assert torch.equal(batch[0][0], expected[5]) and torch.equal(batch[1][0], expected[-1])


def test_batch_size_independent_backbones_match_one_sample_at_a_time(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(20, 6))
    net = Scale()
    features = extract(net, data, batch_size=7)
    for i in range(len(data)):
        (x,) = features[i]
        assert torch.equal(x, net(data[i][0]))


def test_every_kind_of_field_comes_back_as_it_was(cache_root: Path) -> None:
    data, net = Fields(), Scale()
    features = extract(net, data, input="x", batch_size=4)
    for i in range(len(data)):
        got, want = features[i], data[i]
        assert list(got) == list(want)
        assert torch.equal(got["x"], net(want["x"]))
        for key in ("id", "weight", "flag"):
            assert type(got[key]) is type(want[key]) and got[key] == want[key]
        assert torch.equal(got["mask"], want["mask"])
        assert isinstance(got["box"], np.ndarray) and np.array_equal(got["box"], want["box"])
        assert type(got["grade"]) is np.int16 and got["grade"] == want["grade"]


def test_tensor_and_list_samples(cache_root: Path) -> None:
    images = torch.randn(9, 6)
    net = Scale()
    plain = extract(net, images, batch_size=4)  # a tensor is a dataset of tensors
    assert torch.equal(plain[3], net(images[3])) and torch.equal(plain[8], net(images[8]))

    class Pairs(Dataset[Any]):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, i: int) -> list[Any]:
            return [float(i), images[i]]

    listed = extract(net, Pairs(), input=1, batch_size=4)
    got = listed[2]
    assert isinstance(got, list) and got[0] == 2.0 and torch.equal(got[1], net(images[2]))


# -- keys ------------------------------------------------------------------------------
def test_a_second_call_reads_neither_backbone_nor_dataset(cache_root: Path) -> None:
    net, data = Net(), Images()
    first = extract(net, data)
    assert net.seen[0] == len(data) + PROBE_INPUTS  # and the check that rows do not depend on the batch
    reads = data.reads
    second = extract(net, data)
    assert net.seen[0] == len(data) + PROBE_INPUTS and data.reads == reads
    assert second.path == first.path
    assert all(torch.equal(second[i][0], first[i][0]) for i in range(len(data)))


class Tagged(Images):
    """Samples with a string beside the image: their features are kept whole, sample by sample."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:  # type: ignore[override]
        return self.images[i], "tag" * (i % 3)


@pytest.mark.parametrize("kind", [Images, Tagged])
def test_extraction_leaves_the_global_random_generator_as_it_was(cache_root: Path, kind: type[Images]) -> None:
    net, data = Net(), kind()  # built first: their own draws are the caller's
    torch.manual_seed(11)
    state = torch.random.get_rng_state()
    iter(DataLoader(data, batch_size=8))  # what extracting does, outside it: a draw from the global generator
    assert not torch.equal(torch.random.get_rng_state(), state)
    torch.random.set_rng_state(state)
    first = extract(net, data)  # computes
    computed = net.seen[0]
    assert computed in (len(data), len(data) + PROBE_INPUTS)  # samples kept whole are not probed
    assert torch.equal(torch.random.get_rng_state(), state)
    second = extract(net, data)  # reads the cache
    assert net.seen[0] == computed and second.path == first.path
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(11)))


def test_changed_weights_dataset_or_version_compute_afresh(cache_root: Path) -> None:
    net, data = Net(), Images()
    base = extract(net, data)
    with torch.no_grad():
        net.fc.bias.add_(1)
    changed_weights = extract(net, data)
    each = len(data) + PROBE_INPUTS
    assert net.seen[0] == 2 * each and changed_weights.path != base.path
    assert torch.allclose(changed_weights[0][0], base[0][0] + 1, atol=1e-5)

    other = Images(seed=2)
    changed_data = extract(net, other)
    assert net.seen[0] == 2 * each + len(data) and changed_data.path not in (base.path, changed_weights.path)

    versioned = extract(net, other, version="v2")  # a new cache, whose rows come from the one of the same inputs
    assert net.seen[0] == 2 * each + len(data) and versioned.path != changed_data.path
    assert all(torch.equal(versioned[i][0], changed_data[i][0]) for i in range(len(other)))
    assert extract(net, other, version="v2").path == versioned.path and net.seen[0] == 2 * each + len(data)
    assert len(feature_dirs(cache_root)) == 4


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_the_backbones_own_hooks_are_keyed_since_rows_hold_what_they_did(cache_root: Path, kind: str) -> None:
    net, data = Scale(), torch.utils.data.TensorDataset(torch.randn(10, 6))
    if kind == "forward":
        handle = net.register_forward_hook(lambda module, args, output: output * 100)
    else:
        handle = net.register_forward_pre_hook(lambda module, args: (args[0] * 100,))
    hooked = extract(net, data)
    assert torch.equal(hooked[3][0], net(data[3][0]))
    handle.remove()
    plain = extract(net, data)
    assert plain.path != hooked.path and torch.equal(plain[3][0], net(data[3][0]))


def test_train_mode_is_keyed_and_stochastic_layers_are_refused(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 6))
    net = Scale().eval()
    a = extract(net, data)
    b = extract(net.train(), data)
    assert a.path != b.path
    dropout = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout()).requires_grad_(False)
    with pytest.raises(ConfigError, match=r"eval\(\)"):
        extract(dropout, data)
    assert len(extract(dropout.eval(), data)) == 10


class _DropPath(torch.nn.Module):
    """Stochastic depth: a whole sample's branch dropped at random in training mode (no dropout module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(len(x), 1) > 0.5).float() if self.training else 1.0
        return x + self.fc(x) * keep


class _FunctionalDropout(_DropPath):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.fc(x), 0.5, self.training)


@pytest.mark.parametrize("random", ["stochastic depth", "rrelu", "functional dropout"])
def test_a_backbone_random_in_training_mode_without_a_dropout_layer_is_refused(cache_root: Path, random: str) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 6))
    if random == "stochastic depth":
        net: torch.nn.Module = _DropPath()
    elif random == "rrelu":
        net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.RReLU())
    else:
        net = _FunctionalDropout()
    net.requires_grad_(False).train()
    state = torch.random.get_rng_state()
    with pytest.raises(ConfigError, match=r"random.*eval\(\)"):
        extract(net, data)
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe too keeps the caller's random state
    assert len(extract(net.eval(), data)) == 10


class _RoundedByPlace(torch.nn.Module):
    """Deterministic in training mode, each row rounded by its place in the batch (as some CPU kernels do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 1e-7 * torch.arange(len(x), dtype=x.dtype)[:, None])


def test_a_deterministic_backbone_rounding_rows_by_their_place_is_not_taken_for_random(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 6) + 3)
    backbone = _RoundedByPlace().train()
    assert not torch.equal(*backbone(torch.stack([data[0][0]] * 2)))  # one input, two places: other bits
    features = extract(backbone, data)
    assert all(torch.allclose(features[i][0], data[i][0]) for i in range(10))


class _OneAtATime(torch.nn.Module):
    """Deterministic in training mode, made for batches of one, and with a NaN among its features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[0] == 1, f"a batch of {x.shape[0]}"
        return torch.cat([x * 2, torch.full((1, 1), float("nan"))], dim=1)


def test_a_deterministic_backbone_in_training_mode_is_probed_as_it_runs(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(6, 3))
    features = extract(_OneAtATime(), data, batch_size=1)
    assert torch.equal(features[2][0][:3], data[2][0] * 2) and features[2][0][3].isnan()


def test_cache_dir_and_torchcache_dir(cache_root: Path, tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 6))
    default = extract(Scale(), data)
    assert default.path is not None and default.path.parent.parent == cache_root
    assert json.loads((default.path.parent / "torchcache.json").read_text())["kind"] == "features"
    elsewhere = extract(Scale(), data, cache_dir=tmp_path / "root")
    assert elsewhere.path is not None and elsewhere.path.parent.parent == tmp_path / "root"


# -- portable --------------------------------------------------------------------------
def test_a_warm_cache_opens_without_backbone_anywhere(cache_root: Path, tmp_path: Path) -> None:
    net, data = Net(), Images()
    made = extract(net, data)
    assert made.path is not None
    moved = tmp_path / "moved"
    shutil.copytree(made.path.parent, moved / made.path.parent.name)
    for opened in (
        FeatureDataset.open(moved / made.path.parent.name),
        FeatureDataset.open(moved),  # a root that holds one features cache
        FeatureDataset.open(moved / made.path.parent.name / FEATURES_NAME),
        extract_features(None, None, cache_dir=moved),
    ):
        assert len(opened) == len(data) and opened.shape == (5,) and opened.dtype == torch.float32
        assert all(torch.equal(opened[i][0], made[i][0]) and opened[i][1] == made[i][1] for i in range(len(data)))
        assert opened.info["dataset"].endswith("Images")
        opened.close()
    with pytest.raises(ConfigError, match="no features cache"):
        FeatureDataset.open(tmp_path / "empty-root-does-not-exist")
    extract(Net(), Images(seed=5), cache_dir=moved)
    with pytest.raises(ConfigError, match="2 features caches"):
        FeatureDataset.open(moved)


@pytest.mark.slow
def test_it_pickles_as_its_path_into_dataloader_workers(cache_root: Path) -> None:
    net, data = Scale(), torch.utils.data.TensorDataset(torch.randn(40, 6))
    features = extract(net, data)
    clone = pickle.loads(pickle.dumps(FeatureDataset.open(features.path)))
    assert torch.equal(clone[7][0], features[7][0])
    loader = DataLoader(features, batch_size=8, num_workers=2, shuffle=False)
    assert torch.equal(torch.cat([x for (x,) in loader]), torch.stack([features[i][0] for i in range(40)]))


# -- refusals --------------------------------------------------------------------------
class Augmented(Images):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image, label = super().__getitem__(i)
        return image + torch.rand(1), label


def test_random_augmentation_is_refused(cache_root: Path) -> None:
    with pytest.raises(ConfigError, match="random augmentation"):
        extract(Net(), Augmented())
    assert feature_dirs(cache_root) == []


class Flipped(Images):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image, label = super().__getitem__(i)
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


def test_a_flip_with_probability_one_half_is_refused_whatever_the_seed(cache_root: Path) -> None:
    for seed in range(20):  # two reads of two samples passed in 2 of these 20
        torch.manual_seed(seed)
        with pytest.raises(ConfigError, match="random augmentation"):
            extract(Net(), Flipped())
    assert feature_dirs(cache_root) == []


def test_trainable_backbones_and_bad_arguments_are_refused(cache_root: Path) -> None:
    data = Images()
    with pytest.raises(ConfigError, match="require grad"):
        extract(torch.nn.Conv2d(3, 4, 3), data)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        extract(lambda x: x, data)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="batch_size"):
        extract(Net(), data, batch_size=0)
    with pytest.raises(ConfigError, match="num_workers"):
        extract(Net(), data, num_workers=-1)
    with pytest.raises(ConfigError, match="input=2"):
        extract(Net(), data, input=2)
    with pytest.raises(ConfigError, match="pass the backbone"):
        extract_features(None, data)


@pytest.mark.parametrize("later", ["tuple", "longer", "more keys"])
def test_samples_whose_structure_changes_are_kept_whole_not_cut_to_the_first(cache_root: Path, later: str) -> None:
    class Changing(Images):
        def __getitem__(self, i: int) -> Any:
            image = self.images[i]
            if later == "more keys":
                return {"x": image, "y": i} if i < 10 else {"x": image, "y": i, "z": -i}
            if later == "longer":
                return (image, i) if i < 10 else (image, i, 10 * i)
            return [image, i] if i == 0 else (image, i)  # the first a list, the others tuples

    data = Changing()
    features = extract(Net(), data, input="x" if later == "more keys" else 0)
    got, expected = features[15], data[15]
    assert type(got) is type(expected) and len(got) == len(expected)
    assert (list(got) == list(expected)) if isinstance(expected, dict) else got[1:] == expected[1:]


@pytest.mark.slow
def test_samples_that_vary_in_shape_or_hold_strings_are_kept_whole(cache_root: Path) -> None:
    class Named(Images):
        def __getitem__(self, i: int) -> Any:
            return self.images[i], ["cat", "dog", None][i % 3]

    net, named = Net(), Named()
    features = extract(net, named)
    assert features.info["layout"] == "variable" and len(features) == len(named)
    with torch.no_grad():
        for i in (0, 1, 2, 36):
            x, label = features[i]
            assert torch.allclose(x, net(named.images[i : i + 1])[0], atol=1e-6) and label == named[i][1]
    seen = net.seen[0]
    again = extract(net, named)
    x2, label2 = again[2]
    assert net.seen[0] == seen and label2 is None and torch.equal(x2, features[2][0])  # found, not computed
    opened = FeatureDataset.open(features.path)
    assert opened.info["layout"] == "variable" and opened[1][1] == "dog" and opened.shape == (5,)
    assert features.path is not None and FeatureDataset.open(features.path.parent)[1][1] == "dog"  # the root
    loader = DataLoader(opened, batch_size=8, num_workers=2, collate_fn=list)
    assert [label for batch in loader for _, label in batch] == [named[i][1] for i in range(len(named))]

    class Ragged(Dataset[Any]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((2 + (i > 1),), float(i))

    for batch_size in (2, 4):  # batches of one shape and outputs of two; inputs of two shapes in a batch
        ragged = extract(torch.nn.Identity(), Ragged(), batch_size=batch_size, version=batch_size)
        assert [tuple(ragged[i].shape) for i in range(6)] == [(2,), (2,), (3,), (3,), (3,), (3,)]
        assert all(torch.equal(ragged[i], Ragged()[i]) for i in range(6))
    assert feature_dirs(cache_root) and not any((d / FEATURES_NAME).exists() for d in feature_dirs(cache_root))


class _Conjugated(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x, -x).conj()  # a conjugate view, and its negative bit


def test_a_backbone_returning_a_conjugate_view_stores_its_values(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(9, 4))
    features = extract(_Conjugated(), data)
    assert all(torch.equal(features[i][0], torch.complex(data[i][0], data[i][0])) for i in range(9))


def test_a_backbone_that_does_not_return_one_tensor_is_refused(cache_root: Path) -> None:
    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(ConfigError, match="one tensor"):
        extract(Pair(), torch.randn(4, 2))


# -- interrupted and concurrent runs ---------------------------------------------------
KIT = """
import hashlib, json, os, signal, sys
import torch
from torch.utils.data import Dataset
from torchcache import extract_features

class Images(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1))
        self.y = [i % 3 for i in range(n)]
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        if sys.argv[4:] == [str(i)]:  # the index to be killed at (an argument: the environment is not keyed)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]

SEEN = [0]

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(2)), requires_grad=False)
    def forward(self, x):
        SEEN[0] += len(x)
        return x * self.w

root, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
net, data = Net().eval(), Images(n)
features = extract_features(net, data, batch_size=batch, cache_dir=root, progress=False)
digest = hashlib.sha256()
for i in range(n):
    x, y = features[i]
    assert torch.equal(x, data.x[i] * net.w) and y == data.y[i], i
    digest.update(x.numpy().tobytes() + bytes([y]))
print(json.dumps({"computed": SEEN[0], "digest": digest.hexdigest(), "path": str(features.path)}))
"""


def run_kit(script: Path, root: Path, n: int, batch: int, kill_at: int | None = None) -> zygote.Process:
    return zygote.start(
        [str(script), str(root), str(n), str(batch), *([] if kill_at is None else [str(kill_at)])],
        env=python_env(),
        cwd=os.getcwd(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(process: zygote.Process) -> dict[str, Any]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_run_killed_mid_extraction_resumes_with_what_was_missing(tmp_path: Path) -> None:
    script = tmp_path / "kit.py"
    script.write_text(KIT)
    root, n, batch, kill_at = tmp_path / "root", 40, 8, 27
    killed = run_kit(script, root, n, batch, kill_at=kill_at)
    killed.communicate(timeout=300)
    assert killed.returncode == -9
    (directory,) = feature_dirs(root)
    file = open_features(directory / FEATURES_NAME)
    written = file.count()
    # The batches before the kill, but the one it hit and perhaps the one being written as it was read
    assert (kill_at // batch - 1) * batch <= written <= kill_at // batch * batch
    assert file.missing().tolist() == list(range(written, n))
    file.close()
    resumed = finish(run_kit(script, root, n, batch))
    assert resumed["computed"] == n - written
    again = finish(run_kit(script, root, n, batch))
    assert again["computed"] == 0 and again["digest"] == resumed["digest"]


FAIL_ON = Tally()


class FailsOnCall(Net):
    """A Net whose call after ``FAIL_ON[id]`` samples raises, as a backbone running out of memory would.

    The setting lives outside the module: an attribute that changes would change its key.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seen[0] + len(x) > FAIL_ON.get(id(self), 1 << 62):
            raise RuntimeError("CUDA out of memory (a test's)")
        return super().forward(x)


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchcache-features")]


@pytest.fixture(params=["background", "in line"])
def writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Rows written by the writer's thread, or in line (as on a CPU whose every core runs torch's threads)."""
    from torchcache.features import writer

    monkeypatch.setattr(writer, "background_pays", lambda features: request.param == "background")
    return str(request.param)


def test_rows_are_written_in_line_when_the_backbone_takes_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchcache.features.writer import background_pays

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    cpu = torch.zeros(2, 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not background_pays(cpu)  # torch's threads on every core: a writer thread would preempt one
    assert background_pays(torch.zeros(2, 3, device="meta"))  # the backbone ran elsewhere: the CPU waits on it
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert background_pays(cpu)  # a core torch leaves free


def test_rows_written_in_line_or_in_the_background_are_the_backbones(cache_root: Path, writes: str) -> None:
    data, net = Images(n=40), Net()
    features = extract(net, data, batch_size=8)
    assert not _writer_threads()
    reopened = extract(net, data, batch_size=8)
    assert net.seen[0] == 40 + PROBE_INPUTS  # found: not computed again
    with torch.no_grad():
        expected = net(data.images)
    for i in range(40):
        x, y = reopened[i]
        assert torch.equal(x, features[i][0]) and torch.allclose(x, expected[i], atol=1e-6) and y == data.labels[i]


def test_a_ctrl_c_inside_a_write_between_batches_leaves_those_rows_to_the_next_call(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.features import writer

    monkeypatch.setattr(writer, "background_pays", lambda features: False)
    real, marks = RowsFile._write_column, [0]

    def interrupted_marking(self: RowsFile, at: int, width: int, indices: Any, values: Any) -> None:
        if width == 8 and self.path is not None:  # the checks: the rows are written, none marked yet
            marks[0] += 1
            if marks[0] == 3:
                raise KeyboardInterrupt
        real(self, at, width, indices, values)

    monkeypatch.setattr(RowsFile, "_write_column", interrupted_marking)
    data, net = Images(n=40), Net()
    with pytest.raises(KeyboardInterrupt):
        extract(net, data, batch_size=8)
    monkeypatch.undo()
    (directory,) = feature_dirs(cache_root)
    file = open_features(directory / FEATURES_NAME)
    assert file.missing().tolist() == list(range(16, 40))  # the third batch's rows unmarked, the rest not run
    file.close()
    features = extract(net, data, batch_size=8)
    with torch.no_grad():
        assert all(torch.allclose(features[i][0], net(data.images[i : i + 1])[0], atol=1e-6) for i in range(40))


def test_a_backbone_error_mid_extraction_is_raised_with_the_batches_before_it_kept(
    cache_root: Path, writes: str
) -> None:
    data, net = Images(n=40), FailsOnCall()
    FAIL_ON[id(net)] = 24 + PROBE_INPUTS  # the fourth batch of 8, after the check of a first extraction
    with pytest.raises(RuntimeError, match="out of memory"):
        extract(net, data, batch_size=8)
    assert not _writer_threads()
    (directory,) = feature_dirs(cache_root)
    file = open_features(directory / FEATURES_NAME)
    assert file.missing().tolist() == list(range(24, 40))  # the three batches before the error, written
    file.close()
    del FAIL_ON[id(net)]
    features = extract(net, data, batch_size=8)
    assert net.seen[0] == PROBE_INPUTS + 24 + 16  # the rest only (a resumed run is not checked again)
    with torch.no_grad():
        assert all(torch.allclose(features[i][0], net(data.images[i : i + 1])[0], atol=1e-6) for i in range(40))


def test_a_disk_that_fails_mid_extraction_keeps_every_row_in_memory(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, writes: str
) -> None:
    real_write, calls = RowsFile.write, [0]

    def fails_from_the_third(self: RowsFile, indices: Any, rows: Any, max_bytes: int | None = None) -> int:
        calls[0] += 1
        if self.path is not None and calls[0] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, indices, rows)

    monkeypatch.setattr(RowsFile, "write", fails_from_the_third)
    data, net = Images(n=40), Net()
    with pytest.warns(CacheWarning, match="kept in memory"):
        features = extract(net, data, batch_size=8)
    assert features.path is None and net.seen[0] == 40 + PROBE_INPUTS and not _writer_threads()
    with torch.no_grad():
        for i in range(40):  # the rows written to disk before the fault came along
            x, y = features[i]
            assert torch.allclose(x, net(data.images[i : i + 1])[0], atol=1e-6) and y == data.labels[i]


def test_features_of_varying_shape_that_cannot_be_stored_are_kept_in_memory(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchcache.stores.packed.store import PackedStore

    class Named(Images):
        def __getitem__(self, i: int) -> Any:
            return self.images[i], ["cat", None][i % 2]  # a None field: kept whole

    def full(self: PackedStore, items: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PackedStore, "put_many", full)
    net, named = Net(), Named(n=16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        features = extract(net, named, batch_size=4)
    assert any("kept in memory" in str(w.message) for w in seen)
    computed = net.seen[0]
    with torch.no_grad():
        for _ in range(2):  # read from memory: the backbone does not run again
            for i in range(16):
                x, label = features[i]
                assert torch.allclose(x, net(named.images[i : i + 1])[0], atol=1e-6) and label == named[i][1]
                net.seen[0] -= 1  # the check's own call
    assert net.seen[0] == computed
    assert pickle.loads(pickle.dumps(features.file)).kept is None  # a spawned worker computes what it reads
    with pytest.warns(CacheWarning, match="loading them in this process"):
        loader = features.loader(8, num_workers=2, multiprocessing_context="spawn", collate_fn=list)
    assert [label for batch in loader for _, label in batch] == [named[i][1] for i in range(16)]


@pytest.mark.slow
def test_two_processes_extracting_at_once_agree(tmp_path: Path) -> None:
    script = tmp_path / "kit.py"
    script.write_text(KIT)
    root, n, batch = tmp_path / "root", 3000, 16
    first, second = run_kit(script, root, n, batch), run_kit(script, root, n, batch)
    a, b = finish(first), finish(second)
    assert a["digest"] == b["digest"] and a["path"] == b["path"]
    assert n <= a["computed"] + b["computed"] <= 2 * (n + PROBE_INPUTS)
    third = finish(run_kit(script, root, n, batch))
    assert third["computed"] == 0 and third["digest"] == a["digest"]
    file = open_features(Path(a["path"]))
    assert file.count() == n
    file.close()


# -- damage and hostile files ----------------------------------------------------------
def test_a_damaged_row_is_a_warning_and_computed_again(cache_root: Path) -> None:
    net, data = Net(), Images()
    features = extract(net, data)
    expected = features[4][0]
    file = features.file
    assert features.path is not None
    with open(features.path, "r+b") as raw:
        raw.seek(file.row_offset(4) + 3)
        byte = raw.read(1)
        raw.seek(-1, os.SEEK_CUR)
        raw.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(CacheWarning, match="damaged rows"):
        x, _ = features[4]
    # Computed alone, not in its batch of 8: equal up to rounding (a conv net's kernels may
    # differ with the batch size).
    assert torch.allclose(x, expected, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(features[4][0], x)  # written again: no second warning
    assert open_features(features.path).count() == len(data)


def test_a_damaged_row_without_backbone_is_an_error(cache_root: Path) -> None:
    features = extract(Net(), Images())
    assert features.path is not None
    with open(features.path, "r+b") as raw:
        raw.seek(features.file.row_offset(2))
        raw.write(b"\xff" * 8)
    opened = FeatureDataset.open(features.path)
    assert opened[1][1] == features[1][1]
    with pytest.warns(CacheWarning), pytest.raises(MissingFeatureError, match="extract_features"):
        opened[2]


@pytest.mark.parametrize("change", ["weights", "data"])
def test_a_row_damaged_after_the_backbone_or_dataset_changed_is_an_error_not_a_row_of_theirs(
    cache_root: Path, change: str
) -> None:
    net, data = Net(), Images()
    features, original = extract(net, data), Net()
    original.load_state_dict(net.state_dict())
    expected, other = features[3][0], features[4][0]
    if change == "weights":
        with torch.no_grad():
            next(net.parameters()).add_(1.0)  # fine-tuning starts, with the extracted features in hand
    else:
        data.images[3] += 1.0
    _flip_row(features, 3)
    with pytest.warns(CacheWarning, match="damaged"), pytest.raises(MissingFeatureError, match="changed"):
        features[3]
    assert torch.equal(features[4][0], other)  # the others are still served
    again = extract(original, Images())  # the backbone and data it was made from: the row computed again
    assert torch.allclose(again[3][0], expected, atol=1e-6)


class _Memoized(Images):
    """Keeps each sample it decoded (a memo among its attributes, which its key covers)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded: dict[int, Any] = {}

    def __getitem__(self, i: int) -> Any:
        if i not in self.decoded:
            self.decoded[i] = super().__getitem__(i)
        return self.decoded[i]


def test_a_damaged_row_of_a_dataset_that_keeps_a_memo_is_computed_again(cache_root: Path) -> None:
    net, data = Net(), _Memoized()
    features = extract(net, data)
    expected, expected_7 = features[3][0], features[7][0]
    _flip_row(features, 3)
    with pytest.warns(CacheWarning, match="damaged"):
        assert torch.allclose(features[3][0], expected, atol=1e-6)  # its inputs are those it was written with
    data.images[5] += 1.0
    data.decoded.clear()
    _flip_row(features, 5)
    with pytest.raises(MissingFeatureError, match="changed"):  # its input is not the one it was written with
        features[5]
    data.labels[7], label = 99, data.labels[7]  # the input alike, another label: served, never written
    data.decoded.clear()
    _flip_row(features, 7)
    assert features[7][1] == 99
    again = extract(net, _Memoized())  # the dataset the cache was made from, in a later run
    assert again[7][1] == label and torch.allclose(again[7][0], expected_7, atol=1e-6)


@pytest.mark.parametrize("layout", ["rows", "variable"])
def test_a_cache_folder_holding_another_caches_files_is_not_served(cache_root: Path, layout: str) -> None:
    class Named(Images):
        def __getitem__(self, i: int) -> Any:
            return self.images[i], ["cat", "dog", None][i % 3]

    data = Named() if layout == "variable" else Images()
    a, b = Net(), Net()
    ours, theirs = extract(a, data), extract(b, data)
    assert ours.path is not None and theirs.path is not None
    folder, planted = (ours.path, theirs.path) if layout == "variable" else (ours.path.parent, theirs.path.parent)
    expected, other = ours[0][0], theirs[0][0]
    ours.close(), theirs.close()
    shutil.rmtree(folder)
    shutil.copytree(planted, folder)  # b's cache under a's key
    with pytest.raises(ConfigError, match="made for other keys"):
        FeatureDataset.open(folder)
    with pytest.warns(CacheWarning, match="made for other keys"):
        again = extract(a, data)
    assert torch.allclose(again[0][0], expected, atol=1e-6) and not torch.allclose(again[0][0], other)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_features_cache_of_another_user_is_read_and_never_taken_for_damage(cache_root: Path) -> None:
    net, data = Net(), Images()
    features = extract(net, data)
    assert features.path is not None
    expected, path = features[5][0], features.path
    features.close()
    for file in path.parent.iterdir():
        os.chown(file, 12345, -1)
    opened = FeatureDataset.open(path.parent)
    assert torch.equal(opened[5][0], expected)
    opened.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        again = extract(net, data)
    assert torch.equal(again[5][0], expected) and path.stat().st_uid == 12345  # found, not replaced


def _flip_row(features: FeatureDataset, index: int) -> None:
    assert features.path is not None
    file = open_features(features.path)
    at = file.row_offset(index)
    file.close()
    assert at is not None
    with open(features.path, "r+b") as raw:
        raw.seek(at + 3)
        byte = raw.read(1)
        raw.seek(-1, os.SEEK_CUR)
        raw.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
def test_rows_damaged_at_rest_are_computed_when_the_cache_opens(cache_root: Path) -> None:
    net, data = Net(), Images()
    features = extract(net, data)
    expected = [features[i][0] for i in range(len(data))]
    features.close()
    _flip_row(features, 4)
    _flip_row(features, 30)
    seen = net.seen[0]
    with pytest.warns(CacheWarning, match="2 damaged rows"):
        again = extract(net, data)
    assert net.seen[0] == seen + 2  # only those, in the main process
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left for a DataLoader worker to find
        got = [x for batch, _ in DataLoader(again, batch_size=8, num_workers=2) for x in batch]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True))


def test_a_row_damaged_later_in_a_forked_worker_of_a_cuda_process_is_a_clear_error(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchcache.features.dataset as feature_dataset

    features = extract(Net(), Images())
    _flip_row(features, 3)
    monkeypatch.setattr(feature_dataset, "device_of", lambda module: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with pytest.warns(CacheWarning), pytest.raises(MissingFeatureError, match="multiprocessing_context='spawn'"):
        features[3]


@pytest.mark.parametrize("damage", ["magic", "json", "truncate", "empty", "table"])
def test_a_damaged_file_is_a_warning_and_computed_again(cache_root: Path, damage: str) -> None:
    net, data = Net(), Images()
    with torch.no_grad():
        expected = torch.cat([net(data.images[i : i + 8]) for i in range(0, len(data), 8)])
    features = extract(net, data)
    path, checks_at = features.path, features.file.geometry.checks_at
    assert path is not None
    features.close()
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[:8] = b"XXXXXXXX"
    elif damage == "json":
        raw[60] ^= 0x20
    elif damage == "truncate":
        raw = raw[: len(raw) - 100]
    elif damage == "empty":
        raw = bytearray()
    else:  # every row marked written, with a wrong check
        raw[checks_at : checks_at + 8 * len(data)] = b"\x01" * 8 * len(data)
    path.write_bytes(bytes(raw))
    seen = net.seen[0]
    with pytest.warns(CacheWarning, match="damaged"):
        again = extract(net, data)
        got = [again[i][0] for i in range(len(data))]  # a damaged table: found as rows are read
    # Rows found damaged as they are read are computed one read at a time: equal up to rounding.
    assert all(torch.allclose(got[i], expected[i], atol=1e-6) for i in range(len(data)))
    assert net.seen[0] == seen + len(data) + (0 if damage == "table" else PROBE_INPUTS)  # unreadable: a new file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(torch.equal(again[i][0], got[i]) for i in range(len(data)))


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {os.environ['TORCHCACHE_DIR']}/ran",))


def test_no_file_in_the_cache_makes_torchcache_run_code(cache_root: Path) -> None:
    net, data = Net(), Images()
    features = extract(net, data)
    path = features.path
    assert path is not None
    features.close()
    payload = pickle.dumps(Payload())
    raw = bytearray(path.read_bytes())
    file = open_features(path)
    at = file.row_offset(0)
    assert at is not None
    raw[at : at + len(payload)] = payload
    file.close()
    path.write_bytes(bytes(raw))
    with pytest.warns(CacheWarning, match="damaged rows"):
        again = extract(net, data)
        assert again[0][1] == data.labels[0]  # row 0 fails its check: computed again
    again.close()
    path.write_bytes(payload)  # a pickle in place of the whole file
    with pytest.raises(ConfigError, match="not a usable features cache"):
        FeatureDataset.open(path)
    with pytest.warns(CacheWarning, match="damaged"):
        assert len(extract(net, data)) == len(data)
    (path.parent / "torchcache.json").write_bytes(payload)
    assert len(extract(net, data)) == len(data)
    assert not (cache_root / "ran").exists()


def test_hostile_headers_are_refused(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(4, 6))
    features = extract(Scale(), data, cache_dir=tmp_path)
    path = features.path
    assert path is not None
    header = dict(features.file.header)
    features.close()
    import struct

    import xxhash

    for layout in (
        {**header["layout"], "stride": 1 << 40},
        {**header["layout"], "stride": 8},  # shorter than the row
        {**header["layout"], "l": [["object", header["layout"]["l"][0][1]]]},
        {**header["layout"], "l": [["f4", [1 << 40]]]},
        {**header["layout"], "t": "os.system"},
        {**header["layout"], "t": ["namedtuple", "os:system", [["x", "T"]]]},
        {**header["layout"], "t": ["tuple", ["T", ["list", ["i"]]]], "l": [["f4", [8]], ["i8", []]]},
        {**header["layout"], "input": 1},
        {**header["layout"], "offset": 1 << 20},
    ):
        text = json.dumps({**header, "layout": layout}, sort_keys=True, separators=(",", ":")).encode()
        head = struct.pack("<8sIIQQQQ", b"TCROWS01", 1, len(text), 4, 32, 0, 4) + text
        path.write_bytes(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + bytes(13000))
        with pytest.raises(CorruptEntryError):
            open_features(path)


def _in_memory(tmp_path: Path) -> tuple[FeatureDataset, torch.utils.data.TensorDataset, Scale]:
    """Features extracted where no cache can be made (its directory is a file): kept in memory, with a warning."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    data = torch.utils.data.TensorDataset(torch.randn(10, 6))
    net = Scale()
    with pytest.warns(CacheWarning, match="kept in memory"):
        features = extract(net, data, cache_dir=blocker)
    return features, data, net


def test_an_unusable_cache_dir_keeps_features_in_memory(tmp_path: Path) -> None:
    features, data, net = _in_memory(tmp_path)
    assert features.path is None
    assert all(torch.equal(features[i][0], net(data[i][0])) for i in range(10))


def test_a_link_planted_at_the_features_file_is_removed_and_the_file_made_again(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 6))
    net = Scale()
    made = extract(net, data)
    assert made.path is not None
    path, outside = made.path, cache_root.parent / "elsewhere"
    outside.write_bytes(b"the user's")
    made.close()
    path.unlink()
    path.symlink_to(outside)
    with pytest.warns(CacheWarning, match="is a link"):
        again = extract(net, data)
    assert again.path == path and path.is_file() and not path.is_symlink()
    assert outside.read_bytes() == b"the user's"  # never followed
    assert all(torch.equal(again[i][0], net(data[i][0])) for i in range(10))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_features_kept_in_memory_load_in_this_process_where_workers_would_be_spawned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing.context

    features, data, net = _in_memory(tmp_path)
    with pytest.warns(CacheWarning, match="loading them in this process"):
        loader = features.loader(4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True, timeout=5)
    assert loader.num_workers == 0
    (got,) = zip(*loader)
    assert torch.equal(torch.cat(got), net(data.tensors[0]))
    with pytest.raises(ValueError):  # what a DataLoader refuses is still refused
        features.loader(4, num_workers=2, multiprocessing_context="no such method")
    with monkeypatch.context() as unset:  # a process that chose no start method yet keeps its choice open
        unset.setattr(multiprocessing.context._default_context, "_actual_context", None)
        with pytest.warns(CacheWarning, match="loading them in this process"):
            features.loader(4, num_workers=1, multiprocessing_context="spawn")
        features.loader(4, num_workers=1)  # forked, where fork is the default: the workers share the rows
        assert torch.multiprocessing.get_start_method(allow_none=True) is None
    ordered = features.loader(4, shuffle=True, generator=_seeded(3))
    with pytest.warns(CacheWarning, match="loading them in this process"):
        again = features.loader(4, shuffle=True, num_workers=1, multiprocessing_context="spawn", generator=_seeded(3))
    assert [b[0].tolist() for b in ordered] == [b[0].tolist() for b in again]  # the generator is kept


def test_exports() -> None:
    for name in ("extract_features", "FeatureDataset", "MissingFeatureError"):
        assert name in torchcache.__all__ and getattr(torchcache, name) is not None
    assert textwrap.dedent(extract_features.__doc__ or "").strip()


# -- the root's budget -----------------------------------------------------------------
def _bytes_under(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_the_root_budget_removes_unused_features_caches_and_keeps_those_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    in_use = extract(Net(), Images(n=64, seed=1), cache_dir=root)
    closed = extract(Net(), Images(n=64, seed=2), cache_dir=root)
    closed.close()
    assert len(feature_dirs(root)) == 2
    one = max(_bytes_under(d) for d in feature_dirs(root))
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", str(int(one * 2.5)))  # room for two caches, not three
    newest = extract(Net(), Images(n=64, seed=3), cache_dir=root)
    left = feature_dirs(root)
    assert in_use.path is not None and newest.path is not None and closed.path is not None
    assert left == sorted([in_use.path.parent, newest.path.parent]) and not closed.path.parent.exists()
    assert sum(_bytes_under(d) for d in left) <= int(one * 2.5)
    x, label = in_use[5]  # the cache in use still reads
    assert label == Images(n=64, seed=1)[5][1] and x.shape == (5,)
    in_use.close()
    reopened = FeatureDataset.open(newest.path.parent)
    monkeypatch.setenv("TORCHCACHE_MAX_SIZE", "1")  # the next cache to open finds the root over budget
    extract(Net(), Images(n=8, seed=4), cache_dir=root).close()
    assert newest.path.parent.exists() and not in_use.path.parent.exists()  # held open by two objects
    reopened.close()
    newest.close()


# -- the command line ------------------------------------------------------------------
def test_the_command_line_lists_checks_and_clears_a_features_cache(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchcache.cli.main import main

    extract(Net(), Images(37))
    (directory,) = feature_dirs(cache_root)
    capsys.readouterr()
    assert main(["ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    row = next(c for c in (listed if isinstance(listed, list) else listed["caches"]) if directory.name in json.dumps(c))
    assert row["entries"] == 37 and row["bytes"] > (directory / FEATURES_NAME).stat().st_size - 1
    assert main(["verify"]) == 0
    file = open_features(directory / FEATURES_NAME)
    with open(directory / FEATURES_NAME, "r+b") as raw:  # damage one written row
        raw.seek(file.row_offset(5))
        raw.write(bytes(4))
    file.close()
    capsys.readouterr()
    assert main(["verify"]) == 1
    assert "row 5" in capsys.readouterr().out
    assert main(["verify", "--fix"]) == 0  # found and fixed
    assert main(["verify"]) == 0  # the row is marked as not written: computed again at the next extraction
    capsys.readouterr()
    assert main(["clear", "--all", "--yes"]) == 0
    assert not directory.exists()


def test_a_features_layout_is_written_in_the_language_of_every_cached_value() -> None:
    from torchcache.stores.features.layout import SampleLayout

    sample = (3, torch.zeros(6), np.float32(1), True)
    layout = SampleLayout.of_sample(sample, 1).with_features(torch.zeros(5, dtype=torch.float16))
    assert layout.to_json() == {
        "l": [["i8", []], ["f2", [5]], ["<f4", []], ["b1", []]],
        "t": ["tuple", ["i", "T", "S", "b"]],
        "input": 1,
        "stride": 48,  # a packed row: 8 + 16 + 8 + 8 = 40 bytes, rows 16-byte aligned
    }
    assert [(f.name, f.offset) for f in layout.fields] == [("1", 8), ("0", 0), ("2", 24), ("3", 32)]
    assert SampleLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    rows = np.zeros((2, layout.stride), np.uint8)
    layout.fill(rows, torch.ones(2, 5, dtype=torch.float16), [[3, 4], [np.float32(1), np.float32(2)], [True, False]])
    got = layout.decode(rows)
    assert [(s[0], s[2], s[3]) for s in got] == [(3, np.float32(1), True), (4, np.float32(2), False)]
    assert type(got[0][3]) is bool and torch.equal(got[1][1], torch.ones(5, dtype=torch.float16))
    for bad in (
        {"l": [["f4", [5]], ["i8", []]], "t": ["tuple", ["T", ["list", ["i"]]]], "input": 0, "stride": 32},  # nested
        {"l": [["f4", [5]]], "t": ["tuple", ["T", "N"]], "input": 0, "stride": 32},  # None: not in the row
        {"l": [["f4", [5]], ["i8", []]], "t": ["dict", [[1, "T"], [2, "i"]]], "input": 0, "stride": 32},  # int keys
        {"l": [["f4", [5]], ["i8", []]], "t": ["mapping", "a:B", [["x", "T"], ["y", "i"]]], "input": 0, "stride": 32},
    ):
        with pytest.raises(CorruptEntryError):
            SampleLayout.from_json(bad)
    named = SampleLayout.of_sample({"x": torch.zeros(2), "y": 1}, "x").with_features(torch.zeros(3))
    assert named.to_json() == {
        "l": [["f4", [3]], ["i8", []]],
        "t": ["dict", [["x", "T"], ["y", "i"]]],
        "input": 0,
        "stride": 32,
    }


class Targets(Dataset[Any]):
    """Samples whose target is NaN (a missing regression target) or a one-element view with any stride."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.images = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        if self.kind == "nan":
            return self.images[i], float("nan") if i % 2 else float(i)
        return self.images[i], torch.arange(24.0).view(12, 2)[i : i + 1, 0]  # stride 2, one element


@pytest.mark.parametrize("kind", ["nan", "strided"])
def test_nan_targets_and_strided_one_element_targets_are_kept(cache_root: Path, kind: str) -> None:
    dataset = Targets(kind)
    features = extract(torch.nn.Identity(), dataset)
    for i in (0, 1, 5):
        _, target = features[i]
        want = dataset[i][1]
        if kind == "nan":
            assert (target != target and want != want) or target == want
        else:
            assert torch.equal(target, want)


class _Centred(torch.nn.Module):
    """Each input minus the mean of its batch: eval mode, yet its rows depend on the other inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: torch.nn.BatchNorm1d(6, affine=False, track_running_stats=False), "an input alone raised"),
        (_Centred, "an input alone gave other features"),
    ],
    ids=["batch-norm-batch-statistics", "centred-in-its-batch"],
)
def test_a_backbone_whose_rows_depend_on_the_batch_is_refused_before_anything_is_stored(
    cache_root: Path, make: Any, said: str
) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(12, 6), torch.arange(12))
    with pytest.raises(ConfigError, match=f"rows depend on the other inputs of the batch \\({said}"):
        extract(make().eval(), data, batch_size=4)
    assert feature_dirs(cache_root) == []  # nothing a later run would mix with rows of other batches


class _Squeezed(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1, keepdim=True).squeeze()  # (n,) for n > 1, () for one input


def test_a_backbone_that_cannot_take_one_input_is_refused_saying_why(cache_root: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 6), torch.arange(8))
    with pytest.raises(ConfigError, match=r"for a batch of 1 inputs.*a batch of one, as resuming or repairing runs"):
        extract(_Squeezed().eval(), data, batch_size=4)
