"""Byte stores: budgeted maps from hex keys to bytes, behind the batched contract.

Stores never know what their bytes mean; the tiers above frame and decode them.
:mod:`.batched` is the contract; :mod:`.packed` is the persistent store, :mod:`.redis`
the store on a Redis server, :mod:`.layered` a local copy in front of a remote store,
:mod:`.slots` the dataset RAM tier's slots by index, :mod:`.features` the fixed-stride
files of features by index. :mod:`.files` holds the file helpers they share.
"""

from .batched import BatchedStore
from .packed.store import PackedStore

__all__ = ["BatchedStore", "PackedStore"]
