"""What every benchmark's JSON file records besides its figures.

Each script calls :func:`write_results` once at the end. The file holds the benchmark's
name, the command line that ran it (as typed from the repository root), the date, the
seconds it took, the machine (CPU model, cores, RAM, OS), the load average before and
after, the versions (python, torch, numpy, torchcache of this repository) and the
commit of the code measured, then the script's own ``results``. ``report.py`` turns
``benchmarks/results/*.json`` into ``RESULTS.md``. Versions come from package metadata
and ``torchcache/_version.py``, so writing the file imports nothing heavy.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
_STARTED = (time.time(), os.getloadavg()[0] if hasattr(os, "getloadavg") else None)


def default_path(name: str) -> Path:
    """Where a benchmark writes its JSON when no ``--json`` is given: ``benchmarks/results/<name>.json``."""
    return RESULTS / f"{name}.json"


def command() -> str:
    """The command line of this process, with the script's path relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return shlex.join(["python", shown, *sys.argv[1:]])


def machine() -> dict[str, Any]:
    """CPU model, cores, RAM in GiB and OS of this machine."""
    cpu = platform.processor() or platform.machine()
    ram = None
    try:
        info = Path("/proc/cpuinfo").read_text()
        models = re.findall(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
        cpu = models[0].strip() if models else cpu
        found = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        ram = round(int(found.group(1)) / 2**20, 1) if found else None
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": ram, "os": platform.platform()}


def versions() -> dict[str, str]:
    """Versions of python, torch, numpy and this repository's torchcache, plus its commit."""
    found = {"python": platform.python_version()}
    for name in ("torch", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    text = (ROOT / "torchcache" / "_version.py").read_text()
    match = re.search(r"__version__\s*=\s*[\"']([^\"']+)", text)
    found["torchcache"] = match.group(1) if match else "?"
    found["commit"] = _commit()
    return found


def _commit() -> str:
    """Short commit of the repository, with ``+changes`` when ``torchcache/`` differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "torchcache"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{head}+changes" if dirty else head


def write_results(name: str, results: Any, path: str | Path | None = None) -> Path:
    """Write ``results`` with the command, date, machine and versions; return the path written.

    Args:
        name: the benchmark's name (its script's stem).
        results: the figures, anything ``json.dumps`` takes.
        path: the ``--json`` option, or None for :func:`default_path`.
    """
    target = Path(path) if path else default_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    started, load_before = _STARTED
    record = {
        "benchmark": name,
        "command": command(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
        "load_average": {"before": load_before, "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "versions": versions(),
        "results": results,
    }
    target.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results written to {target}")
    return target


def finish(
    name: str, results: dict[str, Any], path: str | Path | None, failures: list[str], missed: list[str], strict: bool
) -> int:
    """Record the failed checks and missed targets in ``results``, write them, print them; the exit status.

    1 if a check failed (a wrong result), else 2 if a target was missed and ``strict``, else 0.
    """
    results["missed"] = missed
    results["correct"] = not failures
    write_results(name, results, path)
    for line in failures:
        print("WRONG:", line)
    for line in missed:
        print("target missed:", line)
    if failures:
        return 1
    return 2 if missed and strict else 0
