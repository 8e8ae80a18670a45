"""Linear probe: epochs over ``extract_features`` against a hand-written np.memmap and the uncached backbone.

Usage::

    python benchmarks/linear_probe.py                  # 10,000 samples, then 100,000
    python benchmarks/linear_probe.py --items 10000    # one size
    python benchmarks/linear_probe.py --quick          # 2,000 samples, 3 epochs (a smoke run)
    python benchmarks/linear_probe.py --workers 2 --json out.json

The dataset holds generated uint8 images (3, 32, 32) and int labels; a sample is
``(image as float32 / 255, label)``. The backbone is a small frozen conv net whose
outputs are (512,) float32 (two strided convolutions, a 2x2 average pool). Every epoch
is a ``DataLoader(batch_size=256, num_workers=--workers)`` pass, timed from
``iter(loader)`` to the last batch, that touches each batch. Compared, per size:

- uncached: the images through the backbone, ``shuffle=False``, the outputs dropped as
  a training loop would drop them (what every epoch costs without a cache); the
  reference outputs come from an untimed first pass;
- first epoch: ``extract_features`` into a fresh cache directory (the backbone over the
  dataset, rows written), timed alone (the extraction, which the target is about) and
  with one shuffled pass over the features it returns (what a training loop's first
  epoch costs); run in ``--rounds`` rounds with an uncached epoch and a hand-written
  extraction (the backbone's rows written into an ``np.memmap``, the labels saved, as an
  engineer writes it: the floor of an extraction that keeps its rows), back to back in
  rotating order, after the untimed pass that warms the process up, and judged on the
  median of the rounds' ratios; then again in ``--busy-rounds`` rounds while ``--busy``
  processes (default one per core) spin in pure Python, as other jobs on a shared
  machine would (the extra work of an extraction shows when cores are scarce);
- memmap: the hand-written alternative, the same features written to an ``np.memmap``
  with the labels in an array, read by a ``Dataset`` whose ``__getitem__`` copies one
  row, through the same DataLoader settings, ``shuffle=True``;
- batched gather: the hand-written alternative that reads a whole shuffled batch with
  one fancy index into the memmap (a ``Dataset`` indexed by a list of indices, through
  ``DataLoader(batch_size=None, sampler=BatchSampler(RandomSampler(...), 256, False))``);
- later epochs: ``--epochs`` rounds of a memmap epoch, a features epoch through
  ``DataLoader(features, batch_size=256, shuffle=True)``, a batched-gather epoch and an
  epoch of ``features.loader(256, shuffle=True)``, back to back in rotating order; the
  median of each, and the medians of the ratios features/memmap and loader/gather;
- changed dataset: the same dataset with 1 % of its images changed and 1 % added (a new
  key), extracted into the same root: the backbone must run on those 2 % only (counted
  by a hook), the other rows coming from the first cache; its time against the median
  extraction;
- second process: a new Python process builds the same dataset and backbone, calls
  ``extract_features`` (which finds the cache: the backbone must not run, counted by a
  hook) and runs one shuffled epoch; its time from the call to the last batch, the
  median of ``--children`` such processes (one after another, each timed once), against
  the median of as many new processes that each open the memmap and run one epoch (a
  process's first epoch pays one-time costs, such as Python's first isinstance checks
  of a tensor against the abstract classes ``default_collate`` tests, that a warm
  process's epochs do not).

Checks: every sample of the features equals the memmap's row and label (the memmap
holds the uncached backbone's outputs over the same batches, so equality is bit for
bit), each epoch sees every label once, the second process saw the same features (a
checksum) without a backbone call, and the changed dataset's rows equal the first
cache's where the input is unchanged and the backbone's (up to batch rounding) where it
changed. The run exits 1 if a check failed (2 with ``--strict`` if a target was
missed). Targets: later epochs within 1.5x of the memmap, the first epoch (the
extraction) within 1.1x of uncached, quiet and with every core busy, the second
process's first epoch within 1.5x of the memmap, and ``features.loader`` epochs within
1.5x of the batched gather.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import finish

from torchcache import extract_features

BATCH = 256
TARGETS = {"later": 1.5, "extract": 1.1, "busy": 1.1, "second": 1.5, "loader": 1.5}


class Images(Dataset[Any]):
    """Generated uint8 images and int labels; a sample is ``(float32 image / 255, label)``."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        self.labels = (torch.arange(n) % 10).tolist()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i].float() / 255, self.labels[i]


