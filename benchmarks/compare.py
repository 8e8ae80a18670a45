"""Compare this torchcache against torchcache 0.6.0 from PyPI on the same workloads.

Usage::

    python benchmarks/compare.py [--quick] [--only W1,W3] [--json PATH]

The new side runs under the current interpreter with the repository root first
on ``sys.path``; the old side runs in ``benchmarks/.venv-old``, created on first
use (torch==2.13.0 first, then torchcache==0.6.0). Each task runs in its own
worker subprocess (``worker.py``); this driver collects their JSON, prints one
table, writes it with the raw results to ``--json`` (by default
``benchmarks/results/compare.json``) and exits non-zero when any correctness check
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from _meta import write_results

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-old"
TMP = HERE / ".tmp"
WORKER = HERE / "worker.py"
MARK = "@@RESULT@@ "
OLD_VERSION = "0.6.0"
TORCH_VERSION = "2.13.0"
ALL = ("W1", "W2", "W3", "W4", "W5", "W6")
NOISY = 0.3  # cores used by other processes above which a task counts as disturbed
QUIET_WAIT = 10.0  # seconds to wait at most for a quiet machine before a task
# glibc's malloc moves its mmap threshold with what the process freed before, which
# makes the cost of 1-32 MB temporaries (page faults or not) differ between processes
# by up to 4x. Fixed thresholds make every worker behave like a warmed-up process.
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
RETRY_BUDGET = 240.0  # seconds into the run after which disturbed tasks are not rerun
ROUNDS = 5  # processes per side for W1, W2, W3 reads and W4 (1 with --quick)


def log(msg: str) -> None:
    """Print a progress line to stderr."""
    print(msg, file=sys.stderr, flush=True)


def venv_python() -> Path:
    """Path of the old side's interpreter."""
    return VENV / "bin" / "python"


def old_venv_ok() -> bool:
    """Return True when the old venv exists and imports what the worker needs."""
    if not venv_python().exists():
        return False
    code = (
        "import torch, numpy, xxhash, brotli, zstd, torchcache\n"
        "from importlib.metadata import version\n"
        f"assert version('torchcache') == '{OLD_VERSION}', version('torchcache')\n"
        f"assert torch.__version__.startswith('{TORCH_VERSION}'), torch.__version__\n"
    )
    r = subprocess.run([str(venv_python()), "-c", code], capture_output=True, env=old_env(), cwd=HERE)
    return r.returncode == 0


def ensure_old_venv() -> None:
    """Create ``benchmarks/.venv-old`` with torchcache 0.6.0 unless it works."""
    if old_venv_ok():
        return
    log(f"creating {VENV} (torch=={TORCH_VERSION} first, then torchcache=={OLD_VERSION}) ...")
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(venv_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True, env=old_env())
    same = [f"{p}=={metadata.version(p)}" for p in ("numpy", "xxhash", "brotli")]
    subprocess.run([*pip, f"torchcache=={OLD_VERSION}", *same], check=True, env=old_env())
    if not old_venv_ok():
        raise SystemExit(f"{VENV} does not import torchcache {OLD_VERSION}")


def old_env() -> dict[str, str]:
    """Environment for the old side: no PYTHONPATH that could leak the repo."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    return env


def busy_seconds() -> float:
    """CPU seconds all processes spent busy since boot (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    """CPU seconds used by this driver's finished children."""
    t = os.times()
    return t.children_user + t.children_system


def run_worker(step: Step, args: argparse.Namespace, directory: Path | None) -> dict[str, Any]:
    """Run one worker task and return its parsed JSON result.

    Also notes how much CPU other processes used meanwhile (``other_cpu``, in
    cores): anything well above 0 makes the timings of that task noisy.
    """
    side, task, only, _ = step
    py = str(venv_python()) if side == "old" else sys.executable
    cmd = [py, str(WORKER), "--side", side, "--task", task, "--only", only]
    if args.quick:
        cmd.append("--quick")
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        cmd += ["--dir", str(directory)]
    env = old_env() if side == "old" else dict(os.environ)
    if not args.default_malloc:
        env.update(PINNED_MALLOC)
    t0, busy0, own0 = time.perf_counter(), busy_seconds(), children_seconds()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    wall = time.perf_counter() - t0
    other = max(0.0, busy_seconds() - busy0 - (children_seconds() - own0)) / wall
    log(f"  [{side:>3} {task:<6} {only:<10}] {wall:6.1f} s, other processes: {other:.2f} cores busy")
    for line in r.stdout.splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK) :]), wall=wall, other_cpu=other)
    detail = f"exit {r.returncode}, no result\n{(r.stderr or r.stdout)[-2000:]}"
    failure = {"name": f"{side} {task} worker", "ok": False, "detail": detail}
    return {"side": side, "task": task, "records": [], "wall": wall, "other_cpu": other, "checks": [failure]}


