"""The arguments of one call: which tensors are per item, what else is part of the key.

A call is bound to the wrapped callable's own signature (a ``functools.wraps`` wrapper's,
not the function it wraps; defaults applied, and keyed whole) only to *name*
its arguments; the callable is always called back with the caller's own layout of
positional and keyword arguments, with only the per-item tensors replaced by the rows
to compute (decorators that add keywords, such as Hugging Face's, keep working).

Every tensor found in an argument, also inside tuples, lists, dicts and other
mappings (``forward(self, batch)`` with a dict of tensors), is *per item*: its
dimension ``batch_dims.get(name, 0)`` indexes the batch, and it is hashed and sliced
per item. The key covers the type of every container that holds per-item tensors
(``(x,)`` and ``[x]`` differ, and so do two namedtuples of the same tensors) and each
tensor's Python type (a subclass of ``torch.Tensor`` by its class's code and the
attributes the instance holds). A tensor argument named in ``shared_args`` is the same
for the whole batch (an attention mask shaped ``(T, T)``): it is hashed whole, where it
sits, into the key of every item and passed whole. Everything else is encoded
canonically into the key.

A per-item tensor without content to key by (on the meta device, nested, sparse, or
quantized per channel along its batch dimension) makes the call run uncached
(:class:`UncachedInput`, one warning): the forward works as without the cache.

Labels keep positional and keyword arguments apart: ``*args[0]`` and ``**name`` can
never be confused with a parameter called ``args[0]``.
"""

from __future__ import annotations

import collections
import inspect
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch.autograd import forward_ad
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..canonical import KeyEncoder, collecting
from ..dtypes import channels_last_format
from ..errors import ConfigError, KeyingError
from ..keys import Context, encode_value, tensor_digest
from .call import CallArguments
from .containers import MAX_DEPTH, container_state, holds_tensor, map_tensors
from .versions import HeldValues

__all__ = ["PASSED_ON", "CallSplitter", "ShapeHint", "UncachedInput", "list_hint"]

_TENSOR = b"\x00T"
_SHARED = b"\x00S"
_TENSOR_TYPE = b"\x00C"
#: A mapping of tensors, its items in order (with ``_KEYWORDS``: apart from keys of 1.2, which sorted them).
_MAPPING = b"{="
_KEYWORDS = b"\x00K"
_SHARED_REMEDY = (
    "Pass a value torchcache can key (tensors, numbers, strings, containers, dataclasses, enums, objects with "
    "plain state), or give the object's class a __torchcache_key__() method"
)
#: How the key names the type of a container of per-item tensors (built-in ones by a letter).
_CONTAINERS: dict[type, bytes] = {tuple: b"t", list: b"l", dict: b"d", collections.OrderedDict: b"o"}
_types: weakref.WeakKeyDictionary[type, tuple[bytes, HeldValues | None]] = weakref.WeakKeyDictionary()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_PLAIN_FUNCTION = torch._C._disabled_torch_function_impl


class UncachedInput(KeyingError):
    """A per-item input whose content cannot be keyed (meta, nested, sparse): the call runs uncached."""


def _refuse_modes() -> None:
    """Refuse a call under a torch function or dispatch mode, which may change what any operation computes.

    ``with torch.device(...)`` and ``torch.set_default_device`` are function modes that
    only choose where new tensors go: they are keyed (:func:`~torchcache.keys.numerics`).

    Raises:
        UncachedInput: Naming the mode.
    """
    modes = [m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext)]  # type: ignore[no-untyped-call]
    modes += _get_current_dispatch_mode_stack()
    if modes:
        raise UncachedInput(f"a {type(modes[0]).__qualname__} (a torch function or dispatch mode) is active")


_transformed = torch._C._functorch.is_functorch_wrapped_tensor


_in_transform = torch._C._functorch.peek_interpreter_stack


class _PassedOn:
    """The default of an argument a ``(*args, **kwargs)`` wrapper passes on: left out of the key."""

    def __repr__(self) -> str:
        return "<passed on>"


PASSED_ON: Any = _PassedOn()


