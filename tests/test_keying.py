"""Keys see everything or refuse: no configuration may share another configuration's entry."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import os
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import load_module, run_python
from torchcache import CacheWarning, KeyingError, torchcache
from torchcache.canonical import KeyEncoder
from torchcache.config import module_dir_name
from torchcache.datasets.dataset import CachedDataset
from torchcache.datasets.keys import fingerprint_dataset
from torchcache.module.fingerprint import describe_instance


def _quantize(values: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    with warnings.catch_warnings():  # quantized dtypes are deprecated in torch, still supported
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(values, scale, zero_point, torch.quint8)


def _frozen(module: nn.Module) -> nn.Module:
    return module.eval().requires_grad_(False)


def _wrapped_pair_outputs(a: nn.Module, b: nn.Module, x: torch.Tensor, root: Path) -> tuple[torch.Tensor, ...]:
    """Wrap two configurations into one persistent root, call both on ``x``; return (a, b, b uncached)."""
    expected_b = b(x)
    wa = torchcache(persistent=True, persistent_cache_dir=root)(_frozen(a))
    out_a = wa(x)
    wa.cache_instance.flush()
    wb = torchcache(persistent=True, persistent_cache_dir=root)(_frozen(b))
    return out_a, wb(x), expected_b


class _Holder(nn.Module):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = self.value
        if callable(value):
            return value(x)
        if isinstance(value, dict):
            return x * value["gain"]
        if isinstance(value, (list, tuple)):
            first = value[0]
            return x * (first if not isinstance(first, list) else first[0]) + torch.as_tensor(value[-1]).sum()
        raise AssertionError(value)


PAIRS = {
    "pool_list": (lambda: nn.AdaptiveAvgPool2d([1, 1]), lambda: nn.AdaptiveAvgPool2d([2, 2]), (4, 3, 8, 8)),
    "unflatten_list": (lambda: nn.Unflatten(1, [4, 6]), lambda: nn.Unflatten(1, [6, 4]), (4, 24)),
    "function": (lambda: _Holder(torch.relu), lambda: _Holder(torch.tanh), (4, 5)),
    "scales_list": (lambda: _Holder([1.0, 0.0]), lambda: _Holder([2.0, 1.0]), (4, 5)),
    "config_dict": (lambda: _Holder({"gain": 1.0}), lambda: _Holder({"gain": 3.0}), (4, 5)),
    "tensor_in_list": (lambda: _Holder([1.0, torch.ones(2)]), lambda: _Holder([1.0, torch.zeros(2)]), (4, 5)),
    "nested": (lambda: _Holder([[1.0], (0.0,)]), lambda: _Holder([[2.0], (0.0,)]), (4, 5)),
    "lambda": (lambda: _Holder(lambda x: x + 1), lambda: _Holder(lambda x: x + 2), (4, 5)),
}


@pytest.mark.parametrize("case", sorted(PAIRS))
def test_two_configurations_never_share_an_entry(case: str, tmp_path: Path) -> None:
    make_a, make_b, shape = PAIRS[case]
    x = torch.randn(*shape)
    out_a, out_b, expected_b = _wrapped_pair_outputs(make_a(), make_b(), x, tmp_path)
    assert not (out_a.shape == expected_b.shape and torch.equal(out_a, expected_b))  # the pair differs
    assert torch.equal(out_b, expected_b)


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from torchcache import torchcache
    x = torch.arange(4 * 3 * 8 * 8, dtype=torch.float32).reshape(4, 3, 8, 8)
    for size in map(int, sys.argv[2:]):
        model = torchcache(persistent=True, persistent_cache_dir=sys.argv[1])(nn.AdaptiveAvgPool2d([size, size]))
        out = model(x)
        model.cache_instance.flush()
        assert torch.equal(out, nn.AdaptiveAvgPool2d([size, size])(x)), out.shape
        print(model.cache_instance.stats().hits)
    """
)


