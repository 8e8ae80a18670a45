"""Rows keyed on the device: every byte, the same bits on every device, 32 bytes per item to the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache import torchcache
from torchcache.device_digest import CHUNK_WORDS, device_row_digests, reference_digests
from torchcache.keys import Context, hash_items

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3 * 4 * CHUNK_WORDS + 7), st.integers(0, 2**31))
def test_the_torch_hash_is_its_numpy_definition_bit_for_bit(batch: int, nbytes: int, seed: int) -> None:
    rows = np.random.default_rng(seed).integers(0, 256, size=(batch, nbytes), dtype=np.uint8)
    assert np.array_equal(device_row_digests(torch.from_numpy(rows)), reference_digests(rows))


@pytest.mark.parametrize("nbytes", [1, 4, 1024, 4 * CHUNK_WORDS * 70 + 3])
def test_any_single_byte_changed_changes_the_digest(nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    row = rng.integers(0, 256, size=(1, nbytes), dtype=np.uint8)
    changed = np.repeat(row, 8, axis=0)
    for i, position in enumerate(rng.integers(0, nbytes, size=8)):
        changed[i, position] ^= 1 << (i % 8)
    digests = device_row_digests(torch.from_numpy(np.concatenate([row, changed])))
    assert len({bytes(d) for d in digests}) == 9


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_gives_the_cpu_s_digests(device: str) -> None:
    rows = torch.randint(0, 256, (16, 3 * 64 * 64 * 4 + 2), dtype=torch.uint8)
    assert np.array_equal(device_row_digests(rows.to(device)), device_row_digests(rows))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_cuda_images_that_differ_in_one_pixel_get_different_entries() -> None:
    images = torch.randn(2, 3, 224, 224, device="cuda")
    images[1] = images[0]
    images[1, 2, 200, 13] += 1.0  # a pixel no subsample of 10,000 elements would see
    keys = hash_items(Context("module").digest(), [images])
    assert keys[0] != keys[1]
    model = torchcache()(torch.nn.Conv2d(3, 4, 3).cuda().eval().requires_grad_(False))
    out = model(images)
    assert model.cache_instance.stats().misses == 2 and not torch.equal(out[0], out[1])


def test_a_cuda_item_and_a_cpu_item_are_keyed_apart_and_subsampling_is_an_opt_in() -> None:
    context = Context("module").digest()
    x = torch.randn(3, 4)
    assert hash_items(context, [x]) == hash_items(context, [x.clone()])
    assert hash_items(context, [x], subsample_count=64) == hash_items(context, [x])  # the CPU hashes every byte
