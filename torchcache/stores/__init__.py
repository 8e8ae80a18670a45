"""Where entries live: the byte-store contract and its implementations."""

from .base import Store
from .disk import DiskStore
from .memory import MemoryTier

__all__ = ["DiskStore", "MemoryTier", "Store"]
