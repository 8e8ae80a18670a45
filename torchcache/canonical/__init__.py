"""The canonical encoding of everything a key covers: values by content, code by what it runs.

:class:`KeyEncoder` turns a value into exact, typed, self-delimiting bytes, or refuses it
with a :class:`~torchcache.errors.KeyingError` that names its path and the remedy. Values
are dispatched in :mod:`~torchcache.canonical.values`, objects by their state in
:mod:`~torchcache.canonical.objects`, modules in :mod:`~torchcache.canonical.modules`,
functions and classes by their code in :mod:`~torchcache.canonical.code`, and every
kind has a tag of its own in :mod:`~torchcache.canonical.tags`.
"""

from __future__ import annotations

from .modules import MODULE_MANAGED, OBSERVER_HOOKS, module_attributes, module_hooks
from .notes import INFERENCE_MODE_READ
from .objects import CONFIG_UNKEYED, collecting, tensor_content_digest
from .origins import origin_of_module
from .pending import deferring
from .values import KeyEncoder, encode_key_value

__all__ = [
    "CONFIG_UNKEYED",
    "INFERENCE_MODE_READ",
    "MODULE_MANAGED",
    "OBSERVER_HOOKS",
    "KeyEncoder",
    "collecting",
    "deferring",
    "encode_key_value",
    "module_attributes",
    "module_hooks",
    "origin_of_module",
    "tensor_content_digest",
]