class Calls:
    """The backbone's calls and samples, counted outside its key (a counting hook would be part of the key)."""

    def __init__(self) -> None:
        self.calls = self.samples = 0

    def __torchcache_key__(self) -> str:
        return "a counter"


class Backbone(torch.nn.Module):
    """A small conv net: (3, 32, 32) images to (512,) features."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = Calls()
        self.layers = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 128, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(2),
            torch.nn.Flatten(),
        )
        self.requires_grad_(False)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, 3, 32, 32) images to (batch, 512) features."""
        self.counted.calls += 1
        self.counted.samples += len(x)
        return self.layers(x)  # type: ignore[no-any-return]


class Memmap(Dataset[Any]):
    """The hand-written alternative: features in an np.memmap, labels in an array."""

    def __init__(self, path: Path, n: int, labels: np.ndarray[Any, Any]) -> None:
        self.features = np.memmap(path, np.float32, "r", shape=(n, 512))
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(self.features[i])), int(self.labels[i])


class MemmapBatches(Memmap):
    """The hand-written batched alternative: one fancy index into the memmap per shuffled batch."""

    def __getitem__(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return torch.from_numpy(self.features[indices]), torch.from_numpy(self.labels[indices])


def batches_of(dataset: Dataset[Any], workers: int) -> DataLoader[Any]:
    """Whole shuffled batches of ``dataset`` indexed by lists of indices, nothing collated again."""
    sampler = BatchSampler(RandomSampler(dataset), BATCH, drop_last=False)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers)


def edited(data: Images, fraction: float) -> tuple[Images, np.ndarray[Any, Any]]:
    """``data`` with ``fraction`` of its images changed and as many new samples appended; the indices computed anew."""
    n = len(data)
    k = max(1, int(n * fraction))
    g = torch.Generator().manual_seed(2)
    changed = torch.randperm(n, generator=g)[:k]
    images = data.images.clone()
    images[changed] = 255 - images[changed]
    out = Images(0)
    out.images = torch.cat([images, torch.randint(0, 256, (k, 3, 32, 32), dtype=torch.uint8, generator=g)])
    out.labels = data.labels + [i % 10 for i in range(k)]
    return out, np.concatenate([np.sort(changed.numpy()), np.arange(n, n + k)])


def make_backbone() -> Backbone:
    torch.manual_seed(0)
    return Backbone()


def epoch(dataset: Dataset[Any] | DataLoader[Any], workers: int, shuffle: bool = True) -> tuple[float, int]:
    """Seconds for one pass, and the sum of the labels seen (each label once per epoch)."""
    if isinstance(dataset, DataLoader):
        loader = dataset
    else:
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=shuffle, num_workers=workers)
    seen = 0
    start = time.perf_counter()
    for x, y in loader:
        seen += int(y.sum()) + 0 * x.shape[0]
    return time.perf_counter() - start, seen


def uncached_epoch(backbone: Backbone, data: Images, workers: int, keep: bool = False) -> tuple[float, torch.Tensor]:
    """Seconds for one pass of the backbone over ``data``, and its outputs when ``keep`` (else an empty tensor).

    A timed epoch does not keep its outputs, as a training loop would not: gathering 205 MB
    of them would time the allocator as much as the backbone.
    """
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, num_workers=workers)
    outputs = []
    start = time.perf_counter()
    with torch.no_grad():
        for x, _ in loader:
            output = backbone(x)
            if keep:
                outputs.append(output)
    return time.perf_counter() - start, torch.cat(outputs) if keep else torch.empty(0)


