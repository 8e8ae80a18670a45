"""Output structures: flatten nested outputs of tensors into a spec and leaves, and rebuild them.

A *layout* is one item of a batched output: its structure and each tensor leaf's shape,
stored and returned dtypes and memory format. Items of one layout share a slab, gathered
with one copy; its canonical JSON is the header of a stored entry.

The structure spec is JSON: ``"T"`` is a tensor leaf, ``"N"`` a ``None`` (it stores
nothing), ``["tuple", [...]]``, ``["list", [...]]`` and ``["dict", [[key, ...], ...]]``
are the plain containers, and ``[kind, "module:qualname", [[name, ...], ...]]`` is a
namedtuple, dataclass (Hugging Face ``ModelOutput`` included) or dict subclass, rebuilt
by :mod:`torchcache.output_types` from a class this process has already imported.
:func:`unflatten` raises :class:`~torchcache.output_types.RebuildError` when that class cannot be rebuilt here:
the entry is intact, the caller should recompute. Specs read from files are validated
strictly (known kinds, well-formed names, at most :data:`MAX_DEPTH` nested containers)
before anything is built from them.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Union

import torch

from .dtypes import ALIGN, CODE_OF, MAX_DEPTH, OUTPUT_DTYPES, channels_last_format, dtype_named
from .dtypes import DTYPES as _ALL_DTYPES
from .errors import KeyingError
from .output_types import KINDS, build, describe_type, is_type_name, kind_of, members, type_name, unplain_tensor

__all__ = [
    "DTYPES",
    "MAX_DEPTH",
    "Layout",
    "LeafSpec",
    "VALUE_LEAVES",
    "describe",
    "flatten",
    "leaf_kinds",
    "leaf_paths",
    "unflatten",
]

#: The dtypes of module outputs, by name (the table is :mod:`torchcache.dtypes`).
DTYPES: dict[str, torch.dtype] = {name: dt for name, dt in _ALL_DTYPES.items() if dt in OUTPUT_DTYPES}

#: Leaf nodes only samples hold: a numpy array (``"A"``) or scalar (``"S"``), and a Python
#: ``int`` (``"i"``), ``float`` (``"f"``), ``complex`` (``"c"``), ``bool`` (``"b"``, in a
#: features row; a dataset sample keeps its bools in the structure), ``str`` (``"s"``) or
#: ``bytes`` (``"y"``); each has one entry in a layout's leaves, as a tensor (``"T"``) has.
VALUE_LEAVES = frozenset("ASifcbsy")

Spec = Union[str, list[Any]]  # noqa: UP007 - a runtime alias, valid on Python 3.10


def flatten(output: object, name: str = "output") -> tuple[Spec, list[torch.Tensor]]:
    """Split an output into a JSON-able structure spec and its tensor leaves.

    Raises:
        KeyingError: If the output holds something other than tensors, ``None`` and
            tuples, lists, dicts with string keys, namedtuples, dataclasses and dict
            subclasses of them, or nests containers deeper than :data:`MAX_DEPTH`.

    Example:
        >>> spec, leaves = flatten({"a": torch.zeros(2, 3), "b": (torch.ones(2), None)})
        >>> spec, [tuple(t.shape) for t in leaves]
        (['dict', [['a', 'T'], ['b', ['tuple', ['T', 'N']]]]], [(2, 3), (2,)])
    """
    leaves: list[torch.Tensor] = []
    return _flatten_node(output, name, 0, leaves), leaves


# Module functions, not closures: a nested function that calls itself holds its own cell, a cycle
# that would keep the leaves it captured (a batch of outputs) alive until the cyclic collector runs.
def _flatten_node(node: object, path: str, depth: int, leaves: list[torch.Tensor]) -> Spec:
    """The spec of ``node``; its tensor leaves are appended to ``leaves``."""
    if isinstance(node, torch.Tensor):
        lost = (type(node) is not torch.Tensor or node.is_nested or node.__dict__) and unplain_tensor(node)
        if lost:  # libraries' bookkeeping flags (torch.compile's hints) are no loss
            raise KeyingError(f"{path}: is {lost}, or cache a function that returns plain tensors")
        leaves.append(node)
        return "T"
    if node is None:
        return "N"
    if depth >= MAX_DEPTH:
        raise KeyingError(f"{path}: the output nests containers more than {MAX_DEPTH} deep")
    cls = type(node)
    if isinstance(node, (tuple, list)) and (cls is tuple or cls is list):
        kind = "tuple" if cls is tuple else "list"
        return [kind, [_flatten_node(v, f"{path}[{i}]", depth + 1, leaves) for i, v in enumerate(node)]]
    if isinstance(node, dict) and cls is dict:
        items: list[Any] = []
        for key, value in node.items():
            if not isinstance(key, str):
                raise KeyingError(f"{path}: dict keys must be str to be cached, got {key!r}")
            items.append([key, _flatten_node(value, f"{path}[{key!r}]", depth + 1, leaves)])
        return ["dict", items]
    typed = kind_of(cls)
    if typed is None:
        raise KeyingError(
            f"{path}: cannot cache an output of type {describe_type(cls)}; expected a tensor shaped "
            "(batch, ...), None, or a tuple, list, dict (str keys), namedtuple, dataclass or dict subclass "
            f"of such values (a dict subclass must keep the __init__ of dict or OrderedDict). {_remedy_for(cls)}"
        )
    fields = []
    for key, value in members(node, typed, path):
        child = f"{path}[{key!r}]" if typed == "mapping" else f"{path}.{key}"
        fields.append([key, _flatten_node(value, child, depth + 1, leaves)])
    return [typed, type_name(cls), fields]


def _remedy_for(cls: type) -> str:
    """The way out for an output class that cannot be cached, by what kind of class it is."""
    if cls.__name__.endswith("Cache") or hasattr(cls, "key_cache") or hasattr(cls, "self_attention_cache"):
        return (
            "It looks like a cache of past keys and values for generation (Hugging Face past_key_values), which "
            "is not per item: use_cache=False, or cache its encoder (model.get_encoder()), whose outputs are"
        )
    if isinstance(cls, type) and issubclass(cls, Mapping):
        return (
            "It is a mapping that is not a dict (such as a tokenizer's BatchEncoding): return dict(output) from "
            "the cached function, or cache the model that computes the tensors (for sentence-transformers, "
            "model[0].auto_model)"
        )
    if cls.__module__ == "torch.return_types":  # x.max(dim), x.topk(k): a structseq of values and indices
        return f"Return tuple(result) from the cached function (its fields in order), not the {cls.__name__} itself"
    return "Return the tensors the caller needs, in one of those containers"


def unflatten(spec: Spec, leaves: list[torch.Tensor]) -> Any:
    """Rebuild the structure that :func:`flatten` described.

    Raises:
        RebuildError: If the spec names a class that cannot be rebuilt in this process
            (its module is not imported, or the class changed); recompute the output.
    """
    return _rebuild_node(spec, iter(leaves))


def _rebuild_node(node: Spec, leaves: Iterator[torch.Tensor]) -> Any:
    """The value of ``node``, taking its tensor leaves from ``leaves`` in order."""
    if isinstance(node, str):
        return next(leaves) if node == "T" else None
    if len(node) == 2:
        kind, items = node
        if kind == "dict":
            return {key: _rebuild_node(value, leaves) for key, value in items}
        values = [_rebuild_node(value, leaves) for value in items]
        return tuple(values) if kind == "tuple" else values
    kind, name, fields = node
    return build(kind, name, [key for key, _ in fields], [_rebuild_node(value, leaves) for _, value in fields])


def leaf_paths(spec: Spec, name: str = "output") -> list[str]:
    """The path of every tensor leaf of a spec, in leaf order, as :func:`flatten` names them.

    Example:
        >>> leaf_paths(["tuple", ["T", ["dataclass", "m:Out", [["logits", "T"], ["aux", "N"]]]]])
        ['output[0]', 'output[1].logits']
    """
    paths: list[str] = []
    _collect_paths(spec, name, paths)
    return paths


def _collect_paths(node: Spec, path: str, paths: list[str]) -> None:
    """Append the path of every tensor leaf under ``node`` to ``paths``."""
    if isinstance(node, str):
        if node == "T":
            paths.append(path)
    elif len(node) == 3:
        kind, _, fields = node
        for key, value in fields:
            _collect_paths(value, f"{path}[{key!r}]" if kind == "mapping" else f"{path}.{key}", paths)
    elif node[0] == "dict":
        for key, value in node[1]:
            _collect_paths(value, f"{path}[{key!r}]", paths)
    else:
        for i, value in enumerate(node[1]):
            _collect_paths(value, f"{path}[{i}]", paths)


def describe(spec: Spec, leaves: Iterable[str]) -> str:
    """A one-line text of a structure, with ``leaves`` giving the text of each tensor leaf.

    Example:
        >>> describe(["dict", [["a", "T"], ["b", ["tuple", ["T", "N"]]]]], ["f32[3]", "i64[]"])
        "{'a': f32[3], 'b': (i64[], None)}"
        >>> describe(["namedtuple", "pkg.mod:Pair", [["x", "T"], ["y", "N"]]], ["f32[3]"])
        'Pair(x=f32[3], y=None)'
        >>> describe(["mapping", "collections:OrderedDict", [["a", "T"]]], ["f32[3]"])
        "OrderedDict({'a': f32[3]})"
    """
    return _describe_node(spec, iter(leaves))


def _describe_node(node: Spec, leaves: Iterator[str]) -> str:
    """The text of ``node``, taking the text of its tensor leaves from ``leaves`` in order."""
    if isinstance(node, str):
        return next(leaves) if node == "T" else "None"
    if len(node) == 3:
        kind, name, fields = node
        short = str(name).partition(":")[2]
        if kind == "mapping":
            return short + "({" + ", ".join(f"{key!r}: {_describe_node(value, leaves)}" for key, value in fields) + "})"
        return short + "(" + ", ".join(f"{key}={_describe_node(value, leaves)}" for key, value in fields) + ")"
    kind, items = node
    if kind == "dict":
        return "{" + ", ".join(f"{key!r}: {_describe_node(value, leaves)}" for key, value in items) + "}"
    inner = ", ".join(_describe_node(value, leaves) for value in items)
    return f"({inner}{',' if len(items) == 1 else ''})" if kind == "tuple" else f"[{inner}]"


@dataclass(frozen=True)
class LeafSpec:
    """One tensor leaf of an item: per-item shape, stored dtype, returned dtype, returned memory format.

    ``channels_last``: the forward returned the batch in ``torch.channels_last`` (4-D) or
    ``torch.channels_last_3d`` (5-D) memory format, and hits are returned in it too. It is
    part of a layout's equality: items stored either way keep to slabs of their own, so
    that each hit comes back in the format its forward returned.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype
    channels_last: bool = False

    @property
    def memory_format(self) -> torch.memory_format:
        """The memory format a batch of this leaf is returned in."""
        if not self.channels_last:
            return torch.contiguous_format
        return torch.channels_last if len(self.shape) == 3 else torch.channels_last_3d

    @property
    def numel(self) -> int:
        """Elements per item."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Stored bytes per item."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The structure and leaves of one item, and where each leaf sits in a packed row."""

    spec_json: str
    leaves: tuple[LeafSpec, ...]

    def same_rows(self, other: Layout) -> bool:
        """Whether items of ``other`` have this layout's structure and rows, whatever their memory format."""
        rows = [(a.shape, a.dtype, a.out_dtype) for a in self.leaves]
        return self.spec_json == other.spec_json and rows == [(b.shape, b.dtype, b.out_dtype) for b in other.leaves]

    @cached_property
    def nbytes(self) -> int:
        """Stored bytes of one item (without alignment padding)."""
        return sum(leaf.nbytes for leaf in self.leaves)

    @cached_property
    def offsets(self) -> list[int]:
        """Byte offset of each leaf in a packed row; every offset is 8-byte aligned."""
        offsets, pos = [], 0
        for leaf in self.leaves:
            offsets.append(pos)
            pos += -(-leaf.nbytes // ALIGN) * ALIGN
        return offsets

    @cached_property
    def row_bytes(self) -> int:
        """Bytes of one packed row, padding included."""
        return sum(-(-leaf.nbytes // ALIGN) * ALIGN for leaf in self.leaves)

    @cached_property
    def spec(self) -> Spec:
        """The structure spec (parsed once; read on every hit, never changed)."""
        return json.loads(self.spec_json)  # type: ignore[no-any-return]

    @classmethod
    def of(cls, spec: Spec, leaves: list[torch.Tensor], cache_dtype: torch.dtype | None) -> Layout:
        """The layout of the items of a batched output (leaves shaped ``(batch, ...)``)."""
        specs = []
        for leaf in leaves:
            out_dtype = leaf.dtype
            if out_dtype not in OUTPUT_DTYPES:
                raise KeyingError(f"cannot cache outputs of dtype {out_dtype}: return them as .float() or .long()")
            dtype = cache_dtype if cache_dtype is not None and out_dtype.is_floating_point else out_dtype
            if dtype != out_dtype and bool(((leaf.abs() > torch.finfo(dtype).max) & leaf.isfinite()).any()):
                raise KeyingError(  # stored as infinities
                    f"cache_dtype={dtype} cannot hold values of this output (beyond {torch.finfo(dtype).max:g}); use "
                    + ("torch.bfloat16 (float32's exponent range) or None" if dtype == torch.float16 else "None")
                )
            specs.append(LeafSpec(tuple(leaf.shape[1:]), dtype, out_dtype, channels_last_format(leaf) is not None))
        return cls(json.dumps(spec, separators=(",", ":")), tuple(specs))

    def to_header(self) -> dict[str, Any]:
        """A JSON-able description, the header of a stored entry.

        The short form: ``{"l": [[dtype, shape] or [dtype, shape, out_dtype] or [dtype,
        shape, out_dtype, "cl"], ...], "t": tree}`` (``"cl"``: returned channels-last),
        each dtype by its code (``"f4"`` for float32), the leaves' offsets
        implied by their shapes, and ``"t"`` left out when the output is a lone tensor
        (tree ``"T"``). :meth:`from_header` also reads dtype names (``"float32"``) in
        the short form, and the long form of torchcache 1.0, ``{"leaves": [{"dtype", "shape",
        "offset", "out_dtype"}, ...], "tree": tree}``.
        """
        leaves: list[list[Any]] = []
        for leaf in self.leaves:
            item: list[Any] = [CODE_OF[leaf.dtype], list(leaf.shape)]
            if leaf.out_dtype != leaf.dtype or leaf.channels_last:  # absent means "same as dtype"
                item.append(CODE_OF[leaf.out_dtype])
            if leaf.channels_last:
                item.append("cl")
            leaves.append(item)
        if self.spec_json == '"T"':  # a lone tensor, the most common output: its tree goes without saying
            return {"l": leaves}
        return {"t": json.loads(self.spec_json), "l": leaves}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Layout:
        """Parse :meth:`to_header` output (either form), validating every field.

        The structure is validated (node kinds, names, depth) before anything else reads
        it; class names are checked for form only, so an entry whose class this process
        lacks still parses, and :func:`unflatten` raises :class:`RebuildError` for it.

        Raises:
            ValueError: If a field is missing or invalid.
        """
        try:
            short = "l" in header
            tree = header.get("t", "T") if short else header["tree"]
            count = len(leaf_kinds(tree))
            leaves = []
            for item in header["l"] if short else header["leaves"]:
                channels_last = False
                if short:
                    if type(item) is not list or len(item) not in (2, 3, 4):
                        raise ValueError(f"invalid leaf {_short(item)}")
                    name, shape, out_name = item[0], item[1], item[2] if len(item) >= 3 else item[0]
                    if len(item) == 4:
                        if item[3] != "cl" or not isinstance(shape, list) or len(shape) not in (3, 4):
                            raise ValueError(f"invalid memory format of leaf {_short(item)}")
                        channels_last = True
                else:
                    name, shape, out_name = item["dtype"], item["shape"], item.get("out_dtype", item["dtype"])
                if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                    raise ValueError(f"invalid shape {_short(shape)}")
                dtype, out_dtype = dtype_named(name, OUTPUT_DTYPES), dtype_named(out_name, OUTPUT_DTYPES)
                if dtype is None or out_dtype is None:
                    raise ValueError(f"invalid dtype of leaf {_short(item)}")
                leaves.append(LeafSpec(tuple(shape), dtype, out_dtype, channels_last))
            layout = cls(json.dumps(tree, separators=(",", ":")), tuple(leaves))
            if not short and [item["offset"] for item in header["leaves"]] != layout.offsets:
                raise ValueError("leaf offsets do not match the layout")
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"invalid header: {type(exc).__name__}: {_short(exc)}") from None
        if count != len(leaves):
            raise ValueError("the structure does not match the number of leaves")
        return layout


def leaf_kinds(tree: object, values: bool = False) -> list[str]:
    """The kind of every leaf of a structure read from a file, in leaf order, validating every node.

    Module outputs hold tensor leaves (``"T"``) and ``None``; with ``values`` the structure
    may also hold what dataset samples do (:data:`VALUE_LEAVES`, the constants ``true``,
    ``false`` and ``["I", int]``, and dicts with int keys).

    Raises:
        ValueError: If a node is not of a known kind, a name is malformed, a key is
            repeated, or containers nest deeper than :data:`MAX_DEPTH`.

    Example:
        >>> leaf_kinds(["tuple", ["T", ["dict", [["a", "N"], ["b", "T"]]]]])
        ['T', 'T']
        >>> leaf_kinds(["tuple", ["T", "i", True, ["I", 2**70]]], values=True)
        ['T', 'i']
    """
    kinds: list[str] = []
    _check_node(tree, 0, values, kinds)
    return kinds


def _check_node(node: Any, depth: int, values: bool, kinds: list[str]) -> None:
    """Validate ``node`` and append the kind of each of its leaves to ``kinds``."""
    if node == "T" or (values and type(node) is str and node in VALUE_LEAVES):
        kinds.append(node)
        return
    if node == "N" or (values and (node is True or node is False)):
        return
    if values and type(node) is list and len(node) == 2 and node[0] == "I" and type(node[1]) is int:
        return
    if not isinstance(node, list) or len(node) not in (2, 3) or node[0] not in (*_PLAIN, *KINDS):
        raise ValueError(f"invalid structure node {_short(node)}")
    if depth >= MAX_DEPTH:
        raise ValueError(f"the structure nests containers more than {MAX_DEPTH} deep")
    if len(node) != (2 if node[0] in _PLAIN else 3):
        raise ValueError(f"invalid {node[0]} node {_short(node)}")
    if not isinstance(node[-1], list):
        raise ValueError(f"invalid {node[0]} node {_short(node)}: its items are not a list")
    if node[0] in ("tuple", "list"):
        for value in node[1]:
            _check_node(value, depth + 1, values, kinds)
        return
    if len(node) == 3 and not is_type_name(node[1]):
        raise ValueError(f"invalid class name {_short(node[1])}: expected 'module:qualname' of identifiers")
    keys = set()
    key_types = (str, int) if values and node[0] == "dict" else (str,)
    for item in node[-1]:
        if not isinstance(item, list) or len(item) != 2 or type(item[0]) not in key_types:
            raise ValueError(f"invalid {node[0]} item {_short(item)}")
        if node[0] in ("namedtuple", "dataclass") and not item[0].isidentifier():
            raise ValueError(f"invalid field name {_short(item[0])}")
        if item[0] in keys:
            raise ValueError(f"repeated key {_short(item[0])} in a {node[0]} node")
        keys.add(item[0])
    for _, value in node[-1]:
        _check_node(value, depth + 1, values, kinds)


_PLAIN = ("tuple", "list", "dict")


def _short(value: Any) -> str:
    """A bounded ``repr`` for messages about untrusted values (depth and length limited)."""
    return reprlib.repr(value)