def wait_quiet(max_wait: float) -> float:
    """Wait until other processes use under 0.25 cores (at most ``max_wait`` s).

    Returns:
        The seconds waited.
    """
    t0 = time.perf_counter()
    while True:
        busy0 = busy_seconds()
        time.sleep(0.5)
        if busy_seconds() - busy0 < 0.125 or time.perf_counter() - t0 > max_wait:
            return time.perf_counter() - t0


def run_task(step: Step, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Run a task; when other processes disturbed it, wait and run it once more.

    The second run replaces the first when it was less disturbed. Retries stop
    at ``deadline`` (a ``time.perf_counter`` value) and with ``--quick``.
    """
    task, sub = step[1], step[3]
    directory = TMP / sub if sub else None
    waited = wait_quiet(QUIET_WAIT) if args.wait else 0.0
    if waited > 1:
        log(f"  (waited {waited:.0f} s for other processes to calm down)")
    result = run_worker(step, args, directory)
    if args.quick or not args.wait or result["other_cpu"] <= NOISY or time.perf_counter() > deadline:
        return result
    wait_quiet(QUIET_WAIT)
    if directory is not None and task != "w3read":  # w3read needs w3fill's entries
        shutil.rmtree(directory, ignore_errors=True)
    log("  running it again: other processes were busy")
    again = run_worker(step, args, directory)
    return again if again["other_cpu"] < result["other_cpu"] else result


Step = tuple[str, str, str, str | None]  # side, task, --only for the worker, scratch subdir


def plan(only: set[str], rounds: int) -> list[Step]:
    """Worker runs in order for the selection.

    Each workload (and each W3 shape) runs in processes of its own: the cost of
    allocating large outputs depends on what the process allocated before. W1,
    W2, W4 and the W3 reads (with their raw-read reference) run in ``rounds``
    processes per side, alternating sides, and their repeats are pooled: on this
    VM a process can be 30% slower than the next one for its whole life (even a
    plain conv forward), and memory-bound passes such as W3's (197,768) hits run
    at half speed for seconds at a time.
    """
    steps: list[Step] = []
    for w in ("W1", "W2"):
        if {w, "W6"} & only:
            steps.append(("ref", "floor", w, None))
        if w in only:
            steps += [(side, "mem", w, None) for _ in range(rounds) for side in ("new", "old")]
    if "W3" in only:
        for kind in ("feat768", "tok197"):
            case = f"W3.{kind}"
            steps += [(side, "w3fill", case, f"w3-{side}") for side in ("new", "old")]
            for _round in range(rounds):
                steps += [(side, "w3read", case, f"w3-{side}") for side in ("new", "old")]
                steps.append(("ref", "w3ref", case, "w3-ref"))
    if "W4" in only:
        for w in ("W4a", "W4b"):
            steps += [(side, "w4", w, f"w4-{side}-{r}") for r in range(rounds) for side in ("new", "old")]
    if "W5" in only:
        steps += [("new", "w5", "W5", "w5-new"), ("old", "w5", "W5", "w5-old")]
    return steps


# Table layout: (workload, metric, key, floor key or None). A floor key is
# looked up among the reference side's records ("ref"), or as "=raw" the W5 raw size.
ROWS: list[tuple[str, str, str, str | None]] = []
for _w, _label in (("W1", "(768,) f32 B=256"), ("W2", "(197,768) f32 B=64")):
    ROWS += [
        (f"{_w} mem {_label}", "uncached forward", f"{_w}/uncached", None),
        ("", "first pass (misses)", f"{_w}/first", None),
        ("", "hit pass", f"{_w}/hit", f"W6/{_w}"),
    ]
for _kind, _label in (("feat768", "(768,) f32 B=256"), ("tok197", "(197,768) f32 B=64")):
    ROWS += [
        (f"W3 disk {_label}", "fill pass incl. flush", f"W3/{_kind}/fill", None),
        ("", "fresh process, 1st pass", f"W3/{_kind}/fresh", f"W3/{_kind}/warm"),
        ("", "hits, warm page cache", f"W3/{_kind}/warm", f"W3/{_kind}/warm"),
        ("", "hits, cold page cache", f"W3/{_kind}/cold", f"W3/{_kind}/cold"),
        ("", "ref: raw read, warm", f"W3/{_kind}/warm", None),
        ("", "ref: raw read, cold", f"W3/{_kind}/cold", None),
        ("", "ref: brotli decode 2 thr", f"W3/{_kind}/brotli", None),
    ]
ROWS += [
    ("W4a persist (768,) B=256", "uncached forward", "W4a/uncached", None),
    ("", "first pass incl. flush", "W4a/first", None),
    ("", "miss-path cost per item", "W4a/miss_cost", "new:W4a/raw_write"),
    ("", "raw file write per item", "W4a/raw_write", None),
    ("W4b persist backbone B=64", "uncached forward", "W4b/uncached", None),
    ("", "first pass incl. flush", "W4b/first", None),
    ("", "first pass / uncached", "W4b/ratio", None),
]
for _v, _label in (("relu_f32", "ReLU f32"), ("gelu_f32", "GELU f32"), ("relu_bf16", "ReLU bf16")):
    ROWS += [
        (f"W5 disk bytes {_label}", "raw bytes", f"W5/{_v}/raw", None),
        ("", "default (new/old)", f"W5/{_v}/default", "=raw"),
        ("", "brotli q11 / zstd 22", f"W5/{_v}/max", "=raw"),
        ("", "zstd 3 (old only)", f"W5/{_v}/zstd3", "=raw"),
    ]
ROWS += [
    ("W6 floor (768,) B=256", "xxh3 + dict + index_select", "W6/W1", None),
    ("W6 floor (197,768) B=64", "xxh3 + dict + index_select", "W6/W2", None),
]
REF_ONLY = {"W6/W1", "W6/W2"}


def fmt(x: float) -> str:
    """Format a number with about three significant digits."""
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3
    return f"{x:.{digits}f}"


def cell(rec: dict[str, Any] | None) -> str:
    """Median and min-max of a record, or '-'."""
    if rec is None:
        return "-"
    v = rec["values"]
    text = fmt(statistics.median(v))
    if len(v) > 1:
        text += f" [{fmt(min(v))}-{fmt(max(v))}]"
    if "allocated_per_item" in rec:
        text += f" ({fmt(rec['allocated_per_item'])} alloc)"
    return text


def median(rec: dict[str, Any] | None) -> float | None:
    """Median of a record's values, or None."""
    return statistics.median(rec["values"]) if rec else None


def ratio(a: float | None, b: float | None) -> str:
    """a/b formatted, or '-'."""
    return f"{a / b:.2f}" if a is not None and b else "-"


def table(results: list[dict[str, Any]]) -> list[list[str]]:
    """Build the printed rows from the workers' records."""
    recs: dict[str, dict[str, dict[str, Any]]] = {"new": {}, "old": {}, "ref": {}}
    for res in results:
        for rec in res["records"]:
            seen = recs[res["side"]].get(rec["key"])
            if seen is None:
                recs[res["side"]][rec["key"]] = dict(rec, values=list(rec["values"]))
            else:  # the same task in another process: pool the repeats
                seen["values"] += rec["values"]
    lines = [
        ["workload", "metric", "unit", "new median [min-max]", "old median [min-max]", "ref", "new/old", "new/floor"]
    ]
    for workload, metric, key, floor_key in ROWS:
        if metric.startswith("ref:") or key in REF_ONLY:
            new = old = None
            ref = recs["ref"].get(key)
        elif key.startswith("W5/") and key.endswith("/raw"):
            new = old = None
            ref = recs["new"].get(key) or recs["old"].get(key)
        else:
            new, old, ref = recs["new"].get(key), recs["old"].get(key), None
        if new is None and old is None and ref is None:
            continue
        floor = None
        if floor_key == "=raw":
            raw = key.rsplit("/", 1)[0] + "/raw"
            floor = recs["new"].get(raw) or recs["old"].get(raw)
        elif floor_key and floor_key.startswith("new:"):
            floor = recs["new"].get(floor_key[4:])
        elif floor_key:
            floor = recs["ref"].get(floor_key)
        unit = (new or old or ref or {}).get("unit", "")
        if ref is not None and "quality" in ref:
            metric = f"{metric} (q{ref['quality']})"
        ratios = [ratio(median(new), median(old)), ratio(median(new), median(floor))]
        lines.append([workload, metric, unit, cell(new), cell(old), cell(ref), *ratios])
    return lines


def print_table(lines: list[list[str]]) -> None:
    """Print rows as an aligned plain-text table."""
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    for n, row in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def machine() -> dict[str, str]:
    """CPU model, cores, OS and package versions of this interpreter."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    out = {
        "cpu": models[0] if models else "?",
        "cores": str(os.cpu_count()),
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    for pkg in ("torch", "numpy", "brotli", "xxhash"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def main() -> int:
    """Run the selected workloads on both sides and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--only", default=",".join(ALL), help="comma-separated workloads, e.g. W1,W3")
    p.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/compare.json")
    p.add_argument("--keep-tmp", action="store_true", help="keep benchmarks/.tmp")
    p.add_argument("--default-malloc", action="store_true", help="keep glibc's dynamic mmap threshold")
    p.add_argument("--no-wait", dest="wait", action="store_false", help="no waiting for a quiet machine, no reruns")
    args = p.parse_args()
    only = {w.strip().upper() for w in args.only.split(",") if w.strip()}
    if not only <= set(ALL):
        p.error(f"unknown workloads: {sorted(only - set(ALL))}")
    args.only = ",".join(sorted(only))
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.2f} before start; timings may be noisy")
    ensure_old_venv()
    shutil.rmtree(TMP, ignore_errors=True)
    results = []
    log(f"running {args.only}{' (quick)' if args.quick else ''}:")
    try:
        deadline = time.perf_counter() + RETRY_BUDGET
        for step in plan(only, 1 if args.quick else ROUNDS):
            results.append(run_task(step, args, deadline))
    finally:
        if not args.keep_tmp:
            shutil.rmtree(TMP, ignore_errors=True)
    info = machine()
    print_header(info, results, args)
    lines = table(results)
    print_table(lines)
    failed = print_checks(results, only)
    print(f"total {time.perf_counter() - t0:.0f} s")
    dump = {"machine": info, "args": vars(args) | {"json": str(args.json)}, "workers": results, "table": lines}
    write_results("compare", dump | {"checks_failed": failed}, args.json)
    return 1 if failed else 0


