"""Every way state reaches ``forward`` changes the key, in two processes sharing one persistent directory.

For each mechanism, a module written to a file in two variants that differ only there is
cached by one process (variant ``a``) and then by another (variant ``b``, the same file
and module name edited in between): the second must compute its own outputs (or be
refused), never return the first's. Both processes key every mechanism in one run.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import python_env, run_python

#: Each mechanism: a module ``probe_<name>`` defining ``build() -> (callable, inputs)``, in
#: two variants, ``{v}`` replaced by the variant's value; ``HELPERS`` adds a second module,
#: ``probe_<name>_helper``, written from its own template in the same way.
MECHANISMS: dict[str, tuple[str, str, str]] = {
    "instance_dict": (
        "2.0",
        "3.0",
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = {v}
            def forward(self, x):
                return x * self.scale
        def build():
            return Net(), (X,)
        """,
    ),
    "slots": (
        "2.0",
        "3.0",
        """
        class Net(nn.Module):
            __slots__ = ("scale",)
            def __init__(self):
                super().__init__()
                self.scale = {v}
            def forward(self, x):
                return x * self.scale
        def build():
            return Net(), (X,)
        """,
    ),
    "class_attribute": (
        "2.0",
        "3.0",
        """
        class Base(nn.Module):
            scale = {v}
        class Net(Base):
            def forward(self, x):
                return x * self.scale
        def build():
            return Net(), (X,)
        """,
    ),
    "method_code": (
        "x * 2",
        "x * 3",
        """
        class Net(nn.Module):
            def forward(self, x):
                return {v}
        def build():
            return Net(), (X,)
        """,
    ),
    "closure_of_a_factory_class": (
        "2.0",
        "3.0",
        """
        def make(scale):
            class Net(nn.Module):
                def forward(self, x):
                    return x * scale
            return Net
        def build():
            return make({v})(), (X,)
        """,
    ),
    "global_value": (
        "2.0",
        "3.0",
        """
        SCALE = {v}
        class Net(nn.Module):
            def forward(self, x):
                return x * SCALE
        def build():
            return Net(), (X,)
        """,
    ),
    "global_read_through_a_module": (
        "2.0",
        "3.0",
        """
        import probe_global_read_through_a_module_helper as settings
        class Net(nn.Module):
            def forward(self, x):
                return x * settings.SCALE
        def build():
            return Net(), (X,)
        """,
    ),
    "default_argument": (
        "2.0",
        "3.0",
        """
        class Net(nn.Module):
            def forward(self, x, scale={v}):
                return x * scale
        def build():
            return Net(), (X,)
        """,
    ),
    "default_argument_of_a_helper_function": (
        "2.0",
        "3.0",
        """
        def scaled(x, k={v}):
            return x * k
        class Net(nn.Module):
            def forward(self, x):
                return scaled(x)
        def build():
            return Net(), (X,)
        """,
    ),
    "property": (
        "2.0",
        "3.0",
        """
        class Net(nn.Module):
            @property
            def scale(self):
                return {v}
            def forward(self, x):
                return x * self.scale
        def build():
            return Net(), (X,)
        """,
    ),
    "staticmethod": (
        "x + 1",
        "x - 1",
        """
        class Net(nn.Module):
            @staticmethod
            def shift(x):
                return {v}
            def forward(self, x):
                return self.shift(x)
        def build():
            return Net(), (X,)
        """,
    ),
    "helper_object_code": (
        "x * 2",
        "x * 3",
        """
        import probe_helper_object_code_helper as helpers
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.pre = helpers.Pre()
            def forward(self, x):
                return self.pre.apply(x)
        def build():
            return Net(), (X,)
        """,
    ),
    "helper_function_in_another_module": (
        "x.relu()",
        "x.tanh()",
        """
        from probe_helper_function_in_another_module_helper import act
        class Net(nn.Module):
            def forward(self, x):
                return act(x)
        def build():
            return Net(), (X,)
        """,
    ),
    "submodule_class": (
        "nn.Tanh()",
        "nn.Sigmoid()",
        """
        def build():
            return nn.Sequential({v}), (X,)
        """,
    ),
    "forward_hook_on_a_submodule": (
        "2.0",
        "3.0",
        """
        def build():
            net = nn.Sequential(nn.Identity(), nn.Tanh())
            net[0].register_forward_hook(lambda module, args, out: out * {v})
            return net, (X,)
        """,
    ),
    "forward_pre_hook_on_a_submodule": (
        "2.0",
        "3.0",
        """
        def build():
            net = nn.Sequential(nn.Identity(), nn.Tanh())
            net[1].register_forward_pre_hook(lambda module, args: (args[0] * {v},))
            return net, (X,)
        """,
    ),
    "dataclass_field": (
        "2.0",
        "3.0",
        """
        @dataclasses.dataclass
        class Config:
            scale: float
        class Net(nn.Module):
            def __init__(self, cfg):
                super().__init__()
                self.cfg = cfg
            def forward(self, x):
                return x * getattr(self.cfg, "extra", self.cfg.scale)
        def build():
            return Net(Config({v})), (X,)
        """,
    ),
    "dataclass_attribute_outside_its_fields": (
        "2.0",
        "3.0",
        """
        @dataclasses.dataclass
        class Config:
            scale: float
        class Net(nn.Module):
            def __init__(self, cfg):
                super().__init__()
                self.cfg = cfg
            def forward(self, x):
                return x * getattr(self.cfg, "extra", self.cfg.scale)
        def build():
            cfg = Config(1.0)
            cfg.extra = {v}
            return Net(cfg), (X,)
        """,
    ),
    "same_named_classes_in_one_file": (
        "True",
        "False",
        """
        if {v}:
            class Net(nn.Module):
                def forward(self, x):
                    return x * 2
        else:
            class Net(nn.Module):
                def forward(self, x):
                    return x * 3
        def build():
            return Net(), (X,)
        """,
    ),
    "container_type_of_the_inputs": (
        "A",
        "B",
        """
        A = collections.namedtuple("A", "first second")
        B = collections.namedtuple("B", "second first")
        class Net(nn.Module):
            def forward(self, pair):
                return pair.first * 2 + pair.second
        def build():
            return Net(), ({v}(X, X.flip(1)),)
        """,
    ),
    "tensor_subclass_of_an_input": (
        "torch.Tensor",
        "Doubled",
        """
        class Doubled(torch.Tensor):
            pass
        class Net(nn.Module):
            def forward(self, x):
                return (x * (3.0 if type(x) is Doubled else 2.0)).as_subclass(torch.Tensor)
        def build():
            return Net(), (X.as_subclass({v}),)
        """,
    ),
    "plain_function": (
        "x * 2",
        "x * 3",
        """
        def scaled(x):
            return {v}
        def build():
            return scaled, (X,)
        """,
    ),
    "global_forward_hook": (
        "2.0",
        "3.0",
        """
        def hook(module, args, out):
            return out * {v} if isinstance(module, nn.Tanh) else out
        torch.nn.modules.module.register_module_forward_hook(hook)
        def build():
            return nn.Sequential(nn.Identity(), nn.Tanh()), (X,)
        """,
    ),  # last: it applies to every module of its process from its import on
}
HELPERS = {
    "global_read_through_a_module": "SCALE = {v}\n",
    "helper_object_code": "class Pre:\n    def apply(self, x):\n        return {v}\n",
    "helper_function_in_another_module": "def act(x):\n    return {v}\n",
}

