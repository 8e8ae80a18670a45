"""The cached subclass of a wrapped instance's class, and the classes of decorated library classes.

Such a class is named like its base and pickles and deep-copies as it: ``torch.save`` of a
whole model saves the plain class, without the cache.

fx makes a class for each ``GraphModule`` instance, and ``recompile()`` (run after an
edit of ``gm.graph``, and by ``gm.graph = ...``) sets the new generated ``forward`` and
a ``__call__`` wrapper on ``type(self)``. A wrapped instance's type is the cached
subclass of that class: run there, fx's ``__call__`` wrapper would call itself and the
new ``forward`` would replace the cached one. So the cached subclass runs ``recompile``
on fx's class, then wraps the new ``forward`` and gives the instance a new cache (the
code changed: so do the key and the signature). A deep copy is made by fx (a class of
its own, as fx gives each copy) and then wrapped as the original was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BINDING", "graph_methods", "plain_namespace", "rebuild_plain"]

BINDING = "_torchcache_binding"  # the attribute of a cached instance holding its settings


def rebuild_plain(cls: type[torch.nn.Module], state: dict[str, Any]) -> torch.nn.Module:
    """The instance of the plain ``cls`` a pickle of a cached one holds."""
    module = object.__new__(cls)
    module.__setstate__(state)  # type: ignore[no-untyped-call]
    return module


def plain_namespace(cls: type[torch.nn.Module]) -> dict[str, Any]:
    """The namespace of a subclass of ``cls`` named like it, whose instances pickle as ``cls`` (without the cache)."""

    def __reduce_ex__(self: torch.nn.Module, protocol: Any) -> Any:
        # Pickled as the plain class, without the cache (torch.save of a whole model).
        state = {k: v for k, v in self.__dict__.items() if k not in ("cache_instance", BINDING)}
        return (rebuild_plain, (cls, state))

    def __deepcopy__(self: torch.nn.Module, memo: dict[int, Any]) -> Any:
        import copy

        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))  # type: ignore[no-untyped-call]
        return copied

    return {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__reduce_ex__": __reduce_ex__,
        "__deepcopy__": __deepcopy__,
    }


Rewrap = Callable[[torch.nn.Module, torch.nn.Module], None]


def graph_methods(cls: type[torch.nn.Module], rewrap: Rewrap) -> dict[str, Any]:
    """``recompile`` and ``__deepcopy__`` for the cached subclass of ``cls``, if it is fx's class of an instance.

    Args:
        cls: The class of the instance being wrapped.
        rewrap: ``rewrap(module, like)`` wraps ``module``, whose class is fx's plain one, as
            ``like`` is wrapped, with a new cache.
    """
    if not issubclass(cls, torch.fx.GraphModule):
        return {}

    def recompile(self: torch.fx.GraphModule) -> Any:
        cached = type(self)
        self.__class__ = cls  # fx sets the new forward on the class it made for this instance
        try:
            code = cls.recompile(self)
        finally:
            self.__class__ = cached
        rewrap(self, self)
        return code

    def __deepcopy__(self: torch.fx.GraphModule, memo: dict[int, Any]) -> torch.fx.GraphModule:
        copied = torch.fx.GraphModule.__deepcopy__(self, memo)  # plain, of a class fx made for it
        rewrap(copied, self)
        return copied

    return {"recompile": recompile, "__deepcopy__": __deepcopy__}
