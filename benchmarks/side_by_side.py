"""Two commits side by side: each benchmark run on both, in turns, on one machine at one time.

Usage::

    python benchmarks/side_by_side.py --base REV                # quick sizes, 2 turns each
    python benchmarks/side_by_side.py --base REV --pairs 3 --only dataset_cache,disk_tier

The base commit is checked out in a temporary ``git worktree`` and imported from there
(``PYTHONPATH``); the working tree is the other side. Each turn runs every benchmark once
on each side, the side that goes first alternating from turn to turn, so that a slow
spell of a shared machine weighs on both. Each benchmark checks its own results (wrong
samples, hits equal to the forward) and its headline figures are taken from the JSON it
writes; the medians over the turns, and their ratio, go to
``benchmarks/results/side_by_side.json`` (rendered into RESULTS.md by ``report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _meta import write_results  # noqa: E402

Figures = Callable[[dict[str, Any]], dict[str, float]]


def _dataset_cache(r: dict[str, Any]) -> dict[str, float]:
    f = r["figures"]
    out = {"uncached epoch, s": f["uncached_s"], "preloaded floor, s": f["floor_s"]}
    for fraction in ("0.50", "1.00"):
        out[f"{fraction[:4]} cached: first epoch, s"] = f[f"torchcache_{fraction}"]["first_s"]
        out[f"{fraction[:4]} cached: later epoch, s"] = f[f"torchcache_{fraction}"]["later_s"]
    assert r["wrong"] == 0, "dataset_cache returned wrong samples"
    return out


def _disk_tier(r: dict[str, Any]) -> dict[str, float]:
    keys = {"fill_us": "fill, us/item", "hit_ms": "1,024 random hits, ms", "floor_ms": "read floor, ms"}
    return {label: r[key] for key, label in keys.items()}


def _linear_probe(r: dict[str, Any]) -> dict[str, float]:
    assert r["correct"], "linear_probe read wrong features"
    (items,) = [k for k in r if k.isdigit()]
    f = r[items]
    keys = {
        "extract_s": "extraction",
        "features_epoch_s": "later epoch, samples",
        "loader_epoch_s": "later epoch, batches",
        "second_process_first_epoch_s": "second process's first epoch",
    }
    return {f"{int(items):,} samples: {label}, ms": f[key] * 1000 for key, label in keys.items()}


def _compare(r: dict[str, Any]) -> dict[str, float]:
    assert r["checks_failed"] == 0, "compare's hits differed from the forward"
    out, workload = {}, ""
    for row in r["table"][1:]:
        workload = row[0] or workload
        found = re.match(r"([\d.]+)", row[3])
        if found and row[2].startswith("ms"):
            out[f"{workload}: {row[1]}, {row[2]}"] = float(found.group(1))
    return out


#: name: (quick arguments, full arguments, headline figures of its ``results``)
BENCHMARKS: dict[str, tuple[list[str], list[str], Figures]] = {
    "dataset_cache": (["--quick"], [], _dataset_cache),
    "disk_tier": (["--items", "20000", "--rounds", "5"], [], _disk_tier),
    "linear_probe": (["--quick"], [], _linear_probe),
    "compare": (["--quick", "--no-wait"], ["--no-wait"], _compare),
}


def _run(name: str, args: list[str], cwd: Path, base: bool, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(cwd)} if base else dict(os.environ)
    command = [sys.executable, str(cwd / "benchmarks" / f"{name}.py"), *args, "--json", str(out)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if not out.is_file():  # a missed target still writes its figures (exit 1 or 2); a failed check does not
        side = "base" if base else "working tree"
        raise SystemExit(
            f"{name} failed on the {side} (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return BENCHMARKS[name][2](json.loads(out.read_text())["results"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--pairs", type=int, default=2, help="turns (each runs both sides once; default 2)")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated benchmarks")
    parser.add_argument("--full", action="store_true", help="the benchmarks' default sizes (long)")
    parser.add_argument("--json", help="default: benchmarks/results/side_by_side.json")
    args = parser.parse_args()
    names = args.only.split(",")
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True)
    head_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    started = time.time()
    runs: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), args.base], cwd=REPO, check=True)
        old_venv = HERE / ".venv-old"  # compare's torchcache 0.6.0, made once, shared by both sides
        if old_venv.is_dir():
            (tree / "benchmarks" / ".venv-old").symlink_to(old_venv)
        try:
            for turn in range(args.pairs):
                for name in names:
                    bench_args = BENCHMARKS[name][1] if args.full else BENCHMARKS[name][0]
                    sides = [("base", tree), ("head", REPO)]
                    for side, cwd in sides if turn % 2 == 0 else sides[::-1]:
                        out = Path(tmp) / f"{name}-{side}-{turn}.json"
                        got = _run(name, bench_args, cwd, side == "base", out)
                        for label, value in got.items():
                            runs[name].setdefault(label, {"base": [], "head": []})[side].append(value)
                        print(f"turn {turn + 1}, {name}, {side}: done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    table = {
        name: {
            label: {
                "base": statistics.median(values["base"]),
                "head": statistics.median(values["head"]),
                "head_over_base": statistics.median(values["head"]) / statistics.median(values["base"]),
                "runs": values,
            }
            for label, values in figures.items()
        }
        for name, figures in runs.items()
    }
    results = {"base": base_rev.stdout.strip(), "head": head_rev.stdout.strip(), "pairs": args.pairs}
    results.update(quick=not args.full, table=table)
    for name, figures in table.items():
        for label, row in figures.items():
            print(f"{name:14} {label:48} {row['base']:10.4g} {row['head']:10.4g} {row['head_over_base']:6.2f}x")
    print(f"({time.time() - started:.0f} s)")
    write_results("side_by_side", results, args.json)


if __name__ == "__main__":
    main()
