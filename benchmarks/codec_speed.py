"""Size, encode cost and decode cost of each frame codec on realistic outputs.

Usage::

    python benchmarks/codec_speed.py [--items N] [--json PATH]

For ReLU float32 features shaped (197, 768) (sparse), GELU-like float32 features of the
same shape (dense) and int64 token ids, encodes every item with each codec the disk tier
can store, checks that every frame decodes to its item, and prints per item, single
threaded: the codec the frame ended up with, the stored size against the raw size, the
encode time (what a miss pays on the writer threads) and the decode time (``split_frame``:
checksum plus decoding, what a disk hit pays before its one copy into the batch).

Modes: ``raw`` never compresses; ``zero`` tries zero elision only (a payload with too few
zero words stays raw); ``brotli5`` tries brotli quality 5 only; ``auto`` is what the disk
tier does when it tries both (zero elision, then brotli only when it beats it by a
margin). The rows go to ``--json`` (by default ``benchmarks/results/codec_speed.json``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _meta import write_results
from brotli_quality import per_item_us

from torchcache.codec import encode_frame, encode_header, split_frame, word_size

MODES: dict[str, tuple[int | None, bool]] = {
    "raw": (None, False),
    "zero": (None, True),
    "brotli5": (5, False),
    "auto": (5, True),
}
CODEC_NAMES = {0: "raw", 1: "brotli", 2: "zero"}


def outputs(kind: str, items: int) -> tuple[list[bytes], int]:
    """Item payloads of one kind of output, and the word size the disk tier would use."""
    gen = torch.Generator().manual_seed(0)
    if kind == "relu f32 (197,768)":
        y = torch.relu(torch.randn(items, 197, 768, generator=gen))
    elif kind == "gelu f32 (197,768)":
        y = torch.nn.functional.gelu(torch.randn(items, 197, 768, generator=gen))
    else:
        y = torch.randint(0, 32000, (items, 512), generator=gen, dtype=torch.int64)
    flat = y.reshape(items, -1).view(torch.uint8)
    word = word_size([y.dtype.itemsize], [flat.shape[1]])
    return [bytes(row.numpy()) for row in flat], word


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--json", help="default: benchmarks/results/codec_speed.json")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, numpy {np.__version__}")
    print(f"{'output':<20} {'mode':<8} {'codec':<7} {'size':>6} {'encode us':>10} {'decode us':>10} {'MB/s':>7}")
    header = encode_header({"bench": 1})
    rows = []
    for kind in ("relu f32 (197,768)", "gelu f32 (197,768)", "int64 ids (512,)"):
        payloads, word = outputs(kind, args.items)
        raw_bytes = len(payloads[0])
        for mode, (quality, elide) in MODES.items():
            use_word = word if elide else None
            frames: list[bytes] = []

            def encode(
                q: int | None = quality,
                w: int | None = use_word,
                out: list[bytes] = frames,
                items: list[bytes] = payloads,
            ) -> None:
                out[:] = [encode_frame(header, p, q, w) for p in items]

            enc = per_item_us(encode, len(payloads), repeats=1 if quality is not None else 3)
            for frame, payload in zip(frames, payloads):
                if bytes(split_frame(frame)[1]) != payload:
                    raise SystemExit(f"{kind} {mode}: a frame does not decode to its item")
            dec = per_item_us(lambda f=frames: [split_frame(x) for x in f], len(frames))
            codecs = sorted({CODEC_NAMES[f[5]] for f in frames})
            ratio = statistics.mean(len(f) for f in frames) / raw_bytes
            speed = raw_bytes / dec
            print(f"{kind:<20} {mode:<8} {'/'.join(codecs):<7} {ratio:>5.3f}x {enc:>10.0f} {dec:>10.0f} {speed:>7.0f}")
            rows.append({"output": kind, "mode": mode, "codec": "/".join(codecs), "size_ratio": ratio})
            rows[-1] |= {"encode_us": enc, "decode_us": dec, "decode_mb_s": speed, "raw_bytes": raw_bytes}
        print(f"{'':<20} ({raw_bytes} bytes per item, word size {word}; round trips checked)")
    write_results("codec_speed", {"items": args.items, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
