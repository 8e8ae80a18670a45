"""What keying a module costs: wrap time, the per-call key check, and verify_weights.

For a ViT-B-sized module (12 transformer layers of width 768, 86 M parameters, 148
tensors) it measures:

- **wrap**: ``torchcache()(model)`` (every attribute of every submodule through the
  canonical encoder) plus the first module key (every weight hashed), as a user pays
  them once per process and again after each change of weights;
- **check**: the check that runs before every cached call (the weights' version counters,
  and every plain attribute, class value and global the key read, for rebinding), against the
  W1 memory-hit path (a batch of 256 images of 3x64x64 whose (768,) features are all in
  memory), the cost it adds to;
- **verify**: one ``verify_weights`` content check (all weights hashed);
- **huge attributes**: wrap plus first key of a small module that holds a 5 M-entry dict
  (a vocabulary) or a list of 2 M small objects;
- **item check**: the first call of a 16-image batch at 3x224x224 through the ViT-B-sized
  module with the check that items are independent (``check_items``) and without it.

Each figure is the median over ``--repeats`` runs with its minimum and maximum. The
benchmark checks its own results: the cached outputs equal the uncached ones, and the
check sees an in-place change and a rebound attribute. It writes its JSON (``--json``, by default
``benchmarks/results/keys_and_versions.json``) for ``report.py``.

    python benchmarks/keys_and_versions.py [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _meta import write_results
from workloads import CheapFeatures

from torchcache import torchcache
from torchcache.module.independence import forget_checks
from torchcache.module.versions import VersionWatch


class VitB(nn.Module):
    """A ViT-B-sized encoder: 16x16 patch embedding, 12 layers of width 768, 12 heads."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 768, 16, stride=16)
        self.cls = nn.Parameter(torch.zeros(1, 1, 768))
        self.pos = nn.Parameter(torch.zeros(1, 197, 768))
        layer = nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(768)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The class token's features, ``(batch, 768)``."""
        tokens = self.patch(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], dim=1) + self.pos
        return self.norm(self.encoder(tokens))[:, 0]


class Vocabulary(nn.Module):
    """A linear map that holds a large table, as a tokenizer-backed model does."""

    def __init__(self, table: object) -> None:
        super().__init__()
        self.table = table
        self.linear = nn.Linear(4, 4)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear map; the table is only held."""
        return self.linear(x)


class Token:
    """A small object with plain state."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = f"t{index}"


def huge_attribute_wrap(table: object, repeats: int) -> list[float]:
    """Seconds to wrap a module that holds ``table`` and take its first key."""
    times = []
    for _ in range(repeats):
        module = Vocabulary(table)
        start = time.perf_counter()
        torchcache()(module)
        _ = module.cache_instance.module_hash
        times.append(time.perf_counter() - start)
    return times