@pytest.mark.slow
def test_configurations_in_separate_processes_keep_their_own_entries(tmp_path: Path) -> None:
    hits = []
    for sizes in (["1"], ["2", "1"]):  # the second process computes its own, then reads the first's
        done = run_python(_CHILD, str(tmp_path), *sizes)
        assert done.returncode == 0, done.stderr
        hits += [int(line) for line in done.stdout.split()]
    assert hits == [0, 0, 4]  # each configuration reuses its own entries, never the other's


def test_quantized_inputs_are_keyed_with_their_scale_and_zero_point() -> None:
    @torchcache()
    def dequantize(x: torch.Tensor) -> torch.Tensor:
        return x.dequantize()

    values = torch.ones(4, 3)
    low = _quantize(values, 0.1, 0)
    high = _quantize(values * 2, 0.2, 0)
    assert torch.equal(low.int_repr(), high.int_repr())
    assert torch.equal(dequantize(low), low.dequantize())
    assert torch.equal(dequantize(high), high.dequantize())
    shifted = _quantize(values, 0.1, 3)
    assert torch.equal(dequantize(shifted), shifted.dequantize())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(4, 3, device="meta"),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        lambda: torch.eye(4).to_sparse(),
    ],
    ids=["meta", "nested", "sparse"],
)
def test_inputs_without_keyable_content_run_uncached_with_one_warning(make: Any) -> None:
    seen = []

    @torchcache()
    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return x * 2

    x = make()
    with pytest.warns(CacheWarning, match="uncached|without the cache"):
        out = f(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x)  # warned once
    assert len(seen) == 2
    assert out.shape == (x * 2).shape
    assert f.cache_instance.stats().hits == 0  # type: ignore[attr-defined]


def test_a_safe_name_never_shares_a_directory_with_a_mapped_one() -> None:
    mapped = module_dir_name("resnet50 v2")
    assert mapped is not None
    assert module_dir_name(mapped) != mapped
    assert module_dir_name("resnet50-v2") == "resnet50-v2"


class _Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Identity())
        self.inner[0].lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_an_attribute_that_cannot_be_keyed_is_refused_with_its_path_and_the_remedies() -> None:
    with pytest.raises(KeyingError) as info:
        torchcache()(_Locked())
    message = str(info.value)
    assert "_Locked.inner.0.lock" in message
    assert "key_ignore=('lock',)" in message and "__torchcache_key__" in message


@pytest.mark.parametrize("ignore", [("lock",), ("inner.0.lock",)])
def test_key_ignore_leaves_a_declared_attribute_out(ignore: tuple[str, ...]) -> None:
    model = torchcache(key_ignore=ignore)(_Locked())
    x = torch.randn(2, 3)
    assert torch.equal(model(x), x + 1)
    assert torch.equal(model(x), x + 1)
    assert model.cache_instance.stats().hits == 2


def test_a_decorated_class_refuses_an_init_argument_it_cannot_key() -> None:
    @torchcache()
    class Net(nn.Module):
        def __init__(self, helper: object) -> None:
            super().__init__()
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    with pytest.raises(KeyingError, match="init argument 0"):
        Net(threading.Lock())
    Net(threading.Lock).requires_grad_(False)  # a class is keyed by name and source


def test_torchcache_key_method_gives_the_key() -> None:
    class Opaque:
        def __init__(self, tag: str) -> None:
            self.tag = tag
            self.lock = threading.Lock()

        def __torchcache_key__(self) -> str:
            return self.tag

    assert describe_instance(_Holder(Opaque("a"))) == describe_instance(_Holder(Opaque("a")))
    assert describe_instance(_Holder(Opaque("a"))) != describe_instance(_Holder(Opaque("b")))


def test_attributes_changed_after_wrapping_are_read_when_wrapped() -> None:
    # Documented: attributes are part of the key as they were when the module was wrapped.
    model = torchcache()(_frozen(_Holder({"gain": 1.0})))
    key = model.cache_instance.module_hash
    assert torchcache()(_frozen(_Holder({"gain": 2.0}))).cache_instance.module_hash != key


# -- the torch.nn zoo ------------------------------------------------------------------------------

