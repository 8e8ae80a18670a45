"""Dataset caching: epoch times of ``CachedDataset`` against stocaching and a preloaded floor.

Usage::

    python benchmarks/dataset_cache.py                # 20,000 images, 3 rounds, 20 pairs
    python benchmarks/dataset_cache.py --quick        # 4,000 images, 2 rounds, 4 pairs (a smoke run)
    python benchmarks/dataset_cache.py --items 50000 --json out.json

The dataset is a folder of small encoded images (64x64 RGB JPEGs written with Pillow, or
zlib-compressed raw pixels without it). A sample is decoded, resized to 48x48 with
``torch.nn.functional.interpolate`` (bilinear, antialiased) and returned as a
``(uint8 tensor (3, 48, 48), int label)`` pair, as the first, cacheable half of a real
image pipeline. Every epoch is a ``DataLoader(batch_size=64, num_workers=2)`` pass in a
fresh shuffled order, timed from ``iter(loader)`` to the last batch. Compared:

- uncached: the dataset itself;
- torchcache: ``CachedDataset(dataset, max_memory_size=budget)`` (RAM tier only), where
  the budget holds the fraction's number of samples in the tier's rows file: its header
  and tables (``Geometry``) plus one row per sample; a fraction of 0 is
  ``max_memory_size=0`` (no tier);
- stocaching 0.2.1: a ``SharedCache`` sized for the same number of samples, with
  ``get_slot``/``set_slot`` in ``__getitem__`` (the label comes from a list);
- floor: the same samples preloaded into one uint8 tensor, indexed in ``__getitem__``.

The run is made of rounds (3 by default). A round runs the floor, an uncached epoch,
then for each fraction makes both caches afresh and runs their first epochs (which fill
them) and one later epoch each, the two libraries in alternating order; a second
uncached epoch runs after the 50 % fraction. Every figure is the median over the rounds,
"uncached" the median of all uncached epochs; the two libraries' later epochs of a round
run back to back, so their ratio is also shown round by round, where a slow spell of
the machine weighs on both.

Then, at 25, 50, 75 and 100 %, ``--pairs`` more pairs of later epochs (20 by
default), each pair back to back in alternating order over a pair of caches filled
once. "At least as fast as stocaching" is judged on pairs: at each fraction, the
geometric mean of torchcache's epoch over stocaching's in every pair (the rounds' and
these), with its 95 % confidence interval (Student's t on the logs). The target is met
at a fraction where that mean is at most 1, or where at least 20 pairs put 1 inside the
interval (equal within what the machine can resolve). Three to five epochs per
library, each varying by 20 % on a shared machine, cannot tell a few percent apart;
twenty-odd pairs can tell about 4 %.

Then each library's own cost, which epochs of real samples drown in the noise of a
shared machine: samples that are copies of preloaded ones (``Copies``), fetched and
collated in this process in alternating passes over the whole dataset (microseconds per
sample), and DataLoader passes of one batch per worker (the start of an epoch's workers,
where torchcache opens its RAM tier), the order turning each time; medians over the
passes.

Each epoch's CPU time is measured too (this process and its workers, which end before
the epoch does: they are not persistent). On a machine shared with other work it varies
far less than the epoch's wall time, so the two libraries' CPU per later epoch is shown
beside their times.

Every batch of an epoch is checked sample by sample against the uncached samples (a
64-bit weighted sum of each sample's bytes, and its label), and each epoch's checksum
against the reference's; after the cost passes, every sample is checked once. The run
exits 1 if a sample was wrong (2 with ``--strict`` if a target was missed). The images
live in a temporary directory, the RAM tiers under a fresh ``/dev/shm`` directory with
their own ``TORCHCACHE_JOB_ID``; both are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import resource
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results

import torchcache
from torchcache import CachedDataset
from torchcache.datasets.decode import frame_head
from torchcache.datasets.encode import encode_sample
from torchcache.stores.rows import Geometry

try:
    from PIL import Image
except ImportError:  # zlib-compressed raw pixels instead
    Image = None
try:
    from stocaching import SharedCache
except ImportError:
    SharedCache = None

SIDE, OUT = 64, 48
SHAPE = (3, OUT, OUT)
BATCH, WORKERS = 64, 2
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
PAIRED = (0.25, 0.5, 0.75, 1.0)  # every fraction that caches: many more pairs of later epochs
ENOUGH_PAIRS = 20  # to call a ratio whose interval holds 1 "equal within the noise"
CLASSES = 10
TARGETS = {"floor_ratio": 1.5, "vs_stocaching": 1.0, "linearity_r2": 0.95, "first_ratio": 1.1}


# -- the dataset ----------------------------------------------------------------------
def make_images(root: Path, count: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """Write ``count`` smooth noisy 64x64 RGB images; return their file names and labels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIDE, 0:SIDE] / (SIDE - 1)
    names, ext = [], ".jpg" if Image is not None else ".z"
    for start in range(0, count, 1000):
        n = min(1000, count - start)
        low, high = rng.uniform(0, 255, (2, n, 1, 1, 3))
        angle = rng.uniform(0, 2 * np.pi, (n, 1, 1, 1))
        ramp = xx[None, :, :, None] * np.cos(angle) + yy[None, :, :, None] * np.sin(angle)
        pixels = low + (high - low) * (ramp - ramp.min()) / np.ptp(ramp, axis=(1, 2, 3), keepdims=True)
        pixels = np.clip(pixels + rng.normal(0, 12, (n, SIDE, SIDE, 3)), 0, 255).astype(np.uint8)
        for i in range(n):
            name = f"{start + i:07d}{ext}"
            if Image is not None:
                buffer = io.BytesIO()
                Image.fromarray(pixels[i]).save(buffer, format="JPEG", quality=90)
                data = buffer.getvalue()
            else:
                data = zlib.compress(pixels[i].tobytes(), 6)
            (root / name).write_bytes(data)
            names.append(name)
    return names, [int(label) for label in rng.integers(0, CLASSES, count)]