def first_calls(check: bool, images: torch.Tensor, repeats: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of the first call of a fresh ViT-B-sized module, with or without the item check."""
    times, out = [], torch.empty(0)
    for _ in range(repeats):
        torch.manual_seed(0)
        model = torchcache(check_items=check)(VitB().eval().requires_grad_(False))
        _ = model.cache_instance.module_hash
        forget_checks()
        start = time.perf_counter()
        with torch.no_grad():
            out = model(images)
        times.append(time.perf_counter() - start)
    return times, out


def timed(fn: Callable[[], object], repeats: int, inner: int = 1) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` times (each the mean of ``inner`` calls)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return times


def spread(values: list[float], scale: float) -> dict[str, float]:
    return {
        "median": statistics.median(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
        "runs": len(values),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/keys_and_versions.json")
    args = parser.parse_args()
    torch.manual_seed(0)

    def vit() -> nn.Module:
        return VitB().eval().requires_grad_(False)

    models = [vit() for _ in range(args.repeats)]
    tensors = sum(1 for _ in models[0].parameters()) + sum(1 for _ in models[0].buffers())
    params = sum(p.numel() for p in models[0].parameters())
    wrap = []
    for model in models:
        start = time.perf_counter()
        torchcache()(model)
        _ = model.cache_instance.module_hash
        wrap.append(time.perf_counter() - start)
    cache = models[0].cache_instance
    cache.take_key()  # the watch of the weights and the held values (attributes, class values, globals) of the key
    watch, held = cache._watch, cache._held
    assert watch is not None and held is not None
    check = timed(lambda: watch.changed() or held.changed(), args.repeats, inner=2000)
    bindings = len(held._bindings)
    models[0].encoder.layers[0].norm1.eps = 2e-5  # a plain attribute rebound: seen too
    seen_attribute = held.changed()
    with torch.no_grad():
        models[0].norm.weight.mul_(1.0)
    seen = watch.changed() and seen_attribute
    verify_watch = VersionWatch(models[0], verify_every=1)
    verify_watch.reset()
    verify = timed(verify_watch.changed, args.repeats)
    del models

    features = CheapFeatures().eval().requires_grad_(False)
    plain = CheapFeatures().eval().requires_grad_(False)
    plain.load_state_dict(features.state_dict())
    cached = torchcache()(features)
    images = torch.randn(256, 3, 64, 64)
    with torch.no_grad():
        first = cached(images)
        correct = torch.equal(first, plain(images)) and torch.equal(cached(images), first)
        hit = timed(lambda: cached(images), args.repeats, inner=5)

    vocabulary = huge_attribute_wrap({f"token{i}": i for i in range(5_000_000)}, 3)
    objects = huge_attribute_wrap([Token(i) for i in range(2_000_000)], 3)
    vit_images = torch.randn(16, 3, 224, 224)
    checked, with_check = first_calls(True, vit_images, 3)
    unchecked, without_check = first_calls(False, vit_images, 3)
    torch.manual_seed(0)
    with torch.no_grad():
        reference = VitB().eval()(vit_images)
    correct = correct and torch.allclose(with_check, reference) and torch.allclose(without_check, reference)

    results = {
        "model": f"ViT-B-sized encoder, {params / 1e6:.0f} M parameters, {tensors} tensors",
        "dict_5m_wrap_s": spread(vocabulary, 1.0),
        "objects_2m_wrap_s": spread(objects, 1.0),
        "first_call_checked_s": spread(checked, 1.0),
        "first_call_unchecked_s": spread(unchecked, 1.0),
        "check_share_of_first_call": statistics.median(checked) / statistics.median(unchecked) - 1,
        "wrap_s": spread(wrap, 1.0),
        "check_us": spread(check, 1e6),
        "check_bindings": bindings,
        "w1_hit_ms": spread(hit, 1e3),
        "check_share_of_w1_hit": statistics.median(check) / statistics.median(hit),
        "verify_ms": spread(verify, 1e3),
        "correct": bool(correct and seen),
    }
    print(f"{results['model']}")
    print(f"wrap + first key      {results['wrap_s']['median']:.3f} s [{wrap_range(results['wrap_s'])}]")
    print(f"key check per call    {results['check_us']['median']:.1f} us [{wrap_range(results['check_us'])}]")
    print(f"values it watches     {results['check_bindings']} attributes, class values and globals")
    print(f"W1 memory-hit batch   {results['w1_hit_ms']['median']:.2f} ms [{wrap_range(results['w1_hit_ms'])}]")
    print(f"check / W1 hit        {results['check_share_of_w1_hit']:.2%}")
    print(f"verify_weights check  {results['verify_ms']['median']:.1f} ms [{wrap_range(results['verify_ms'])}]")
    for label, name in (("5 M-entry dict wrap", "dict_5m_wrap_s"), ("2 M objects wrap", "objects_2m_wrap_s")):
        print(f"{label:<22}{results[name]['median']:.2f} s [{wrap_range(results[name])}]")
    print(
        f"first call, checked   {results['first_call_checked_s']['median']:.3f} s against "
        f"{results['first_call_unchecked_s']['median']:.3f} s unchecked (+{results['check_share_of_first_call']:.1%})"
    )
    print(f"correct               {results['correct']}")
    write_results("keys_and_versions", results, args.json)
    return 0 if results["correct"] else 1


def wrap_range(figure: dict[str, float]) -> str:
    return f"{figure['min']:.3g}-{figure['max']:.3g}"


if __name__ == "__main__":
    raise SystemExit(main())
