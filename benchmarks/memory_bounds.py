"""Resident memory under a memory budget, as the machine feels it, in the cases that once broke it.

Each case runs in a fresh subprocess with the cyclic garbage collector off (so a
reference cycle on the call path would show as growth), and reports the growth of the
process's resident memory (``/proc/self/statm``) over the calls against the budget and
against what ``stats()`` says the memory tier holds:

- ``widening``: outputs whose width changes from call to call (1 to 8 x 1,024 floats per
  item, 64 new items a batch), 50 MB budget, 300 batches;
- ``wide``: 64 x 16,384 float outputs a batch, 50 MB budget, 300 batches;
- ``workers``: a ``CachedDataset`` (RAM tier, 50 MB) read by a DataLoader with 2 workers
  for 3 epochs of 2,000 samples of 16 KB; the figure is the main process's growth plus
  each worker's peak.

The bound checked: growth at most the budget plus 10 % plus 50 MB. It writes ``--json``
for ``report.py``.

    python benchmarks/memory_bounds.py [--json results/memory_bounds.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _meta import write_results

BUDGET = 50_000_000
BOUND = BUDGET + BUDGET // 10 + 50_000_000

CHILD = r"""
import gc, json, os, sys, tempfile
import torch
from torch import nn
sys.path.insert(0, sys.argv[2])
from torchcache import CachedDataset, torchcache

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

case, budget = sys.argv[1], int(sys.argv[3])
gc.collect()
gc.disable()
if case in ("widening", "wide"):
    @torchcache(max_memory_cache_size=budget)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.requires_grad_(False)

        def forward(self, x):
            times = 64 * (1 + int(x[0, 0])) if case == "widening" else 1024
            return x.repeat(1, times) * self.scale

    net = Net()
    def batch(i):
        x = torch.randn(64, 16)
        if case == "widening":
            x[:, 0] = i % 8
        return x
    for i in range(8):
        net(batch(i))
    before, peak = rss(), 0
    for i in range(300):
        out = net(batch(i))
        del out
        peak = max(peak, rss())
    held = net.cache_instance.stats().memory.bytes
    print(json.dumps({"growth": peak - before, "held": held}))
else:
    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 2000
        def __getitem__(self, i):
            return torch.full((4096,), float(i))

    class Peak(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner
        def __len__(self):
            return len(self.inner)
        def __getitem__(self, i):
            sample = self.inner[i]
            return sample, rss()

    data = CachedDataset(Samples(), max_memory_size=budget)
    loader = torch.utils.data.DataLoader(Peak(data), batch_size=64, num_workers=2, multiprocessing_context="fork")
    before, peak, worker_start, worker_peak = rss(), 0, None, 0
    for epoch in range(3):
        for samples, worker_rss in loader:
            peak = max(peak, rss())
            worker_peak = max(worker_peak, int(worker_rss.max()))
            worker_start = int(worker_rss.min()) if worker_start is None else min(worker_start, int(worker_rss.min()))
    held = data.stats().memory.bytes
    data.close()
    print(json.dumps({"growth": peak - before + (worker_peak - worker_start), "held": held}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    results: dict[str, object] = {"budget MB": BUDGET / 1e6, "bound MB": BOUND / 1e6}
    ok = True
    for case in ("widening", "wide", "workers"):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, case, root, str(BUDGET)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        within = figures["growth"] <= BOUND
        ok = ok and within
        results[f"{case}: RSS growth MB"] = round(figures["growth"] / 1e6, 1)
        results[f"{case}: tier holds MB"] = round(figures["held"] / 1e6, 1)
        results[f"{case}: within the bound"] = within
        print(
            f"{case:9s} RSS growth {figures['growth'] / 1e6:7.1f} MB, tier holds {figures['held'] / 1e6:5.1f} MB, "
            f"budget {BUDGET / 1e6:.0f} MB, bound {BOUND / 1e6:.0f} MB: {'within' if within else 'OVER'}"
        )
    write_results("memory_bounds", results, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