class ImageFiles(Dataset[Any]):
    """Decode an image file, resize it to 48x48, return ``(uint8 (3, 48, 48), label)``."""

    def __init__(self, root: Path, files: list[str], labels: list[int]) -> None:
        self.root, self.files, self.labels = str(root), files, labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with open(os.path.join(self.root, self.files[i]), "rb") as file:
            if Image is not None:
                pixels = np.array(Image.open(file).convert("RGB"))
            else:
                pixels = np.frombuffer(zlib.decompress(file.read()), np.uint8).reshape(SIDE, SIDE, 3).copy()
        x = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0).float()
        x = F.interpolate(x, size=(OUT, OUT), mode="bilinear", antialias=True, align_corners=False)
        return x.squeeze(0).round_().clamp_(0, 255).to(torch.uint8), self.labels[i]


class Preloaded(Dataset[Any]):
    """The floor: every sample already decoded, in one uint8 tensor."""

    def __init__(self, images: torch.Tensor, labels: list[int]) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.labels[i]


class Copies(Preloaded):
    """Samples that cost almost nothing to make (a copy of a preloaded one): what is left is the cache's cost."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i].clone(), self.labels[i]


class Stocached(Dataset[Any]):
    """The dataset behind a stocaching ``SharedCache`` of ``slots`` samples, as its README shows."""

    def __init__(self, base: ImageFiles | Copies, slots: int) -> None:
        self.base, self.labels = base, base.labels
        n, slot = len(base), int(np.prod(SHAPE))
        limit_gib = (slots * slot + n + slot / 2) / 1024**3  # samples + its status bytes, rounding-safe
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its sizing
            self.cache = SharedCache(limit_gib, n, SHAPE, torch.uint8)
        assert len(self.cache) == slots, (len(self.cache), slots)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.cache.get_slot(i)
        if x is None:
            x = self.base[i][0]
            self.cache.set_slot(i, x)
        return x, self.labels[i]


# -- epochs and checks ----------------------------------------------------------------
class Reference:
    """Per-sample digests and labels of the uncached samples."""

    def __init__(self, images: torch.Tensor, labels: list[int]) -> None:
        rng = np.random.default_rng(7)
        self.weights = rng.integers(1, 2**63, int(np.prod(SHAPE)) // 8, dtype=np.uint64) | np.uint64(1)
        self.digests = np.concatenate([self.digest(images[i : i + 4096]) for i in range(0, len(images), 4096)])
        self.labels = np.asarray(labels)
        self.checksum = int(self.digests.sum(dtype=np.uint64))

    def digest(self, images: torch.Tensor) -> np.ndarray[Any, Any]:
        """One 64-bit digest per sample of a uint8 batch: a weighted sum of its 8-byte words."""
        rows = np.ascontiguousarray(images.numpy()).reshape(len(images), -1).view(np.uint64)
        return (rows * self.weights).sum(axis=1, dtype=np.uint64)  # modulo 2**64


def cpu_seconds() -> float:
    """CPU time (user and system) of this process and of its children that have ended."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def run_epoch(dataset: Dataset[Any], order: list[int], ref: Reference | None) -> dict[str, Any]:
    """One timed DataLoader pass in ``order``; counts the samples that differ from ``ref``.

    Also the CPU time the epoch took, in this process and its workers (which end, and are
    waited for, before the last batch's loop ends: the workers are not persistent).
    """
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, sampler=order)
    wrong, checksum, at = 0, 0, 0
    cpu = cpu_seconds()
    start = time.perf_counter()
    for images, labels in loader:
        picked = order[at : at + len(labels)]
        at += len(labels)
        if ref is None:
            continue
        if images.dtype != torch.uint8 or tuple(images.shape[1:]) != SHAPE:
            wrong += len(labels)
            continue
        digests = ref.digest(images)
        wrong += int(((digests != ref.digests[picked]) | (labels.numpy() != ref.labels[picked])).sum())
        checksum = (checksum + int(digests.sum(dtype=np.uint64))) % 2**64
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu
    if at != len(order):
        wrong += len(order) - at
    if ref is not None and checksum != ref.checksum:
        wrong = max(wrong, 1)
    return {"s": seconds, "cpu_s": cpu, "wrong": wrong}


