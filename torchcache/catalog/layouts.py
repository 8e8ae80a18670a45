"""What a cache's entries hold: their layouts (tree, dtypes, shapes), from a sample of headers.

Only prefixes and headers are read (entry files, packed-store records read with the index
read-only, dataset sample frames); no payload is decoded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from ..codec import PREFIX_SIZE, parse_header, read_prefix
from ..stores.files import open_regular, read_at
from ..stores.packed.format import encode_keys, payload_of, record_size
from ..stores.packed.index import open_index, unpack_entry
from ..stores.packed.segments import SegmentFiles
from ..stores.packed.store import MAX_ENTRY_BYTES
from ..tree import Layout, describe
from .inspect import CacheFiles, open_store

__all__ = ["LayoutSummary", "summarize_layouts"]


@dataclass(frozen=True)
class LayoutSummary:
    """Sampled entries that share one layout (or could not be read, ``layout=None``)."""

    description: str
    entries: int
    layout: Layout | None


def _read_header(path: Path) -> dict[str, Any]:
    """Read only the prefix and the header of an entry.

    Raises:
        FileNotFoundError: If it is gone or not a regular file.
        CorruptEntryError: If it is not a frame.
    """
    opened = open_regular(path)
    if opened is None:
        raise FileNotFoundError(path)
    fd, _ = opened
    try:
        _, _, header_len, _, _, _ = read_prefix(read_at(fd, PREFIX_SIZE))
        return parse_header(read_at(fd, header_len, PREFIX_SIZE))
    finally:
        os.close(fd)


def _describe(layout: Layout) -> str:
    texts = []
    for leaf in layout.leaves:
        dtype, out_dtype = (str(dt).removeprefix("torch.") for dt in (leaf.dtype, leaf.out_dtype))
        text = f"{dtype}[{','.join(str(d) for d in leaf.shape)}]"
        texts.append(text if out_dtype == dtype else f"{text} as {out_dtype}")
    return describe(layout.spec, texts)


def _frame_header(data: bytes | memoryview) -> dict[str, Any]:
    _, _, header_len, _, _, _ = read_prefix(data)
    return parse_header(bytes(data[PREFIX_SIZE : PREFIX_SIZE + header_len]))


def _read_payloads(directory: Path, keys: Sequence[str]) -> list[bytes]:
    """The payloads of the intact records of ``keys`` in a packed store, read with the index read-only.

    Not through :meth:`PackedStore.get_many`: a record that fails its checks there is
    removed from the index when the store is closed, and inspecting removes nothing.
    An index row that claims more than the store's largest entry is not read.

    Raises:
        lmdb.Error: If the index cannot be read.
        OSError: If a segment file exists and cannot be read.
    """
    root = os.fspath(directory)
    index = open_index(root, readonly=True)
    segments = SegmentFiles(root, 1)
    try:
        with index.begin() as txn:
            rows = [(kb, unpack_entry(txn.get(kb, db=index.entries))) for kb in encode_keys(list(keys))]
        payloads = []
        for kb, entry in sorted(rows, key=lambda row: row[1] or (0, 0, 0)):
            if entry is None or entry.length > MAX_ENTRY_BYTES:
                continue
            data = segments.read(entry.seg, entry.offset, record_size(kb, entry.length))
            payload = None if isinstance(data, str) else payload_of(data, kb, entry.length)
            if payload is not None:
                payloads.append(bytes(payload))
        return payloads
    finally:
        segments.close()
        index.close()


def _sample_headers(directory: Path, files: CacheFiles, sample: int) -> list[Callable[[], dict[str, Any]]]:
    """Readers of the headers of at most ``sample`` entries, spread over the store, then the 1.0 files."""
    readers: list[Callable[[], dict[str, Any]]] = []
    store = open_store(directory, readonly=True) if files.has_store and sample > 0 else None
    if store is not None:
        with store:
            keys = list(store.keys())
        n = len(keys)
        picks = [keys[i * n // sample] for i in range(sample)] if n > sample else keys
        try:
            payloads = _read_payloads(directory, picks)
        except (lmdb.Error, OSError):
            payloads = []
        readers.extend(lambda data=data: _frame_header(data) for data in payloads)  # type: ignore[misc]
    entries = files.entries
    left = max(sample - len(readers), 0)
    n = len(entries)
    picks_files = [entries[i * n // left] for i in range(left)] if n > left > 0 else list(entries[:left])
    readers.extend(lambda path=entry.path: _read_header(path) for entry in picks_files)  # type: ignore[misc]
    return readers


def summarize_layouts(directory: Path, files: CacheFiles, sample: int) -> list[LayoutSummary]:
    """Group a sample of entries by layout, reading only their headers.

    Args:
        directory: The module directory.
        files: Its files (see :func:`list_files`).
        sample: At most this many entries, spread evenly over the packed store and then
            over the 1.0 entry files, are read.

    Returns:
        One summary per layout, the most common first; unreadable headers are grouped
        under ``layout=None``.
    """
    groups: dict[Layout | None, tuple[Layout | None, str, int]] = {}
    for read in _sample_headers(directory, files, sample):
        try:
            layout = Layout.from_header(read())
            key, description = layout, _describe(layout)  # both forms of a header: one layout
        except FileNotFoundError:
            continue
        except (OSError, KeyError, TypeError, ValueError, RecursionError):
            layout, key, description = None, None, "unreadable header"
        _, _, count = groups.get(key, (layout, description, 0))
        groups[key] = (layout, description, count + 1)
    summaries = [LayoutSummary(desc, count, layout) for layout, desc, count in groups.values()]
    summaries.sort(key=lambda s: (s.layout is None, -s.entries))
    return summaries
