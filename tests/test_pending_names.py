"""Names code reads that do not exist yet when a key is first taken: later globals, imports inside functions."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers import load_module
from torchcache import torchcache
from torchcache.canonical import origins

X = torch.arange(6.0).reshape(3, 2)


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
    first = load_module(tmp_path / "defines_later.py", "defines_later", LATER.format(root=root, add=1, gain=2.0))
    assert torch.equal(first.f(X), (X + 1) * 2)
    first.f.cache_instance.flush()
    for add, gain in ((1, 5.0), (4, 2.0)):  # as the same file edited between runs
        again = load_module(tmp_path / "defines_later.py", "defines_later", LATER.format(root=root, add=add, gain=gain))
        assert torch.equal(again.f(X), (X + add) * gain)
        assert again.f.cache_instance.module_hash != first.f.cache_instance.module_hash


OPTIONAL = """
import sys
from torchcache import torchcache

try:
    from no_such_package_here import fused
except ImportError:
    HAS_FUSED = False

@torchcache()
def f(x):
    if HAS_FUSED:
        return fused(x)
    if sys.version_info < (3, 8):
        return old_path(x)
    return x + 1
"""


def test_names_never_defined_are_keyed_as_absent(tmp_path: Path, modules: list[str]) -> None:
    modules.append("defines_optional")  # an optional dependency, a branch that never runs
    module = load_module(tmp_path / "defines_optional.py", "defines_optional", OPTIONAL)
    assert torch.equal(module.f(X), X + 1) and torch.equal(module.f(X), X + 1)
    assert module.f.cache_instance.stats().hits == 3


def _import_fresh(name: str, *others: str) -> ModuleType:
    """Import ``name`` as a new process would (``others``, which it imports, not imported yet)."""
    for gone in (name, *others):
        sys.modules.pop(gone, None)
    importlib.invalidate_caches()
    return importlib.import_module(name)


def test_a_submodule_imported_from_its_package_inside_a_function_is_keyed_by_its_code(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    package = tmp_path / "lazy_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    root = str(tmp_path / "cache")
    (package / "model.py").write_text(
        "from torchcache import torchcache\n\n"
        f"@torchcache(persistent=True, persistent_cache_dir={root!r})\n"
        "def f(x):\n    from . import helpers\n    return helpers.g(x)\n"
    )
    modules += ["lazy_pkg", "lazy_pkg.model", "lazy_pkg.helpers"]
    for factor in (2, 7):
        (package / "helpers.py").write_text(f"def g(x):\n    return x * {factor}\n")
        model = _import_fresh("lazy_pkg.model", "lazy_pkg", "lazy_pkg.helpers")
        assert torch.equal(model.f(X), X * factor)
        model.f.cache_instance.flush()


def test_a_function_that_imports_a_module_importing_its_own_is_keyed_at_its_first_call(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    root = str(tmp_path / "cache")
    (tmp_path / "cycle_a.py").write_text(  # cycle_b imports cycle_a: at decoration, cycle_a is half imported
        "from torchcache import torchcache\n\n"
        f"@torchcache(persistent=True, persistent_cache_dir={root!r})\n"
        "def f(x):\n    import cycle_b\n    return cycle_b.g(x) + OFFSET\n\nOFFSET = 1\n"
    )
    modules += ["cycle_a", "cycle_b"]
    for factor in (2, 7):
        (tmp_path / "cycle_b.py").write_text(f"from cycle_a import OFFSET\n\ndef g(x):\n    return x * {factor}\n")
        module = _import_fresh("cycle_a", "cycle_b")
        assert torch.equal(module.f(X), X * factor + 1)
        module.f.cache_instance.flush()


def test_a_function_that_imports_its_own_module_is_keyed_at_its_first_call(
    tmp_path: Path, modules: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    root = str(tmp_path / "cache")
    modules.append("imports_itself")
    for factor in (2, 7):  # at decoration, the module is half imported: g is not there yet
        (tmp_path / "imports_itself.py").write_text(
            "from torchcache import torchcache\n\n"
            f"@torchcache(persistent=True, persistent_cache_dir={root!r})\n"
            "def f(x):\n    import imports_itself\n    return imports_itself.g(x)\n\n"
            f"def g(x):\n    return x * {factor}\n"
        )
        module = _import_fresh("imports_itself")
        assert torch.equal(module.f(X), X * factor)
        module.f.cache_instance.flush()


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
    net = load_module(tmp_path / "defines_lazy.py", "defines_lazy", LAZY).Net
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
    module = load_module(tmp_path / "defines_fallback.py", "defines_fallback", source)
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
    module = load_module(tmp_path / "defines_installed.py", "defines_installed", source)
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
    net = load_module(tmp_path / "defines_vendored.py", "defines_vendored", source).Net
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
