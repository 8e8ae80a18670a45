"""A cached ResNet-50 on a GPU: what keying and each kind of hit cost against the plain forward.

For a torchvision ResNet-50 at 224 px, batch 256, on CUDA, in fp32 and under bf16
autocast, it measures (each the median of ``--repeats`` timed batches after a warm-up,
with the device synchronised around each):

- **a** the plain forward;
- **b** keying alone: every input byte hashed on the device, 32 bytes per item to the host;
- **c** an all-hit batch from the host memory tier (``memory_cache_device="cpu"``);
- **d** an all-hit batch from the device memory tier (``memory_cache_device="cuda"``);
- **e** an all-hit batch read from disk by a fresh process (memory tier off);
- **f** a first pass (all misses, ``persistent=True``) against **a**.

The targets: **b** at most 5 % of **a**, **c** at least 10x faster than **a**, **d** at
least 50x, **f** at most 1.05x **a**. Outputs are checked: every cached batch equals the
batch the cache computed, and the first pass equals the plain forward. Without a CUDA
device it exits with a message and writes nothing.

    python benchmarks/gpu.py [--repeats 7] [--batch 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results

from torchcache import torchcache
from torchcache.keys import Context, hash_items

HERE = str(Path(__file__).resolve().parent)


def resnet50() -> nn.Module:
    """The ResNet-50 of torchvision, with random weights."""
    torch.manual_seed(0)
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None).eval().requires_grad_(False)
    except ImportError:  # pragma: no cover - the GPU machines have torchvision
        raise SystemExit("benchmarks/gpu.py needs torchvision (it measures its ResNet-50)") from None


DEVICE = os.environ.get("TORCHCACHE_BENCH_DEVICE", "cuda")  # "cpu": a smoke run of the script itself


def autocast(bf16: bool) -> AbstractContextManager[Any]:
    return torch.autocast(DEVICE, dtype=torch.bfloat16) if bf16 else nullcontext()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls, the device synchronised before and after each."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def spread(values: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values) * 1e3, "min_ms": min(values) * 1e3, "max_ms": max(values) * 1e3}


def batches(count: int, batch: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(batch, 3, 224, 224, device=DEVICE, generator=generator) for _ in range(count)]


_DISK_CHILD = """
import json, statistics, sys, time, torch
sys.path.insert(0, sys.argv[4])
from gpu import DEVICE, autocast, resnet50, sync
from torchcache import torchcache
root, bf16, repeats = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
data = torch.load(sys.argv[5])
model = torchcache(persistent=True, persistent_cache_dir=root, max_memory_cache_size=0)(resnet50().to(DEVICE))
times, same = [], True
for x, want in zip(data["x"], data["want"]):
    x = x.to(DEVICE)
    sync()
    start = time.perf_counter()
    with torch.no_grad(), autocast(bf16):
        out = model(x)
    sync()
    times.append(time.perf_counter() - start)
    same = same and torch.equal(out.cpu(), want)
