"""Modules, data and reference implementations shared by both benchmark sides.

This module is imported by ``worker.py`` under the current interpreter (new
torchcache) and under ``benchmarks/.venv-old`` (torchcache 0.6.0). It imports
only torch, numpy, xxhash and brotli, never torchcache.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import brotli
import numpy as np
import torch
import xxhash
from torch import Tensor, nn

INPUT_SHAPE = (3, 64, 64)


def freeze(module: nn.Module) -> None:
    """Disable gradients on every parameter and switch to eval mode.

    Args:
        module: The module to freeze in place.
    """
    for p in module.parameters():
        p.requires_grad_(False)
    module.eval()


def _activation(act: str) -> nn.Module:
    if act == "relu":
        return nn.ReLU()
    if act == "gelu":
        return nn.GELU()
    raise ValueError(f"unknown activation {act!r}")


class CheapFeatures(nn.Module):
    """Cheap image encoder returning (768,) features per item.

    A strided 8x8 conv, a global average pool and a Linear layer followed by
    ReLU (about half of the outputs are zeros) or GELU (dense outputs).
    """

    def __init__(self, act: str = "relu") -> None:
        """Build the layers and freeze them.

        Args:
            act: ``"relu"`` or ``"gelu"``.
        """
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=8, stride=8)
        self.fc = nn.Linear(32, 768)
        self.act = _activation(act)
        freeze(self)

    def forward(self, x: Tensor) -> Tensor:
        """Encode a batch of (3, 64, 64) images into (B, 768) features."""
        out: Tensor = self.act(self.fc(self.conv(x).mean(dim=(2, 3))))
        return out


class TokenFeatures(nn.Module):
    """Cheap ViT-like patch embedding returning (197, 768) tokens per item.

    A 4x4/stride-4 patch conv on the central 56x56 crop gives 14x14 = 196
    patch tokens; a learned cls token is prepended, then an activation.
    """

    def __init__(self, act: str = "relu") -> None:
        """Build the layers and freeze them.

        Args:
            act: ``"relu"`` or ``"gelu"``.
        """
        super().__init__()
        self.patch = nn.Conv2d(3, 768, kernel_size=4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 768) * 0.02)
        self.act = _activation(act)
        freeze(self)

    def forward(self, x: Tensor) -> Tensor:
        """Encode a batch of (3, 64, 64) images into (B, 197, 768) tokens."""
        tokens = self.patch(x[:, :, 4:60, 4:60]).flatten(2).transpose(1, 2)
        cls = self.cls.expand(x.shape[0], -1, -1)
        out: Tensor = self.act(torch.cat([cls, tokens], dim=1))
        return out


class Backbone(nn.Module):
    """A small conv backbone (tens of ms per batch of 64) with (768,) outputs."""

    def __init__(self, act: str = "relu") -> None:
        """Build the layers and freeze them.

        Args:
            act: ``"relu"`` or ``"gelu"``.
        """
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, c_out, stride in ((3, 32, 1), (32, 64, 2), (64, 128, 2), (128, 256, 2)):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.ReLU()]
        for _ in range(3):
            layers += [nn.Conv2d(256, 256, 3, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(256, 768)
        self.act = _activation(act)
        freeze(self)

    def forward(self, x: Tensor) -> Tensor:
        """Encode a batch of (3, 64, 64) images into (B, 768) features."""
        out: Tensor = self.act(self.fc(self.features(x).mean(dim=(2, 3))))
        return out


MODULES: dict[str, type[nn.Module]] = {
    "feat768": CheapFeatures,
    "tok197": TokenFeatures,
    "backbone": Backbone,
}

OUTPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "feat768": (768,),
    "tok197": (197, 768),
    "backbone": (768,),
}


def build_plain(kind: str, act: str = "relu", seed: int = 0) -> nn.Module:
    """Build the uncached module with deterministic weights.

    Args:
        kind: Key of ``MODULES``.
        act: Activation name.
        seed: Seed for the weight initialisation.

    Returns:
        The frozen module in eval mode.
    """
    torch.manual_seed(seed)
    return MODULES[kind](act=act)


def old_style_hash(x: Tensor) -> Tensor:
    """Reproduce torchcache 0.6.0's per-item input hash (default settings).

    The old package hashes a weighted sum of the input values truncated to
    int64, which collides on a fraction of a percent of random images.

    Args:
        x: Batch of inputs, shape (B, ...).

    Returns:
        int64 hash per item.
    """
    flat = x.flatten(1)
    flat = flat[:, :: max(1, flat.shape[1] // 10000)]
    powers = torch.arange(0, flat.shape[1]) % 15
    coefficients = torch.pow(torch.tensor([2.0]), powers).float().view(1, -1)
    return torch.sum(flat * coefficients, dim=1, dtype=torch.long)


def make_inputs(n_batches: int, batch: int, seed: int) -> list[Tensor]:
    """Draw ``n_batches`` batches of distinct standard-normal images.

    Items whose input hash collides under torchcache 0.6.0's hash are drawn
    again, so that the old package can be checked for exact outputs.

    Args:
        n_batches: Number of batches.
        batch: Items per batch.
        seed: Seed of the generator.

    Returns:
        Contiguous float32 tensors of shape (batch, 3, 64, 64).
    """
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(n_batches * batch, *INPUT_SHAPE, generator=gen)
    for _ in range(100):
        hashes = old_style_hash(data).tolist()
        seen: set[int] = set()
        dup = []
        for i, h in enumerate(hashes):
            if h in seen:
                dup.append(i)
            seen.add(h)
        if not dup:
            break
        data[dup] = torch.randn(len(dup), *INPUT_SHAPE, generator=gen)
    return [b.contiguous() for b in torch.split(data, batch)]


class Floor:
    """The floor of a memory hit: hash rows, look keys up, gather outputs.

    Inputs are viewed as (B, -1) uint8 rows, each hashed with
    ``xxhash.xxh3_128_digest``; a dict maps digests to rows of a contiguous
    slab of stored outputs, gathered with ``torch.index_select`` into the output
    of the call before when nothing else holds it (else into a new tensor): a new
    tensor of 32 MiB or more costs the kernel fresh pages at every call.
    """

    def __init__(self, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        """Store the outputs in one slab and index them by input digest.

        Args:
            inputs: Batches of inputs.
            outputs: The matching batches of outputs.
        """
        self.slab = torch.cat(outputs).contiguous()
        self.last: Tensor | None = None
        self.index: dict[bytes, int] = {}
        for x in inputs:
            for key in self.keys(x):
                self.index[key] = len(self.index)

    @staticmethod
    def keys(x: Tensor) -> list[bytes]:
        """Hash every item of a batch with xxh3-128 over its raw bytes."""
        arr = x.reshape(x.shape[0], -1).numpy().view(np.uint8)
        row = arr.shape[1]
        mv = arr.reshape(-1).data
        digest = xxhash.xxh3_128_digest
        return [digest(mv[i * row : (i + 1) * row]) for i in range(arr.shape[0])]

    def lookup(self, x: Tensor) -> Tensor:
        """Return a new tensor with the stored outputs for batch ``x``."""
        index = self.index
        idx = torch.tensor([index[k] for k in self.keys(x)], dtype=torch.long)
        last = self.last
        if last is not None and len(last) == len(idx) and sys.getrefcount(last) == 3:  # self.last, last, the call
            return torch.index_select(self.slab, 0, idx, out=last)
        self.last = torch.index_select(self.slab, 0, idx)
        return self.last


def write_raw_files(directory: Path, outputs: list[Tensor]) -> list[list[Path]]:
    """Write each output item's raw bytes to its own file (temporary file + rename).

    Args:
        directory: Target directory (created if missing).
        outputs: Batches of outputs.

    Returns:
        Per batch, the file path of each item.
    """
    directory.mkdir(parents=True, exist_ok=True)
    paths: list[list[Path]] = []
    n = 0
    for out in outputs:
        batch_paths = []
        for row in out.reshape(out.shape[0], -1).numpy():
            p = directory / f"{n}.bin"
            tmp = directory / f".{n}.tmp"
            with open(tmp, "wb", buffering=0) as f:
                f.write(row.data)
            os.replace(tmp, p)
            batch_paths.append(p)
            n += 1
        paths.append(batch_paths)
    return paths


def raw_read(paths: list[Path], item_shape: tuple[int, ...]) -> Tensor:
    """Read one raw float32 file per item into a new stacked tensor.

    Args:
        paths: One file per item.
        item_shape: Shape of one item.

    Returns:
        Tensor of shape (len(paths), *item_shape).
    """
    out = torch.empty(len(paths), *item_shape, dtype=torch.float32)
    rows = out.numpy().reshape(len(paths), -1).view(np.uint8)
    for i, p in enumerate(paths):
        with open(p, "rb", buffering=0) as f:
            f.readinto(rows[i].data)
    return out


def brotli_payloads(outputs: Tensor, quality: int) -> list[bytes]:
    """Compress each item's raw bytes with brotli at ``quality``.

    The window is the smallest that holds an item (as the new torchcache does).
    """
    out = []
    for item in outputs:
        raw = item.numpy().tobytes()
        lgwin = max(10, min(24, len(raw).bit_length() + 1))
        out.append(brotli.compress(raw, quality=quality, lgwin=lgwin))
    return out


def brotli_decode(pool: ThreadPoolExecutor, payloads: list[bytes], item_shape: tuple[int, ...]) -> Tensor:
    """Decompress payloads over the pool's threads into a new stacked tensor.

    Args:
        pool: Thread pool (2 workers in the benchmark).
        payloads: One brotli payload per item.
        item_shape: Shape of one item.

    Returns:
        Tensor of shape (len(payloads), *item_shape).
    """
    out = torch.empty(len(payloads), *item_shape, dtype=torch.float32)
    rows = out.numpy().reshape(len(payloads), -1).view(np.uint8)
    chunks = np.array_split(np.arange(len(payloads)), pool._max_workers)

    def work(idx: np.ndarray) -> None:
        for i in idx:
            rows[i] = np.frombuffer(brotli.decompress(payloads[i]), dtype=np.uint8)

    list(pool.map(work, chunks))
    return out


def drop_page_cache() -> bool:
    """Sync and drop the kernel page cache; return False if not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm_page_cache(directory: Path) -> int:
    """Read every file under ``directory`` once, so that its pages are in the page cache.

    A process that drops the page cache (the cold passes) empties it for the next
    processes too; a "warm" measurement reads its files first. Returns the bytes read.
    """
    total = 0
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(1 << 20):
                    total += len(chunk)
    return total


