"""fx graphs in keys: by the code fx generates from them and what their nodes call, never by their notes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .tags import Tag, tagged

if TYPE_CHECKING:
    from .values import KeyEncoder as Encoder

__all__ = ["encode_fx_graph"]


def encode_fx_graph(encoder: Encoder, graph: torch.fx.Graph, path: str, depth: int) -> bytes:
    """An fx graph by the code fx generates from it, and each node's operation, name, target and arguments.

    Not its metadata (what a trace or ``torch.export`` noted, FakeTensors included), its name
    counters or the module that owns it (whose own hooks run around a cached forward). The
    code and its codegen's pytree specs cover how inputs and outputs are packed, even where a
    lazy graph module has not generated its code yet; the targets, what the code calls.
    """

    def plain(value: Any) -> Any:  # a node as its name, marked by the class of the graph
        if isinstance(value, torch.fx.Node):
            return (torch.fx.Graph, value.name)
        if isinstance(value, (tuple, list)):
            return tuple(map(plain, value)) if isinstance(value, tuple) else list(map(plain, value))
        if isinstance(value, slice):
            return slice(plain(value.start), plain(value.stop), plain(value.step))
        return {k: plain(v) for k, v in value.items()} if isinstance(value, dict) else value

    try:
        code = graph.python_code(root_module="self").src
    except Exception as exc:  # noqa: BLE001 - a graph fx cannot make code of: nothing to key it by
        raise encoder.refuse(path, f"fx cannot generate the code of this graph ({exc})") from None
    nodes = [(n.op, n.name, n.target, plain(n.args), plain(n.kwargs)) for n in graph.nodes]
    codegen = (type(graph._codegen), getattr(graph._codegen, "pytree_info", None))  # the specs code reads from self
    described = encoder.child((code, codegen), f"{path}.code", depth) + encoder.child(nodes, f"{path}.nodes", depth)
    return tagged(Tag.OBJECT, encoder.child(type(graph), path, depth) + described)
