"""Names code reads that do not exist yet when a key is first taken: later globals, imports inside functions."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from torchcache import KeyingError, torchcache
from torchcache.canonical import origins

X = torch.arange(6.0).reshape(3, 2)


def _load(path: Path, name: str, source: str) -> ModuleType:
    path.write_text(source)
    importlib.invalidate_caches()
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def modules() -> Iterator[list[str]]:
    """Names of modules a test loads: removed from ``sys.modules`` afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


LATER = """
from torchcache import torchcache

@torchcache(persistent=True, persistent_cache_dir={root!r})
def f(x):
    return helper(x) * GAIN

def helper(x):
    return x + {add}

GAIN = {gain}
"""


def test_a_function_keys_a_helper_and_a_constant_defined_below_it(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_later")
    root = str(tmp_path / "cache")
    first = _load(tmp_path / "defines_later.py", "defines_later", LATER.format(root=root, add=1, gain=2.0))
    assert torch.equal(first.f(X), (X + 1) * 2)
    first.f.cache_instance.flush()
    for add, gain in ((1, 5.0), (4, 2.0)):  # as the same file edited between runs
        again = _load(tmp_path / "defines_later.py", "defines_later", LATER.format(root=root, add=add, gain=gain))
        assert torch.equal(again.f(X), (X + add) * gain)
        assert again.f.cache_instance.module_hash != first.f.cache_instance.module_hash


def test_a_global_not_defined_at_the_first_call_is_refused_by_name(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_missing")
    source = "from torchcache import torchcache\n\n@torchcache()\ndef f(x):\n    return not_there_yet(x)\n"
    module = _load(tmp_path / "defines_missing.py", "defines_missing", source)  # decorating is fine
    with pytest.raises(KeyingError, match=r"f\.__globals__\.not_there_yet: .*not defined when the key is taken"):
        module.f(X)


LAZY = """
from torch import nn

class Net(nn.Module):
    def forward(self, x):
        import lazy_helper
        return lazy_helper.g(x)
"""


def test_a_users_module_imported_inside_forward_is_keyed_by_its_code(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    modules += ["defines_lazy", "lazy_helper"]
    net = _load(tmp_path / "defines_lazy.py", "defines_lazy", LAZY).Net
    root = tmp_path / "cache"
    for factor in (2, 7, 2):  # the helper edited between runs, and back
        sys.modules.pop("lazy_helper", None)  # a new process: not imported until forward or the key imports it
        (tmp_path / "lazy_helper.py").write_text(f"def g(x):\n    return x * {factor}\n")
        importlib.invalidate_caches()
        model = torchcache(persistent=True, persistent_cache_dir=root)(net().eval())
        assert torch.equal(model(X), X * factor)
        model.cache_instance.flush()


def test_an_import_that_cannot_be_found_is_the_codes_own_fallback(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_fallback")
    source = (
        "from torchcache import torchcache\n\n@torchcache()\ndef f(x):\n"
        "    try:\n        import no_such_package_here\n    except ImportError:\n        return x + 1\n"
        "    return no_such_package_here.g(x)\n"
    )
    module = _load(tmp_path / "defines_fallback.py", "defines_fallback", source)
    assert torch.equal(module.f(X), X + 1) and torch.equal(module.f(X), X + 1)
    assert module.f.cache_instance.stats().hits == 3


def test_installed_code_imported_inside_a_function_is_keyed_without_importing_it(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "wave", raising=False)
    modules.append("defines_installed")
    source = (
        "from torchcache import torchcache\n\n@torchcache()\ndef f(x):\n"
        "    if x.shape[0] > 100:\n        import wave\n    return x * 2\n"
    )
    module = _load(tmp_path / "defines_installed.py", "defines_installed", source)
    assert torch.equal(module.f(X), X * 2)
    assert "wave" not in sys.modules


def test_installed_code_without_metadata_imported_inside_a_function_is_keyed_by_its_files(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    packages = tmp_path / "site-packages"  # a package put on the path by hand: no version to key it by
    packages.mkdir()
    monkeypatch.syspath_prepend(str(packages))
    modules.append("defines_vendored")
    source = LAZY.replace("lazy_helper", "vendored_ops")
    net = _load(tmp_path / "defines_vendored.py", "defines_vendored", source).Net
    keys = []
    for factor in (2, 3):
        monkeypatch.delitem(sys.modules, "vendored_ops", raising=False)
        monkeypatch.setattr(origins, "_versions", {})  # a new process
        (packages / "vendored_ops.py").write_text(f"def g(x):\n    return x * {factor}\n")
        importlib.invalidate_caches()
        model = torchcache()(net().eval())
        keys.append(model.cache_instance.module_hash)  # taken without importing it
        assert "vendored_ops" not in sys.modules
    assert keys[0] != keys[1]
