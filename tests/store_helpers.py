"""Keys, values, a report collector and the reference store shared by the byte-store tests."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from torchcache.stores.batched import BatchedStore, VerifyReport
from torchcache.stores.packed.format import encode_key
from torchcache.stores.packed.store import PackedStore


def key(i: int) -> str:
    """A key as the cache makes them: 32 lowercase hex digits."""
    return hashlib.md5(str(i).encode()).hexdigest()


def value(i: int, size: int = 1000) -> bytes:
    """``size`` bytes that name ``i``: the value stored under ``key(i)``."""
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def charged(store: PackedStore) -> int:
    """The bytes a packed store's budget counts: its records and the index's share."""
    usage = store.usage()
    return usage["records"] + usage["index"]


def poison_index_leaves(index: Path) -> None:
    """Give the first entry of every leaf of 16-byte keys (live or free) a 2 GiB value: a reader goes past the map."""
    data, poisoned = bytearray(index.read_bytes()), 0
    for base in range(2 * 4096, len(data), 4096):
        flags, lower = (int.from_bytes(data[base + at : base + at + 2], "little") for at in (10, 12))
        if flags & 0x02 and lower > 16:  # a leaf page with nodes
            node = base + int.from_bytes(data[base + 16 : base + 18], "little")
            if int.from_bytes(data[node + 6 : node + 8], "little") == 16:
                data[node : node + 4] = b"\xff\xff\xff\x7f"  # the value's size
                poisoned += 1
    assert poisoned, "no leaf of 16-byte keys in the index"
    index.write_bytes(bytes(data))


class Reports:
    """A ``report`` callback that keeps the ``(kind, message)`` pairs it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, kind: str, message: str) -> None:
        self.seen.append((kind, message))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.seen]


class ReferenceStore(BatchedStore):
    """The contract in plain Python: a dict, a byte budget, MRU eviction by write time."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        kbs = [encode_key(k) for k in keys]  # validates
        del kbs
        with self._lock:
            return [self._data.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> int:
        for k, _ in items:
            encode_key(k)
        with self._lock:
            stored = []
            held = sum(map(len, self._data.values()))  # once per batch: counting at every eviction is quadratic
            for k, data in items:
                held -= len(self._data.pop(k, b""))
                if len(data) > self.max_bytes:
                    continue
                while held + len(data) > self.max_bytes:
                    held -= len(self._data.pop(next(reversed(self._data))))
                self._data[k] = bytes(data)
                held += len(data)
                stored.append(k)
            return sum(1 for k in set(stored) if k in self._data)

    def delete_many(self, keys: Sequence[str]) -> int:
        for k in keys:
            encode_key(k)
        with self._lock:
            return sum(self._data.pop(k, None) is not None for k in keys)

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    @property
    def nbytes(self) -> int:
        return sum(map(len, self._data.values()))

    @property
    def disk_bytes(self) -> int:
        return 0

    def clear(self) -> None:
        self._data.clear()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def verify(self, fix: bool = False) -> VerifyReport:
        return VerifyReport(entries=len(self._data))