def build_reference(base: ImageFiles) -> tuple[torch.Tensor, Reference, float]:
    """One uncached pass in index order; its samples are the reference and the floor's data."""
    images = torch.empty((len(base), *SHAPE), dtype=torch.uint8)
    loader = DataLoader(base, batch_size=BATCH, num_workers=WORKERS)
    start, at = time.perf_counter(), 0
    for batch, _ in loader:
        images[at : at + len(batch)] = batch
        at += len(batch)
    return images, Reference(images, base.labels), time.perf_counter() - start


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares of ``ys`` on ``xs``: slope, Pearson r, R² and the worst residual over the range."""
    x, y = np.asarray(xs), np.asarray(ys)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((residual**2).sum()) / total if total else 0.0
    spread = float(y.max() - y.min()) or 1.0
    return {
        "slope": float(slope),
        "r": float(np.corrcoef(x, y)[0, 1]),
        "r2": r2,
        "max_residual": float(np.abs(residual).max() / spread),
    }


# Student's t, 97.5 % quantiles for 1 to 30 degrees of freedom (beyond: an expansion).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(dof: int) -> float:
    """The 97.5 % quantile of Student's t with ``dof`` degrees of freedom (from 31: Cornish-Fisher, within 0.01 %)."""
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def paired_ratio(ratios: list[float]) -> dict[str, float]:
    """The geometric mean of paired ratios and its 95 % confidence interval (t on the logs)."""
    logs = np.log(np.asarray(ratios, dtype=float))
    mean, n = float(logs.mean()), len(logs)
    half = t95(n - 1) * float(logs.std(ddof=1)) / n**0.5 if n > 1 else float("inf")
    return {
        "geomean": float(np.exp(mean)),
        "low": float(np.exp(mean - half)),
        "high": float(np.exp(mean + half)),
        "n": n,
    }


def batches(dataset: Dataset[Any], order: list[int]) -> Iterator[tuple[list[int], Any]]:
    """The indices of each batch of ``order`` and the batch, fetched and collated in this process."""
    getitems = getattr(dataset, "__getitems__", None)
    for at in range(0, len(order), BATCH):
        picked = order[at : at + BATCH]
        yield picked, default_collate(getitems(picked) if getitems is not None else [dataset[i] for i in picked])