class _Splitter:
    """Walks the arguments of one call, adding key fields and collecting per-item tensors."""

    def __init__(self, context: Context, shared: Collection[str], dims: Mapping[str, int]) -> None:
        self.context = context
        self.shared = shared
        self.dims = dims
        self.tensors: list[torch.Tensor] = []
        self.batch = -1
        self.first_label = ""
        self.sequences: list[tuple[str, int]] = []  # non-tensor lists keyed whole, with their lengths
        self.shared_tensors: list[torch.Tensor] = []
        self.types: dict[type, bytes] = {}  # each type's key, checked once per call

    def type_key(self, cls: type, label: str) -> bytes:
        found = self.types.get(cls)
        if found is None:
            found = self.types[cls] = _type_key(cls, label)
        return found

    def add(self, label: str, name: str, value: Any) -> None:
        self.context.add(label.encode())
        if name in self.shared:
            self.add_shared(label, value)
        else:
            self._walk(label, self.dims.get(name, 0), value, 0)

    def add_shared(self, label: str, value: Any) -> None:
        """Add an argument that is the same for every item: hashed whole, tensors by content where they sit."""
        if holds_tensor(value):
            start = len(self.shared_tensors)
            map_tensors(value, self._note_shared)  # watched for writes and grad, as inputs are
            if any(map(_transformed, self.shared_tensors[start:])):
                raise UncachedInput(f"argument {label!r} is inside a torch.func transform (vmap): it has no storage")
            # Every tensor by its content, where it sits: (m, None) and (None, m) differ.
            self.context.add(_SHARED + KeyEncoder(_SHARED_REMEDY).encode(value, f"argument {label!r}"))
        else:
            self.context.add(encode_value(value, f"argument {label!r}"))

    def _note_shared(self, tensor: torch.Tensor) -> torch.Tensor:
        self.shared_tensors.append(tensor)
        return tensor

    def _walk(self, label: str, dim: int, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            self._add_tensor(label, dim, value)
        elif depth < MAX_DEPTH and isinstance(value, (tuple, list)) and holds_tensor(value):
            self.context.add(b"(" + self.type_key(type(value), label) + str(len(value)).encode())
            if type(value) is not tuple and type(value) is not list:
                self.context.add(container_state(value, label))
            for i, item in enumerate(value):
                self._walk(f"{label}[{i}]", dim, item, depth + 1)
        elif depth < MAX_DEPTH and isinstance(value, Mapping) and holds_tensor(value):
            keys = list(value)
            if not all(isinstance(k, str) for k in keys):
                raise KeyingError(f"argument {label!r}: a mapping that holds tensors must have str keys, got {keys!r}")
            # In their order (a forward may concatenate the values), and a subclass's own state with its class.
            self.context.add(_MAPPING + self.type_key(type(value), label) + str(len(keys)).encode())
            if type(value) is not dict:
                self.context.add(container_state(value, label))
            for key in keys:
                self.context.add(key.encode())
                self._walk(f"{label}[{key!r}]", dim, value[key], depth + 1)
        else:
            if isinstance(value, (list, tuple)) and len(value) > 1 and all(isinstance(v, (str, bytes)) for v in value):
                self.sequences.append((label, len(value)))  # texts or names, one per item?
            self.context.add(encode_value(value, f"argument {label!r}"))

    def _add_tensor(self, label: str, dim: int, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            raise UncachedInput(f"argument {label!r} is on the meta device: it has no content to key items by")
        if _transformed(tensor):
            raise UncachedInput(f"argument {label!r} is inside a torch.func transform (vmap): it has no storage to key")
        if getattr(tensor, "is_nested", False) or tensor.layout != torch.strided:
            kind = "nested" if getattr(tensor, "is_nested", False) else str(tensor.layout)
            raise UncachedInput(f"argument {label!r} is a {kind} tensor, which cannot be keyed per item")
        if tensor.dim() <= dim:
            expected = "(batch, ...)" if dim == 0 else f"with the batch at dimension {dim}"
            raise KeyingError(
                f"argument {label!r}: expected a tensor shaped {expected}, got shape {tuple(tensor.shape)}; "
                "add a batch dimension (x.unsqueeze(0)), pass a Python number, or name the argument in "
                "shared_args if it is the same for the whole batch"
            )
        if tensor.__dict__ or type(tensor) is not torch.Tensor:  # its class and attributes count
            self.context.add(_TENSOR_TYPE + self.type_key(type(tensor), label) + _tensor_state(label, dim, tensor))
        if dim:
            tensor = tensor.movedim(dim, 0)
        if self.batch < 0:
            self.batch, self.first_label = tensor.shape[0], label
        elif tensor.shape[0] != self.batch:
            raise KeyingError(
                f"argument {label!r}: batch size {tensor.shape[0]} does not match the batch size {self.batch} "
                f"of argument {self.first_label!r}; every per-item tensor must have the same batch size. "
                "A tensor that is the same for the whole batch (a shared mask) belongs in shared_args"
            )
        self.context.add(_TENSOR + str(tensor.dtype).encode() + repr(tuple(tensor.shape[1:])).encode())
        if channels_last_format(tensor) is not None:  # the kernels that run and the outputs' layout follow it
            self.context.add(b"channels_last")
        if tensor.is_quantized:
            self.context.add(_quantization(label, dim, tensor))
        self.tensors.append(tensor)


def _tensor_state(label: str, dim: int, tensor: torch.Tensor) -> bytes:
    """The attributes of a per-item tensor of a subclass, or with attributes set, whose rows keep its class.

    Raises:
        KeyingError: If its rows come out of another class (its ``__torch_function__``
            unwraps them): smaller batches of it would compute another way.
    """
    rows = tensor.index_select(dim, torch.zeros(0, dtype=torch.long, device=tensor.device))
    # nn.Parameter turns its __torch_function__ off: it computes as a plain tensor, whose rows are
    if type(rows) is not type(tensor) and type(tensor).__torch_function__ is not _PLAIN_FUNCTION:
        raise KeyingError(
            f"argument {label!r}: rows taken from a {type(tensor).__qualname__} (index_select) are a "
            f"{type(rows).__qualname__}, so smaller batches of it (the misses of a partly cached batch) would "
            "compute another way; make its __torch_function__ return its own class, or pass a plain tensor"
        )
    return encode_value(dict(tensor.__dict__), f"argument {label!r} attributes") if tensor.__dict__ else b""


def _quantization(label: str, dim: int, tensor: torch.Tensor) -> bytes:
    """What turns a quantized tensor's integers into values: its scheme, scales and zero points."""
    scheme = tensor.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return f"{scheme}|{tensor.q_scale().hex()}|{tensor.q_zero_point()}".encode()
    axis = tensor.q_per_channel_axis()
    if axis == dim:
        raise UncachedInput(f"argument {label!r} is quantized per channel along its batch dimension")
    scales = tensor_digest([("scales", tensor.q_per_channel_scales()), ("zero", tensor.q_per_channel_zero_points())])
    return f"{scheme}|{axis}|{scales}".encode()


def _type_key(cls: type, label: str) -> bytes:
    """The key of a type that holds or is a per-item tensor: a letter for built-in containers, else its code.

    Taken once per type and process, and again once a global or attribute it read was
    rebound, or a tensor it read written (what the module key's check watches, watched here).
    """
    known = _CONTAINERS.get(cls)
    if known is not None:
        return known
    found = _types.get(cls)
    if found is None or (found[1] is not None and found[1].changed()):
        with collecting() as read:
            encoded = b"c" + KeyEncoder(_SHARED_REMEDY, tensors=False).encode(cls, f"argument {label!r} type")
        held = HeldValues(read)
        found = _types[cls] = (encoded, held if held else None)
    return found[0]


class CallSplitter:
    """Splits the calls of one callable: what depends only on its signature is worked out once.

    Args:
        signature: Gives the signature of the wrapped callable (without ``self``), with
            the defaults it has now: taken again by :meth:`renewed`.
        shared: Argument names whose tensors are the same for the whole batch.
        dims: Argument names whose batch dimension is not the first.
        inference_read: The callable's code reads ``torch.is_inference_mode_enabled()`` or a
            tensor's ``is_inference()``: its calls are keyed by inference mode and by which of
            their tensors are inference tensors.
    """

    def __init__(
        self,
        signature: Callable[[], inspect.Signature],
        shared: Collection[str] = (),
        dims: Mapping[str, int] | None = None,
        inference_read: bool = False,
    ) -> None:
        self._signature_of = signature
        self.shared = shared
        self.dims = dims or {}
        self._inference_read = inference_read
        self.signature = self._signature_of()
        params = list(self.signature.parameters.values())
        self._kinds = {p.name: p.kind for p in params}
        self._check_names(params)
        positional = [p.name for p in params if p.kind in _POSITIONAL]
        self._var_positional = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "")
        self._positional = positional
        # Calls that pass every parameter positionally need no binding (the common case).
        self._simple = len(positional) == len(params)

    def renewed(self, inference_read: bool) -> CallSplitter:
        """A splitter like this one with the signature taken again (``fn.__defaults__ = ...``): swapped whole."""
        return CallSplitter(self._signature_of, self.shared, self.dims, inference_read)

    def _check_names(self, params: list[inspect.Parameter]) -> None:
        """Names in ``shared_args`` and ``batch_dims`` must be arguments (a typo would slice silently)."""
        if any(p.kind is inspect.Parameter.VAR_KEYWORD and p.annotation is not PASSED_ON for p in params):
            return  # any keyword may come (not only to a wrapper that passes them on: those are the names)
        known = {p.name for p in params}
        for option, names in (("shared_args", self.shared), ("batch_dims", self.dims)):
            unknown = sorted(n for n in names if n not in known and not n.startswith("output"))
            if unknown:
                raise ConfigError(
                    f"{option} names {unknown}, which are not arguments of {self.signature}; "
                    "use argument names (and output paths such as 'output[1][0]' in batch_dims)"
                )

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any], context: Context) -> CallArguments:
        """Bind a call and split it into per-item tensors and key context.

        Args:
            args: Positional arguments as the caller gave them.
            kwargs: Keyword arguments as the caller gave them.
            context: The context to extend (it starts with the module key).

        Returns:
            The split call.

        Raises:
            TypeError: If the arguments do not fit the signature.
            KeyingError: If an argument cannot be keyed, batch sizes disagree, or the
                call has no per-item tensor.
        """
        if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
            _refuse_modes()
        if forward_ad._current_level >= 0:  # weights swapped in by functional_call may carry tangents too
            raise UncachedInput("forward-mode AD is active (forward_ad.dual_level): a hit would drop tangents")
        if _in_transform() is not None:
            raise UncachedInput("a torch.func transform (vmap, grad, jvp) is active: its tensors have no storage")
        positional = self._positional
        passed: set[str] | None = None
        if self._simple and not kwargs and len(args) == len(positional):
            arguments: Mapping[str, Any] = dict(zip(positional, args))
        else:
            bound = self.signature.bind(*args, **kwargs)
            passed = set(bound.arguments)
            bound.apply_defaults()
            arguments = bound.arguments
        splitter = _Splitter(context, self.shared, self.dims)
        for name, value in arguments.items():
            kind = self._kinds.get(name)
            if kind is inspect.Parameter.VAR_POSITIONAL:
                for i, item in enumerate(value):
                    splitter.add(f"*{name}[{i}]", name, item)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                splitter.context.add(_KEYWORDS)  # in the caller's order, which **kwargs keeps
                for key in value:
                    splitter.add(f"**{key}", key, value[key])
            elif passed is not None and name not in passed:  # a default (a tensor in it is one for the batch)
                if value is PASSED_ON:  # a wrapper's: what it passes on is its own
                    continue
                splitter.context.add(name.encode())
                splitter.add_shared(name, value)
            else:
                splitter.add(name, name, value)
        if self._inference_read:  # a forward that branches on inference mode, or on inputs made under it
            inference = bytes(t.is_inference() for t in (*splitter.tensors, *splitter.shared_tensors))
            context.add(b"inference:%d:" % torch.is_inference_mode_enabled() + inference)
        if not splitter.tensors:
            raise KeyingError(
                "torchcache needs at least one per-item tensor argument shaped (batch, ...) to key items by"
                + (f" (shared_args {sorted(self.shared)} are hashed whole, not per item)" if self.shared else "")
            )
        names = positional[: len(args)]
        if len(args) > len(positional):
            names = names + [self._var_positional] * (len(args) - len(positional))
        return CallArguments(
            args=args,
            kwargs=kwargs,
            tensors=splitter.tensors,
            batch=splitter.batch,
            _names=names,
            _kw_names={key: key for key in kwargs},
            _shared=self.shared,
            _dims=self.dims,
            lists_like_the_batch=[label for label, length in splitter.sequences if length == splitter.batch],
            shared=splitter.shared_tensors,
        )


