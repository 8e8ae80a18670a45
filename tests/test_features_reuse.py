"""extract_features over a changed dataset: rows of inputs seen before are taken from the older cache."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import Tally
from tests.test_features import Images, Net, Scale, extract, feature_dirs
from torchcache.features.probe import PROBE_INPUTS
from torchcache.stores.features.digests import DIGESTS_NAME, DigestFile, bindings, input_digest


def edited(base: Images, changed: list[int], added: int) -> Images:
    """``base`` with the images at ``changed`` altered and ``added`` new samples at the end."""
    data = Images(len(base))
    data.images = base.images.clone()
    data.images[changed] += 1
    extra = torch.randn(added, *base.images.shape[1:], generator=torch.Generator().manual_seed(9))
    data.images = torch.cat([data.images, extra])
    data.labels = base.labels + [i % 5 for i in range(added)]
    return data


def test_a_changed_dataset_runs_the_backbone_only_on_the_inputs_it_has_not_seen(cache_root: Path) -> None:
    net, base = Net(), Images(40)
    before = extract(net, base)
    assert net.seen[0] == 40 + PROBE_INPUTS  # and the check that rows do not depend on the batch
    data = edited(base, changed=[3, 17, 30], added=5)
    after = extract(net, data)
    assert after.path != before.path and len(feature_dirs(cache_root)) == 2
    assert net.seen[0] == 40 + PROBE_INPUTS + 3 + 5  # the changed and the new samples, nothing else
    with torch.no_grad():
        direct = net(data.images)
    for i in range(len(data)):
        x, y = after[i]
        assert y == data.labels[i]  # the other fields always come from the new samples
        assert torch.allclose(x, direct[i], atol=1e-6)  # rounding may differ with the batch's size
    unchanged = [i for i in range(40) if i not in (3, 17, 30)]
    assert all(torch.equal(after[i][0], before[i][0]) for i in unchanged)  # the very rows taken


def _counted(net: torch.nn.Module) -> tuple[torch.nn.Module, Tally]:
    """``net`` with a forward hook that counts the samples it computes (a hook is part of the key)."""
    calls = Tally(samples=0)
    net.register_forward_hook(lambda module, args, out: calls.__setitem__("samples", calls["samples"] + len(args[0])))
    return net, calls


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])  # the first cache's digests hashed in the writer's thread, in workers
def test_reordered_samples_are_found_by_their_input_and_match_bit_for_bit(cache_root: Path, workers: int) -> None:
    net, calls = _counted(Scale(width=6).eval())
    base = torch.utils.data.TensorDataset(torch.randn(30, 6), torch.arange(30))
    before = extract(net, base, num_workers=workers)
    order = torch.randperm(30)
    shuffled = torch.utils.data.TensorDataset(base.tensors[0][order], base.tensors[1][order])
    calls["samples"] = 0
    after = extract(net, shuffled)
    assert calls["samples"] == 0
    for i in range(30):
        x, y = after[i]
        assert int(y) == int(order[i]) and torch.equal(x, before[int(order[i])][0])


class DoublesItsInput(torch.nn.Module):
    """Changes its input in place, as a first ``ReLU(inplace=True)`` or ``x.div_(255)`` would.

    ``how``: ``"op"`` (an in-place op, which torch counts), ``"data"`` (through ``x.data``)
    or ``"numpy"`` (through a numpy view): these two torch does not count.
    """

    def __init__(self, how: str = "op") -> None:
        super().__init__()
        self.how = how
        self.w = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(3)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "data":
            x.data.mul_(2)
        elif self.how == "numpy":
            x.numpy()[...] *= 2
        else:
            x.mul_(2)
        return x * self.w


@pytest.mark.parametrize("how", ["op", "data", "numpy"])
def test_a_backbone_that_changes_its_inputs_in_place_gives_no_rows_to_other_inputs(cache_root: Path, how: str) -> None:
    net, x = DoublesItsInput(how), torch.randn(20, 6)
    extract(net, torch.utils.data.TensorDataset(x.clone(), torch.arange(20)))
    doubled = torch.utils.data.TensorDataset(x * 2, torch.arange(20))  # what the backbone turned the inputs into
    after = extract(net, doubled)
    with torch.no_grad():
        expected = net(x * 2)  # 4x times w, not the 2x times w that the first inputs gave
    assert all(torch.equal(after[i][0], expected[i]) for i in range(20))


def test_a_changed_transform_or_backbone_takes_nothing(cache_root: Path) -> None:
    net, base = Net(), Images(24)
    extract(net, base)
    scaled = Images(24)
    scaled.images = base.images * 2  # what a changed normalisation does to every input
    extract(net, scaled)
    assert net.seen[0] == 48 + PROBE_INPUTS  # one first extraction of this backbone
    other = Net()  # other weights: another module key, no older cache of its own
    with torch.no_grad():
        other.fc.bias.add_(1)
    extract(other, base)
    assert other.seen[0] == 24 + PROBE_INPUTS


def test_rows_of_an_older_cache_that_fail_their_check_are_computed(cache_root: Path) -> None:
    net, base = Net(), Images(20)
    before = extract(net, base)
    file = before.file
    assert before.path is not None
    with open(before.path, "r+b") as raw:  # damage rows 2 and 9 of the older cache
        for row in (2, 9):
            raw.seek(file.row_offset(row) + 5)
            byte = raw.read(1)
            raw.seek(-1, os.SEEK_CUR)
            raw.write(bytes([byte[0] ^ 0x10]))
    data = edited(base, changed=[], added=1)
    after = extract(net, data)
    assert net.seen[0] == PROBE_INPUTS + 20 + 2 + 1
    with torch.no_grad():
        direct = net(data.images)
    assert all(torch.allclose(after[i][0], direct[i], atol=1e-6) for i in range(len(data)))


@pytest.mark.parametrize("damage", ["garbage", "cut short", "swapped", "digests swapped", "missing"])
def test_a_damaged_digest_file_never_gives_a_wrong_row(cache_root: Path, damage: str) -> None:
    net, base = Net(), Images(16)
    before = extract(net, base)
    assert before.path is not None
    digests = before.path.with_name(DIGESTS_NAME)
    raw = bytearray(digests.read_bytes())
    if damage == "garbage":
        raw[4096:] = np.random.default_rng(0).integers(0, 256, len(raw) - 4096, np.uint8).tobytes()
        digests.write_bytes(bytes(raw))
    elif damage == "cut short":
        digests.write_bytes(bytes(raw[:100]))
    elif damage == "swapped":  # two entries exchanged: each names the other row's check, so neither is taken
        a, b = 4096 + 24 * 1, 4096 + 24 * 6
        raw[a : a + 24], raw[b : b + 24] = raw[b : b + 24], raw[a : a + 24]
        digests.write_bytes(bytes(raw))
    elif damage == "digests swapped":  # only the digests: each binding stays with its row, and names its digest
        a, b = 4096 + 24 * 1, 4096 + 24 * 6
        raw[a : a + 16], raw[b : b + 16] = raw[b : b + 16], raw[a : a + 16]
        digests.write_bytes(bytes(raw))
    else:
        digests.unlink()
    data = edited(base, changed=[], added=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged digest file only means less is taken
        after = extract(net, data)
    with torch.no_grad():
        direct = net(data.images)
    assert all(torch.allclose(after[i][0], direct[i], atol=1e-6) for i in range(len(data)))
    assert all(not torch.equal(direct[1], direct[6]) for _ in [0])  # a row taken for the other would show


def test_a_digest_file_that_cannot_be_made_is_a_warning(cache_root: Path) -> None:
    from torchcache import CacheWarning
    from torchcache.stores.features.file import FEATURES_NAME

    net, data = Net(), Images(16)
    made = extract(net, data)
    assert made.path is not None
    made.close()
    folder = made.path.parent
    (folder / FEATURES_NAME).unlink()
    (folder / DIGESTS_NAME).unlink()
    (folder / DIGESTS_NAME).mkdir()  # where the file would go: as a full disk, nothing can be made there
    with pytest.warns(CacheWarning, match="rows are kept without their input digests"):
        again = extract(net, data)
    with torch.no_grad():
        assert all(torch.allclose(again[i][0], net(data.images[i : i + 1])[0], atol=1e-6) for i in range(16))


@pytest.mark.parametrize("planted", ["link", "cut short"])
def test_a_digest_file_planted_or_damaged_before_a_resumed_extraction_is_made_again(
    cache_root: Path, planted: str
) -> None:
    from torchcache.stores.features.file import FEATURES_NAME

    net, data = Net(), Images(16)
    made = extract(net, data)
    assert made.path is not None
    made.close()
    folder, outside = made.path.parent, cache_root.parent / "elsewhere"
    outside.write_bytes(b"the user's")
    digests = folder / DIGESTS_NAME
    (folder / FEATURES_NAME).unlink()
    if planted == "link":
        digests.unlink()
        digests.symlink_to(outside)
    else:
        digests.write_bytes(digests.read_bytes()[:100])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # made again: nothing to warn about
        extract(net, data)
    assert digests.is_file() and not digests.is_symlink() and outside.read_bytes() == b"the user's"
    assert DigestFile.open(digests, 16, create=False) is not None
    seen = net.seen[0]
    extract(net, edited(data, changed=[], added=1))
    assert net.seen[0] - seen == 1  # the other rows are found again by their inputs' digests


def test_a_digest_file_made_again_by_another_process_is_not_removed_as_the_damaged_one(cache_root: Path) -> None:
    from types import SimpleNamespace

    from torchcache.features.reuse import open_digests
    from torchcache.stores.features.file import remove_features

    made = extract(Net(), Images(16))
    assert made.path is not None
    made.close()
    digests = made.path.with_name(DIGESTS_NAME)
    digests.write_bytes(digests.read_bytes()[:100])
    judged = DigestFile.planted_or_damaged(digests, 16)  # a second extraction finds it damaged ...
    assert judged is not None
    first = open_digests(SimpleNamespace(path=made.path, length=16))  # type: ignore[arg-type]  # ... the first remade it
    assert first is not None
    remove_features(digests, judged)  # ... and the second's removal comes now
    assert os.lstat(digests).st_ino == os.fstat(first._fd).st_ino and os.fstat(first._fd).st_nlink == 1
    first.close()


def test_digests_name_the_input_exactly() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert input_digest(x) == input_digest(x.clone()) == input_digest(x.t().contiguous().t())
    assert input_digest(x) != input_digest(x.reshape(4, 3))  # same bytes, another shape
    assert input_digest(x) != input_digest(x.double())
    assert input_digest(x) == input_digest(x.numpy())  # both collate to the same input
    bumped = x.clone()
    bumped[2, 3] = torch.nextafter(bumped[2, 3], torch.tensor(100.0))
    assert input_digest(x) != input_digest(bumped)
    assert input_digest("an image path") is None and input_digest(np.array(["a"], dtype=object)) is None


def test_a_digest_file_of_another_length_or_header_is_not_used(tmp_path: Path) -> None:
    path = tmp_path / DIGESTS_NAME
    made = DigestFile.open(path, 10, create=True)
    assert made is not None
    made.write(np.arange(3, 6), np.full((3, 16), 7, np.uint8), np.array([11, 12, 2**64 - 1], np.uint64))
    made.close()
    assert DigestFile.open(path, 11, create=False) is None
    opened = DigestFile.open(path, 10, create=False)
    assert opened is not None
    digests, checks = opened.read()
    opened.close()
    assert (digests[3:6] == 7).all() and not digests[:3].any() and not digests[6:].any()
    expected = bindings(np.full((3, 16), 7, np.uint8), np.array([11, 12, 2**64 - 1], np.uint64)).tolist()
    assert checks.tolist() == [0, 0, 0, *expected, 0, 0, 0, 0] and 0 not in expected
    path.write_bytes(b"\0" * 8192)
    assert DigestFile.open(path, 10, create=False) is None


def test_several_older_caches_serve_one_batch_and_stand_in_for_each_others_damage(cache_root: Path) -> None:
    net, calls = _counted(Scale(width=6).eval())
    pool = torch.randn(30, 6)
    first = extract(net, torch.utils.data.TensorDataset(pool[:20]))  # inputs 0-19
    second = extract(net, torch.utils.data.TensorDataset(pool[10:]))  # inputs 10-29, the newer cache
    assert second.path is not None
    file = second.file
    with open(second.path, "r+b") as raw:  # damage input 12's row in the newer cache (its row 2)
        raw.seek(file.row_offset(2))
        byte = raw.read(1)
        raw.seek(-1, os.SEEK_CUR)
        raw.write(bytes([byte[0] ^ 0x01]))
    calls["samples"] = 0
    both = extract(net, torch.utils.data.TensorDataset(pool))
    assert calls["samples"] == 0  # every input is in one cache or the other; input 12 from the older one
    assert torch.equal(both[12][0], first[12][0])
    assert all(torch.equal(both[i][0], (pool[i] * net.w).detach()) for i in range(30))