def fetch_all(dataset: Dataset[Any], order: list[int]) -> float:
    """Microseconds per sample to fetch and collate ``order`` in batches, in this process."""
    start = time.perf_counter()
    for _ in batches(dataset, order):
        pass
    return (time.perf_counter() - start) / len(order) * 1e6


def check_all(dataset: Dataset[Any], order: list[int], ref: Reference) -> int:
    """The samples of ``order`` that differ from the reference, fetched in this process."""
    wrong = 0
    for picked, (images, labels) in batches(dataset, order):
        wrong += int(((ref.digest(images) != ref.digests[picked]) | (labels.numpy() != ref.labels[picked])).sum())
    return wrong


def worker_start(dataset: Dataset[Any], order: list[int]) -> float:
    """Seconds of a DataLoader pass over one batch per worker: the workers' start and first use."""
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, sampler=order[: BATCH * WORKERS])
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def library_cost(
    images: torch.Tensor, labels: list[int], ref: Reference, charge: int, fixed: int, repeats: int, say: Any
) -> tuple[dict[str, Any], int]:
    """What each library itself costs: samples that are copies of preloaded ones, fetched in one process.

    For each fraction, both caches are filled by one pass, then passes over the whole
    dataset in fresh orders alternate between torchcache, stocaching and the uncached
    copies (the order turning each time), and so do DataLoader passes of one batch per
    worker (the cost of an epoch's worker start, with the cache opened there). Medians
    over ``repeats``. Every sample is then checked once against the reference.
    """
    items = len(labels)
    base = Copies(images, labels)
    rng = np.random.default_rng(2)
    costs: dict[str, Any] = {}
    wrong = 0
    say(f"library cost per sample: {items:,} copies of preloaded samples, {repeats} passes each, in one process")
    for f in FRACTIONS:
        slots = round(f * items)
        budget = fixed + slots * charge if slots else 0
        tc = CachedDataset(base, max_memory_size=budget, version=f"cost-{f}")
        caches: dict[str, Dataset[Any]] = {"torchcache": tc, "uncached": base}
        if SharedCache is not None:
            caches["stocaching"] = Stocached(base, slots)
        names = list(caches)
        per_sample: dict[str, list[float]] = {name: [] for name in names}
        start: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            fetch_all(caches[name], rng.permutation(items).tolist())  # fills the caches
        for r in range(repeats):
            order = rng.permutation(items).tolist()
            turn = names[r % len(names) :] + names[: r % len(names)]
            for name in turn:
                per_sample[name].append(fetch_all(caches[name], order))
            for name in turn:
                start[name].append(worker_start(caches[name], order))
        for name in names:
            wrong += check_all(caches[name], rng.permutation(items).tolist(), ref)
        costs[f"{f:.2f}"] = {
            name: {
                "us_per_sample": statistics.median(per_sample[name]),
                "worker_start_ms": 1e3 * statistics.median(start[name]),
            }
            for name in names
        }
        shown = ", ".join(
            f"{name} {statistics.median(per_sample[name]):.2f} us, start {1e3 * statistics.median(start[name]):.1f} ms"
            for name in names
        )
        say(f"  {f:.0%}: {shown}")
        memory_dir = tc.cache.memory_dir
        tc.close()
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)
    return costs, wrong


