"""Digests of item rows computed where the rows live, with torch operations only.

An item on an accelerator is keyed by every one of its bytes without copying them to the
host: its row is hashed on the device by a universal hash written in torch integer
operations (so CUDA, ROCm, MPS and XLA run it with nothing to compile), and only 32 bytes
per item reach the host, in one copy per batch, where they are hashed into the item's
key like a row digest of the CPU path.

The hash is NH, the universal hash of UMAC (Black et al., 1999), in four lanes with
independent keys. A row's bytes are read as 32-bit words (zero-padded to a whole number
of chunks); each chunk of 256 words ``m`` gives, per lane with key ``k``, the 64-bit sum
``sum_i ((m[2i] + k[2i]) mod 2^32) * ((m[2i+1] + k[2i+1]) mod 2^32) mod 2^64``. The
chunk values, split into 32-bit words, are hashed again the same way, level by level,
until one 64-bit value per lane is left. For two different rows of the same length
(their length, dtype and shape are part of every key's context) a lane's value is equal
with probability at most 2^-32 per level under random keys, so the four lanes collide
with probability at most about 2^-128 times the number of levels (two for a 224x224
image, three up to 64 M words). This bounds collisions of *random* keys against inputs
chosen without knowing them: the keys are fixed seeds, part of the key format, so the
hash is not cryptographic, like xxh3 on the CPU path.

The arithmetic wraps modulo 2^64 in int64 tensors (the same bits on every device, which
``tests`` check against a NumPy reference in unsigned arithmetic); a product of two
32-bit values fits in 64 bits, and a chunk's sum wraps as NH's definition does.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["CHUNK_WORDS", "LANES", "device_row_digests", "nh_keys", "reference_digests"]

#: 32-bit words hashed together at each level.
CHUNK_WORDS = 256
#: Independent lanes: 64 bits each, 32 bytes per item.
LANES = 4
_MASK = 0xFFFFFFFF
_SEED = 0x7C0C_A5E5_D1CE_57A7  # part of the key format: changing it changes every device key
_keys: dict[tuple[str, int], torch.Tensor] = {}


def nh_keys(levels: int) -> np.ndarray:
    """The fixed NH keys: ``(levels, LANES, CHUNK_WORDS)`` 32-bit values in uint64."""
    generator = np.random.Generator(np.random.PCG64(_SEED))
    return generator.integers(0, 1 << 32, size=(levels, LANES, CHUNK_WORDS), dtype=np.uint64)


def _device_keys(device: torch.device, levels: int) -> torch.Tensor:
    found = _keys.get((str(device), levels))
    if found is None:
        found = torch.from_numpy(nh_keys(levels).astype(np.int64)).to(device)
        _keys[(str(device), levels)] = found
    return found


def _levels(words: int) -> int:
    """Levels of NH until one 64-bit value (two words) per lane is left."""
    levels = 0
    while True:
        levels += 1
        chunks = max(1, -(-words // CHUNK_WORDS))
        if chunks == 1:
            return levels
        words = 2 * chunks


def device_row_digests(rows: torch.Tensor) -> np.ndarray:
    """The 32-byte digest of each row of a ``(batch, nbytes)`` uint8 tensor, computed on its device.

    Args:
        rows: Each item's bytes, contiguous, on any device.

    Returns:
        A ``(batch, 32)`` uint8 array on the host: each lane's 64-bit value, little-endian.

    Example:
        >>> rows = torch.arange(24, dtype=torch.uint8).reshape(2, 12)
        >>> digests = device_row_digests(rows)
        >>> digests.shape, bool((digests[0] != digests[1]).any())
        ((2, 32), True)
    """
    batch, nbytes = rows.shape
    pad = -nbytes % 4
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    if rows.shape[1]:
        words = rows.contiguous().view(torch.int32).to(torch.int64) & _MASK  # (batch, W), each < 2^32
    else:
        words = torch.zeros((batch, 0), dtype=torch.int64, device=rows.device)
    levels = _levels(words.shape[1])
    keys = _device_keys(rows.device, levels)
    lanes = []
    for lane in range(LANES):
        values = words
        for level in range(levels):
            values = _nh(values, keys[level, lane])
            if level + 1 < levels:
                values = torch.stack([values & _MASK, (values >> 32) & _MASK], dim=-1).reshape(batch, -1)
        lanes.append(values.reshape(batch))
    digests = torch.stack(lanes, dim=1).cpu()  # (batch, LANES) int64: the only copy to the host
    return digests.numpy().astype("<i8", copy=False).view(np.uint8).reshape(batch, 8 * LANES)


def _nh(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """One level of NH: ``(batch, W)`` words to ``(batch, chunks)`` 64-bit sums (wrapping)."""
    batch, count = words.shape
    pad = -count % CHUNK_WORDS
    if pad or count == 0:
        words = torch.nn.functional.pad(words, (0, pad or CHUNK_WORDS))
    chunks = words.reshape(batch, -1, CHUNK_WORDS)
    mixed = (chunks + key) & _MASK
    return (mixed[..., 0::2] * mixed[..., 1::2]).sum(dim=-1)


def reference_digests(rows: np.ndarray) -> np.ndarray:
    """:func:`device_row_digests` in NumPy's unsigned arithmetic: the definition tests check the device against."""
    batch, nbytes = rows.shape
    padded = np.zeros((batch, -(-nbytes // 4) * 4), dtype=np.uint8)
    padded[:, :nbytes] = rows
    words = padded.view("<u4").astype(np.uint64)
    levels = _levels(words.shape[1])
    keys = nh_keys(levels)
    out = np.zeros((batch, LANES), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for lane in range(LANES):
            values = words
            for level in range(levels):
                count = values.shape[1]
                pad = -count % CHUNK_WORDS if count else CHUNK_WORDS
                values = np.concatenate([values, np.zeros((batch, pad), dtype=np.uint64)], axis=1)
                chunks = values.reshape(batch, -1, CHUNK_WORDS)
                mixed = (chunks + keys[level, lane]) & np.uint64(_MASK)
                values = (mixed[..., 0::2] * mixed[..., 1::2]).sum(axis=-1, dtype=np.uint64)
                if level + 1 < levels:
                    halves = np.stack([values & np.uint64(_MASK), values >> np.uint64(32)], axis=-1)
                    values = halves.reshape(batch, -1)
            out[:, lane] = values.reshape(batch)
    return out.astype("<u8").view(np.uint8).reshape(batch, 8 * LANES)
