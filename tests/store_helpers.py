"""Keys, values and a report collector shared by the byte-store tests."""

from __future__ import annotations

import hashlib


def key(i: int) -> str:
    """A key as the cache makes them: 32 lowercase hex digits."""
    return hashlib.md5(str(i).encode()).hexdigest()


def value(i: int, size: int = 1000) -> bytes:
    """``size`` bytes that name ``i``: the value stored under ``key(i)``."""
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


class Reports:
    """A ``report`` callback that keeps the ``(kind, message)`` pairs it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, kind: str, message: str) -> None:
        self.seen.append((kind, message))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.seen]