# -- the run ----------------------------------------------------------------------------
def measure(items: int, rounds: int, pairs: int, work: Path, log: list[str]) -> dict[str, Any]:
    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    root = work / "images"
    root.mkdir()
    start = time.perf_counter()
    files, labels = make_images(root, items)
    encoded = sum(f.stat().st_size for f in root.iterdir())
    say(f"wrote {items:,} images ({encoded / items:.0f} B each) in {time.perf_counter() - start:.1f} s")
    base = ImageFiles(root, files, labels)
    floor_images, ref, seconds = build_reference(base)
    say(f"reference pass (uncached, in index order): {seconds:.2f} s")
    frame = encode_sample(base[0])
    assert all(len(encode_sample(base[i])) == len(frame) for i in (1, items // 2, items - 1))
    head = frame_head(frame)
    assert head is not None
    geometry = Geometry.of(items, len(frame), head, {"kind": "samples"})
    charge, fixed = geometry.stride, geometry.rows_at  # bytes per row, header and tables
    slots = {f: round(f * items) for f in FRACTIONS}
    libraries = ["torchcache"] + (["stocaching"] if SharedCache is not None else [])
    rng = np.random.default_rng(1)
    wrong = 0
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    cached: dict[tuple[str, float], float] = {}

    def epoch(name: str, dataset: Dataset[Any], order: list[int]) -> None:
        nonlocal wrong
        result = run_epoch(dataset, order, ref)
        wrong += result["wrong"]
        times.setdefault(name, []).append(result["s"])
        cpu.setdefault(name, []).append(result["cpu_s"])
        flag = f"  WRONG SAMPLES: {result['wrong']}" if result["wrong"] else ""
        say(f"  {name:<26} {result['s']:7.2f} s  (CPU {result['cpu_s']:5.2f} s){flag}")

    def make(lib: str, f: float, r: int) -> Dataset[Any]:
        if lib == "stocaching":
            return Stocached(base, slots[f])
        budget = fixed + slots[f] * charge if slots[f] else 0
        return CachedDataset(base, max_memory_size=budget, version=f"bench-{f}-{r}")

    def drop(lib: str, f: float, dataset: Dataset[Any]) -> None:
        if isinstance(dataset, Stocached):
            cached[lib, f] = min(cached.get((lib, f), 1.0), int((dataset.cache.aux_array == 1).sum()) / items)
            return
        assert isinstance(dataset, CachedDataset)
        memory = dataset.stats().memory
        cached[lib, f] = min(cached.get((lib, f), 1.0), memory.entries / items)
        say(f"  (torchcache {f:.0%}: {memory.entries} entries, {memory.bytes:,} of {memory.max_bytes:,} B)")
        directory = dataset.cache.memory_dir
        dataset.close()
        if directory is not None:  # other caches of this job keep the job directory: free this one's RAM now
            shutil.rmtree(directory, ignore_errors=True)

    for r in range(rounds):
        say(f"round {r + 1}/{rounds} (load average {' '.join(f'{v:.2f}' for v in os.getloadavg())})")
        first, later = rng.permutation(items).tolist(), rng.permutation(items).tolist()
        epoch("floor", Preloaded(floor_images, labels), later)
        epoch("uncached", base, first)
        for k, f in enumerate(FRACTIONS):
            if k == len(FRACTIONS) // 2 + 1:
                epoch("uncached", base, later)
            ordered = libraries if (k + r) % 2 == 0 else libraries[::-1]
            caches = {lib: make(lib, f, r) for lib in ordered}
            for lib in ordered:
                epoch(f"{lib} {f:.0%} first", caches[lib], first)
            for lib in ordered:
                epoch(f"{lib} {f:.0%} later", caches[lib], later)
            for lib in ordered:
                drop(lib, f, caches.pop(lib))
    paired: dict[str, dict[str, list[float]]] = {}
    if pairs and "stocaching" in libraries:
        say(f"paired later epochs: {pairs} pairs at {', '.join(f'{f:.0%}' for f in PAIRED)}, back to back")
        for f in PAIRED:
            caches = {lib: make(lib, f, rounds) for lib in libraries}
            for lib in libraries:  # fill them
                wrong += run_epoch(caches[lib], rng.permutation(items).tolist(), ref)["wrong"]
            for k in range(pairs):
                order = rng.permutation(items).tolist()
                for lib in libraries if k % 2 == 0 else libraries[::-1]:
                    result = run_epoch(caches[lib], order, ref)
                    wrong += result["wrong"]
                    paired.setdefault(f"{lib} {f:.0%}", []).append(result["s"])
                    paired.setdefault(f"{lib} {f:.0%} cpu", []).append(result["cpu_s"])
            shown = [f"{lib} {statistics.median(paired[f'{lib} {f:.0%}']):.2f} s" for lib in libraries]
            say(f"  {f:.0%}: medians " + ", ".join(shown))
            for lib in libraries:
                drop(lib, f, caches.pop(lib))
    costs, cost_wrong = library_cost(floor_images, labels, ref, charge, fixed, max(9, 3 * rounds), say)
    wrong += cost_wrong
    return {
        "times": times,
        "cpu": cpu,
        "paired": paired,
        "wrong": wrong,
        "charge": charge,
        "cached": cached,
        "libraries": libraries,
        "costs": costs,
    }


def summarize(items: int, raw: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, bool | None]], dict[str, Any]]:
    """The table, the targets (name, measured, met) and the figures for ``--json``."""
    times, libraries = raw["times"], raw["libraries"]
    med = {name: statistics.median(values) for name, values in times.items()}
    uncached, floor = med["uncached"], med["floor"]
    lines = [
        f"{'cached':>6}  {'library':<10} {'stored':>7}  {'first epoch':>11}  {'first/unc':>9}  "
        f"{'later: median [min-max]':<25} {'speedup':>7}  {'vs floor':>8}  {'tc/stoc':>7}"
    ]
    figures: dict[str, Any] = {"uncached_s": uncached, "floor_s": floor}
    for f in FRACTIONS:
        for lib in libraries:
            first = med[f"{lib} {f:.0%} first"]
            later_all = times[f"{lib} {f:.0%} later"]
            later = med[f"{lib} {f:.0%} later"]
            versus = ""
            if lib == "torchcache" and "stocaching" in libraries:
                versus = f"{later / med[f'stocaching {f:.0%} later']:.2f}"
            spread = f"{later:.2f} s [{min(later_all):.2f}-{max(later_all):.2f}]"
            lines.append(
                f"{f:>6.0%}  {lib:<10} {raw['cached'][lib, f]:>7.1%}  {first:>9.2f} s  {first / uncached:>8.2f}x  "
                f"{spread:<25} {uncached / later:>6.2f}x  {later / floor:>7.2f}x  {versus:>7}"
            )
            figures[f"{lib}_{f:.2f}"] = {"first_s": first, "later_s": later, "later_all_s": later_all}
    for name, value in (("uncached", uncached), ("floor", floor)):
        spread = f"{value:.2f} s [{min(times[name]):.2f}-{max(times[name]):.2f}]"
        lines.append(f"{'':>6}  {name:<10} {'':>7}  {'':>11}  {'':>9}  {spread:<25} {uncached / value:>6.2f}x")
    targets: list[tuple[str, str, bool | None]] = []
    tc_later = [med[f"torchcache {f:.0%} later"] for f in FRACTIONS]
    full = tc_later[-1] / floor
    targets.append(("later epochs at 100% within 1.5x of the floor", f"{full:.2f}x", full <= TARGETS["floor_ratio"]))
    if "stocaching" in libraries:
        ratios = [med[f"torchcache {f:.0%} later"] / med[f"stocaching {f:.0%} later"] for f in FRACTIONS]
        figures["tc_over_stocaching"] = ratios
        paired = [
            [tc / st for tc, st in zip(times[f"torchcache {f:.0%} later"], times[f"stocaching {f:.0%} later"])]
            for f in FRACTIONS
        ]
        figures["tc_over_stocaching_by_round"] = paired
        lines.append(
            "tc/stoc round by round (the two later epochs of a round run back to back), median [min-max]: "
            + ", ".join(
                f"{f:.0%} {statistics.median(p):.2f} [{min(p):.2f}-{max(p):.2f}]" for f, p in zip(FRACTIONS, paired)
            )
        )
        faster = sum(r <= 1.0 for p in paired for r in p)
        lines.append(f"torchcache's later epoch at most stocaching's in {faster} of {sum(map(len, paired))} rounds")
        extra = raw["paired"]
        every = []  # per fraction: the rounds' pairs and the extra ones
        for f, in_rounds in zip(FRACTIONS, paired):
            more = extra.get(f"torchcache {f:.0%}", [])
            every.append(in_rounds + [tc / st for tc, st in zip(more, extra.get(f"stocaching {f:.0%}", []))])
        intervals = [paired_ratio(p) for p in every]
        figures["tc_over_stocaching_paired"] = intervals
        for f in PAIRED:
            if f"torchcache {f:.0%}" not in extra:
                continue
            wall = [tc / st for tc, st in zip(extra[f"torchcache {f:.0%}"], extra[f"stocaching {f:.0%}"])]
            cpu_pairs = [tc / st for tc, st in zip(extra[f"torchcache {f:.0%} cpu"], extra[f"stocaching {f:.0%} cpu"])]
            w, c = paired_ratio(wall), paired_ratio(cpu_pairs)
            lines.append(
                f"{len(wall)} paired later epochs at {f:.0%}, tc/stoc geometric mean [95% CI]: "
                f"time {w['geomean']:.3f} [{w['low']:.3f}-{w['high']:.3f}], torchcache faster in "
                f"{sum(r < 1 for r in wall)}; CPU {c['geomean']:.3f} [{c['low']:.3f}-{c['high']:.3f}], "
                f"torchcache less in {sum(r < 1 for r in cpu_pairs)}"
            )
        shown = ", ".join(
            f"{f:.0%} {i['geomean']:.2f} [{i['low']:.2f}-{i['high']:.2f}] ({i['n']})"
            for f, i in zip(FRACTIONS, intervals)
        )
        targets.append(
            (
                "at every fraction at least as fast as stocaching (paired: <= 1, or 20+ pairs, 95% CI holds 1)",
                shown,
                all(i["geomean"] <= 1.0 or (i["n"] >= ENOUGH_PAIRS and i["low"] <= 1.0) for i in intervals),
            )
        )
        cpu = {name: statistics.median(values) for name, values in raw["cpu"].items()}
        cpu_ratios = [cpu[f"torchcache {f:.0%} later"] / cpu[f"stocaching {f:.0%} later"] for f in FRACTIONS]
        figures["cpu_later_s"] = {name: value for name, value in cpu.items() if name.endswith("later")}
        figures["cpu_tc_over_stocaching"] = cpu_ratios
        lines.append(
            "CPU of a later epoch (this process and its workers), median s, tc | stoc (tc/stoc): "
            + ", ".join(
                f"{f:.0%} {cpu[f'torchcache {f:.0%} later']:.2f} | {cpu[f'stocaching {f:.0%} later']:.2f} ({r:.2f})"
                for f, r in zip(FRACTIONS, cpu_ratios)
            )
        )
    else:
        targets.append(("at least as fast as stocaching", "stocaching not installed", None))
    saved = [uncached - t for t in tc_later]
    fit = linear_fit(list(FRACTIONS), saved)
    figures["linearity_torchcache"] = fit
    targets.append(
        (
            "time saved grows linearly with the fraction (R² >= 0.95)",
            f"r {fit['r']:.3f}, R² {fit['r2']:.3f}, worst residual {fit['max_residual']:.1%} of the range",
            fit["r2"] >= TARGETS["linearity_r2"],
        )
    )
    if "stocaching" in libraries:
        sfit = linear_fit(list(FRACTIONS), [uncached - med[f"stocaching {f:.0%} later"] for f in FRACTIONS])
        figures["linearity_stocaching"] = sfit
        lines.append(f"stocaching linearity: r {sfit['r']:.3f}, R² {sfit['r2']:.3f}")
    costs = raw["costs"]
    names = list(costs[f"{FRACTIONS[0]:.2f}"])
    lines.append("")
    lines.append(
        "library cost, one process (samples copied from RAM; fetch + collate), medians: "
        "us per sample | ms for a DataLoader pass of one batch per worker (the workers' start)"
    )
    lines.append(
        f"{'cached':>6}  " + "".join(f"{name:>12}" for name in names) + "  |" + "".join(f"{name:>12}" for name in names)
    )
    for f in FRACTIONS:
        row = costs[f"{f:.2f}"]
        lines.append(
            f"{f:>6.0%}  "
            + "".join(f"{row[name]['us_per_sample']:>9.2f} us" for name in names)
            + "  |"
            + "".join(f"{row[name]['worker_start_ms']:>9.1f} ms" for name in names)
        )
    figures["library_cost"] = costs
    if "stocaching" in libraries:
        gaps = [
            costs[f"{f:.2f}"]["torchcache"]["us_per_sample"] - costs[f"{f:.2f}"]["stocaching"]["us_per_sample"]
            for f in FRACTIONS
        ]
        shown = ", ".join(f"{f:.0%} {gap:+.2f} us" for f, gap in zip(FRACTIONS, gaps))
        targets.append(
            ("library cost per sample at every fraction at most stocaching's (tc - stoc <= 0)", shown, max(gaps) <= 0)
        )
    firsts = [med[f"torchcache {f:.0%} first"] / uncached for f in FRACTIONS]
    shown = ", ".join(f"{f:.0%} {r:.2f}" for f, r in zip(FRACTIONS, firsts))
    targets.append(("first epoch at most 1.1x an uncached epoch", shown, max(firsts) <= TARGETS["first_ratio"]))
    return lines, targets, figures


