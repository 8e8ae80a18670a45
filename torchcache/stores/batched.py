"""The batched byte-store contract.

A batched store maps keys (4 to 64 lowercase hex digits; 32 in practice) to bytes
under a byte budget. It never knows what its bytes mean. Every primitive takes a
whole batch, so that a batch of 1,024 entries costs one lock, one index pass and as
few system calls as the store's layout allows; single-key helpers are written once
here on top of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np

__all__ = ["BatchedStore", "Rows", "VerifyReport", "rows_of"]


class Rows(NamedTuple):
    """The entries of a batch as arrays (:meth:`BatchedStore.get_rows`)."""

    positions: np.ndarray[Any, np.dtype[np.int64]]  #: of the keys found, into the keys asked for, ascending
    heads: np.ndarray[Any, np.dtype[np.uint8]]  #: ``(found, head)``: each payload's first ``head`` bytes
    rest: np.ndarray[Any, np.dtype[np.uint8]]  #: ``(found, length - head)``: the rest of each payload


@dataclass
class VerifyReport:
    """What :meth:`BatchedStore.verify` found (and, with ``fix``, repaired).

    Attributes:
        entries: Entries checked.
        bad: Keys whose entry failed its checks (removed when fixed).
        problems: One line per other inconsistency (totals, files, index rows).
        fixed: Whether repairs were made.
        unsure: One line per check that could not be made (the server away): no fix helps, verify again.
    """

    entries: int = 0
    bad: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fixed: bool = False
    unsure: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing was wrong."""
        return not self.bad and not self.problems and not self.unsure