def child(root: str, n: int, workers: int) -> None:
    """The second process: open the cache through extract_features, run one epoch, report."""
    if root.endswith(".f32"):  # the hand-written alternative: open the memmap, run one epoch
        labels = np.asarray(Images(n).labels, np.int64)
        start = time.perf_counter()
        _, seen = epoch(Memmap(Path(root), n, labels), workers)
        print(json.dumps({"seconds": time.perf_counter() - start, "labels": seen}))
        return
    data, backbone = Images(n), make_backbone()
    start = time.perf_counter()
    features = extract_features(backbone, data, batch_size=BATCH, num_workers=workers, cache_dir=root, progress=False)
    opened = time.perf_counter() - start
    _, seen = epoch(features, workers)
    seconds = time.perf_counter() - start
    checksum = float(sum(float(x.double().sum()) for x, _ in DataLoader(features, batch_size=4096)))
    print(
        json.dumps(
            {
                "seconds": seconds,
                "open_seconds": opened,
                "backbone_calls": backbone.counted.calls,
                "labels": seen,
                "checksum": checksum,
            }
        )
    )


def second_process(root: Path, n: int, workers: int) -> dict[str, Any]:
    """What :func:`child` reports from a new Python process, or ``{"error": ...}``."""
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(root), str(n), str(workers)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


