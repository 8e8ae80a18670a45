"""The path of each kind of hit, traced, is the one ``docs/how-it-works.md`` draws.

Each test makes a hit, then repeats it under ``sys.setprofile`` and records every
torchcache function called, by module. The modules must be those the page lists for that
path: a hit that starts to cross another module fails here until the page says so.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from torchcache import CachedDataset, extract_features, torchcache

PACKAGE = str(Path(__file__).resolve().parent.parent / "torchcache") + "/"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "how-it-works.md"


def documented_paths() -> dict[str, set[str]]:
    """The modules of each path in the page's drawing, by the path's first words."""
    text = PAGE.read_text()
    block = text.split("## The path of a hit", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    paths: dict[str, set[str]] = {}
    current = ""
    for line in block.splitlines():
        if line and not line.startswith(" "):
            current = line.split(" (")[0]
            paths[current] = set()
        elif line.strip():
            names = re.match(r"\s+([\w/.]+\.py(?:, [\w/.]+\.py)*)", line)
            assert names, f"a line of the drawing names no module: {line!r}"
            paths[current].update(names.group(1).split(", "))
    return paths


def traced(hit: Callable[[], Any]) -> set[str]:
    """The torchcache modules whose functions ``hit`` calls, relative to the package."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.add(frame.f_code.co_filename.removeprefix(PACKAGE))

    gc.collect()  # finalizers of objects other tests left (a cache's __del__) must not run inside the trace
    gc.disable()
    sys.setprofile(profile)
    try:
        hit()
    finally:
        sys.setprofile(None)
        gc.enable()
    return seen


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.requires_grad_(False)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Pairs(Dataset[Any]):
    def __init__(self) -> None:
        self.x = torch.randn(100, 8, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


def test_the_drawing_has_the_three_paths() -> None:
    assert set(documented_paths()) == {
        "FeatureDataset hit",
        "CachedDataset hit from the RAM tier",
        "Decorator disk hit, memory tier off",
    }


@pytest.mark.parametrize(
    "path", ["FeatureDataset hit", "CachedDataset hit from the RAM tier", "Decorator disk hit, memory tier off"]
)
def test_a_hit_crosses_the_modules_the_page_draws(path: str, tmp_path: Path) -> None:
    if path == "FeatureDataset hit":
        features = extract_features(Net(), Pairs(), cache_dir=tmp_path, progress=False)
        hit: Callable[[], Any] = lambda: features.__getitems__(list(range(32)))  # noqa: E731
    elif path == "CachedDataset hit from the RAM tier":
        data = CachedDataset(Pairs(), tmp_path)
        hit = lambda: data.__getitems__(list(range(32)))  # noqa: E731
    else:
        model = torchcache(persistent=True, persistent_cache_dir=tmp_path, max_memory_cache_size=0)(Net)()
        x = torch.randn(64, 8)
        model(x)
        model.cache_instance.flush()
        hit = lambda: model(x)  # noqa: E731
    hit()  # the first read opens what it needs
    assert traced(hit) == documented_paths()[path]


def test_the_trace_sees_a_module_that_a_hit_crosses() -> None:
    from torchcache import policy

    assert traced(lambda: policy.parse_size("1 MB")) == {"policy.py"}