def entry_bytes(directory: Path) -> tuple[int, int, int]:
    """Sum entry file sizes under ``directory``, metadata json files excluded.

    Returns:
        (apparent bytes, allocated bytes, number of files).
    """
    apparent = allocated = files = 0
    for root, _, names in os.walk(directory):
        for name in names:
            if name.endswith(".json"):
                continue
            st = os.stat(os.path.join(root, name))
            apparent += st.st_size
            allocated += st.st_blocks * 512
            files += 1
    return apparent, allocated, files


class Computed:
    """Counts items that really ran through the module's first layer."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        """Hook the first layer of ``module`` (a workload module)."""
        name = {"feat768": "conv", "tok197": "patch", "backbone": "features"}[kind]
        layer = next(m for n, m in module.named_modules() if n.split(".")[-1] == name)
        self.items = 0
        layer.register_forward_hook(self._hook)

    def _hook(self, _m: nn.Module, inputs: tuple[Tensor, ...], _o: Tensor) -> None:
        self.items += int(inputs[0].shape[0])


def release_memory() -> None:
    """Collect garbage, hand free heap pages back to the OS (glibc) and sync.

    Run between repeats, with the earlier repeats' modules kept alive: a repeat
    that reuses the heap pages an earlier cache freed is spared page faults the
    first repeat paid (up to 2x on (197, 768) outputs).
    """
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    os.sync()  # no writeback of earlier files during the next timed pass


def pass_times(fn: Callable[[Any], object], xs: Sequence[Any]) -> float:
    """Run ``fn`` over every batch and return the total wall time in seconds."""
    total = 0.0
    for x in xs:
        t0 = time.perf_counter()
        fn(x)
        total += time.perf_counter() - t0
    return total


def per_batch_ms(totals: list[float], n_batches: int) -> list[float]:
    """Convert pass totals (s) into per-batch milliseconds."""
    return [t * 1e3 / n_batches for t in totals]