class Busy:
    """``count`` processes spinning in pure Python, one core each, while the block runs (other work on the machine)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.spinners: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Busy:
        self.spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *_: object) -> None:
        for spinner in self.spinners:
            spinner.kill()
            spinner.wait()


def hand_extraction(backbone: Backbone, data: Images, workers: int, path: Path) -> float:
    """Seconds for the extraction an engineer writes by hand: the backbone's rows into an ``np.memmap``, labels saved.

    The file is not flushed (``extract_features`` does not sync either): the kernel writes
    both back when it will.
    """
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, num_workers=workers)
    start = time.perf_counter()
    rows = np.memmap(path, np.float32, "w+", shape=(len(data), 512))
    labels, at = [], 0
    with torch.no_grad():
        for x, y in loader:
            out = backbone(x)
            rows[at : at + len(out)] = out.numpy()
            labels.append(y.numpy())
            at += len(out)
    np.save(path.with_suffix(".labels.npy"), np.concatenate(labels))
    del rows
    return time.perf_counter() - start


def first_epochs(
    n: int,
    data: Images,
    backbone: Backbone,
    reference: torch.Tensor,
    workers: int,
    rounds: int,
    scratch: Path,
    tag: str,
    failures: list[str],
) -> tuple[dict[str, list[float]], Any]:
    """``rounds`` rounds of an uncached epoch, an extraction (and one read epoch) and a hand-written extraction.

    Back to back, in rotating order: a slow spell weighs on all three. Returns the times
    (``uncached``, ``extract``, ``first``, ``hand``, and the rounds' ratios ``first_ratio``,
    ``extract_ratio`` and ``hand_ratio``, each over the round's uncached epoch) and the last
    round's features (open; the others closed and removed). The hand-written rows are
    checked against ``reference`` (untimed).
    """
    keys = ("uncached", "extract", "first", "hand", "first_ratio", "extract_ratio", "hand_ratio")
    times: dict[str, list[float]] = {k: [] for k in keys}
    label_sum = sum(data.labels)
    features = None
    names = ("uncached", "first", "hand")
    for r in range(rounds):
        pair = {}
        for name in names[r % 3 :] + names[: r % 3]:
            if name == "uncached":
                seconds, _ = uncached_epoch(backbone, data, workers)
                times["uncached"].append(seconds)
            elif name == "hand":
                path = scratch / f"hand-{tag}{n}.f32"
                seconds = hand_extraction(backbone, data, workers, path)
                times["hand"].append(seconds)
                if not np.array_equal(np.memmap(path, np.float32, "r", shape=(n, 512)), reference.numpy()):
                    failures.append(f"{n}: the hand-written extraction's rows differ from the uncached backbone's")
                path.unlink()
                path.with_suffix(".labels.npy").unlink()
            else:
                if features is not None:  # the previous round's cache: closed and removed, untimed
                    features.close()
                    shutil.rmtree(scratch / f"root-{tag}{n}-{r - 1}")
                start = time.perf_counter()
                features = extract_features(
                    backbone,
                    data,
                    batch_size=BATCH,
                    num_workers=workers,
                    cache_dir=scratch / f"root-{tag}{n}-{r}",
                    progress=False,
                )
                times["extract"].append(time.perf_counter() - start)
                _, seen = epoch(features, workers)
                seconds = time.perf_counter() - start
                times["first"].append(seconds)
                if seen != label_sum:
                    failures.append(f"{n}: the first epoch over the features did not see every label once")
            pair[name] = seconds
        times["first_ratio"].append(pair["first"] / pair["uncached"])
        times["extract_ratio"].append(times["extract"][-1] / pair["uncached"])
        times["hand_ratio"].append(pair["hand"] / pair["uncached"])
    return times, features


def run_size(
    n: int, workers: int, epochs: int, rounds: int, children: int, scratch: Path, busy: int, busy_rounds: int
) -> tuple[dict[str, Any], list[str]]:
    failures: list[str] = []
    data, backbone = Images(n), make_backbone()
    labels = np.asarray(data.labels, np.int64)
    label_sum = int(labels.sum())
    # Untimed, and the reference outputs: the process's first pass over the data pays for
    # warming the allocator (page faults on every new buffer until the heap has grown) and
    # torch's kernels; whichever side ran first would pay it.
    _, reference = uncached_epoch(backbone, data, workers, keep=True)
    loaded: dict[str, list[float]] = {}
    if busy and busy_rounds:  # every core busy with other work: extraction must not cost more than it does quiet
        with Busy(busy):
            loaded, features = first_epochs(
                n, data, backbone, reference, workers, busy_rounds, scratch, "busy-", failures
            )
        assert features is not None
        features.close()
    quiet, features = first_epochs(n, data, backbone, reference, workers, rounds, scratch, "", failures)
    uncached_times, firsts, extracts = quiet["uncached"], quiet["first"], quiet["extract"]
    first_ratios, extract_ratios = quiet["first_ratio"], quiet["extract_ratio"]
    assert features is not None and features.path is not None
    root = features.path.parent.parent
    uncached, first = statistics.median(uncached_times), statistics.median(firsts)
    mm_path = scratch / f"features-{n}.f32"
    mm = np.memmap(mm_path, np.float32, "w+", shape=(n, 512))
    mm[:] = reference.numpy()
    mm.flush()
    del mm
    memmap = Memmap(mm_path, n, labels)

    for i, (x, y) in enumerate(DataLoader(features, batch_size=4096)):
        rows = slice(i * 4096, i * 4096 + len(x))
        if not torch.equal(x, reference[rows]) or not np.array_equal(y.numpy(), labels[rows]):
            failures.append(f"{n}: features {rows.start}-{rows.stop} differ from the uncached backbone's")

    kinds = {
        "memmap": lambda: memmap,
        "features": lambda: features,
        "gather": lambda: batches_of(MemmapBatches(mm_path, n, labels), workers),
        "loader": lambda: features.loader(BATCH, shuffle=True, num_workers=workers),
    }
    first_batch = next(iter(features.loader(BATCH)))
    if not torch.equal(first_batch[0], reference[:BATCH]) or first_batch[1].tolist() != labels[:BATCH].tolist():
        failures.append(f"{n}: features.loader's first batch differs from the uncached backbone's")
    times: dict[str, list[float]] = {name: [] for name in kinds}
    ratios, batched_ratios = [], []
    names = list(kinds)
    for r in range(epochs):
        pair = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotating: a slow spell weighs on all
            seconds, seen = epoch(kinds[name](), workers)
            if seen != label_sum:
                failures.append(f"{n}: a {name} epoch did not see every label once")
            pair[name] = seconds
            times[name].append(seconds)
        ratios.append(pair["features"] / pair["memmap"])
        batched_ratios.append(pair["loader"] / pair["gather"])
    memmap_median = statistics.median(times["memmap"])

    second_times, memmap_children, opens, calls = [], [], [], []
    checksum = float(reference.double().sum())
    for _ in range(children):  # each a fresh process: one first epoch each, judged on their median
        alternative = second_process(mm_path, n, workers)
        if "error" in alternative or alternative["labels"] != label_sum:
            failures.append(f"{n}: the memmap's second process failed: {alternative}")
        memmap_children.append(alternative.get("seconds", float("nan")))
        second = second_process(root, n, workers)
        if "error" in second:
            failures.append(f"{n}: the second process failed: {second['error']}")
        elif (
            second["backbone_calls"]
            or second["labels"] != label_sum
            or abs(second["checksum"] - checksum) > 1e-6 * abs(checksum)
        ):
            failures.append(f"{n}: the second process ran the backbone or saw other features: {second}")
        second_times.append(second.get("seconds", float("nan")))
        opens.append(second.get("open_seconds", float("nan")))
        calls.append(second.get("backbone_calls", -1))
    # A changed dataset (1 % of the images changed, 1 % added): a new cache in the same root
    # that takes the rows of the inputs it has seen from the older one.
    changed_data, fresh = edited(data, 0.01)
    before = backbone.counted.samples
    start = time.perf_counter()
    changed = extract_features(
        backbone, changed_data, batch_size=BATCH, num_workers=workers, cache_dir=root, progress=False
    )
    changed_seconds = time.perf_counter() - start
    seen = backbone.counted.samples - before
    if seen != len(fresh):
        failures.append(f"{n}: the changed dataset ran the backbone on {seen} samples, not {len(fresh)}")
    got = torch.cat([x for x, _ in DataLoader(changed, batch_size=4096)])
    old = np.setdiff1d(np.arange(n), fresh)
    with torch.no_grad():
        direct = backbone(changed_data.images[torch.from_numpy(fresh)].float() / 255)
    if not torch.equal(got[torch.from_numpy(old)], reference[torch.from_numpy(old)]) or not torch.allclose(
        got[torch.from_numpy(fresh)], direct, atol=1e-5
    ):
        failures.append(f"{n}: the changed dataset's features differ from the backbone's")
    changed.close()

    result = {
        "items": n,
        "feature_shape": [512],
        "batch_size": BATCH,
        "workers": workers,
        "uncached_epoch_s": uncached,
        "uncached_epochs_s": uncached_times,
        "extract_s": statistics.median(extracts),
        "first_epoch_s": first,
        "first_epochs_s": firsts,
        "extracts_s": extracts,
        "extract_over_uncached": statistics.median(extract_ratios),
        "hand_extracts_s": quiet["hand"],
        "hand_extract_over_uncached": statistics.median(quiet["hand_ratio"]),
        "busy_hand_extracts_s": loaded.get("hand", []),
        "busy_hand_extract_over_uncached": statistics.median(loaded["hand_ratio"]) if loaded else None,
        "busy_processes": busy if loaded else 0,
        "busy_uncached_epochs_s": loaded.get("uncached", []),
        "busy_extracts_s": loaded.get("extract", []),
        "busy_extract_over_uncached": statistics.median(loaded["extract_ratio"]) if loaded else None,
        "busy_first_over_uncached": statistics.median(loaded["first_ratio"]) if loaded else None,
        "first_over_uncached": statistics.median(first_ratios),
        "memmap_epoch_s": memmap_median,
        "features_epoch_s": statistics.median(times["features"]),
        "later_over_memmap": statistics.median(ratios),
        "gather_epoch_s": statistics.median(times["gather"]),
        "loader_epoch_s": statistics.median(times["loader"]),
        "loader_over_gather": statistics.median(batched_ratios),
        "later_epochs_s": times,
        "second_process_first_epoch_s": statistics.median(second_times),
        "second_process_first_epochs_s": second_times,
        "second_process_open_s": statistics.median(opens),
        "second_process_memmap_epochs_s": memmap_children,
        "second_over_memmap": statistics.median(second_times) / statistics.median(memmap_children),
        "second_process_backbone_calls": max(calls, key=abs),
        "bytes_on_disk": features.file.size,
        "changed_samples": len(fresh),
        "changed_items": len(changed_data),
        "changed_extract_s": changed_seconds,
        "changed_over_extract": changed_seconds / statistics.median(extracts),
        "changed_backbone_samples": seen,
        "correct": not failures,
    }
    features.close()
    return result, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, action="append", help="samples (repeatable; default 10,000 and 100,000)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers in every epoch (default 0)")
    parser.add_argument("--epochs", type=int, help="rounds of later epochs (default 8; 4 with --quick)")
    parser.add_argument(
        "--rounds", type=int, help="rounds of uncached, first and hand-written epochs (default 9; 1 with --quick)"
    )
    parser.add_argument("--children", type=int, help="second processes, each timed once (default 5; 1 with --quick)")
    parser.add_argument(
        "--busy", type=int, help="processes spinning while extractions are timed again (default: one per core; 0: none)"
    )
    parser.add_argument("--busy-rounds", type=int, help="rounds timed while they spin (default 5; 1 quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2,000 samples, 3 pairs")
    parser.add_argument("--json", help="default: benchmarks/results/linear_probe.json")
    parser.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    sizes = args.items or ([2000] if args.quick else [10_000, 100_000])
    epochs = args.epochs or (4 if args.quick else 8)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict[str, Any] = {}
    failures: list[str] = []
    missed = []
    with tempfile.TemporaryDirectory(prefix="linear-probe-") as scratch:
        for n in sizes:
            rounds = args.rounds or (1 if args.quick else 9)
            children = args.children or (1 if args.quick else 5)
            busy = len(os.sched_getaffinity(0)) if args.busy is None else args.busy
            busy_rounds = args.busy_rounds or (1 if args.quick else 5)
            result, failed = run_size(n, args.workers, epochs, rounds, children, Path(scratch), busy, busy_rounds)
            failures += failed
            results[str(n)] = result
            print(
                f"{n:>7,} samples: uncached epoch {result['uncached_epoch_s']:.2f} s | extraction "
                f"{result['extract_s']:.2f} s ({result['extract_over_uncached']:.2f}x uncached; with a read epoch "
                f"{result['first_epoch_s']:.2f} s, {result['first_over_uncached']:.2f}x; with {busy} cores busy "
                f"{result['busy_extract_over_uncached'] or float('nan'):.2f}x; by hand into an np.memmap "
                f"{result['hand_extract_over_uncached']:.2f}x) | later epochs: memmap "
                f"{result['memmap_epoch_s'] * 1e3:.1f} ms, "
                f"features {result['features_epoch_s'] * 1e3:.1f} ms ({result['later_over_memmap']:.2f}x); batched: "
                f"gather {result['gather_epoch_s'] * 1e3:.1f} ms, loader {result['loader_epoch_s'] * 1e3:.1f} ms "
                f"({result['loader_over_gather']:.2f}x) | second "
                f"process {result['second_process_first_epoch_s'] * 1e3:.1f} ms ({result['second_over_memmap']:.2f}x a "
                f"memmap's, {result['second_process_backbone_calls']} backbone calls) | changed dataset "
                f"{result['changed_extract_s']:.2f} s ({result['changed_over_extract']:.2f}x extraction, backbone "
                f"on {result['changed_backbone_samples']:,} samples)"
            )
            for key, target in (
                ("later_over_memmap", "later"),
                ("extract_over_uncached", "extract"),
                ("busy_extract_over_uncached", "busy"),
                ("second_over_memmap", "second"),
                ("loader_over_gather", "loader"),
            ):
                if result[key] is None:  # not measured (--busy 0)
                    continue
                met = result[key] <= TARGETS[target]
                results[f"{n} {key}"] = result[key]
                if not met:
                    missed.append(f"{n}: {key} {result[key]:.2f} > {TARGETS[target]}")
    results["targets"] = {
        "later epochs within 1.5x of the memmap": TARGETS["later"],
        "first epoch (extraction) within 1.1x of uncached": TARGETS["extract"],
        "first epoch (extraction) within 1.1x of uncached, every core busy with other work": TARGETS["busy"],
        "second process's first epoch within 1.5x of the memmap": TARGETS["second"],
        "features.loader epochs within 1.5x of the batched memmap gather": TARGETS["loader"],
    }
    return finish("linear_probe", results, args.json, failures, missed, args.strict)


if __name__ == "__main__":
    sys.exit(main())
