"""State around a module's own code that reaches ``forward``: patched functions, modes, switches, rebinding."""

from __future__ import annotations

import collections
import functools
import os
import random
import subprocess
import sys
import warnings
from os import getenv as read_variable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import is_inference_mode_enabled, nn
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import REPO, python_env
from torchcache import CacheWarning, torchcache
from torchcache.module import rebinding

SCALE = 2.0


class Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) + torch.tanh(x)


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * SCALE


def _fresh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) + torch.tanh(x)


@pytest.mark.parametrize(
    ("owner", "name", "replacement"),
    [
        (F, "gelu", functools.partial(F.gelu, approximate="tanh")),
        (F, "gelu", F.silu),
        (torch, "tanh", torch.sigmoid),
    ],
    ids=["partial", "another-function", "builtin"],
)
def test_an_installed_function_replaced_under_its_name_is_keyed_by_the_replacement(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, replacement: Any, tmp_path: Path
) -> None:
    x = torch.randn(4, 6)
    before = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Gelu())
    before(x)
    before.cache_instance.flush()
    monkeypatch.setattr(owner, name, replacement)
    after = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Gelu())
    assert after.cache_instance.module_hash != before.cache_instance.module_hash
    assert torch.equal(after(x), _fresh_gelu(x))  # computed with the replacement, not read from disk


class UsesGeluModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


def test_an_installed_method_replaced_by_another_of_its_package_is_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 6)
    before = torchcache()(UsesGeluModule())
    before(x)
    monkeypatch.setattr(nn.GELU, "forward", nn.Tanh.forward)
    after = torchcache()(UsesGeluModule())
    assert after.cache_instance.module_hash != before.cache_instance.module_hash
    assert torch.equal(after(x), torch.tanh(x))


class Doubling(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.ops.aten.mul.Tensor else out


class Negating(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return -out if func is torch.Tensor.mul else out


@pytest.mark.parametrize("mode", [Doubling, Negating])
def test_a_call_under_a_torch_mode_runs_uncached_with_a_warning(mode: type) -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    model(x)  # cached without the mode
    with pytest.warns(CacheWarning, match=mode.__qualname__), mode():
        under = model(x)
    with mode():
        expected = x * SCALE
    assert torch.equal(under, expected)
    assert model.cache_instance.stats().hits == 0


def test_a_default_device_context_is_keyed_not_refused() -> None:
    model, x = torchcache()(Scaled()), torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.device("cpu"):
            model(x)
            assert torch.equal(model(x), x * SCALE)
    assert model.cache_instance.stats().hits == len(x)


def test_the_attention_fast_path_switch_is_keyed() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).eval().requires_grad_(False)
    model = torchcache(subsample_count=None)(layer)
    x = torch.randn(3, 5, 8)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:, -2:] = True
    kwargs = {"src_key_padding_mask": mask}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        fast = model(x, **kwargs)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = model(x, **kwargs)
            expected = layer(x, **kwargs)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert torch.equal(slow, expected) and not torch.equal(fast, slow)


def _scaled_by_mode(x: torch.Tensor) -> torch.Tensor:
    return x * (2 if torch.is_inference_mode_enabled() else 3)


def _scaled_by_mode_imported(x: torch.Tensor) -> torch.Tensor:
    return x * (2 if is_inference_mode_enabled() else 3)


def _scaled_by_a_tensors_mode(x: torch.Tensor) -> torch.Tensor:
    return x * (2 if (x + 0).is_inference() else 3)


@pytest.mark.parametrize("first_in_inference_mode", [False, True])
@pytest.mark.parametrize(
    "fn", [_scaled_by_mode, _scaled_by_mode_imported, _scaled_by_a_tensors_mode], ids=["torch", "imported", "tensor"]
)
def test_inference_mode_is_keyed_where_the_code_reads_it(first_in_inference_mode: bool, fn: Any) -> None:
    scaled, x = torchcache()(fn), torch.randn(4, 3)
    for inference in (first_in_inference_mode, not first_in_inference_mode):
        with torch.inference_mode(inference):
            assert torch.equal(scaled(x), x * (2 if inference else 3))
    assert scaled.cache_instance.stats().hits == 0
    plain = torchcache()(lambda x: x * 2)
    with torch.no_grad():
        plain(x)
    with torch.inference_mode():
        plain(x)  # computes the same: the entries of the call under no_grad serve it
    assert plain.cache_instance.stats().hits == len(x)