def list_hint(label: str) -> str:
    """What to say of an argument that is a list of as many strings as the batch has items."""
    return (
        f"argument {label!r} is a list of as many strings as the batch has items; only tensors are split into "
        "items, so the whole list is part of every item's key and the same items in another batch or order miss. "
        "Pass per-item values as tensors, or leave them out of the cached call (ignore this if the list is the "
        "same for every batch)"
    )


class ShapeHint:
    """Points out, once, a low hit rate while per-item input shapes keep changing.

    Items are keyed by their exact shape, so a sample padded to the longest item of each
    batch (dynamic padding) gets a new key in every batch.

    Args:
        calls: Calls to see before judging.
        shapes: Distinct per-item shapes that count as "keep changing".
    """

    def __init__(self, calls: int = 64, shapes: int = 8) -> None:
        self._min_calls = calls
        self._min_shapes = shapes
        self._calls = 0
        self._shapes: set[bytes] = set()

    def note(self, tensors: list[torch.Tensor], hits: int, misses: int) -> str | None:
        """Record one call; a message when the hit rate should be pointed out, else ``None``."""
        self._calls += 1
        if len(self._shapes) < 4 * self._min_shapes:
            self._shapes.add(b"|".join(f"{t.dtype}{tuple(t.shape[1:])}".encode() for t in tensors))
        if self._calls < self._min_calls or len(self._shapes) < self._min_shapes or hits >= 0.2 * (hits + misses):
            return None
        return (
            f"hit rate {hits / max(1, hits + misses):.0%} after {self._calls} calls whose per-item input shapes "
            f"took {len(self._shapes)}+ different values: items are keyed by their exact shape, so a sample "
            "padded to the longest item of each batch gets a new key in every batch. Pad to a fixed length, or "
            "bucket lengths to a few sizes (see the docs: 'Variable-length inputs')"
        )
