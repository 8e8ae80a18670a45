"""Classes and attributes of per-item inputs and of outputs: keyed and carried into smaller batches, or refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchcache import KeyingError, torchcache

X = torch.arange(8.0).reshape(4, 2)


def scaled(batch: Any) -> torch.Tensor:
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    return (x * batch.scale).as_subclass(torch.Tensor)


class Batch(list):  # type: ignore[type-arg]
    scale = 1.0


class Pair(tuple):  # type: ignore[type-arg]
    scale = 1.0


class Unwrapping(torch.Tensor):
    """A subclass whose ``__torch_function__`` returns plain tensors."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class Keeping(torch.Tensor):
    """A subclass whose rows stay of its class (torch's default ``__torch_function__``)."""


def _with(scale: float, make: Any) -> Any:
    value = make()
    value.scale = scale
    return value


MAKERS = {
    "list subclass": lambda x: Batch([x]),
    "tuple subclass": lambda x: Pair((x,)),
    "plain tensor": lambda x: x.clone(),
    "tensor subclass": lambda x: x.clone().as_subclass(Keeping),
}


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("check_items", [True, False])
def test_attributes_of_an_input_are_keyed_and_carried_into_smaller_batches(kind: str, check_items: bool) -> None:
    cached = torchcache(check_items=check_items)(scaled)
    make = MAKERS[kind]
    assert torch.equal(cached(_with(2.0, lambda: make(X[:2]))), X[:2] * 2)
    for scale in (10.0, 2.0):
        got = cached(_with(scale, lambda: make(X)))  # at scale 2: two hits, and two misses computed
        assert torch.equal(got, X * scale)
    assert cached.cache_instance.stats().hits == 2


def test_a_subclass_whose_rows_are_plain_tensors_is_refused_with_the_cause() -> None:
    def doubled_by_class(x: torch.Tensor) -> torch.Tensor:
        return x * (2 if isinstance(x, Unwrapping) else 1)

    cached = torchcache()(doubled_by_class)
    with pytest.raises(KeyingError, match=r"argument 'x': rows taken from a Unwrapping .* are a Tensor"):
        cached(X.clone().as_subclass(Unwrapping))
    assert torch.equal(cached(X), X)  # plain tensors are cached as before


def test_a_frozen_parameter_as_the_per_item_input_is_cached_as_a_tensor() -> None:
    cached = torchcache()(lambda x: x * 2)
    first = torch.nn.Parameter(X[:2].clone(), requires_grad=False)
    assert torch.equal(cached(first), X[:2] * 2)
    assert torch.equal(cached(torch.nn.Parameter(X.clone(), requires_grad=False)), X * 2)  # two hits, two computed
    assert cached.cache_instance.stats().hits == 2