_ARGUMENTS: dict[str, Any] = {
    "in_features": 6,
    "out_features": 5,
    "in1_features": 6,
    "in2_features": 6,
    "in_channels": 3,
    "out_channels": 4,
    "kernel_size": 3,
    "num_features": 3,
    "normalized_shape": [6],
    "num_groups": 1,
    "num_channels": 3,
    "embed_dim": 6,
    "num_heads": 2,
    "d_model": 6,
    "nhead": 2,
    "input_size": 6,
    "hidden_size": 4,
    "num_embeddings": 10,
    "embedding_dim": 4,
    "output_size": 2,
    "size": 4,
    "scale_factor": 2.0,
    "padding": 1,
    "upscale_factor": 1,
    "downscale_factor": 1,
    "dim": 1,
    "start_dim": 1,
    "lambd": 0.5,
    "p": 0.5,
    "negative_slope": 0.1,
    "threshold": 0.1,
    "value": 0.5,
    "min_val": -0.5,
    "max_val": 0.5,
    "beta": 1.0,
}
_INPUTS = [(2, 3, 8, 8), (2, 3, 8), (2, 6), (2, 3, 6), (2, 6, 6), (2, 5)]
_SKIP = {"Module", "Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict"}


def _variants(value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, max(0, value - 1)]
    if isinstance(value, float):
        return [value * 2 + 0.25]
    if isinstance(value, str):
        return {"mean": ["sum"], "zeros": ["reflect"], "nearest": ["bilinear"], "relu": ["gelu"]}.get(value, [])
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return [type(value)(v + 1 for v in value)]
    return []


def _build(cls: type[nn.Module], kwargs: dict[str, Any]) -> nn.Module | None:
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _frozen(cls(**kwargs))
    except Exception:  # noqa: BLE001 - a configuration the class does not accept
        return None


