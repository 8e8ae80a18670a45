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
its own, as fx gives each copy) and then wrapped as the original was; a pickle is fx's
(the code of the graph, generated again where it is loaded), without the cache. A lazy
graph module's code is generated when it is wrapped: its lazy forward would call the
cached one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BINDING", "compile_graph", "graph_methods", "make_subclass", "plain_namespace", "rebuild_plain"]

BINDING = "_torchcache_binding"  # the attribute of a cached instance holding its settings


def make_subclass(cls: type[torch.nn.Module], namespace: dict[str, Any]) -> type[torch.nn.Module]:
    """``type(cls.__name__, (cls,), namespace)``, without running the ``__init_subclass__`` ``cls`` inherits again.

    A hook such as ``def __init_subclass__(cls, k=1.0): cls.K = k`` ran when ``cls`` was
    defined (``class Sub(Base, k=3.0)``); run again for the cached subclass, without its
    arguments, it would set ``K = 1.0`` there, or register the class twice.
    """
    with _making:  # one at a time: another would take the stand-in for the class's own
        own = cls.__dict__.get("__init_subclass__")
        type.__setattr__(cls, "__init_subclass__", classmethod(_no_hook))  # type.__new__ runs the parents'
        try:
            return type(cls.__name__, (cls,), namespace)
        finally:
            if own is None:
                type.__delattr__(cls, "__init_subclass__")
            else:
                type.__setattr__(cls, "__init_subclass__", own)


_making = threading.RLock()  # a metaclass may wrap another module as the class is made


def _no_hook(cls: type, /, **kwargs: Any) -> None:
    """What the cached subclass's creation runs in place of ``__init_subclass__``."""


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
    """``recompile``, ``__deepcopy__`` and pickling for the cached subclass of ``cls``, if fx made ``cls``.

    Args:
        cls: The class of the instance being wrapped.
        rewrap: ``rewrap(module, like)`` wraps ``module`` (``like`` itself, recompiled, or a copy
            of it whose class is fx's plain one) as ``like`` is wrapped, with a new cache.
    """
    if not issubclass(cls, torch.fx.GraphModule):
        return {}
    lazy = hasattr(cls, "_real_recompile")  # a lazy graph module's recompile() only marks its code stale

    def recompile(self: torch.fx.GraphModule) -> Any:
        cached = type(self)
        self.__class__ = cls  # fx sets the new forward on the class it made for this instance
        try:
            code = torch.fx.GraphModule.recompile(self) if lazy else cls.recompile(self)
        finally:
            self.__class__ = cached
        rewrap(self, self)
        return code

    def __deepcopy__(self: torch.fx.GraphModule, memo: dict[int, Any]) -> torch.fx.GraphModule:
        copied = cls.__deepcopy__(self, memo)  # fx's (or its subclass's): plain, of a class fx made for it
        compile_graph(copied)
        rewrap(copied, self)
        return copied

    def __reduce_ex__(self: torch.fx.GraphModule, protocol: Any) -> Any:
        # As fx pickles a graph module (the code of its graph, generated again where it is loaded), without the cache
        # and without recompiling this one.
        from torch.fx.graph_module import _format_import_block, reduce_graph_module
        from torch.package.importer import sys_importer

        code = self.graph.python_code(root_module="self")
        body = {k: v for k, v in self.__dict__.items() if k not in ("_graph", "cache_instance", BINDING)}
        body["_code"] = code.src
        return reduce_graph_module, (body, _format_import_block(code.globals, sys_importer))

    return {"recompile": recompile, "__deepcopy__": __deepcopy__, "__reduce_ex__": __reduce_ex__}


def compile_graph(module: torch.nn.Module) -> None:
    """Generate a lazy fx graph module's code now (its lazy forward would call the cached one without end)."""
    if isinstance(module, torch.fx.GraphModule) and hasattr(module, "real_recompile"):
        module.real_recompile()  # type: ignore[operator]
