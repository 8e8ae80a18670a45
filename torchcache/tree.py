"""Output structures: flatten nested tuples, lists and dicts of tensors, and rebuild them.

A *layout* describes one item of a batched output: the structure and, per tensor leaf,
its per-item shape, the dtype it is stored at and the dtype it is returned in. Items
with equal layouts can be stored side by side in one slab and gathered with one copy.
The layout serializes to canonical JSON, which is also the header of a stored entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Union

import torch

from .errors import KeyingError

__all__ = ["DTYPES", "Layout", "LeafSpec", "flatten", "unflatten"]

#: Dtypes that can be stored, by name. Reading a file only ever looks names up here.
DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
ALIGN = 8

Spec = Union[str, list[Any]]  # noqa: UP007 - a runtime alias, valid on Python 3.10


def flatten(output: object, name: str = "output") -> tuple[Spec, list[torch.Tensor]]:
    """Split an output into a JSON-able structure spec and its tensor leaves.

    Raises:
        KeyingError: If the output holds something other than tensors, tuples, lists and
            dicts with string keys.

    Example:
        >>> spec, leaves = flatten({"a": torch.zeros(2, 3), "b": (torch.ones(2),)})
        >>> spec, [tuple(t.shape) for t in leaves]
        (['dict', [['a', 'T'], ['b', ['tuple', ['T']]]]], [(2, 3), (2,)])
    """
    leaves: list[torch.Tensor] = []

    def walk(node: object, path: str) -> Spec:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return "T"
        if isinstance(node, (tuple, list)) and type(node) in (tuple, list):
            kind = "tuple" if type(node) is tuple else "list"
            return [kind, [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]]
        if isinstance(node, dict) and type(node) is dict:
            items: list[Any] = []
            for key, value in node.items():
                if not isinstance(key, str):
                    raise KeyingError(f"{path}: dict keys must be str to be cached, got {key!r}")
                items.append([key, walk(value, f"{path}[{key!r}]")])
            return ["dict", items]
        raise KeyingError(
            f"{path}: cannot cache an output of type {type(node).__name__}; expected a tensor "
            "shaped (batch, ...), or a tuple, list or dict of such tensors"
        )

    return walk(output, name), leaves


def unflatten(spec: Spec, leaves: list[torch.Tensor]) -> Any:
    """Rebuild the structure that :func:`flatten` described."""
    it = iter(leaves)

    def build(node: Spec) -> Any:
        if isinstance(node, str):
            return next(it)
        kind, items = node
        if kind == "dict":
            return {key: build(value) for key, value in items}
        values = [build(value) for value in items]
        return tuple(values) if kind == "tuple" else values

    return build(spec)


@dataclass(frozen=True)
class LeafSpec:
    """One tensor leaf of an item: per-item shape, stored dtype, returned dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype

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
            if out_dtype not in _NAMES:
                raise KeyingError(f"cannot cache outputs of dtype {out_dtype}")
            dtype = cache_dtype if cache_dtype is not None and out_dtype.is_floating_point else out_dtype
            specs.append(LeafSpec(tuple(leaf.shape[1:]), dtype, out_dtype))
        return cls(json.dumps(spec, separators=(",", ":")), tuple(specs))

    def to_header(self) -> dict[str, Any]:
        """A JSON-able description, the header of a stored entry."""
        leaves = []
        for leaf, offset in zip(self.leaves, self.offsets):
            item: dict[str, Any] = {"dtype": _NAMES[leaf.dtype], "shape": list(leaf.shape), "offset": offset}
            if leaf.out_dtype != leaf.dtype:  # only with cache_dtype; absent means "same as dtype"
                item["out_dtype"] = _NAMES[leaf.out_dtype]
            leaves.append(item)
        return {"tree": json.loads(self.spec_json), "leaves": leaves}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Layout:
        """Parse :meth:`to_header` output, validating every field.

        Raises:
            ValueError: If a field is missing or invalid.
        """
        leaves = []
        for item in header["leaves"]:
            shape = item["shape"]
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"invalid shape {shape!r}")
            dtype = DTYPES[item["dtype"]]
            leaves.append(LeafSpec(tuple(shape), dtype, DTYPES[item["out_dtype"]] if "out_dtype" in item else dtype))
        layout = cls(json.dumps(header["tree"], separators=(",", ":")), tuple(leaves))
        if [item["offset"] for item in header["leaves"]] != layout.offsets:
            raise ValueError("leaf offsets do not match the layout")
        if _count_leaves(header["tree"]) != len(leaves):
            raise ValueError("the structure does not match the number of leaves")
        return layout


def _count_leaves(node: Any) -> int:
    if node == "T":
        return 1
    if not isinstance(node, list) or len(node) != 2 or node[0] not in ("tuple", "list", "dict"):
        raise ValueError(f"invalid structure node {node!r}")
    if node[0] == "dict":
        return sum(_count_leaves(value) for _, value in node[1])
    return sum(_count_leaves(value) for value in node[1])