def _run(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = module(x)
    except Exception:  # noqa: BLE001 - an input the module does not take
        return None
    return out if isinstance(out, torch.Tensor) else None


def _zoo() -> list[tuple[str, type[nn.Module], dict[str, Any], tuple[int, ...]]]:
    found = []
    for name in sorted(dir(nn)):
        cls = getattr(nn, name)
        if not (inspect.isclass(cls) and issubclass(cls, nn.Module)) or name in _SKIP or name.startswith("_"):
            continue
        try:
            params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        except (TypeError, ValueError):
            continue
        kwargs = {}
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("device", "dtype"):
                continue
            if p.default is inspect.Parameter.empty:
                if p.name not in _ARGUMENTS:
                    break
                kwargs[p.name] = _ARGUMENTS[p.name]
            else:
                kwargs[p.name] = p.default
        else:
            module = _build(cls, kwargs)
            if module is None:
                continue
            shape = next((s for s in _INPUTS if _run(module, torch.randn(*s)) is not None), None)
            if shape is not None:
                found.append((name, cls, kwargs, shape))
    return found


ZOO = _zoo()


def test_the_zoo_is_broad() -> None:
    assert len(ZOO) >= 60, [name for name, *_ in ZOO]


@pytest.mark.parametrize(("name", "cls", "kwargs", "shape"), ZOO, ids=[z[0] for z in ZOO])
def test_zoo_configurations_with_different_outputs_have_different_keys(
    name: str, cls: type[nn.Module], kwargs: dict[str, Any], shape: tuple[int, ...]
) -> None:
    base = _build(cls, kwargs)
    assert base is not None
    torch.manual_seed(1)
    x = torch.randn(*shape)
    expected = _run(base, x)
    assert expected is not None
    key = torchcache()(base).cache_instance.module_hash
    for arg, value in kwargs.items():
        for variant in _variants(value):
            other = _build(cls, {**kwargs, arg: variant})
            if other is None:
                continue
            out = _run(other, x)
            if out is None or (out.shape == expected.shape and torch.equal(out, expected)):
                continue
            other_key = torchcache()(other).cache_instance.module_hash
            assert other_key != key, f"{name}({arg}={variant!r}) shares the key of {arg}={value!r}"


# -- every branch of the encoder ---------------------------------------------------------------------


class _Color(enum.Enum):
    RED = 1
    BLUE = 2


class _Point(NamedTuple):
    x: int
    y: int


@dataclasses.dataclass
class _Config:
    depth: int
    width: float


class _Slotted:
    __slots__ = ("a",)

    def __init__(self, a: int) -> None:
        self.a = a


class _Plain:
    def __init__(self, a: Any) -> None:
        self.a = a


def _f1(x: int) -> int:
    return x + 1


def _f2(x: int) -> int:
    return x + 2


def _adder(n: int) -> Any:
    return lambda x: x + n


# Each pair: two values one branch of the encoder must tell apart (and each equals a copy of itself).
BRANCHES: dict[str, tuple[Any, Any]] = {
    "none_bool": (None, False),
    "bool": (True, False),
    "int": (1, 2),
    "int_vs_float": (1, 1.0),
    "float_zero_sign": (0.0, -0.0),
    "complex": (1 + 2j, 1 + 3j),
    "str": ("a", "b"),
    "bytes": (b"a", b"b"),
    "bytearray": (bytearray(b"a"), bytearray(b"b")),
    "enum": (_Color.RED, _Color.BLUE),
    "dtype": (torch.float32, torch.float16),
    "device": (torch.device("cpu"), torch.device("meta")),
    "size": (torch.Size([1, 2]), torch.Size([2, 1])),
    "memory_format": (torch.contiguous_format, torch.channels_last),
    "layout": (torch.strided, torch.sparse_coo),
    "tensor": (torch.zeros(3), torch.tensor([0.0, 0.0, 1.0])),
    "tensor_dtype": (torch.zeros(3), torch.zeros(3, dtype=torch.float64)),
    "quantized": (
        _quantize(torch.ones(3), 0.1, 0),
        _quantize(torch.ones(3) * 2, 0.2, 0),
    ),
    "array": (np.zeros(3), np.array([0.0, 0.0, 1.0])),
    "object_array": (np.array([1, "a"], dtype=object), np.array([1, "b"], dtype=object)),
    "numpy_scalar": (np.float32(1), np.float64(1)),
    "numpy_structured_scalar": (np.zeros(1, [("a", "i4")])[0], np.zeros(1, [("b", "i4")])[0]),
    "numpy_dtype": (np.dtype("float32"), np.dtype("float64")),
    "tuple_list": ((1, 2), [1, 2]),
    "list": ([1, 2], [2, 1]),
    "dict_order": ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
    "ordered_dict": (collections.OrderedDict(a=1), {"a": 1}),
    "set": ({1, 2}, {1, 3}),
    "frozenset": (frozenset({1}), {1}),
    "namedtuple": (_Point(1, 2), (1, 2)),
    "dataclass": (_Config(1, 1.0), _Config(1, 2.0)),
    "partial": (functools.partial(_f1, 1), functools.partial(_f1, 2)),
    "function": (_f1, _f2),
    "closure": (_adder(1), _adder(2)),
    "builtin": (torch.relu, torch.tanh),
    "class": (_Plain, _Slotted),
    "module": (np, torch),
    "slots": (_Slotted(1), _Slotted(2)),
    "plain_object": (_Plain(1), _Plain(2)),
    "nn_module": (nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=True)),
    "path": (Path("a"), Path("b")),
    "range": (range(3), range(4)),
    "default_dict": (collections.defaultdict(int, a=1), collections.defaultdict(list, a=1)),
    "cycle": ([], [[]]),
}
BRANCHES["cycle"][0].append(BRANCHES["cycle"][0])


@pytest.mark.parametrize("branch", sorted(BRANCHES))
def test_each_branch_of_the_encoder_tells_values_apart(branch: str) -> None:
    a, b = BRANCHES[branch]

    def encode(value: Any) -> bytes:
        return KeyEncoder("remedy").encode(value, "value")

    assert encode(a) != encode(b)
    assert encode(a) == encode(a)