def test_an_input_made_under_inference_mode_is_keyed_apart_where_the_code_asks() -> None:
    @torchcache(check_items=False)  # the check's rows, taken under inference mode, are inference tensors
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * (3 if x.is_inference() else 2)

    plain = torch.arange(4.0).reshape(4, 1)
    with torch.inference_mode():
        made = torch.arange(4.0).reshape(4, 1)
        assert torch.equal(scaled(made), plain * 3)
        assert torch.equal(scaled(plain), plain * 2)  # the same values, not an inference tensor
    assert scaled.cache_instance.stats().hits == 0


class QuantizedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.randn(32, 64, generator=g) * 0.1)
        self.register_buffer("b", torch.randn(32, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qx = torch.quantize_per_tensor(x, 0.05, 128, torch.quint8)
        qw = torch.quantize_per_tensor(self.w, 0.01, 0, torch.qint8)
        return torch.ao.nn.quantized.functional.linear(qx, qw, self.b, scale=0.07, zero_point=100).dequantize()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")
@pytest.mark.skipif(
    not {"x86", "qnnpack"} <= set(torch.backends.quantized.supported_engines),
    reason="needs the x86 and QNNPACK engines",
)
def test_the_quantized_engine_is_keyed() -> None:
    model, x = torchcache()(QuantizedLinear()), torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    was = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "x86"
        model(x)
        torch.backends.quantized.engine = "qnnpack"
        expected = QuantizedLinear()(x)
        found = model(x)
    finally:
        torch.backends.quantized.engine = was
    assert not torch.equal(expected, model(x))  # the engines round differently
    assert torch.equal(found, expected)


class PackedLinear(nn.Module):
    """A quantized linear layer whose packed parameters keep a float bias that requires grad (as convert leaves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.ao.nn.quantized.Linear(8, 4)
        weight = torch.quantize_per_tensor(torch.randn(4, 8), 0.05, 0, torch.qint8)
        self.linear.set_weight_bias(weight, nn.Parameter(torch.randn(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.quantize_per_tensor(x, 0.05, 128, torch.quint8)).dequantize()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")
def test_packed_parameters_are_keyed_without_being_frozen() -> None:
    model, x = PackedLinear().eval(), torch.randn(3, 8)
    expected = model(x)
    cached = torchcache()(model)
    assert torch.equal(cached(x), expected) and torch.equal(cached(x), expected)
    assert cached.cache_instance.stats().hits == len(x)
    weight = torch.quantize_per_tensor(torch.randn(4, 8), 0.05, 0, torch.qint8)
    model.linear.set_weight_bias(weight, torch.zeros(4))  # packed again: a new key
    assert torch.equal(cached(x), PackedLinear.forward(model, x))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's forward AD
def test_inputs_carrying_a_forward_mode_tangent_run_uncached() -> None:
    model, x, v = torchcache()(Scaled()), torch.randn(4, 3), torch.randn(4, 3)
    model(x)
    with forward_ad.dual_level(), pytest.warns(CacheWarning, match="forward-mode AD"):
        out = model(forward_ad.make_dual(x, v))
        tangent = forward_ad.unpack_dual(out).tangent
    assert tangent is not None and torch.equal(tangent, v * SCALE)


def test_a_global_rebound_after_the_key_is_seen_in_later_processes_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4, 3)
    writer = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Scaled())
    writer(x)
    monkeypatch.setattr(f"{__name__}.SCALE", 3.0)
    assert torch.equal(writer(x), x * 3.0)  # the key is taken again, with SCALE = 3
    writer.cache_instance.flush()
    monkeypatch.setattr(f"{__name__}.SCALE", 2.0)
    reader = torchcache(persistent=True, persistent_cache_dir=tmp_path)(Scaled())
    assert torch.equal(reader(x), x * 2.0)


class ReadsTheEnvironment(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(os.environ.get("TC_TEST_SCALE", "1"))


class AsksTheEnvironment(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(os.getenv("TC_TEST_SCALE", "1"))


class ReadsAVariableImportedByName(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(read_variable("TC_TEST_SCALE", "1"))


class ReadsTheCommandLine(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * len(sys.argv)


def _set_scale(monkeypatch: pytest.MonkeyPatch, cls: type, scale: int) -> None:
    """A run whose environment (or command line) gives ``scale``."""
    if cls is ReadsTheCommandLine:
        monkeypatch.setattr(sys, "argv", ["train.py", *["--more"] * (scale - 1)])
    else:
        monkeypatch.setenv("TC_TEST_SCALE", str(scale))


@pytest.mark.parametrize(
    "cls",
    [ReadsTheEnvironment, AsksTheEnvironment, ReadsAVariableImportedByName, ReadsTheCommandLine],
    ids=["environ", "getenv", "getenv-imported-by-name", "argv"],
)
def test_the_environment_and_command_line_forward_reads_are_keyed_by_their_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[nn.Module]
) -> None:
    x = torch.randn(4, 3)
    _set_scale(monkeypatch, cls, 1)
    first = torchcache(persistent=True, persistent_cache_dir=tmp_path)(cls())
    assert torch.equal(first(x), x)
    first.cache_instance.flush()
    again = torchcache(persistent=True, persistent_cache_dir=tmp_path)(cls())
    assert torch.equal(again(x), x)
    assert again.cache_instance.module_hash == first.cache_instance.module_hash  # the same run's key: hits
    assert again.cache_instance.stats().disk.hits == 4
    _set_scale(monkeypatch, cls, 2)  # a later run (another process) with another environment or command line
    second = torchcache(persistent=True, persistent_cache_dir=tmp_path)(cls())
    assert torch.equal(second(x), x * 2)  # computed, not the first run's rows read from disk
    assert second.cache_instance.module_hash != first.cache_instance.module_hash


@pytest.mark.parametrize(
    "cls",
    [ReadsTheEnvironment, AsksTheEnvironment, ReadsAVariableImportedByName, ReadsTheCommandLine],
    ids=["environ", "getenv", "getenv-imported-by-name", "argv"],
)
def test_the_environment_and_command_line_written_after_the_key_was_taken_are_seen(
    monkeypatch: pytest.MonkeyPatch, cls: type[nn.Module]
) -> None:
    x = torch.randn(4, 3)
    _set_scale(monkeypatch, cls, 1)
    model = torchcache()(cls())
    assert torch.equal(model(x), x) and torch.equal(model(x), x)
    key = model.cache_instance.module_hash
    if cls is ReadsTheCommandLine:
        sys.argv.append("--more")  # in place: the same list
    else:
        os.environ["TC_TEST_SCALE"] = "2"  # (monkeypatch restores it)
    assert torch.equal(model(x), x * 2)
    assert model.cache_instance.module_hash != key


def test_an_environment_written_at_every_call_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebinding, "_rebound", collections.Counter())  # counts of other tests' writes left out
    monkeypatch.setenv("TC_TEST_SCALE", "1")
    model = torchcache()(ReadsTheEnvironment())
    x = torch.randn(4, 3)
    model(x)
    for scale in range(2, 2 + rebinding.REBOUND_WARN - 1):
        os.environ["TC_TEST_SCALE"] = str(scale)
        assert torch.equal(model(x), x * scale)
    os.environ["TC_TEST_SCALE"] = "9"
    with pytest.warns(CacheWarning, match=r"the environment \(os.environ\), which a cached forward reads, was writ"):
        assert torch.equal(model(x), x * 9)


class WritesTheEnvironment(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        os.environ["TC_TEST_SCALE"] = "2"
        return x * float(os.environ["TC_TEST_SCALE"])


def test_rows_of_a_forward_that_writes_the_environment_it_reads_are_not_stored_under_the_key_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TC_TEST_SCALE", "1")
    model = torchcache()(WritesTheEnvironment())
    x = torch.randn(4, 3)
    assert torch.equal(model(x), x * 2)
    assert model.cache_instance.stats().memory.entries == 0  # made with the environment written, not the keyed one
    assert torch.equal(model(x), x * 2)  # the key taken again, with the environment written: stored
    assert model.cache_instance.stats().memory.entries == 4
    assert torch.equal(model(x), x * 2) and model.cache_instance.stats().hits == 4


def test_the_environment_named_in_key_ignore_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TC_TEST_SCALE", "1")
    first = torchcache(key_ignore=("os",))(ReadsTheEnvironment())
    first(torch.ones(2, 3))
    monkeypatch.setenv("TC_TEST_SCALE", "2")
    second = torchcache(key_ignore=("os",))(ReadsTheEnvironment())
    second(torch.ones(2, 3))
    assert second.cache_instance.module_hash == first.cache_instance.module_hash


class ListScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scales = [2.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scales[0]


def test_clear_takes_the_key_again(tmp_path: Path) -> None:
    model = torchcache(persistent=True, persistent_cache_dir=tmp_path)(ListScaled())
    model(torch.randn(4, 3))
    first = model.cache_instance.module_hash
    model.scales[0] = 5.0  # an item set in place: not seen until the key is taken again
    model.cache_instance.clear()
    x = torch.randn(4, 3)
    assert torch.equal(model(x), x * 5.0)
    model.cache_instance.flush()
    assert model.cache_instance.module_hash != first  # not stored under the key of scales [2.0]


CALLS = 0
STEP = 0


class Counting(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        return x * 2


class CountedScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        return x * CALLS


class Stepped(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * STEP


def test_a_global_that_forward_assigns_and_reads_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.CALLS", 0)
    model, x = torchcache(check_items=False)(CountedScale().eval()), torch.randn(4, 3)  # the check would call it
    with pytest.warns(CacheWarning, match="'CALLS'.*rebound 3 times.*key_ignore"):
        for calls in range(1, 5):
            assert torch.equal(model(x), x * calls)


def test_a_counter_that_forward_keeps_is_kept_out_of_the_key_by_key_ignore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.CALLS", 0)
    model, x = torchcache(key_ignore=("CALLS",))(Counting()), torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert torch.equal(model(x), x * 2)
    assert model.cache_instance.stats().hits == 2 * len(x)


def test_a_global_rebound_at_every_call_is_followed_and_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache()(Stepped()), torch.randn(4, 3)
    with pytest.warns(CacheWarning, match="'STEP'.*key_ignore") as caught:
        for step in range(6):
            monkeypatch.setattr(f"{__name__}.STEP", step)
            assert torch.equal(model(x), x * step)
    assert len([w for w in caught if "rebound" in str(w.message)]) == 1


def test_an_installed_function_replaced_after_the_key_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache()(Gelu()), torch.randn(4, 6)
    model(x)
    monkeypatch.setattr(F, "gelu", F.silu)
    assert torch.equal(model(x), F.silu(x) + torch.tanh(x))
    monkeypatch.setattr(nn.GELU, "forward", nn.Tanh.forward)
    uses = torchcache()(UsesGeluModule())
    uses(x)
    monkeypatch.setattr(nn.GELU, "forward", nn.Sigmoid.forward)
    assert torch.equal(uses(x), torch.sigmoid(x))


class Patcher:
    def __init__(self, approximate: str) -> None:
        self.approximate = approximate

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.gelu(x, approximate=self.approximate)


def test_a_bound_method_put_in_place_of_a_function_of_the_same_name_is_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = []
    for approximate in ("none", "tanh"):
        monkeypatch.setattr(F, "gelu", Patcher(approximate).gelu)
        model = torchcache()(Gelu())
        keys.append(model.cache_instance.module_hash)
    assert keys[0] != keys[1]


class WithClassState(nn.Module):
    K = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.K

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_a_method_of_a_class_of_yours_replaced_after_the_key_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = torchcache()(WithClassState()), torch.randn(4, 3)
    model(x)
    monkeypatch.setattr(WithClassState, "inner", lambda self, x: x - 1)
    assert torch.equal(model(x), (x - 1) * 2.0)


class Rotary(nn.Module):
    """Keeps a class-level table that forward grows on demand (as rotary embeddings do)."""

    table = torch.zeros(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(Rotary.table) < x.shape[1]:
            Rotary.table = torch.arange(float(x.shape[1]))
        return x + Rotary.table[: x.shape[1]]


def test_a_class_level_table_that_forward_grows_takes_the_key_again_unless_it_is_ignored() -> None:
    batches = [torch.randn(4, width) for width in (3, 5, 7)]
    Rotary.table = torch.zeros(0)
    model = torchcache()(Rotary())
    with pytest.warns(CacheWarning, match="attribute 'table'.*rebound 3 times.*key_ignore"):
        for x in batches + batches:  # each entry under the key of the table it was computed with
            assert torch.equal(model(x), x + torch.arange(float(x.shape[1])))
    Rotary.table = torch.zeros(0)
    ignoring = torchcache(key_ignore=("table",))(Rotary())  # a memo: outputs do not depend on it
    for x in batches + batches:
        assert torch.equal(ignoring(x), x + torch.arange(float(x.shape[1])))
    assert ignoring.cache_instance.stats().hits == 12


class Jitter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 0 * random.random())


def test_a_function_bound_to_a_packages_own_object_is_keyed_by_name_not_state() -> None:
    model = torchcache()(Jitter())
    first = model.cache_instance.module_hash
    random.seed(1234)  # the state of random's hidden instance differs in every process
    again = torchcache()(Jitter())
    assert again.cache_instance.module_hash == first


def test_a_module_of_yours_read_as_a_whole_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    helpers = types.ModuleType("tc_test_helpers")
    helpers.OFFSET = 1.0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tc_test_helpers", helpers)

    class ReadsModule(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            import tc_test_helpers as h  # type: ignore[import-not-found]

            return x + h.OFFSET

    model, x = torchcache()(ReadsModule()), torch.randn(4, 3)
    model(x)
    monkeypatch.setattr(helpers, "OFFSET", 5.0)
    assert torch.equal(model(x), x + 5.0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's forward AD
def test_a_torch_func_transform_over_swapped_weights_runs_uncached() -> None:
    plain = nn.Linear(4, 4).requires_grad_(False)
    model = torchcache()(nn.Linear(4, 4).requires_grad_(False))
    model.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    model(x)
    params = dict(plain.named_parameters())
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    expected = torch.func.jvp(lambda p: torch.func.functional_call(plain, p, (x,)), (params,), (tangents,))
    with pytest.warns(CacheWarning):
        got = torch.func.jvp(lambda p: torch.func.functional_call(model, p, (x,)), (params,), (tangents,))
    assert torch.allclose(got[0], expected[0]) and torch.allclose(got[1], expected[1])


def _using(helper: Any) -> nn.Module:
    class UsesHelper(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return helper(x)

    return torchcache()(UsesHelper())


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's imports (torch.jit)
def test_a_compiled_helper_is_keyed_by_what_it_compiles() -> None:
    first, second = (_using(torch.compile(_double)) for _ in range(2))  # each wrapper holds an id of its own
    assert first.cache_instance.module_hash == second.cache_instance.module_hash
    assert _using(torch.compile(_triple)).cache_instance.module_hash != first.cache_instance.module_hash


def _offset(x: torch.Tensor, by: float = 1.0) -> torch.Tensor:
    return x + by


def _scale_by_three(x: torch.Tensor, by: float = 1.0) -> torch.Tensor:
    return x * 3


class UsesHelper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _offset(x)


def _closure_module() -> tuple[nn.Module, Any]:
    """A module whose forward calls a closure, and a setter that rebinds the closure's captured value."""
    by = 1.0

    def shift(x: torch.Tensor) -> torch.Tensor:
        return x + by

    def rebind(value: float | None) -> None:
        nonlocal by
        if value is None:
            del by
        else:
            by = value

    class Shifted(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return shift(x)

    return Shifted(), rebind


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda: setattr(_offset, "__defaults__", (5.0,)), lambda x: x + 5.0),
        (lambda: setattr(_offset, "__code__", _scale_by_three.__code__), lambda x: x * 3),
    ],
    ids=["defaults", "code"],
)
def test_a_helpers_defaults_or_code_replaced_after_the_key_is_seen(
    monkeypatch: pytest.MonkeyPatch, change: Any, expected: Any
) -> None:
    monkeypatch.setattr(_offset, "__defaults__", _offset.__defaults__)
    monkeypatch.setattr(_offset, "__code__", _offset.__code__)
    model, x = torchcache()(UsesHelper()), torch.randn(4, 3)
    assert torch.equal(model(x), x + 1.0)
    change()
    assert torch.equal(model(x), expected(x))


