"""Later epochs of a linear probe's training loop: ``features.loader`` against a hand-written batched gather.

Usage::

    python benchmarks/probe_training.py                 # 10,000 and 100,000 samples
    python benchmarks/probe_training.py --items 20000   # one size (repeatable)
    python benchmarks/probe_training.py --json out.json

``linear_probe.py`` times reads alone; this times what a probe's later epochs cost:
each batch goes through a linear head (forward, cross-entropy, backward, an SGD step).
The features are ``linear_probe.py``'s (its generated images and small conv backbone,
(512,) float32 features, batch 256, ``num_workers=0``), extracted once into a
temporary root; the hand-written alternative is the same features in an ``np.memmap``
read with one fancy index per shuffled batch (``linear_probe.MemmapBatches``).

``--epochs`` rounds each run one epoch of both, in alternating order, every epoch
training a new head from the same initial weights on the order drawn by a generator
seeded with the round: both sides see the same batches, so their trained heads must be
equal bit for bit (checked, with every label seen once per epoch). The figure is the
median over the rounds of the ratio of the two epochs' times. Target: at most 1.2x.
Exits 1 if a check failed (2 with ``--strict`` if the target was missed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import finish
from linear_probe import BATCH, Images, MemmapBatches, make_backbone

from torchcache import extract_features

TARGET = 1.2


def train_epoch(batches: Any, classes: int = 10) -> tuple[float, int, torch.Tensor]:
    """Seconds for one epoch of a new linear head's training over ``batches``, the labels' sum, the trained weights."""
    torch.manual_seed(0)
    head = torch.nn.Linear(512, classes)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    seen = 0
    start = time.perf_counter()
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(head(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += int(y.sum())
    seconds = time.perf_counter() - start
    return seconds, seen, torch.cat([head.weight.detach().flatten(), head.bias.detach()])


def run_size(n: int, epochs: int, scratch: Path) -> tuple[dict[str, Any], list[str]]:
    failures: list[str] = []
    data = Images(n)
    labels = np.asarray(data.labels, np.int64)
    root = scratch / f"root-{n}"
    features = extract_features(make_backbone(), data, batch_size=BATCH, cache_dir=root, progress=False)
    mm_path = scratch / f"features-{n}.f32"
    mm = np.memmap(mm_path, np.float32, "w+", shape=(n, 512))
    for start in range(0, n, 4096):  # the cache's features, row for row (linear_probe.py checks them)
        stop = min(n, start + 4096)
        mm[start:stop] = features.batch(np.arange(start, stop))[0].numpy()
    mm.flush()
    del mm
    gathered = MemmapBatches(mm_path, n, labels)

    def kinds(round_: int) -> dict[str, Any]:
        def gather() -> DataLoader[Any]:  # as DataLoader(shuffle=True, generator=g) draws: g seeds the workers too
            g = torch.Generator().manual_seed(round_)
            sampler = BatchSampler(RandomSampler(gathered, generator=g), BATCH, drop_last=False)  # type: ignore[arg-type]
            return DataLoader(gathered, batch_size=None, sampler=sampler, generator=g)

        return {
            "gather": gather,
            "loader": lambda: features.loader(BATCH, shuffle=True, generator=torch.Generator().manual_seed(round_)),
        }

    train_epoch(features.loader(BATCH, shuffle=True))  # untimed: the process warms up
    times: dict[str, list[float]] = {"gather": [], "loader": []}
    ratios = []
    for r in range(epochs):
        made, pair, weights = kinds(r), {}, {}
        for name in ("gather", "loader") if r % 2 == 0 else ("loader", "gather"):
            seconds, seen, weights[name] = train_epoch(made[name]())
            if seen != int(labels.sum()):
                failures.append(f"{n}: a {name} epoch did not see every label once")
            pair[name] = seconds
            times[name].append(seconds)
        if not torch.equal(weights["gather"], weights["loader"]):
            failures.append(f"{n}: round {r}: the heads trained on the cache and on the memmap differ")
        ratios.append(pair["loader"] / pair["gather"])
    features.close()
    return {
        "items": n,
        "epochs": epochs,
        "gather_epochs_s": times["gather"],
        "loader_epochs_s": times["loader"],
        "ratios": ratios,
        "loader_over_gather": statistics.median(ratios),
        "correct": not failures,
    }, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, action="append", help="samples (repeatable; default 10,000 and 100,000)")
    parser.add_argument("--epochs", type=int, default=8, help="rounds of one epoch each (default 8)")
    parser.add_argument("--json", help="default: benchmarks/results/probe_training.json")
    parser.add_argument("--strict", action="store_true", help="exit 2 when the target is missed")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    failures: list[str] = []
    missed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="probe-training-") as scratch:
        for n in args.items or [10_000, 100_000]:
            result, failed = run_size(n, args.epochs, Path(scratch))
            failures += failed
            results[str(n)] = result
            ratio = result["loader_over_gather"]
            gather, loader = (statistics.median(result[f"{k}_epochs_s"]) * 1e3 for k in ("gather", "loader"))
            print(
                f"{n:>7,} samples: training epoch, batched gather {gather:.1f} ms, features.loader {loader:.1f} ms "
                f"({ratio:.2f}x, "
                f"median of {result['epochs']} rounds)"
            )
            if ratio > TARGET:
                missed.append(f"{n}: loader_over_gather {ratio:.2f} > {TARGET}")
    results["target"] = TARGET
    return finish("probe_training", results, args.json, failures, missed, args.strict)


if __name__ == "__main__":
    sys.exit(main())