def test_values_without_an_exact_encoding_are_refused() -> None:
    encoder = KeyEncoder("give a version")
    for value in (threading.Lock(), (x for x in ()), torch.empty(2, device="meta")):
        with pytest.raises(KeyingError, match="give a version"):
            encoder.encode(value, "value")


def test_deep_nesting_is_refused_not_truncated() -> None:
    deep: list[Any] = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(KeyingError, match="levels deep"):
        KeyEncoder("remedy").encode(deep, "value")


# -- datasets ---------------------------------------------------------------------------------------


class _Rows(torch.utils.data.Dataset[Any]):
    def __init__(self, table: Any, extra: Any = None) -> None:
        self.table = table
        self.extra = extra

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.as_tensor(np.asarray(self.table[i], dtype=np.float32))


def test_dataset_fingerprints_see_every_row_of_a_large_list() -> None:
    rows = [[float(i)] for i in range(5000)]
    changed = [list(r) for r in rows]
    changed[2500][0] = -1.0
    assert fingerprint_dataset(_Rows(rows)) != fingerprint_dataset(_Rows(changed))


def test_dataset_fingerprints_see_pandas_rows() -> None:
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"a": np.arange(100.0), "b": ["x"] * 100})
    other = frame.copy()
    other.loc[50, "a"] = -1.0
    assert repr(frame) == repr(other)  # what a repr-based fingerprint saw
    assert fingerprint_dataset(_Rows(frame)) != fingerprint_dataset(_Rows(other))


def test_dataset_fingerprints_see_categories_attrs_and_what_an_object_cell_holds() -> None:
    pandas = pytest.importorskip("pandas")
    labels = pandas.Categorical(["dog", "cat"], categories=["cat", "dog"])
    reordered = pandas.Categorical(["dog", "cat"], categories=["bird", "cat", "dog"])  # other codes, same values
    frames = [pandas.DataFrame({"label": labels}), pandas.DataFrame({"label": reordered})]
    scaled = pandas.DataFrame({"a": [1.0, 2.0]})
    scaled.attrs["scale"] = 100
    frames += [pandas.DataFrame({"a": [1.0, 2.0]}), scaled]
    cells = ([None, "x"], [float("nan"), "x"])
    frames += [pandas.DataFrame({"o": pandas.Series(column, dtype=object)}) for column in cells]
    frames += [pandas.DataFrame({"a": [0.0]}), pandas.DataFrame({"a": [-0.0]})]  # 1 / a: inf or -inf
    frames += [pandas.DataFrame({"a": [1.0]}, index=[0]), pandas.DataFrame({"a": [1.0]}, index=[0.0])]
    named = pandas.DataFrame({"a": [1.0]}, index=pandas.Index([0], name="id"))
    frames += [named]
    twice = [pandas.DataFrame([[None, 1]], columns=["c", "c"]), pandas.DataFrame([[np.nan, 1]], columns=["c", "c"])]
    frames += [frame.astype(object) for frame in twice]  # columns of one name: each cell's type still counts
    keys = [fingerprint_dataset(_Rows(frame)) for frame in frames]
    assert len(set(keys)) == len(keys)