stats = model.cache_instance.stats()
print(json.dumps({"times": times, "same": same, "hits": stats.hits, "misses": stats.misses}))
"""


def measure(bf16: bool, batch: int, repeats: int) -> dict[str, Any]:
    plain = resnet50().to(DEVICE)
    xs = batches(repeats + 1, batch, seed=1)
    with torch.no_grad(), autocast(bf16):
        forward = timed(lambda: plain(xs[0]), repeats)
        context = Context("gpu-benchmark").digest()
        keying = timed(lambda: hash_items(context, [xs[0]]), repeats)
        results: dict[str, Any] = {"a_forward": spread(forward), "b_keying": spread(keying)}
        correct = True
        for name, device in (("c_host_memory_hit", "cpu"), ("d_device_memory_hit", "cuda")):
            tier = device if DEVICE == "cuda" else "cpu"
            model = torchcache(memory_cache_device=tier, max_memory_cache_size="8GB")(resnet50().to(DEVICE))
            first = model(xs[0])  # computed and kept (the item check runs here, untimed)
            hits = timed(lambda model=model: model(xs[0]), repeats)
            correct = correct and torch.equal(model(xs[0]), first)
            results[name] = spread(hits)
        with tempfile.TemporaryDirectory() as root:
            disk = torchcache(persistent=True, persistent_cache_dir=root, max_memory_cache_size=0)
            model = disk(resnet50().to(DEVICE))
            model(xs[0][:2])  # the item check and the tier's opening, untimed
            computed: list[torch.Tensor] = []
            first_pass = timed_each(lambda x: computed.append(model(x)), xs[1:])
            outs = [model(x) for x in xs[1:]]  # now hits (from the write queue or the disk)
            correct = correct and all(torch.equal(o, c) for o, c in zip(outs, computed))
            tolerance = {"atol": 1e-2, "rtol": 1e-2} if bf16 else {"atol": 1e-4, "rtol": 1e-4}
            correct = correct and all(torch.allclose(c, plain(x), **tolerance) for c, x in zip(computed, xs[1:]))
            model.cache_instance.flush()
            results["f_first_pass"] = spread(first_pass)
            state = Path(root) / "batches.pt"
            torch.save({"x": [x.cpu() for x in xs[1:]], "want": [o.cpu() for o in outs]}, state)
            child = subprocess.run(
                [sys.executable, "-c", _DISK_CHILD, root, "1" if bf16 else "0", str(repeats), HERE, str(state)],
                capture_output=True,
                text=True,
                check=False,
            )
            if child.returncode != 0:
                raise SystemExit(f"the fresh process failed:\n{child.stderr[-3000:]}")
            report = json.loads(child.stdout.strip().splitlines()[-1])
            correct = correct and report["same"] and report["misses"] == 0
            results["e_disk_hit_fresh_process"] = spread(report["times"])
    a = results["a_forward"]["median_ms"]
    results["ratios"] = {
        "b_keying_over_a": results["b_keying"]["median_ms"] / a,
        "a_over_c": a / results["c_host_memory_hit"]["median_ms"],
        "a_over_d": a / results["d_device_memory_hit"]["median_ms"],
        "a_over_e": a / results["e_disk_hit_fresh_process"]["median_ms"],
        "f_over_a": results["f_first_pass"]["median_ms"] / a,
    }
    results["correct"] = bool(correct)
    return results


def timed_each(fn: Callable[[torch.Tensor], Any], inputs: list[torch.Tensor]) -> list[float]:
    """Seconds of ``fn`` on each input, the device synchronised before and after each."""
    times = []
    for x in inputs:
        sync()
        start = time.perf_counter()
        fn(x)
        sync()
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/gpu.json")
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; nothing measured")
        return 0
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (a smoke run)",
        "model": "torchvision resnet50, random weights, 224 px",
        "batch": args.batch,
        "torch": torch.__version__,
    }
    for precision, bf16 in (("fp32", False), ("bf16_autocast", True)):
        results[precision] = measure(bf16, args.batch, args.repeats)
        r = results[precision]
        print(
            f"{precision:>14}: forward {r['a_forward']['median_ms']:.1f} ms, "
            f"keying {r['b_keying']['median_ms']:.2f} ms "
            f"({r['ratios']['b_keying_over_a']:.1%}), host-memory hit {r['c_host_memory_hit']['median_ms']:.2f} ms "
            f"({r['ratios']['a_over_c']:.1f}x), device-memory hit {r['d_device_memory_hit']['median_ms']:.2f} ms "
            f"({r['ratios']['a_over_d']:.1f}x), disk hit {r['e_disk_hit_fresh_process']['median_ms']:.1f} ms "
            f"({r['ratios']['a_over_e']:.1f}x), first pass {r['ratios']['f_over_a']:.2f}x, correct {r['correct']}"
        )
    write_results("gpu", results, args.json)
    return 0 if all(results[p]["correct"] for p in ("fp32", "bf16_autocast")) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