class ScaledByDefault(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    def features(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale + 1


def _scaled(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return x * scale - 1


@pytest.mark.parametrize(
    ("wrap", "function", "plain"),
    [
        (lambda m: torchcache()(m), lambda: ScaledByDefault.forward, lambda x, s: x * s),
        (lambda m: torchcache()(m.features), lambda: ScaledByDefault.features, lambda x, s: x * s + 1),
        (lambda m: torchcache()(_scaled), lambda: _scaled, lambda x, s: x * s - 1),
    ],
    ids=["forward", "method", "function"],
)
def test_the_cached_callables_own_defaults_replaced_bind_its_later_calls(
    monkeypatch: pytest.MonkeyPatch, wrap: Any, function: Any, plain: Any
) -> None:
    monkeypatch.setattr(function(), "__defaults__", (2.0,))
    module = ScaledByDefault()  # a cached method holds its module weakly
    cached, x = wrap(module), torch.randn(4, 3)
    assert torch.equal(cached(x), plain(x, 2.0))
    function().__defaults__ = (5.0,)
    assert torch.equal(cached(x), plain(x, 5.0))  # not the entries of scale=2.0
    assert torch.equal(cached(x, scale=2.0), plain(x, 2.0))  # nor filed under them
    assert torch.equal(cached(x), plain(x, 5.0))


def test_a_value_a_closure_captured_rebound_after_the_key_is_seen() -> None:
    module, rebind = _closure_module()
    model, x = torchcache()(module), torch.randn(4, 3)
    assert torch.equal(model(x), x + 1.0)
    rebind(2.0)
    assert torch.equal(model(x), x + 2.0)
    rebind(2.0)  # rebound to an equal value: the entries stay
    model(x)
    assert model.cache_instance.stats().hits == len(x)


def test_a_captured_value_deleted_after_the_key_is_seen_fails_as_an_uncached_call_does() -> None:
    module, rebind = _closure_module()
    model, x = torchcache()(module), torch.randn(4, 3)
    model(x)
    rebind(None)
    with pytest.raises(NameError, match="'by'"):
        model(x)


def test_a_captured_value_rebound_at_every_call_is_said_once_naming_it_and_can_be_ignored() -> None:
    module, rebind = _closure_module()
    model, x = torchcache()(module), torch.randn(4, 3)
    with pytest.warns(CacheWarning, match="captured value 'by'.*rebound 3 times.*key_ignore"):
        for step in range(5):
            rebind(float(step))
            assert torch.equal(model(x), x + step)
    module, rebind = _closure_module()
    ignoring = torchcache(key_ignore=("by",))(module)
    ignoring(x)
    rebind(2.0)  # named in key_ignore: neither keyed nor watched
    ignoring(x)
    assert ignoring.cache_instance.stats().hits == len(x)


class CachedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.computed = 0
        assert self.table == 2.0  # filled before the key is taken

    @functools.cached_property
    def table(self) -> float:
        self.__dict__["computed"] += 1
        return 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def test_a_cached_property_invalidated_after_the_key_is_seen_is_not_read_by_the_check() -> None:
    model, x = torchcache()(CachedTable()), torch.randn(4, 3)
    model(x)
    del model.table  # invalidated: the getter runs when forward next reads it, and this forward does not
    assert torch.equal(model(x), x * 2.0)
    assert model.computed == 1


def _counted(fn: Any) -> Any:
    """A wrapper that counts its calls in a value it captured."""
    calls = 0

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return fn(*args)

    return wrapper


def _make_lazy(alpha: float | None) -> Any:
    """A helper that sets its captured scale on first use if none was given."""

    def act(x: torch.Tensor) -> torch.Tensor:
        nonlocal alpha
        if alpha is None:
            alpha = 0.5
        return x * alpha

    return act


class Holds(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


@_counted
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class UsesCounted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _doubled(x)


def test_a_counter_a_wrapper_keeps_is_said_and_kept_out_of_the_key_by_key_ignore() -> None:
    x = torch.randn(4, 3)
    model = torchcache()(UsesCounted())
    with pytest.warns(CacheWarning, match="captured value 'calls'.*rebound 3 times.*key_ignore"):
        for _ in range(4):
            assert torch.equal(model(x), x * 2)
    ignoring = torchcache(key_ignore=("calls",))(UsesCounted())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            assert torch.equal(ignoring(x), x * 2)
    assert ignoring.cache_instance.stats().hits == 3 * len(x)


def test_values_a_helper_captured_and_assigns_itself_are_keyed(cache_root: Path) -> None:
    x = torch.randn(4, 3)
    for alpha in (2.0, 3.0):  # one disk cache: each helper's own value in its key
        model = torchcache(persistent=True)(Holds(_make_lazy(alpha)))
        assert torch.equal(model(x), x * alpha)
    lazy = torchcache()(Holds(_make_lazy(None)))
    assert torch.equal(lazy(x), x * 0.5)
    assert torch.equal(lazy(x), x * 0.5)  # set once by the first call: followed, then kept


def test_a_captured_value_bound_after_the_key_is_taken_is_watched_from_then_on() -> None:
    def make() -> tuple[nn.Module, Any]:
        def shift(x: torch.Tensor) -> torch.Tensor:
            return x + by

        def bind(value: float) -> None:
            nonlocal by
            by = value

        class Late(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return shift(x)

        by: float
        return Late(), bind

    module, bind = make()
    model, x = torchcache()(module), torch.randn(4, 3)
    model.cache_instance.take_key()  # the cell is empty
    bind(2.0)
    assert torch.equal(model(x), x + 2.0)
    bind(3.0)
    assert torch.equal(model(x), x + 3.0)


def _scaled_by_attribute(x: torch.Tensor) -> torch.Tensor:
    return x * _scaled_by_attribute.scale  # type: ignore[attr-defined]


class UsesAttribute(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled_by_attribute(x)


def test_an_attribute_of_a_helper_rebound_after_the_key_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_scaled_by_attribute, "scale", 1.0, raising=False)
    model, x = torchcache()(UsesAttribute()), torch.randn(4, 3)
    assert torch.equal(model(x), x)
    _scaled_by_attribute.scale = 5.0  # type: ignore[attr-defined]
    assert torch.equal(model(x), x * 5.0)


def _tallied(x: torch.Tensor) -> torch.Tensor:
    _tallied.calls += 1  # type: ignore[attr-defined]
    return x * 2


class UsesTallied(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tallied(x)


def test_a_call_count_kept_on_a_helper_and_named_in_key_ignore_is_not_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_tallied, "calls", 0, raising=False)
    model = torchcache(key_ignore=("calls",))(UsesTallied())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):  # new items: forward runs, and bumps the count, at every call
            x = torch.randn(4, 3)
            assert torch.equal(model(x), x * 2)
    assert [str(w.message) for w in caught] == []  # no rebinding said: it is not watched
    assert torch.equal(model(x), x * 2) and model.cache_instance.stats().hits == len(x)


_LAZY_SUBMODULE = """
import sys
import numpy as np
from torchcache.keys import encode_value

def sample(i):
    return np.random.default_rng(i).integers(0, 256, 4)

before = "numpy.random" in sys.modules
first = encode_value(sample)
sample(0)  # numpy imports numpy.random at its first use
print(before, "numpy.random" in sys.modules, encode_value(sample) == first)
"""


@pytest.mark.slow
def test_a_compiled_function_of_a_lazily_imported_submodule_keys_alike_before_and_after_its_import() -> None:
    done = subprocess.run(  # a new interpreter: a zygote's children have numpy.random imported already
        [sys.executable, "-c", _LAZY_SUBMODULE], capture_output=True, text=True, timeout=120, cwd=REPO, env=python_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"]  # a dataset's fingerprint the same in every run


def test_a_compiled_function_in_place_of_an_installed_one_is_still_keyed_in_full() -> None:
    from torchcache.canonical.globals import _put_there

    np_random = pytest.importorskip("numpy.random")
    assert not _put_there(np_random.default_rng, "default_rng", "numpy.random")  # numpy's own: by version
    assert _put_there(np_random.default_rng, "seed", "numpy.random")  # under another name: keyed
    assert _put_there(lambda seed: seed, "default_rng", "numpy.random")  # a function of yours: keyed