def test_an_output_of_a_tensor_subclass_is_refused_rather_than_returned_plain_on_hits() -> None:
    def as_keeping(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).as_subclass(Keeping)

    cached = torchcache()(as_keeping)
    with pytest.raises(KeyingError, match=r"output: is a .*Keeping, a subclass of torch.Tensor: a stored copy would"):
        cached(X)
    parameter = torchcache()(lambda x: torch.nn.Parameter(x * 2))
    with pytest.raises(KeyingError, match=r"Parameter, a subclass of torch.Tensor"):
        parameter(X)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_an_output_with_attributes_set_on_it_or_nested_is_refused_rather_than_returned_plain_on_hits() -> None:
    def with_format(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        boxes = x * 2
        boxes.format = "XYXY"  # type: ignore[attr-defined]
        return x, boxes

    with pytest.raises(KeyingError, match=r"output\[1\]: is a tensor with attributes set on it \(format\)"):
        torchcache()(with_format)(X)

    def with_compile_hints(x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2
        doubled._dynamo_dynamic_indices = {0}  # type: ignore[attr-defined]  # torch._dynamo.mark_dynamic's: no loss
        return doubled

    assert torch.equal(torchcache()(with_compile_hints)(X), X * 2)

    def nested(x: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor(list(x))

    with pytest.raises(KeyingError, match=r"output: is a nested tensor, .*to_padded_tensor"):
        torchcache()(nested)(X)


def test_a_cache_dtype_that_cannot_hold_an_outputs_values_is_refused_rather_than_storing_infinities() -> None:
    cached = torchcache(cache_dtype=torch.float16)(lambda x: x * 1e5)
    with pytest.raises(KeyingError, match=r"cache_dtype=torch.float16 cannot hold .*use torch.bfloat16 .* or None"):
        cached(X + 1)
    wide = torchcache(cache_dtype=torch.bfloat16)(lambda x: x.double() * 1e300)  # bfloat16 itself: None only
    with pytest.raises(KeyingError, match=r"cache_dtype=torch.bfloat16 cannot hold .*\); use None$"):
        wide(X + 1)
    inf = torchcache(cache_dtype=torch.float16)(lambda x: x / 0)  # infinities already: stored as they are
    assert torch.equal(inf(X + 1), (X + 1) / 0) and torch.equal(inf(X + 1), (X + 1) / 0)


def test_a_forward_that_writes_its_input_is_refused_also_when_only_some_items_are_computed() -> None:
    def relu_in_place(x: torch.Tensor) -> torch.Tensor:
        return torch.relu_(x) * 2

    cached = torchcache(check_items=False)(relu_in_place)
    assert torch.equal(cached(X[:2].clone()), X[:2] * 2)  # no negative value: written, but unchanged
    mixed = torch.cat([X[:2], -X[2:]])  # two hits, and two rows a write changes
    with pytest.raises(KeyingError, match=r"its forward wrote an input in place"):
        cached(mixed)
    assert torch.equal(cached(X + 1), (X + 1) * 2)  # writes that change nothing pass


def test_a_write_that_leaves_a_nan_as_it_was_is_not_refused_in_a_partly_cached_batch() -> None:
    cached = torchcache(check_items=False)(lambda x: torch.relu_(x) * 2)
    x = X.clone()
    x[3, 0] = float("nan")
    cached(x[:2].clone())
    out = cached(x.clone())  # two hits, and two rows computed: one with a NaN that relu_ leaves as it is
    assert torch.equal(out[:3], x[:3] * 2) and out[3, 0].isnan()


def test_a_shared_tensors_attributes_and_channels_last_layout_are_in_the_key() -> None:
    @torchcache(shared_args=["mask"])
    def scaled(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * getattr(mask, "scale", 1) * getattr(mask, "_shift", 1) + mask.stride()[-1]

    x = torch.randn(3, 2, 2, 2)
    first, second = torch.ones(1, 2, 2, 2), torch.ones(1, 2, 2, 2)
    first.scale, second.scale = 2, 3  # type: ignore[attr-defined]
    assert torch.equal(scaled(x, first), x * 2 + 1)
    assert torch.equal(scaled(x, second), x * 3 + 1)
    plain = torch.ones(1, 2, 2, 2)
    last = plain.to(memory_format=torch.channels_last)  # equal values, another layout
    assert torch.equal(scaled(x, plain), x + 1)
    assert torch.equal(scaled(x, last), x + last.stride()[-1]) and last.stride()[-1] != 1
    private = torch.ones(1, 2, 2, 2)
    private._shift = 5  # type: ignore[attr-defined]  # a user's own, named as private
    assert torch.equal(scaled(x, private), x * 5 + 1)
    flagged = torch.ones(1, 2, 2, 2)
    flagged._is_hf_initialized = True  # type: ignore[attr-defined]  # a library's flag: the same entries
    hits = scaled.cache_instance.stats().hits
    assert torch.equal(scaled(x, flagged), x + 1) and scaled.cache_instance.stats().hits == hits + 3
