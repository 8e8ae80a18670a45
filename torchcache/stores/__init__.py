"""Byte stores: budgeted maps from hex keys to bytes, behind the batched contract.

Stores never know what their bytes mean; the tiers above frame and decode them.
:mod:`.base` and :mod:`.batched` are the contracts; :mod:`.packed` is the persistent
store, :mod:`.redis` the store on a Redis server, :mod:`.layered` a local copy in front
of a remote store, :mod:`.slots` the dataset RAM tier's slots by index, :mod:`.features`
the fixed-stride files of features by index, and :class:`DiskStore` reads (and migrates
from) the one-file-per-entry layout of torchcache 1.0. :mod:`.files` holds the file
helpers they share.
"""

from .base import Store
from .batched import BatchedStore
from .disk import DiskStore
from .packed.store import PackedStore

__all__ = ["BatchedStore", "DiskStore", "PackedStore", "Store"]
