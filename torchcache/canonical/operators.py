"""Operators (``torch.ops.<namespace>.<name>``, a ``custom_op``): keyed by the code that defines them.

An operator defined in Python with ``torch.library.custom_op`` is keyed by its functions,
and its kernels are watched, so that one registered later takes the key again. One
defined in C++ (``TORCH_LIBRARY``) is keyed by the bytes of every library that may
define it: those loaded with ``torch.ops.load_library`` (``load_inline``, a
``cpp_extension`` build) and the user's compiled extension modules; an installed package
of the namespace's name also by its version. Torch's own operators go with torch's version.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any, cast

from .objects import Binding, collect
from .origins import file_digest, is_installed_file, origin_of_module, version_of
from .tags import text

if TYPE_CHECKING:
    from .code import Encoder

__all__ = ["encode_operator", "operator_name"]

#: Namespaces of operators torch itself defines (some of their kernels are registered from Python).
_TORCH_OPERATORS = frozenset({"aten", "prims", "prim", "_native", "quantized", "_quantized", "profiler", "inductor"})
#: Devices whose kernel a ``custom_op`` may be given after the key was taken.
_DEVICES = (None, "cpu", "cuda", "mps", "xpu", "hpu", "mtia")
_COMPILED = (".so", ".pyd", ".dylib", ".dll")


def operator_name(value: object) -> tuple[str, str, str] | None:
    """``(namespace, name, overload)`` of an operator (``torch.ops.ns.name``, an overload, a custom_op), or ``None``."""
    import torch

    if isinstance(value, torch._library.custom_ops.CustomOpDef):
        return value._namespace, value._name, ""
    if isinstance(value, torch._ops.OpOverloadPacket):
        qualified, overload = value._qualified_op_name, ""
    elif isinstance(value, torch._ops.OpOverload):
        qualified, overload = value._schema.name, value._overloadname
    else:
        return None
    namespace, _, name = qualified.partition("::")
    return namespace, name, overload


def encode_operator(encoder: Encoder, namespace: str, name: str, path: str, depth: int) -> bytes:
    """An operator called as ``torch.ops.<namespace>.<name>``: the code that defines it.

    Raises:
        KeyingError: If Python code registered it in another way (``torch.library.Library``),
            whose functions cannot be found, or a library that may define it can no longer be read.
    """
    import torch

    if namespace in _TORCH_OPERATORS:
        return text(version_of("torch"))
    definition = getattr(torch._library.custom_ops, "OPDEFS", {}).get(f"{namespace}::{name}")
    if definition is not None:
        backends = definition._backend_fns
        kernels = sorted((str(device), _kernel(f)) for device, f in backends.items())
        if not all(isinstance(f, types.FunctionType) for _, f in kernels):
            raise encoder.refuse(path, "the kernels of this custom operator could not be found")
        for device in {*backends, *_DEVICES}:  # register_kernel later: the key is taken again
            collect(Binding(backends, cast(str, device), backends.get(device)))
        return encoder.child([definition._init_fn, kernels], path, depth)
    registered = getattr(torch.library, "_impls", ())
    if any(entry.startswith(f"{namespace}/{name}/") for entry in registered):
        raise encoder.refuse(path, "an operator registered from Python with torch.library.Library is not followed")
    return text(_libraries(encoder, namespace, path))


def _libraries(encoder: Encoder, namespace: str, path: str) -> str:
    """What identifies the C++ code that may define an operator of ``namespace``.

    The bytes of the libraries loaded with ``torch.ops.load_library`` and of the user's
    compiled extension modules (not installed ones: numpy's would change nothing), and
    the version of an installed package named as the namespace (``torchvision``).
    """
    import torch

    files = {str(f) for f in getattr(torch.ops, "loaded_libraries", ())}
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if isinstance(filename, str) and filename.endswith(_COMPILED) and not is_installed_file(filename):
            files.add(filename)
    digests = []
    for filename in files:
        digest = file_digest(filename)
        if digest is None:
            raise encoder.refuse(path, f"the library {filename!r}, which may define this operator, cannot be read")
        digests.append(digest)
    origin = origin_of_module(namespace) if namespace in sys.modules else None
    return "|".join([*sorted(digests), origin or ""])


def _kernel(registered: Any) -> Any:
    """The function a ``custom_op`` kernel was registered with: torch keeps it in a closure cell ``fn``."""
    import inspect

    function = inspect.unwrap(registered)
    code = getattr(function, "__code__", None)
    if code is not None and "fn" in code.co_freevars and function.__closure__:
        return function.__closure__[code.co_freevars.index("fn")].cell_contents
    return function
