"""Byte stores: budgeted maps from hex keys to bytes, behind the batched contract.

Stores never know what their bytes mean; the tiers of :mod:`torchcache.tiers` frame
and decode them. :class:`PackedStore` is the persistent store; :class:`DiskStore` reads
(and migrates from) the one-file-per-entry layout of torchcache 1.0.
"""

from .base import Store
from .batched import BatchedStore
from .disk import DiskStore
from .packed.store import PackedStore

__all__ = ["BatchedStore", "DiskStore", "PackedStore", "Store"]
