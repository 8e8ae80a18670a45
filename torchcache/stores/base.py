"""The byte-store contract.

A store maps string keys to byte strings under a byte budget and an eviction policy. It
never knows what the bytes mean (that is the codec's job). Derived helpers are written
once here on top of a few primitives, as in joblib's store backends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

__all__ = ["Store"]


class Store(ABC):
    """A budgeted map from keys (hex strings) to bytes.

    Implementations must be safe to call from several threads at once.
    """

    max_bytes: int

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """Return the stored bytes, or ``None`` if absent. Counts as a use of the key.

        Raises:
            StoreError: If the backing storage could not be read.
            CorruptEntryError: If what is stored under the key cannot be an entry (a store
                that knows its entries' framing checks it before reading them whole).
        """

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store bytes under a key, evicting others to stay within ``max_bytes``.

        Returns:
            ``False`` if the value alone is larger than ``max_bytes`` (nothing is stored).

        Raises:
            StoreError: If the backing storage could not be written.
        """

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove a key; return whether it was present."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over the stored keys."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes currently stored."""

    def reject(self, key: str) -> bool:
        """Remove an entry that failed validation; return whether it is gone.

        A store that cannot remove it should at least stop returning it.
        """
        try:
            self.delete(key)
        except OSError:
            return False
        return True

    def clear(self) -> None:
        """Remove every entry."""
        for key in list(self.keys()):
            self.delete(key)

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in set(self.keys())
