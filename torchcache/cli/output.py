"""How the ``torchcache`` command writes: tables, JSON, dates, sizes, progress and error lines.

Results go to stdout, as text or as JSON (non-finite numbers become ``null``, so the
output always parses); progress, notes and errors go to stderr, prefixed with the
command's name, so ``--json`` output on stdout stays parseable.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from ..catalog.inspect import ModuleCache
from ..features.variable import MARK
from ..policy import format_size, plural

__all__ = [
    "PROG",
    "Progress",
    "cache_json",
    "cache_table",
    "count_caches",
    "damaged_note",
    "error",
    "iso",
    "note",
    "print_json",
    "product",
    "relative",
    "short_keys",
    "table",
    "totals",
    "visible",
    "when",
]

#: The command's name, which starts every line it writes to stderr.
PROG = "torchcache"
#: The products whose caches share a root, in the order their counts are written.
PRODUCTS = ("module", "dataset", "feature")
#: The fewest hex digits of a module key that the ``KEY`` column shows.
SHORT_KEY = 12


class Progress:
    """Progress of a long check: a tqdm bar on a terminal, else a plain line now and then.

    Args:
        total: Steps expected.
        desc: What is being done.
        stream: Where progress goes (stderr when ``None``).
        interval: Seconds between plain lines.
    """

    def __init__(self, total: int, desc: str, stream: TextIO | None = None, interval: float = 10.0) -> None:
        self.total, self.done, self.desc, self.interval = total, 0, desc, interval
        self._stream = stream if stream is not None else sys.stderr
        self._last = time.monotonic()
        self._bar: Any = None
        if self._stream is not None and self._stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit="entry", file=self._stream, leave=False)

    def update(self, n: int = 1) -> None:
        """Record ``n`` more steps done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._stream is not None and time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            share = f" ({self.done / self.total:.0%})" if self.total else ""
            print(f"{self.desc}: {self.done:,}/{self.total:,} entries{share}", file=self._stream, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()


def note(message: str) -> None:
    """Write one line to stderr, after the command's name."""
    print(f"{PROG}: {message}", file=sys.stderr)


def error(message: str) -> None:
    """Write one ``torchcache: error: ...`` line to stderr."""
    note(f"error: {message}")


def _date(ts: float | None) -> datetime | None:
    try:
        return None if ts is None else datetime.fromtimestamp(ts).astimezone()
    except (OverflowError, OSError, ValueError):  # a time no date can show
        return None


def when(ts: float | None) -> str:
    """A timestamp as local ``YYYY-MM-DD HH:MM``, or ``-`` when there is none (or no date can show it)."""
    date = _date(ts)
    return "-" if date is None else date.strftime("%Y-%m-%d %H:%M")


def iso(ts: float | None) -> str | None:
    """A timestamp as a local ISO 8601 date and time to the second, or ``None``."""
    date = _date(ts)
    return None if date is None else date.isoformat(timespec="seconds")


def relative(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` where it is under it, else whole."""
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def visible(text: str) -> str:
    """``text`` with what a terminal would act on or cannot show escaped (control characters, lone surrogates).

    Names and versions come from metadata files, which anyone who can write the cache
    directory can edit: printed raw, an escape sequence would reach the terminal.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """A plain-text table: columns as wide as their widest cell, those in ``right`` aligned right."""
    rows = [[visible(cell) for cell in row] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = []
    for row in (headers, *rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cache_json(cache: ModuleCache) -> dict[str, Any]:
    """What ``--json`` output says of one module cache."""
    return {
        "key": cache.key,
        "directory": str(cache.directory),
        "name": cache.name,
        "kind": cache.meta.get("kind"),
        "entries": cache.entries,
        "bytes": cache.nbytes,
        "disk_bytes": cache.disk_bytes,
        "live_bytes": cache.live_bytes,
        "reclaimable_bytes": cache.reclaimable_bytes,
        "legacy_entries": cache.legacy_entries,
        "unsent_entries": cache.unsent,
        "copy_of": _text(cache.meta.get("copy_of")),
        "module_key": _text(cache.meta.get("module_key")),
        "temporary_files": cache.temporaries,
        "max_bytes": cache.max_bytes,
        "created": iso(cache.created),
        "last_used": iso(cache.last_used),
        "torchcache_version": cache.version,
        "metadata_problem": cache.meta_problem,
    }


def _text(value: object) -> str | None:
    """A metadata field that should be a string, or ``None`` (missing, or another type in a damaged file)."""
    return value if isinstance(value, str) else None


def product(cache: ModuleCache) -> str:
    """Which product wrote a cache: ``"module"`` (a module or function), ``"dataset"`` or ``"feature"``.

    Features kept whole in a dataset cache (they vary in shape) are features; a cache whose
    metadata no longer says is counted as a module cache.
    """
    kind = cache.meta.get("kind")
    if kind == "features" or (kind == "dataset" and MARK in cache.meta):
        return "feature"
    return "dataset" if kind == "dataset" else "module"


def count_caches(caches: Sequence[ModuleCache]) -> str:
    """How many caches of each product, such as ``2 module caches and 1 dataset cache`` (``0 caches`` for none).

    Example:
        >>> count_caches([])
        '0 caches'
    """
    counts = [sum(product(c) == name for c in caches) for name in PRODUCTS]
    parts = [plural(n, f"{name} cache") for n, name in zip(counts, PRODUCTS) if n]
    if not parts:
        return "0 caches"
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def short_keys(keys: Sequence[str], among: Sequence[str] = ()) -> list[str]:
    """Each key cut to its first :data:`SHORT_KEY` characters, or more where another key starts alike.

    A short key is as long as it takes to tell the key from every other one in ``keys``
    and ``among`` (the other caches under the root), so that it names one cache, as a
    ``KEY`` argument does.

    Example:
        >>> short_keys(["features-0a1b2c3d", "features-0a1f9e8d", "5f3c9a1d2e4b6f7a"])
        ['features-0a1b', 'features-0a1f', '5f3c9a1d2e4b']
    """
    ordered = sorted({*keys, *among})

    def shared(a: str, b: str) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    cut = {}
    for i, key in enumerate(ordered):
        neighbours = ordered[max(i - 1, 0) : i] + ordered[i + 1 : i + 2]
        cut[key] = key[: max([SHORT_KEY, *(shared(key, other) + 1 for other in neighbours)])]
    return [cut[key] for key in keys]


def cache_table(caches: Sequence[ModuleCache], among: Sequence[ModuleCache] = ()) -> str:
    """Caches as a table, one row each, with keys as short as they can be among ``caches`` and ``among``."""
    keys = short_keys([c.key for c in caches], [c.key for c in among])
    rows = [
        [
            short,
            c.name
            + ("" if c.meta_problem is None else " (damaged metadata)")
            + ("" if c.index_damage is None else " (damaged index)"),
            "features" if product(c) == "feature" else c.meta["kind"] if isinstance(c.meta.get("kind"), str) else "-",
            f"{c.entries:,}",
            format_size(c.nbytes),
            format_size(c.disk_bytes),
            when(c.created),
            when(c.last_used),
            c.version or "-",
        ]
        for short, c in zip(keys, caches)
    ]
    headers = ["KEY", "NAME", "KIND", "ENTRIES", "SIZE", "ON DISK", "CREATED", "LAST USED", "VERSION"]
    return table(headers, rows, right=(3, 4, 5))


def _finite(data: Any) -> Any:
    """``data`` with non-finite floats (which JSON cannot hold) as ``None``."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_finite(value) for value in data]
    return data


def print_json(data: Any) -> None:
    """Print ``data`` to stdout as indented JSON, non-finite numbers as ``null``."""
    print(json.dumps(_finite(data), indent=2, allow_nan=False))


def totals(caches: Sequence[ModuleCache]) -> str:
    """How many caches of each product and entries, and their size (and on disk), in one phrase."""
    entries = plural(sum(c.entries for c in caches), "entry", "entries")
    size, disk = format_size(sum(c.nbytes for c in caches)), format_size(sum(c.disk_bytes for c in caches))
    return f"{count_caches(caches)}, {entries}, {size} ({disk} on disk)"


def damaged_note(caches: Sequence[ModuleCache]) -> None:
    """Print how many of the caches have damaged metadata or a damaged index, and the fix, if any do."""
    damaged = [c for c in caches if c.meta_problem is not None]
    if damaged:
        print(f"{count_caches(damaged)} with damaged metadata; `torchcache verify --fix` rebuilds it")
    unindexed = [c for c in caches if c.index_damage is not None]  # its entries cannot be counted: 0 shown
    if unindexed:
        print(f"{count_caches(unindexed)} with a damaged index; `torchcache verify --fix` rebuilds it")
