"""Size, write cost and read cost of each brotli quality on realistic outputs.

Usage::

    python benchmarks/brotli_quality.py [--items N] [--json PATH]

Encodes items exactly as the disk tier does (``encode_frame`` with the window the codec
picks, stored raw when brotli does not shrink the payload to ``RAW_RATIO``), checks that
every frame decodes to its item, and prints per item: the stored size against the raw
size, the encode time (what a miss pays on the writer threads) and the decode time (what
a disk hit pays), single-threaded. Quality ``raw`` is ``brotli_quality`` with compression
never tried. The rows go to ``--json`` (by default
``benchmarks/results/brotli_quality.json``) for ``report.py``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import brotli
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results

from torchcache.codec import RAW_RATIO, encode_frame, encode_header, split_frame

QUALITIES: list[int | None] = [None, 0, 1, 2, 3, 4, 5, 6, 9, 11]


def outputs(kind: str, items: int, shape: tuple[int, ...]) -> list[bytes]:
    """Item payloads of one kind of output: ReLU or GELU float32, or ReLU bfloat16."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(items, *shape, generator=gen)
    if kind == "relu f32":
        y = torch.relu(x)
    elif kind == "gelu f32":
        y = torch.nn.functional.gelu(x)
    else:
        y = torch.relu(x).bfloat16()
    flat = y.reshape(items, -1).view(torch.uint8)
    return [bytes(row.numpy()) for row in flat]


def encode(frames: list[bytes], payloads: list[bytes], quality: int | None) -> None:
    """Encode every payload into ``frames`` (replacing what it held)."""
    header = encode_header({"bench": 1})
    frames[:] = [encode_frame(header, p, quality) for p in payloads]


def per_item_us(fn: Callable[[], object], n: int, repeats: int = 3) -> float:
    """Median over repeats of the time per item of ``fn`` (which handles ``n`` items)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=64, help="items per output kind and shape (default 64)")
    parser.add_argument("--json", help="default: benchmarks/results/brotli_quality.json")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"torch {torch.__version__}, brotli {brotli.__version__}; raw below {RAW_RATIO:.0%} stores raw"
    )
    failures = 0
    rows = []
    for shape, label in (((768,), "(768,)"), ((197, 768), "(197, 768)")):
        n = args.items if shape == (768,) else max(4, args.items // 8)
        print(f"\nitems {label}, {n} per kind; us per item, single thread")
        print(f"{'output':<10} {'quality':>7} {'size/raw':>9} {'encode us':>10} {'decode us':>10}")
        for kind in ("relu f32", "gelu f32", "relu bf16"):
            payloads = outputs(kind, n, shape)
            raw = len(payloads[0])
            for quality in QUALITIES:
                frames: list[bytes] = []
                repeats = 1 if quality is not None and quality >= 9 else 3
                enc = per_item_us(lambda q=quality, f=frames, p=payloads: encode(f, p, q), n, repeats)
                dec = per_item_us(lambda f=frames: [split_frame(x) for x in f], n)
                for frame, payload in zip(frames, payloads):
                    if bytes(split_frame(frame)[1]) != payload:
                        failures += 1
                size = statistics.mean(len(f) for f in frames)
                name = "raw" if quality is None else str(quality)
                print(f"{kind:<10} {name:>7} {size / raw:>9.3f} {enc:>10.0f} {dec:>10.0f}")
                row = {"shape": label, "output": kind, "quality": name, "size_ratio": size / raw}
                rows.append(row | {"encode_us": enc, "decode_us": dec, "items": n})
    print(f"\nchecks: {'all frames decode to their items' if not failures else f'{failures} FAILED'}")
    results = {"brotli": brotli.__version__, "raw_ratio": RAW_RATIO, "rows": rows, "failures": failures}
    write_results("brotli_quality", results, args.json)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
