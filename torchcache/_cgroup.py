"""The memory this process may use: the machine's RAM, or its control group's limit where lower.

A container (Docker's ``--memory``, a Kubernetes pod's limit, a Slurm job's cgroup) sees
all the machine's RAM in ``sysconf``, but is killed past its limit, and the files of a
RAM file system (``/dev/shm``) count against that limit. Both cgroup versions are read:
v2's ``memory.max`` and v1's ``memory.limit_in_bytes``, of the process's group and each
group above it (the lowest applies).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["memory_limit"]


def memory_limit(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of memory this process may use: the RAM, or its cgroup's limit where lower (``None``: unknown)."""
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(OSError, UnicodeDecodeError):
        limits += _group_limits(proc.read_text(), root)
    return min(limits) if limits else None


def _group_limits(groups: str, root: Path) -> list[int]:
    """The memory limits set on the groups of ``/proc/self/cgroup``'s lines and their ancestors."""
    found = []
    for line in groups.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):  # v1: the memory controller's hierarchy, maybe mounted with others
            base = root / "memory" if (root / "memory").is_dir() else root / controllers
            name = "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.strip().split("/") if part not in ("", ".")]
        if ".." in parts:  # a group outside this cgroup namespace: not under the mount
            continue
        for depth in range(len(parts), -1, -1):  # the group, then each above it (a container sees its own as /)
            with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
                text = (base.joinpath(*parts[:depth]) / name).read_text().strip()
                if text != "max":  # v1's "no limit" is a number near 2**63, above any RAM
                    found.append(int(text))
    return found
