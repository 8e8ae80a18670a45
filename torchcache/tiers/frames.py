"""Item rows to checked frames and back, with the codec chosen per output layout.

A frame (:mod:`torchcache.codec`) holds one item: its layout header and its row of
bytes, raw, zero-elided or brotli-compressed, under a checksum. :class:`FrameCodec`
keeps what one persistent tier learns about its layouts: the header bytes of each, the
zero-elision word size, and how often brotli and zero elision paid. When either keeps
failing to pay for a layout (random or GELU-like outputs), it is only retried now and
then, so outputs it does not shrink cost no time in it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..codec import (
    CODEC_BROTLI,
    CODEC_RAW,
    CODEC_ZERO,
    MAGIC,
    MIN_ELIDE_BYTES,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    encode_frame,
    encode_header,
    encode_raw_frames,
    encode_zero_frames,
    heads_alike,
    parse_header,
    split_frame,
    unelide_rows,
    word_size,
)
from ..dtypes import ALIGN, standard_strides
from ..errors import CorruptEntryError
from ..tree import Layout

__all__ = ["Frame", "FrameCodec", "pack_rows"]

#: A decoded frame: its header bytes and its raw payload.
Frame = tuple[bytes, bytes | memoryview]

_RETRY_EVERY = 256  # once brotli stopped paying: one row in 256 tries it again
_GIVE_UP_AFTER = 8  # rows that brotli, or jobs that zero elision, did not pay for
_RETRY_JOBS = 16  # once zero elision stopped paying: one job in 16 tries it again
_LAYOUTS_KEPT = 4096  # parsed headers kept (outputs of many shapes: the oldest all go at once)
_LAYOUT_HEADER_BYTES = 4 << 20  # and their bytes (a layout takes about 15 times its header's)


def pack_rows(layout: Layout, leaves: Sequence[torch.Tensor], rows: int) -> np.ndarray:
    """The ``(rows, layout.row_bytes)`` uint8 rows of ``leaves`` (CPU tensors), one per item."""
    if len(leaves) == 1 and layout.row_bytes == layout.nbytes:
        return standard_strides(leaves[0].reshape(rows, -1)).view(torch.uint8).numpy()
    packed = np.zeros((rows, layout.row_bytes), dtype=np.uint8)
    for leaf, off, spec in zip(leaves, layout.offsets, layout.leaves):
        packed[:, off : off + spec.nbytes] = standard_strides(leaf.reshape(rows, -1)).view(torch.uint8).numpy()
    return packed


class FrameCodec:
    """Encodes rows of one tier's layouts into frames and decodes frames back.

    Args:
        quality: brotli quality for new frames.
    """

    def __init__(self, quality: int) -> None:
        self.quality = quality
        self._layouts: dict[bytes, Layout] = {}
        self._kept = 0  # bytes of the headers of the layouts kept
        self._headers: dict[Layout, bytes] = {}
        self._streak: dict[Layout, int] = {}
        self._dense: dict[Layout, int] = {}  # jobs in a row where no row was zero-elided
        self._words: dict[Layout, int] = {}
        self._lock = threading.Lock()

    # -- layouts ----------------------------------------------------------------------
    def layout_of(self, header_bytes: bytes) -> Layout:
        """The layout a frame's header describes.

        Raises:
            CorruptEntryError: If the header is not a valid layout.
        """
        layout = self._layouts.get(header_bytes)
        if layout is None:
            try:
                layout = Layout.from_header(parse_header(header_bytes))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptEntryError(f"invalid header: {exc}") from None
            except RecursionError:
                raise CorruptEntryError("invalid header: nested too deeply") from None
            if len(header_bytes) <= _LAYOUT_HEADER_BYTES:  # one larger than all kept (a planted one): parsed again
                if len(self._layouts) >= _LAYOUTS_KEPT or self._kept + len(header_bytes) > _LAYOUT_HEADER_BYTES:
                    self._layouts.clear()  # the oldest all go at once
                    self._kept = 0
                self._layouts[header_bytes] = layout
                self._kept += len(header_bytes)
        return layout

    def header_of(self, layout: Layout) -> bytes:
        """The header bytes of ``layout`` (encoded once)."""
        header = self._headers.get(layout)
        if header is None:
            header = self._headers[layout] = encode_header(layout.to_header())
            self._layouts.setdefault(header, layout)
        return header

    def _word_of(self, layout: Layout) -> int:
        """The zero-elision word size for rows of ``layout``."""
        word = self._words.get(layout)
        if word is None:
            word = self._words[layout] = word_size(
                [leaf.dtype.itemsize for leaf in layout.leaves],
                [-(-leaf.nbytes // ALIGN) * ALIGN for leaf in layout.leaves],
            )
        return word

    # -- frames -----------------------------------------------------------------------
    def encode(self, layout: Layout, packed: np.ndarray) -> list[bytes | memoryview]:
        """One frame per row of ``packed`` (see :func:`pack_rows`).

        Small rows (under :data:`~torchcache.codec.MIN_ELIDE_BYTES`) are zero-elided as one
        array and, where that does not pay, framed raw as one array; rows that try brotli
        and large rows are encoded one by one. Once zero elision has not paid for a whole
        job several times in a row (dense outputs), it is tried on one job in 16 only.
        """
        header = self.header_of(layout)
        with self._lock:
            streak = self._streak.get(layout, 0)
            dense = self._dense.get(layout, 0)
        tries = dense < _GIVE_UP_AFTER or dense % _RETRY_JOBS == 0
        word = self._word_of(layout) if tries else None
        small = layout.row_bytes < MIN_ELIDE_BYTES
        elided = encode_zero_frames(header, packed, word) if small and word is not None else None
        raw: np.ndarray | None = None
        frames: list[bytes | memoryview] = []
        for i, row in enumerate(packed):
            attempt = streak < _GIVE_UP_AFTER or streak % _RETRY_EVERY == 0
            if attempt or not small:
                frame = encode_frame(header, memoryview(row), self.quality if attempt else None, word)
                frames.append(frame)
                if attempt:
                    streak = streak + 1 if frame[5] != CODEC_BROTLI else 0
                    continue
            else:
                ready: bytes | memoryview | None = None if elided is None else elided[i]
                if ready is None:
                    if raw is None:
                        raw = encode_raw_frames(header, packed)
                    ready = memoryview(raw[i])
                frames.append(ready)
            if streak:
                streak += 1
        sparse = word is not None and any(frame[5] == CODEC_ZERO for frame in frames)
        with self._lock:
            self._streak[layout] = streak
            self._dense[layout] = 0 if sparse else dense + 1
        return frames

    def decode(
        self, data: bytes | memoryview, verify: bool = False, out: np.ndarray[Any, np.dtype[np.uint8]] | None = None
    ) -> Frame:
        """Check a frame's structure and decompress its row.

        Args:
            data: The frame.
            verify: Also check the frame's own checksum (stores check theirs, which
                covers the whole frame, so frames read from a store need not).
            out: Where a zero-elided row may be written (a ``(row_bytes,)`` uint8 array).

        Raises:
            CorruptEntryError: If the frame is damaged or its header is not a valid layout.
        """
        header, payload = split_frame(data, verify=verify, raw_size=self._row_bytes, out=out)
        return header, payload

    def _row_bytes(self, header_bytes: bytes) -> int:
        return self.layout_of(header_bytes).row_bytes

    def raw_head(self, data: memoryview) -> int | None:
        """The bytes before the payload of a raw frame, checked in full; ``None`` if it is not one.

        For :meth:`~torchcache.stores.batched.BatchedStore.get_rows`: one frame of a batch,
        decoded here, sizes the heads that :meth:`raw_layout` then compares.
        """
        if len(data) < PREFIX_SIZE or data[5] != CODEC_RAW:
            return None
        try:
            _, payload = self.decode(data)
        except CorruptEntryError:
            return None
        return len(data) - len(payload)

    def raw_layout(self, heads: np.ndarray) -> Layout | None:
        """The layout of raw frames whose heads (prefix and header) are the rows of ``heads``, if all are equal.

        The heads must equal each other, checksum aside (each frame's own checksum is not
        needed: the store checked the record, see :meth:`decode`); one of
        them was checked in full by :meth:`raw_head`, so all of them are valid.
        """
        if not len(heads) or heads.shape[1] < PREFIX_SIZE:
            return None
        first = heads[0]
        if not heads_alike(heads, first):
            return None
        try:
            return self.layout_of(first[PREFIX_SIZE:].tobytes())
        except CorruptEntryError:
            return None

    def unelide_many(
        self, datas: Sequence[bytes | memoryview], header: bytes, rows: np.ndarray[Any, np.dtype[np.uint8]]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Rebuild the zero-elided frames of ``datas`` that carry ``header`` into ``rows``, in one pass.

        Each frame's prefix is checked field by field against the layout ``header``
        describes (its row size and word size); the payloads of those that pass are
        checked and rebuilt together (:func:`~torchcache.codec.unelide_rows`). Frames of
        another codec, header or word size, and damaged ones, are left alone for
        :meth:`decode` to decode or reject one by one. Frames read from a store need no
        checksum of their own (see :meth:`decode`).

        Args:
            datas: Frames.
            header: The header bytes of a frame already decoded in full (so its layout
                is known and valid).
            rows: A ``(len(datas), row_bytes)`` uint8 array with contiguous rows.

        Returns:
            For each frame, whether its row was written.
        """
        layout = self.layout_of(header)
        raw_len, word = layout.row_bytes, self._word_of(layout)
        picked: list[int] = []
        stored: list[memoryview] = []
        for i, data in enumerate(datas):
            payload = _stored_if(data, header, CODEC_ZERO, word, raw_len)
            if payload is not None:
                picked.append(i)
                stored.append(payload)
        done = np.zeros(len(datas), dtype=np.bool_)
        if not picked:
            return done
        if len(picked) == len(datas):
            done[:] = unelide_rows(stored, word, rows)
            return done
        into = np.empty((len(picked), raw_len), dtype=np.uint8)
        ok = unelide_rows(stored, word, into)
        where = np.asarray(picked)[ok]
        rows[where] = into[ok]
        done[where] = True
        return done

    def decode_many(
        self,
        datas: Sequence[bytes | memoryview | None],
        raw_only: bool = False,
        outs: Sequence[np.ndarray[Any, np.dtype[np.uint8]]] | None = None,
    ) -> list[Frame | CorruptEntryError | bytes | memoryview | None]:
        """:meth:`decode` each frame; a damaged one gives its error in its place.

        Raw frames whose header is the one met last take a fast path (their prefix is
        checked field by field, nothing is copied).

        Args:
            datas: Frames, ``None`` for misses.
            raw_only: Decode only raw frames; others are returned as they are, for
                :meth:`decode_many` to decompress elsewhere (on a pool).
            outs: One row per frame, where zero-elided payloads may be written.
        """
        out: list[Frame | CorruptEntryError | bytes | memoryview | None] = []
        last, row = b"", -1
        for n, data in enumerate(datas):
            if data is None:
                out.append(None)
                continue
            if len(data) >= PREFIX_SIZE:
                payload = _stored_if(data, last, CODEC_RAW, 0, row) if row >= 0 else None
                if payload is not None:
                    out.append((last, payload))
                    continue
                if raw_only and data[5] != CODEC_RAW:  # the codec byte
                    out.append(data)
                    continue
            try:
                frame = self.decode(data, out=None if outs is None else outs[n])
            except CorruptEntryError as exc:
                out.append(exc)
                continue
            out.append(frame)
            last, row = frame[0], len(frame[1])
        return out


def _stored_if(data: bytes | memoryview, header: bytes, codec: int, word: int, raw_len: int) -> memoryview | None:
    """The stored payload of a frame whose fixed fields and header are the given ones, else ``None``.

    The frame's checksum is not computed (see :meth:`FrameCodec.decode`); a raw frame
    must also store exactly ``raw_len`` bytes.
    """
    start = PREFIX_SIZE + len(header)
    if len(data) < start:
        return None
    magic, version, found, param, header_len, stored, raw, _ = PREFIX.unpack_from(data)
    if (
        found == codec
        and param == word
        and raw == raw_len
        and header_len == len(header)
        and magic == MAGIC
        and version == VERSION
        and len(data) == start + stored
        and (codec != CODEC_RAW or stored == raw)
        and data[PREFIX_SIZE:start] == header
    ):
        return memoryview(data)[start:]
    return None
