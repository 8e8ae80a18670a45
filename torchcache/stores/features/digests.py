"""The input digests of a features cache: what each row was computed from.

The file (``inputs.tcdig``), beside ``features.tcrows``::

    header   magic, version, dataset length, and the xxh3_64 of these (32 bytes)
    entries  24 bytes per index at ``4096 + 24 * index``: the xxh3_128 of the backbone's
             input for that sample (its bytes, seeded by its dtype and shape), then the
             binding of that digest to the row it gave: the xxh3_64 of the digest seeded by
             the row's check (as the features file holds it); zeros where unknown

An extraction writes a batch's entries once its rows are written and marked. A later
extraction with the same backbone over a changed dataset (another fingerprint, another
cache) takes the row of an input it has seen instead of running the backbone again
(:mod:`torchcache.features.reuse`), but only where the entry's check equals the row's
check in the features file and the row's bytes pass it: an entry binds an input to one
row's content, so an entry that is damaged, cut short, left from a killed run, moved to
another index or given another entry's digest matches nothing (or, with odds of 2**-64,
passes). A file that is
missing or not valid only means nothing is taken from that cache.
"""

from __future__ import annotations

import functools
import itertools
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ...dtypes import standard_strides
from ..files import create_whole, identity, pwrite_all, read_at
from ..rows import runs

__all__ = ["DIGESTS_NAME", "DigestFile", "batch_digests", "bindings", "input_digest", "pack_digests"]

DIGESTS_NAME = "inputs.tcdig"
DIGEST_BYTES = 16
_ENTRY = DIGEST_BYTES + 8
_MAGIC = b"TCDIGS1\0"
_VERSION = 2  # 1 kept the row check alone: a digest moved to another entry was taken for it
_FIRST = struct.Struct("<8sIIQ")  # magic, version, reserved, length; then the xxh3_64 of these (8 bytes)
_HEAD_BYTES = _FIRST.size + 8
_AT = 4096
_O_OPEN = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def batch_digests(batch: object, count: int) -> list[bytes | None]:
    """The digest of each sample's input in a collated batch (``None`` each where it is not a CPU tensor).

    A digest is the xxh3_128 of the sample's bytes, seeded by its dtype and shape: equal
    digests mean equal inputs to the backbone (a sample given as a numpy array and one
    given as a tensor collate to the same input, and get the same digest).
    """
    if (
        not isinstance(batch, torch.Tensor)
        or batch.dim() == 0
        or len(batch) != count
        or batch.device.type != "cpu"
        or batch.layout != torch.strided
        or batch.is_quantized
    ):
        return [None] * count
    try:
        raw = standard_strides(batch.detach().contiguous().reshape(count, -1)).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return [None] * count
    size = raw.shape[1]
    seed = _seed(str(batch.dtype), tuple(batch.shape[1:]))
    view = memoryview(raw.reshape(-1))  # type: ignore[arg-type]
    samples = (view[start : start + size] for start in range(0, count * size, size))
    return list(map(xxhash.xxh3_128_digest, samples, itertools.repeat(seed, count)))


def input_digest(value: object) -> bytes | None:
    """The digest of one sample's input (a tensor or a numpy array), as :func:`batch_digests` gives it."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            return None
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        return None
    return batch_digests(value.unsqueeze(0), 1)[0]


@functools.lru_cache(maxsize=64)
def _seed(dtype: str, shape: tuple[int, ...]) -> int:
    return xxhash.xxh3_64_intdigest(f"torchcache-input|{dtype}|{shape}".encode())


def pack_digests(digests: list[bytes | None]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``(n, 16)`` uint8 of a batch's digests (zeros for unknown ones)."""
    if None not in digests:  # the common case: one join
        return np.frombuffer(b"".join(digests), np.uint8).reshape(len(digests), DIGEST_BYTES)  # type: ignore[arg-type]
    out = np.zeros((len(digests), DIGEST_BYTES), np.uint8)
    for j, digest in enumerate(digests):
        if digest is not None:
            out[j] = np.frombuffer(digest, np.uint8)
    return out


