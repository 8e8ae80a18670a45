"""Operators in keys: a ``custom_op`` by its functions and kernels, one defined in C++ by its library's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import fake_extension, load_module
from torchcache import KeyingError, torchcache
from torchcache.canonical import KeyEncoder

X = torch.arange(12.0).reshape(3, 4) - 5

_OPERATOR = """
import torch
@torch.library.custom_op("tcops::scale_{name}", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0
"""


def _define(tmp_path: Path, modules: list[str], name: str) -> torch.library.CustomOpDef:
    modules.append(f"defines_{name}")
    module = load_module(tmp_path / f"defines_{name}.py", f"defines_{name}", _OPERATOR.format(name=name))
    return module.scale  # type: ignore[no-any-return]


def test_a_custom_operator_is_keyed_by_the_functions_it_is_defined_with(tmp_path: Path, modules: list[str]) -> None:
    operator = _define(tmp_path, modules, "keyed")

    def calls(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tcops.scale_keyed(x)

    before = torchcache()(calls).cache_instance.module_hash

    @operator.register_kernel("cpu")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    cached = torchcache()(calls)
    assert cached.cache_instance.module_hash != before
    assert torch.equal(cached(X), X * 3.0)


def test_a_kernel_registered_after_the_first_call_is_seen(tmp_path: Path, modules: list[str]) -> None:
    operator = _define(tmp_path, modules, "later")

    def calls(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tcops.scale_later(x)

    cached = torchcache()(calls)
    assert torch.equal(cached(X), X * 2.0)
    operator.register_kernel("cpu", lambda x: x * 5.0)
    assert torch.equal(cached(X), X * 5.0)


@pytest.mark.parametrize("held", ["custom op object", "alias of the packet", "overload"])
def test_an_operator_held_as_a_value_is_keyed_by_what_defines_it(tmp_path: Path, modules: list[str], held: str) -> None:
    name = held.replace(" ", "_")
    operator = _define(tmp_path, modules, name)
    packet = getattr(torch.ops.tcops, f"scale_{name}")
    value = {"custom op object": operator, "alias of the packet": packet, "overload": packet.default}[held]
    before = KeyEncoder("remedy").encode(value, "op")  # not refused for the state torch keeps in it
    operator.register_kernel("cpu", lambda x: x * 7.0)
    assert KeyEncoder("remedy").encode(value, "op") != before


def test_overloads_of_one_operator_have_keys_of_their_own() -> None:
    encode = KeyEncoder("remedy").encode
    assert encode(torch.ops.aten.add.Tensor, "op") != encode(torch.ops.aten.add.Scalar, "op")
    assert encode(torch.ops.aten.add.Tensor, "op") == encode(torch.ops.aten.add.Tensor, "op")


def _calls_native(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tcnative.scale(x)  # defined in C++ (TORCH_LIBRARY), in a library loaded by load_inline


def test_an_operator_defined_in_cpp_is_keyed_by_the_bytes_of_the_libraries_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / "tcnative.so"
    library.write_bytes(b"\x7fELF x * 2")
    monkeypatch.setattr(torch.ops, "loaded_libraries", {str(library)})
    before = KeyEncoder("remedy").encode(_calls_native, "forward")
    assert KeyEncoder("remedy").encode(_calls_native, "forward") == before
    library.write_bytes(b"\x7fELF x * 5, rebuilt")
    assert KeyEncoder("remedy").encode(_calls_native, "forward") != before


def test_a_users_compiled_extension_module_counts_as_a_library_that_may_define_operators(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = fake_extension(tmp_path, "tc_native_ext", monkeypatch)
    before = KeyEncoder("remedy").encode(_calls_native, "forward")
    built.write_bytes(b"\x7fELF version 2")
    assert KeyEncoder("remedy").encode(_calls_native, "forward") != before


def test_a_library_that_can_no_longer_be_read_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "deleted_after_loading.so"
    monkeypatch.setattr(torch.ops, "loaded_libraries", {str(gone)})
    with pytest.raises(KeyingError, match=r"deleted_after_loading\.so.*cannot be read"):
        KeyEncoder("remedy").encode(_calls_native, "forward")