def versions() -> dict[str, str]:
    found = {"torch": torch.__version__, "torchcache": torchcache.__version__, "numpy": np.__version__}
    for name in ("stocaching", "pillow"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, help="images in the dataset (default 20,000; 4,000 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds of epochs (default 3; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4,000 images, 2 rounds, 4 pairs")
    parser.add_argument(
        "--pairs", type=int, help="extra pairs of later epochs at 25-100 %% (default 20; 4 with --quick)"
    )
    parser.add_argument("--json", help="default: benchmarks/results/dataset_cache.json")
    parser.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    args = parser.parse_args()
    items = args.items or (4000 if args.quick else 20000)
    rounds = args.rounds or (2 if args.quick else 3)
    pairs = args.pairs if args.pairs is not None else 4 if args.quick else 20
    if items < BATCH or rounds < 1 or pairs < 0:
        parser.error("--items must be at least 64, --rounds at least 1 and --pairs at least 0")
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    work = Path(tempfile.mkdtemp(prefix="torchcache-dataset-bench-"))
    shm_base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else work
    shm_root = shm_base / f"torchcache-bench-{token}"
    os.environ["TORCHCACHE_SHM_DIR"] = str(shm_root)
    os.environ["TORCHCACHE_JOB_ID"] = f"dataset-bench-{token}"
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    found = versions()
    print(f"{machine}; " + ", ".join(f"{k} {v}" for k, v in found.items()))
    if SharedCache is None:
        print("stocaching is not installed (pip install stocaching==0.2.1 --no-deps): its column is left out")
    load_before = os.getloadavg()
    start = time.perf_counter()
    log: list[str] = []
    try:
        raw = measure(items, rounds, pairs, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()
    lines, targets, figures = summarize(items, raw)
    print()
    print(
        f"{items:,} images ({'JPEG' if Image is not None else 'zlib'} 64x64 -> uint8 (3, 48, 48) + label), "
        f"batch {BATCH}, {WORKERS} workers, {rounds} rounds, {pairs} extra pairs, "
        f"{raw['charge']} B charged per sample; "
        f"{elapsed:.0f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("\n".join(lines))
    print("speedup = uncached epoch / later epoch; first/unc = first epoch / uncached epoch (medians of all epochs)")
    print()
    for name, value, ok in targets:
        verdict = "not measured" if ok is None else "met" if ok else "MISSED"
        print(f"  {name:<64} {value:<48} {verdict}")
    print(f"wrong samples: {raw['wrong']}")
    result = {
        "items": items,
        "rounds": rounds,
        "machine": machine,
        "versions": found,
        "load_average": {"before": load_before, "after": load_after},
        "seconds": elapsed,
        "charge_bytes": raw["charge"],
        "wrong": raw["wrong"],
        "cached": {f"{lib}_{f:.2f}": v for (lib, f), v in raw["cached"].items()},
        "epochs": raw["times"],
        "epochs_cpu": raw["cpu"],
        "paired_epochs": raw["paired"],
        "figures": figures,
        "targets": [{"target": n, "measured": v, "met": ok} for n, v, ok in targets],
    }
    write_results("dataset_cache", result, args.json)
    if raw["wrong"]:
        print("FAILED: some samples served differ from the uncached samples")
        return 1
    return 2 if args.strict and any(ok is False for _, _, ok in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
