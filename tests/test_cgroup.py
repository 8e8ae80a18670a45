"""The memory a process may use: the RAM, or its cgroup's limit (v1 or v2, the lowest on the way up)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchcache._cgroup import memory_limit
from torchcache.datasets import shm

GIB = 1 << 30
RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tree(root: Path, files: dict[str, str], groups: str) -> Path:
    """Files under a fake ``/sys/fs/cgroup`` at ``root``, and a fake ``/proc/self/cgroup`` naming ``groups``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(groups)
    return proc


@pytest.mark.parametrize(
    ("files", "groups", "expected"),
    [
        ({"memory.max": str(GIB)}, "0::/\n", GIB),  # v2, a container's own group seen as /
        ({"job/memory.max": "max", "memory.max": str(2 * GIB)}, "0::/job\n", 2 * GIB),  # a limit above the group
        ({"job/step/memory.max": str(3 * GIB), "job/memory.max": str(GIB)}, "0::/job/step\n", GIB),  # the lowest
        ({"memory/pod/memory.limit_in_bytes": str(GIB)}, "4:memory:/pod\n3:cpu:/pod\n", GIB),  # v1
        ({"memory/memory.limit_in_bytes": str(2**63 - 4096)}, "4:memory:/\n", None),  # v1's "no limit"
        ({"memory/memory.limit_in_bytes": str(GIB)}, "4:cpuacct,memory:/\n", GIB),  # controllers mounted together
        ({"memory.max": "max"}, "0::/\n", None),
        ({"memory.max": "garbage"}, "0::/../..\nnot a line\n", None),  # nothing usable: the RAM
        ({"memory/memory.limit_in_bytes": str(GIB)}, "4:cpu:/\n", None),  # no memory controller named
        ({"cpu,memory/job/memory.limit_in_bytes": str(GIB)}, "4:cpu,memory:/job\n", GIB),  # mounted together
        ({"sib/memory.max": str(GIB), "../sib/memory.max": str(GIB)}, "0::/../sib\n", None),  # outside the namespace
    ],
)
def test_the_limit_is_the_lowest_of_the_ram_and_the_groups_on_the_way_up(
    tmp_path: Path, files: dict[str, str], groups: str, expected: int | None
) -> None:
    root = tmp_path / "cgroup"
    proc = tree(root, files, groups)
    assert memory_limit(proc, root) == min(RAM, expected or RAM)


def test_a_process_without_cgroups_has_the_ram(tmp_path: Path) -> None:
    assert memory_limit(tmp_path / "missing", tmp_path) == RAM


def test_the_ram_tiers_default_budget_is_a_quarter_of_a_containers_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "memory_limit", lambda: 400 << 20)  # --memory=400m on a machine with more RAM
    assert shm.default_memory_size(tmp_path) == min(100 << 20, shm.usable_bytes(os.statvfs(tmp_path)) // 2)
