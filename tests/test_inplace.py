"""No stale outputs: weights and buffers changed in place are seen at the next call."""

from __future__ import annotations

import copy
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.helpers import run_python
from torchcache import CacheWarning, torchcache


def _backbone(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)).eval().requires_grad_(False)


def _cached(persistent: bool, root: Path, seed: int = 0, **options: Any) -> tuple[nn.Module, nn.Module]:
    """A cached backbone and a plain copy of it with the same weights."""
    plain = _backbone(seed)
    cached = torchcache(persistent=persistent, persistent_cache_dir=root, **options)(copy.deepcopy(plain))
    return cached, plain


def _same(cached: nn.Module, plain: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        assert torch.equal(cached(x), plain(x))


PERSISTENT = [False, True]


@pytest.mark.parametrize("persistent", PERSISTENT)
@pytest.mark.parametrize(
    "change",
    [
        lambda m: m[0].weight.mul_(0.5),
        lambda m: m[0].weight.copy_(torch.ones_like(m[0].weight)),
        lambda m: m[3].bias.add_(1.0),
        lambda m: torch._foreach_mul_(list(m.parameters()), 0.9),
        lambda m: m[1].running_mean.fill_(2.0),
    ],
    ids=["mul_", "copy_", "add_", "foreach", "buffer"],
)
def test_in_place_changes_under_no_grad_are_seen(persistent: bool, change: Any, tmp_path: Path) -> None:
    cached, plain = _cached(persistent, tmp_path)
    x = torch.randn(5, 6)
    _same(cached, plain, x)
    with torch.no_grad():
        change(cached)
        change(plain)
    _same(cached, plain, x)
    _same(cached, plain, x)
    assert cached.cache_instance.stats().hits == 5  # the third call hits the entries of the new weights


@pytest.mark.parametrize("persistent", PERSISTENT)
def test_an_ema_model_follows_its_updates(persistent: bool, tmp_path: Path) -> None:
    teacher = AveragedModel(
        torchcache(persistent=persistent, persistent_cache_dir=tmp_path)(_backbone(0)),
        multi_avg_fn=get_ema_multi_avg_fn(0.9),
    )
    student = _backbone(1)
    x = torch.randn(5, 6)
    for _ in range(3):
        out = teacher.module(x)
        plain = copy.deepcopy(teacher.module)
        del plain.cache_instance
        assert torch.equal(out, nn.Sequential.forward(plain, x))
        teacher.update_parameters(student)


def test_batch_norm_statistics_updated_in_train_mode_never_mix_into_a_batch(tmp_path: Path) -> None:
    cached, plain = _cached(False, tmp_path)
    x, x2 = torch.randn(8, 6), torch.randn(8, 6) + 3
    _same(cached, plain, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # the train-mode warning
        cached.train()
        plain.train()
        _same(cached, plain, x2)
    cached.eval()
    plain.eval()
    _same(cached, plain, torch.cat([x[:4], x2[:4]]))


def test_an_optimizer_step_between_freezes_is_seen(tmp_path: Path) -> None:
    cached, plain = _cached(False, tmp_path)
    x = torch.randn(5, 6)
    _same(cached, plain, x)
    for module in (cached, plain):
        module.requires_grad_(True)
        torch.manual_seed(3)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:  # unfrozen: the cached one runs uncached
            warnings.simplefilter("always", CacheWarning)
            module(torch.randn(4, 6)).sum().backward()
        assert [str(w.message) for w in caught if "require grad" in str(w.message)] or module is plain
        optimizer.step()
        module.requires_grad_(False)
    _same(cached, plain, x)


def test_a_replaced_parameter_is_seen(tmp_path: Path) -> None:
    cached, plain = _cached(False, tmp_path)
    x = torch.randn(5, 6)
    _same(cached, plain, x)
    new = torch.randn(4, 8)
    cached[3].weight = nn.Parameter(new.clone(), requires_grad=False)
    plain[3].weight = nn.Parameter(new.clone(), requires_grad=False)
    _same(cached, plain, x)


def test_a_submodule_put_straight_into_modules_or_swapped_there_is_seen(tmp_path: Path) -> None:
    cached, plain = _cached(False, tmp_path)
    x = torch.randn(5, 6)
    _same(cached, plain, x)
    for module in (cached, plain):  # as module-surgery utilities do: no registration hook runs
        module._modules["2"] = nn.Tanh()
    _same(cached, plain, x)
    for module in (cached, plain):  # two submodules trade places: the count stays
        module._modules["2"], module._modules["1"] = module._modules["1"], module._modules["2"]
    _same(cached, plain, x)


class _Graph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("adjacency", (torch.rand(5, 5) > 0.5).float().to_sparse())  # a sparse buffer
        self.lin = nn.Linear(3, 3)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.sparse.mm(self.adjacency, row) for row in self.lin(x)])


def test_a_sparse_buffer_passes_the_item_check_and_its_writes_are_seen() -> None:
    cached, plain = torchcache()(_Graph()).eval(), _Graph().eval()
    x = torch.randn(4, 5, 3)
    assert torch.equal(cached(x), plain(x))  # the item check restores buffers: sparse ones too
    with torch.no_grad():
        cached.adjacency.mul_(0.5)
        plain.adjacency.mul_(0.5)
    assert torch.equal(cached(x), plain(x))


def test_a_module_unfrozen_after_its_first_call_runs_uncached_with_its_graph() -> None:
    cached = torchcache()(nn.Linear(4, 4).requires_grad_(False)).eval()
    x = torch.randn(3, 4)
    cached(x)
    cached.requires_grad_(True)  # fine-tuning after a warm-up: a hit would carry no gradient
    with pytest.warns(CacheWarning, match="require grad"):
        out = cached(x)
    assert out.requires_grad


