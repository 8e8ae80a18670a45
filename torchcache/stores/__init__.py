"""Where entries live: the byte-store contracts and their implementations."""

from .base import Store
from .batched import BatchedStore
from .disk import DiskStore
from .memory import MemoryTier
from .packed import PackedStore

__all__ = ["BatchedStore", "DiskStore", "MemoryTier", "PackedStore", "Store"]
