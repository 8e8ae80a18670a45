"""Run one benchmark several times, one process after another, for figures judged on their median.

Usage::

    python benchmarks/repeat.py linear_probe [--runs 5] [-- extra options for the benchmark]

Each run writes ``benchmarks/results/runs/<name>-<i>.json`` (the runs of an earlier
repeat are removed first, so the folder holds one set), and the last run is copied to
``benchmarks/results/<name>.json``, the file its RESULTS.md section shows. ``report.py``
judges the targets of a benchmark with runs on the median of the runs' figures and
lists every run's figure beside it. On a shared machine one run can land in a slow
spell; the median of five is what a target is held to.

Exits with the first failing run's status (a benchmark exits 1 when a check of its
results failed).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "runs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a benchmark's name: the stem of its script in benchmarks/")
    parser.add_argument("--runs", type=int, default=5, help="runs, one after another (default 5)")
    own, extra = sys.argv[1:], []
    if "--" in own:  # what follows goes to every run, untouched
        cut = own.index("--")
        own, extra = own[:cut], own[cut + 1 :]
    args = parser.parse_args(own)
    script = HERE / f"{args.name}.py"
    if not script.is_file() or args.name in ("repeat", "report") or args.name.startswith("_"):
        parser.error(f"name must be a benchmark in {HERE}, got {args.name!r}")
    if args.runs < 1:
        parser.error(f"--runs must be a positive int, got {args.runs}")
    RUNS.mkdir(parents=True, exist_ok=True)
    for old in RUNS.glob(f"{args.name}-*.json"):
        old.unlink()
    status = 0
    for i in range(1, args.runs + 1):
        out = RUNS / f"{args.name}-{i}.json"
        started = time.perf_counter()
        print(f"== {args.name}: run {i} of {args.runs}", flush=True)
        done = subprocess.run([sys.executable, str(script), *extra, "--json", str(out)], check=False)
        print(f"== run {i}: exit {done.returncode}, {time.perf_counter() - started:.0f} s", flush=True)
        if done.returncode and not status:
            status = done.returncode
    last = RUNS / f"{args.name}-{args.runs}.json"
    if last.is_file():
        shutil.copyfile(last, HERE / "results" / f"{args.name}.json")
    return status


if __name__ == "__main__":
    sys.exit(main())