def test_pandas_cells_pandas_cannot_hash_are_keyed_one_by_one(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    frames = [
        pandas.DataFrame({"boxes": [[1, 2], [3, 4]], "y": [0, 1]}),
        pandas.DataFrame({"boxes": [[1, 2], [3, 5]], "y": [0, 1]}),  # one coordinate of one box
        pandas.DataFrame({"t": pandas.Series([torch.ones(2), torch.zeros(2)], dtype=object)}),
        pandas.DataFrame({"t": pandas.Series([torch.ones(2), torch.ones(2)], dtype=object)}),
    ]
    boxes = [[1, 2], [3, 4]]
    for categories in (["a", "b"], ["b", "a"]):  # the codes a model reads differ: so must the keys
        labels = pandas.Categorical(["a", "b"], categories=categories)
        frames.append(pandas.DataFrame({"boxes": boxes, "label": labels}))
    frames += [pandas.DataFrame({"t": pandas.Series([torch.tensor(v)], dtype=object)}) for v in (0.10001, 0.10002)]
    keys = [fingerprint_dataset(_Rows(frame)) for frame in frames]
    assert len(set(keys)) == len(keys)
    assert fingerprint_dataset(_Rows(frames[0].copy())) == keys[0]


def test_paths_in_a_pandas_column_or_index_are_keyed_by_their_files(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    files = [tmp_path / f"{i}.npy" for i in range(2)]
    for file in files:
        np.save(file, np.zeros(3))
    column = pandas.DataFrame({"path": files, "label": [0, 1]})
    index = pandas.Series([0, 1], index=files)
    pairs = pandas.DataFrame({"pair": [(files[0], files[1])]})  # a path inside a cell
    frames = [column, index, pairs]
    before = [fingerprint_dataset(_Rows(frame)) for frame in frames]
    np.save(files[1], np.ones(3))  # edited in place, under the same name
    os.utime(files[1], ns=(os.stat(files[1]).st_atime_ns, os.stat(files[1]).st_mtime_ns + 10**9))
    after = [fingerprint_dataset(_Rows(frame)) for frame in frames]
    assert all(a != b for a, b in zip(before, after, strict=True))


def test_dataset_fingerprints_see_which_part_of_a_memory_mapped_file_a_view_covers(tmp_path: Path) -> None:
    np.save(tmp_path / "rows.npy", np.arange(40.0).reshape(20, 2))
    for name in (str(tmp_path / "rows.npy"), tmp_path / "rows.npy"):
        rows = np.load(name, mmap_mode="r")
        views = [rows[:10], rows[10:], rows[::2], rows[1::2], rows[:10]]
        keys = [fingerprint_dataset(_Rows(view)) for view in views]
        assert len(set(keys[:4])) == 4 and keys[4] == keys[0]


def test_dataset_fingerprints_see_slots_and_masks() -> None:
    @dataclasses.dataclass(slots=True)
    class Signals(torch.utils.data.Dataset[float]):
        values: list[float]

        def __len__(self) -> int:
            return len(self.values)

        def __getitem__(self, i: int) -> float:
            return self.values[i]

    assert fingerprint_dataset(Signals([1.0, 2.0])) != fingerprint_dataset(Signals([10.0, 20.0]))
    masked = np.ma.masked_array([3.0, 4.0], mask=[False, True])
    assert fingerprint_dataset(_Rows(masked)) != fingerprint_dataset(_Rows(np.ma.masked_array([3.0, 4.0])))


def test_dataset_paths_are_keyed_by_size_and_mtime(tmp_path: Path) -> None:
    file = tmp_path / "labels.txt"
    file.write_text("a")
    before = fingerprint_dataset(_Rows([[1.0]], file))
    file.write_text("ab")
    assert fingerprint_dataset(_Rows([[1.0]], file)) != before


def test_a_dataset_attribute_that_cannot_be_keyed_asks_for_a_version(tmp_path: Path) -> None:
    with pytest.raises(KeyingError, match="version="):
        CachedDataset(_Rows([[1.0]], threading.Lock()), tmp_path / "c")
    data = CachedDataset(_Rows([[1.0]], threading.Lock()), tmp_path / "c", version="v1")
    assert torch.equal(data[0], torch.tensor([1.0]))


# -- Hugging Face configurations ---------------------------------------------------------------------

_VIT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 37}
_VIT.update(image_size=16, patch_size=8)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_act", "relu"), ("layer_norm_eps", 1e-3), ("qkv_bias", False)],
)
def test_hugging_face_configurations_that_change_outputs_have_other_keys(field: str, value: Any) -> None:
    transformers = pytest.importorskip("transformers")

    def build(**changes: Any) -> nn.Module:
        torch.manual_seed(0)
        return _frozen(transformers.ViTModel(transformers.ViTConfig(**_VIT, **changes)))

    base, other = build(), build(**{field: value})
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert not torch.equal(base(x).last_hidden_state, other(x).last_hidden_state)
    assert torchcache()(base).cache_instance.module_hash != torchcache()(other).cache_instance.module_hash