class BatchedStore(ABC):
    """A budgeted map from hex keys to bytes, read and written in batches.

    Implementations are safe to call from several threads at once. Faults of single
    entries (a damaged record) are misses, never wrong bytes; faults of the storage as a
    whole raise :class:`~torchcache.errors.StoreError` from writes.
    """

    max_bytes: int
    #: Whether the store is a server that may refuse writes for a while (full, away) and
    #: accept them again later; a local store that refuses writes stays refused.
    remote: bool = False
    #: How many entries written before the last :meth:`put_many` evicted to make room for it
    #: (0 where the store does not count them).
    evicted_by_last_put: int = 0

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """The stored bytes of each key, ``None`` for a miss. Counts as a use of each hit.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        """Store entries, evicting others to stay within :attr:`max_bytes`.

        Items that alone exceed the budget are skipped. A later item with the same key
        replaces an earlier one.

        Returns:
            How many of the items are stored when the call returns.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreError: If the storage cannot be written (nothing half-written is visible).
        """

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove entries; return how many were present.

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
            StoreError: If the storage cannot be written.
        """

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over the stored keys (a snapshot taken in pieces, not one instant)."""

    @abstractmethod
    def __len__(self) -> int:
        """Entries stored."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether a key is stored (without counting as a use)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Payload bytes of the live entries."""

    @property
    @abstractmethod
    def disk_bytes(self) -> int:
        """Bytes the store's files take on disk (allocated blocks); 0 for memory stores."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry.

        Raises:
            StoreError: If the storage cannot be written.
        """

    @abstractmethod
    def flush(self) -> None:
        """Make everything this process did visible to others and safe from a killed process."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release files and locks; the store reopens if used again."""

    @abstractmethod
    def verify(self, fix: bool = False) -> VerifyReport:
        """Check every entry's checksum and the index; with ``fix``, repair what is wrong.

        Raises:
            StoreError: If ``fix`` is set and the storage cannot be written.
        """

    def get_rows(self, keys: Sequence[str], head_of: Callable[[memoryview], int | None]) -> Rows | None:
        """A batch whose found payloads all have one length, as arrays; else ``None``.

        The read path of every store for batches of one kind of entry: a store may serve
        it without building a ``bytes`` object per entry (the packed store gathers the
        records with numpy); this default reads :meth:`get_many` and joins the payloads.

        Returns:
            ``(positions, heads, rows)``: the positions (into ``keys``, ascending, an
            int64 array) of the entries found, checked as :meth:`get_many` checks them;
            a ``(found, head)`` uint8 array of the first ``head`` bytes of each payload,
            ``head`` being ``head_of(first payload found)``; and a contiguous
            ``(found, length - head)`` uint8 array of the rest. ``None`` where the batch
            is not that simple (then call :meth:`get_many`, the general path).

        Raises:
            KeyingError: If a key is not 4 to 64 lowercase hex digits.
        """
        return rows_of(self.get_many(keys), head_of)

    #: Whether reads may fetch entries beyond those asked for, for :meth:`take_extras`
    #: (a local copy in front turns it off while it has no room for them).
    prefetch: bool = False

    def take_extras(self) -> list[tuple[str, bytes | memoryview]]:
        """Checked entries that reads fetched beyond the keys asked for (whole remote segments), once.

        A local copy in front of the store keeps them, so that later batches find them
        there. Stores that read only what is asked return ``[]``.
        """
        return []

    def placement(self, keys: Sequence[str], shared: bool = False) -> list[tuple[str, int] | None]:
        """Where a read of each key fetches it from: ``(object, its bytes)`` of a remote store.

        ``None`` where there is nothing to fetch (a local store, or a key it lacks). A
        sampler orders an epoch by it so that an object's entries are asked for together
        (:class:`~torchcache.datasets.sampler.WindowSampler`). With ``shared``, what a
        local copy in front holds is placed too: the same answer on every machine.
        """
        return [None] * len(keys)

    def reads_failing(self, retry: bool = False) -> bool:
        """Whether the last read of a remote store failed (the server away): its misses may be there.

        ``retry`` lifts a backoff of reads, so that the next read is sent (a reader that waits).
        """
        return False

    def end_write_backoff(self) -> None:  # noqa: B027 - a store with no backoff has nothing to end
        """Send the next write of a remote store whatever its backoff (a flush at the end: the outage may be over)."""

    # -- helpers written once -----------------------------------------------------
    def get(self, key: str) -> bytes | memoryview | None:
        """The stored bytes of one key, or ``None``."""
        return self.get_many([key])[0]

    def put(self, key: str, data: bytes | memoryview) -> bool:
        """Store one entry; ``False`` if it was not stored (larger than the budget).

        Raises:
            StoreError: If the storage cannot be written.
        """
        return self.put_many([(key, data)]) == 1

    def delete(self, key: str) -> bool:
        """Remove one entry; return whether it was present.

        Raises:
            StoreError: If the storage cannot be written.
        """
        return self.delete_many([key]) == 1

    def __enter__(self) -> BatchedStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def rows_of(datas: Sequence[bytes | memoryview | None], head_of: Callable[[memoryview], int | None]) -> Rows | None:
    """:class:`Rows` of the found payloads of a batch if they share one length and ``head_of`` takes the first.

    Example:
        >>> rows = rows_of([b"h1abc", None, b"h2xyz"], lambda payload: 2)
        >>> rows.positions.tolist(), rows.heads.tobytes(), rows.rest.tobytes()
        ([0, 2], b'h1h2', b'abcxyz')
    """
    at = [i for i, data in enumerate(datas) if data is not None]
    if not at:
        return Rows(np.empty(0, np.int64), np.empty((0, 0), np.uint8), np.empty((0, 0), np.uint8))
    views = [memoryview(datas[i]) for i in at]  # type: ignore[arg-type]
    length = len(views[0])
    if any(len(view) != length for view in views):
        return None
    head = head_of(views[0])
    if head is None or not 0 <= head <= length:
        return None
    heads = np.frombuffer(bytearray().join([view[:head] for view in views]), np.uint8).reshape(len(views), head)
    rest = np.frombuffer(bytearray().join([view[head:] for view in views]), np.uint8)
    return Rows(np.asarray(at, np.int64), heads, rest.reshape(len(views), length - head))