def print_header(info: dict[str, str], results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Print the machine, the versions and the settings."""
    sides = {r["side"]: r.get("info", {}) for r in results if r.get("info")}
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['os']}")
    print(
        f"python {info['python']}, torch {info['torch']}, numpy {info['numpy']}, "
        f"brotli {info['brotli']}, xxhash {info['xxhash']}, "
        f"torch threads {sides.get('ref', {}).get('torch_threads', '?')}"
    )
    for side in ("new", "old"):
        s = sides.get(side, {})
        zstd = f", zstd {s['zstd']}" if side == "old" and "zstd" in s else ""
        print(
            f"{side}: torchcache {s.get('torchcache', '?')} "
            f"({s.get('torchcache_file', 'not imported')}), "
            f"torch {s.get('torch', '?')}{zstd}"
        )
    malloc = "default" if args.default_malloc else " ".join(f"{k}={v}" for k, v in PINNED_MALLOC.items())
    print(f"glibc malloc: {malloc}")
    print(
        "times in ms per batch unless noted; new/floor: against the W6 floor (W1/W2), the raw-read "
        "reference (W3), the raw file writes of the same process (W4a) or the raw bytes (W5)\n"
    )


def print_checks(results: list[dict[str, Any]], only: set[str]) -> int:
    """Print the noise warnings and the correctness checks; return the failures."""
    if "W3" in only and not any("/cold" in rec["key"] for r in results for rec in r["records"]):
        print("W3 cold: not available (cannot write /proc/sys/vm/drop_caches)")
    busy = [f"{r['side']} {r['task']}" for r in results if r.get("other_cpu", 0) > NOISY]
    if busy:
        print(
            f"warning: other processes kept >{NOISY} cores busy during: {', '.join(busy)}"
            " (timings of these tasks are noisy)"
        )
    checks = [(r["side"], c) for r in results for c in r["checks"]]
    failed = [(s, c) for s, c in checks if not c["ok"]]
    print(f"\nchecks: {len(checks) - len(failed)} passed, {len(failed)} failed")
    for side, c in failed:
        detail = c["detail"].strip().splitlines()
        if len(detail) > 12:
            detail = [*detail[:2], "...", *detail[-9:]]
        print(f"FAILED [{side}] {c['name']}: " + "\n    ".join(detail))
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