def bindings(digests: np.ndarray[Any, Any], checks: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """What an entry holds beside each digest (``(n, 16)`` uint8): its xxh3_64 seeded by the row's check.

    0 where the check is 0 (a row not written).
    """
    count = len(checks)
    raw = memoryview(np.ascontiguousarray(digests, np.uint8).reshape(-1))  # type: ignore[arg-type]
    entries = (raw[start : start + DIGEST_BYTES] for start in range(0, count * DIGEST_BYTES, DIGEST_BYTES))
    out = np.fromiter(map(xxhash.xxh3_64_intdigest, entries, checks.tolist()), np.uint64, count)
    out[out == 0] = 1  # 0 stays "unknown"
    out[checks == 0] = 0
    return out


def _head(length: int) -> bytes:
    first = _FIRST.pack(_MAGIC, _VERSION, 0, length)
    return first + xxhash.xxh3_64_intdigest(first).to_bytes(8, "little")


class DigestFile:
    """The digests of one features cache, opened for writing and reading.

    Use :meth:`open`, which makes the file when there is none.
    """

    def __init__(self, path: Path, fd: int, length: int) -> None:
        self.path = path
        self.length = length
        self._fd = fd

    @classmethod
    def open(cls, path: Path, length: int, create: bool) -> DigestFile | None:
        """The digest file at ``path`` for ``length`` rows; made there with ``create``.

        Returns:
            ``None`` if there is none (and ``create`` is false), or it is not a valid
            digest file of ``length`` rows, or it cannot be made or opened.
        """
        try:
            fd = os.open(path, _O_OPEN)
        except FileNotFoundError:
            fd = -1
        except OSError:  # a read-only file or directory: it still gives its digests, but takes none
            if create:
                return None
            try:
                fd = os.open(path, (_O_OPEN & ~os.O_RDWR) | os.O_RDONLY)
            except OSError:
                return None
        if fd >= 0:
            try:
                st = os.fstat(fd)
                whole = stat.S_ISREG(st.st_mode) and st.st_size >= _AT + _ENTRY * length
                if whole and read_at(fd, _HEAD_BYTES) == _head(length):
                    return cls(path, fd, length)
            except OSError:
                pass
            os.close(fd)
            return None
        if not create:
            return None
        try:
            made = create_whole(path, _AT + _ENTRY * length, _head(length))
        except OSError:
            return None
        if made is None:  # another process made it first
            return cls.open(path, length, create=False)
        return cls(path, made, length)

    @staticmethod
    def planted_or_damaged(path: Path, length: int) -> tuple[int, ...] | None:
        """The :func:`~torchcache.stores.files.identity` of a planted or damaged file at ``path``, else ``None``.

        Planted: a link or another non-file (a directory is left to ``torchcache verify``);
        damaged: a file that is not a whole digest file of ``length`` rows. A file is whole
        from the moment it appears (:func:`~torchcache.stores.files.create_whole`), so one
        that is not is damaged; what cannot be looked at (no permission) is not said to be.
        """
        try:
            st = os.lstat(path)
            judged = identity(st)
            if not stat.S_ISREG(st.st_mode):
                return None if stat.S_ISDIR(st.st_mode) else judged
            fd = os.open(path, (_O_OPEN & ~os.O_RDWR) | os.O_RDONLY)
        except OSError:
            return None
        try:
            opened = os.fstat(fd)
            if identity(opened) != judged:  # replaced since: judged again at the next open
                return None
            whole = opened.st_size >= _AT + _ENTRY * length and read_at(fd, _HEAD_BYTES) == _head(length)
            return None if whole else judged
        except OSError:
            return None
        finally:
            os.close(fd)

    def write(self, indices: np.ndarray[Any, Any], digests: np.ndarray[Any, Any], checks: np.ndarray[Any, Any]) -> None:
        """Write the entries of ascending ``indices``: digests (``(n, 16)`` uint8) bound to their rows' checks.

        Raises:
            OSError: If the file cannot be written.
        """
        entries = np.zeros((len(indices), _ENTRY), np.uint8)
        entries[:, :DIGEST_BYTES] = digests
        bound = np.where(digests.any(axis=1), bindings(digests, np.asarray(checks, np.uint64)), 0)
        entries[:, DIGEST_BYTES:] = np.ascontiguousarray(bound, "<u8").view(np.uint8).reshape(-1, 8)
        for start, stop in runs(indices):
            offset = _AT + _ENTRY * int(indices[start])
            pwrite_all(self._fd, memoryview(entries[start:stop]).cast("B"), offset)  # type: ignore[arg-type]

    def read(self) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], np.ndarray[Any, np.dtype[np.uint64]]]:
        """Every entry: the digests, ``(length, 16)`` uint8, and their bindings, ``(length,)`` (zeros where unknown).

        Raises:
            OSError: If the file cannot be read.
        """
        want = _ENTRY * self.length
        data = read_at(self._fd, want, _AT)
        raw = np.zeros(want, np.uint8)
        raw[: len(data)] = np.frombuffer(data, np.uint8)
        entries = raw.reshape(self.length, _ENTRY)
        checks = np.ascontiguousarray(entries[:, DIGEST_BYTES:]).view("<u8").reshape(self.length)
        return np.ascontiguousarray(entries[:, :DIGEST_BYTES]), checks.astype(np.uint64)

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