_CHILD = """
import json, sys, importlib, warnings
import torch
from torchcache import KeyingError, torchcache

root, names = sys.argv[1], sys.argv[2].split(",")
report = {}
for name in names:
    module = importlib.import_module("probe_" + name)
    model, inputs = module.build()
    expected = model(*inputs)
    cached_model, _ = module.build()
    if isinstance(cached_model, torch.nn.Module):
        cached_model = cached_model.eval().requires_grad_(False)
    try:
        cached = torchcache(persistent=True, persistent_cache_dir=root)(cached_model)
        got = cached(*inputs)
        cached.cache_instance.flush()
        report[name] = {
            "same": bool(torch.equal(got, expected)),
            "hits": cached.cache_instance.stats().hits,
            "output": expected.numpy().tobytes().hex(),
        }
    except KeyingError as exc:
        report[name] = {"refused": str(exc), "output": expected.numpy().tobytes().hex()}
print(json.dumps(report))
"""

_PRELUDE = (
    "import collections, dataclasses\nimport torch\nfrom torch import nn\nX = torch.arange(12.0).reshape(3, 4) - 5\n"
)


def _write_variant(directory: Path, variant: int) -> None:
    for name, (a, b, template) in MECHANISMS.items():
        value = (a, b)[variant]
        (directory / f"probe_{name}.py").write_text(_PRELUDE + textwrap.dedent(template).replace("{v}", value))
        if name in HELPERS:
            (directory / f"probe_{name}_helper.py").write_text(HELPERS[name].replace("{v}", value))
    for compiled in directory.glob("__pycache__/probe_*"):
        compiled.unlink()  # an edited file must be compiled again, whatever its timestamp


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The reports of the two processes: variant ``a`` first, then variant ``b`` in the same directory."""
    directory = tmp_path_factory.mktemp("probes")
    root = directory / "cache"
    reports = []
    for variant in (0, 1):
        _write_variant(directory, variant)
        done = run_python(_CHILD, str(root), ",".join(MECHANISMS), env=python_env(directory), path=directory / "c.py")
        assert done.returncode == 0, done.stderr[-3000:]
        reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_a_change_through_each_mechanism_gets_its_own_entries_across_processes(
    mechanism: str, runs: list[dict[str, Any]]
) -> None:
    first, second = runs[0][mechanism], runs[1][mechanism]
    assert first["output"] != second["output"], "the two variants must compute different outputs"
    assert "refused" not in first, first.get("refused")
    assert first["same"] and first["hits"] == 0
    if "refused" in second:  # a refusal names what it could not see; never a wrong output
        assert "cannot" in second["refused"]
        return
    assert second["same"], f"{mechanism}: the second process returned the first one's outputs"
    assert second["hits"] == 0