@pytest.mark.parametrize("package", ["torchvision", "timm"])
def test_model_library_configurations_that_change_outputs_have_other_keys(package: str) -> None:
    library = pytest.importorskip(package, reason=f"{package} is not installed (it needs its own torch build)")

    def build(**kwargs: Any) -> nn.Module:
        torch.manual_seed(0)
        if package == "torchvision":
            return _frozen(library.models.resnet18(weights=None, **kwargs))
        return _frozen(library.create_model("resnet18", pretrained=False, **kwargs))

    x = torch.randn(2, 3, 64, 64)  # a last feature map of 2x2, where max and average pooling differ
    # Arguments each library's resnet18 takes, and that change its outputs.
    changed = {"torchvision": {"zero_init_residual": True}, "timm": {"global_pool": "max"}}[package]
    for changes in ({"num_classes": 10}, changed):
        base, other = build(), build(**changes)
        with torch.no_grad():
            assert base(x).shape != other(x).shape or not torch.equal(base(x), other(x)), changes
        assert torchcache()(base).cache_instance.module_hash != torchcache()(other).cache_instance.module_hash


_EDITED = """
import threading
import torch

LOCK = threading.Lock()  # cannot be keyed: left to the version


class Text(torch.utils.data.Dataset):
    def __init__(self, lines, options):
        self.lines, self.options = lines, options

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        with LOCK:
            return torch.tensor([len(self.lines[i])]) * {factor}
"""


def test_with_a_version_only_what_cannot_be_keyed_is_left_to_it(tmp_path: Path, modules: list[str]) -> None:
    modules.append("edited_dataset")

    def fingerprint(factor: int, size: int) -> str:
        module = load_module(tmp_path / f"edited_{factor}.py", "edited_dataset", _EDITED.format(factor=factor))
        options = {"size": size, "lock": threading.Lock()}  # an attribute with a part that cannot be keyed
        return fingerprint_dataset(module.Text(["hello"], options), version="v1")

    with pytest.raises(KeyingError, match="LOCK"):
        fingerprint_dataset(load_module(tmp_path / "e.py", "edited_dataset", _EDITED.format(factor=1)).Text([], {}))
    base = fingerprint(1, 224)
    assert fingerprint(1, 224) == base
    assert fingerprint(10, 224) != base  # the class's code edited: still in the key
    assert fingerprint(1, 256) != base  # another item of the attribute holding the lock


class _OwnKey(torch.utils.data.Dataset[int]):
    lock = threading.Lock()  # a class value that cannot be keyed: the dataset gives its own key

    def __init__(self, name: str) -> None:
        self.name = name

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return i

    def __torchcache_key__(self) -> str:
        return self.name


class _Delegating(torch.utils.data.Dataset[int]):
    """A wrapper whose attribute lookups go to the dataset it wraps (which has a key of its own)."""

    def __init__(self, inner: _OwnKey, scale: int) -> None:
        self.inner, self.scale = inner, scale

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return self.inner[i] * self.scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def test_a_dataset_with_a_key_of_its_own_is_keyed_by_it_and_its_code(tmp_path: Path, modules: list[str]) -> None:
    assert fingerprint_dataset(_OwnKey("a")) == fingerprint_dataset(_OwnKey("a")) != fingerprint_dataset(_OwnKey("b"))
    wrapped = [fingerprint_dataset(_Delegating(_OwnKey("a"), scale)) for scale in (2, 3)]
    assert wrapped[0] != wrapped[1]  # a wrapper keyed by its own attributes, not the key it delegates to
    modules.append("own_key_dataset")
    keys = []
    for factor in (1, 10):
        source = _EDITED.format(factor=factor).replace(
            "    def __len__(self):",
            "    def __torchcache_key__(self):\n        return 'v'\n\n    def __len__(self):",
        )
        module = load_module(tmp_path / f"own_{factor}.py", "own_key_dataset", source)
        keys.append(fingerprint_dataset(module.Text(["hello"], {})))  # its lock left to its key
    assert keys[0] != keys[1]  # __getitem__ edited