_UNFROZEN_LATER = nn.Linear(4, 4).requires_grad_(False)
_UNFROZEN_SCALE = torch.ones(4)


class _HoldsInAList(nn.Module):
    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.other = [other]  # held as a value, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other[0](x)  # type: ignore[no-any-return]


def _through_a_global(x: torch.Tensor) -> torch.Tensor:
    return _UNFROZEN_LATER(x)  # type: ignore[no-any-return]


def _scaled_by_a_global(x: torch.Tensor) -> torch.Tensor:
    return x * _UNFROZEN_SCALE


@pytest.mark.parametrize("how", ["a module read as a global", "a module held in a list", "a tensor read as a global"])
def test_a_module_or_tensor_held_elsewhere_unfrozen_after_the_first_call_runs_uncached_with_its_graph(
    how: str,
) -> None:
    unfrozen: Any = _UNFROZEN_SCALE if how == "a tensor read as a global" else _UNFROZEN_LATER
    if how == "a module held in a list":
        cached: Any = torchcache()(_HoldsInAList(_UNFROZEN_LATER).eval())
    else:
        cached = torchcache()(_through_a_global if how == "a module read as a global" else _scaled_by_a_global)
    x = torch.randn(3, 4)
    cached(x)
    unfrozen.requires_grad_(True)  # fine-tuning it after a warm-up: a hit would carry no gradient
    try:
        with pytest.warns(CacheWarning, match="require grad"):
            out = cached(x)
        assert out.requires_grad and cached.cache_instance.stats().hits == 0
    finally:
        unfrozen.requires_grad_(False)


def test_load_state_dict_still_takes_the_key_again(tmp_path: Path) -> None:
    cached, plain = _cached(False, tmp_path)
    x = torch.randn(5, 6)
    _same(cached, plain, x)
    other = _backbone(7).state_dict()
    cached.load_state_dict(other)
    plain.load_state_dict(other)
    _same(cached, plain, x)


def test_writes_through_data_are_seen_only_with_verify_weights(tmp_path: Path) -> None:
    # Documented: p.data has a version counter of its own; verify_weights hashes the weights.
    cached, plain = _cached(False, tmp_path)
    x = torch.randn(5, 6)
    _same(cached, plain, x)
    cached[0].weight.data.mul_(0.5)
    with torch.no_grad():
        assert not torch.equal(cached(x), nn.Sequential.forward(cached, x))  # the documented blind spot

    cached, plain = _cached(False, tmp_path, verify_weights=1)
    _same(cached, plain, x)
    cached[0].weight.data.mul_(0.5)
    plain[0].weight.data.mul_(0.5)
    _same(cached, plain, x)


def test_a_cached_method_sees_its_module_change(tmp_path: Path) -> None:
    model = _backbone(0)
    first = torchcache()(model.forward)
    x = torch.randn(5, 6)
    first(x)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    assert torch.equal(first(x), nn.Sequential.forward(model, x))


def test_exact_batches_compute_a_batch_with_any_miss_whole() -> None:
    sizes: list[int] = []

    @torchcache(check_items=False, exact_batches=True)
    def f(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        return x * 2

    x = torch.randn(6, 3)
    f(x[:3])
    out = f(x)
    assert sizes == [3, 6]
    assert torch.equal(out, x * 2)
    assert torch.equal(f(x), x * 2)
    assert sizes == [3, 6]  # found whole: served from the cache


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from torchcache import torchcache
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh()).eval().requires_grad_(False)
    plain = nn.Sequential(nn.Linear(6, 4), nn.Tanh()).eval().requires_grad_(False)
    plain.load_state_dict(model.state_dict())
    cached = torchcache(persistent=True, persistent_cache_dir=sys.argv[1])(model)
    x = torch.arange(30, dtype=torch.float32).reshape(5, 6) / 30
    hits = []
    for step in range(2):
        assert torch.equal(cached(x), plain(x)), step
        hits.append(cached.cache_instance.stats().hits)
        with torch.no_grad():
            model[0].weight.mul_(0.5)
            plain[0].weight.mul_(0.5)
    cached.cache_instance.flush()
    print(hits)
    """
)


@pytest.mark.slow
def test_in_place_changes_across_processes_reuse_the_entries_of_each_state(tmp_path: Path) -> None:
    runs = []
    for _ in range(2):
        done = run_python(_CHILD, str(tmp_path))
        assert done.returncode == 0, done.stderr
        runs.append(done.stdout.split("\n")[-2])
    assert runs == ["[0, 0]", "[5, 10]"]


@torchcache()
class Resizes(nn.Module):
    """Keeps its last input's first row in a buffer that it resizes to the row's width."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last.resize_(x.shape[1]).copy_(x[0])
        return x * 2


def test_a_buffer_that_forward_resizes_stays_resizable_after_its_key() -> None:
    model = Resizes()
    for width in (3, 5):
        x = torch.randn(4, width)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)  # the buffer changes at every call: rekeyed
            assert torch.equal(model(x), x * 2)
        assert torch.equal(model.last, x[0])
    assert model.last.untyped_storage().resizable()


def test_a_deleted_model_with_a_plain_tensor_attribute_is_freed_without_a_collection() -> None:
    import gc
    import weakref

    model = torchcache()(nn.Sequential(nn.Linear(3, 3)).requires_grad_(False))
    model.mask = torch.ones(3)  # watched for rebinding: held without a cycle through the model
    model(torch.randn(4, 3))
    layer = weakref.ref(model[0])
    gc.disable()
    try:
        del model
        assert layer() is None
    finally:
        gc.enable()
