"""Operators that code calls as ``torch.ops.<namespace>.<name>``: keyed by the functions that define them."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .code import Encoder

__all__ = ["encode_operator"]

#: Namespaces of operators torch itself defines (some of their kernels are registered from Python).
_TORCH_OPERATORS = frozenset({"aten", "prims", "prim", "_native", "quantized", "_quantized", "profiler", "inductor"})


def encode_operator(encoder: Encoder, namespace: str, name: str, path: str, depth: int) -> bytes:
    """An operator called as ``torch.ops.<namespace>.<name>``: the functions a ``custom_op`` defines it with.

    Raises:
        KeyingError: If Python code registered it in another way (``torch.library.Library``),
            whose functions cannot be found.
    """
    import torch

    definition = getattr(torch._library.custom_ops, "OPDEFS", {}).get(f"{namespace}::{name}")
    if definition is not None:
        kernels = sorted((str(device), _kernel(f)) for device, f in definition._backend_fns.items())
        if not all(isinstance(f, types.FunctionType) for _, f in kernels):
            raise encoder.refuse(path, "the kernels of this custom operator could not be found")
        return encoder.child([definition._init_fn, kernels], path, depth)
    registered = getattr(torch.library, "_impls", ())
    if namespace not in _TORCH_OPERATORS and any(entry.startswith(f"{namespace}/{name}/") for entry in registered):
        raise encoder.refuse(path, "an operator registered from Python with torch.library.Library is not followed")
    return b""


def _kernel(registered: Any) -> Any:
    """The function a ``custom_op`` kernel was registered with: torch keeps it in a closure cell ``fn``."""
    import inspect

    function = inspect.unwrap(registered)
    code = getattr(function, "__code__", None)
    if code is not None and "fn" in code.co_freevars and function.__closure__:
        return function.__closure__[code.co_freevars.index("fn")].cell_contents
    return function
