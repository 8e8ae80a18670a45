"""The packed store's budget: whole-segment eviction and when to compact.

The budget counts record bytes plus the index's share (an estimate per entry, or the
index file's real size past its empty size, whichever is larger). Eviction drops whole
segments, most recently written first (MRU) or least (LRU): its file goes at once, so
eviction never leaves dead bytes behind. A segment that another live process still
writes to is left alone; this process's own is evicted only when nothing else is left.
A segment holding a *pinned* entry (a local copy's entry its shared store has not taken
yet: its only copy) is never evicted; a write that cannot fit otherwise is not stored.
Deletions and replaced entries do leave dead bytes: compaction gives them back once
the files pass the budget by 5 %.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Container

import lmdb

from ...faults import Report
from ..files import open_regular
from . import upkeep
from .format import record_size, scan_keys
from .index import Change, Index, IndexReplacedError
from .segments import SegmentFiles

__all__ = [
    "INDEX_BASE_BYTES",
    "INDEX_ENTRY_BYTES",
    "NoRoom",
    "Pinned",
    "evict",
    "fitting",
    "keep_within_bounds",
    "release",
]

#: Index bytes charged to the budget per entry (measured: 55 to 70 with 32-digit keys).
INDEX_ENTRY_BYTES = 96
#: Index file bytes not charged to the budget: an empty index and its lock file take 68 KiB.
INDEX_BASE_BYTES = 1 << 17
Victims = list[tuple[int, int | None]]  # segment, descriptor holding its exclusive lock (None: our own)
Pinned = Callable[[], Container[bytes]]  # the keys (in the index's form) whose entries are not to be evicted


_holding: weakref.WeakKeyDictionary[SegmentFiles, dict[int, bytes]] = weakref.WeakKeyDictionary()


class NoRoom(Exception):
    """The budget holds only if entries ``pinned`` names are evicted: nothing is."""


def index_charge(index_bytes: int, count: int) -> int:
    """What the index costs the budget with ``count`` entries and a file of ``index_bytes``."""
    return max(count * INDEX_ENTRY_BYTES, index_bytes - INDEX_BASE_BYTES)


def write_charge(index_bytes: int, count: int, max_bytes: int) -> int:
    """The index's charge as a write sees it: a bloated index counts as its entries.

    Its free pages are no reason to evict or to refuse entries: :func:`keep_within_bounds`
    compacts it after the write.
    """
    return index_charge(0 if index_bloated(index_bytes, count, max_bytes) else index_bytes, count)


def fitting(
    index: Index, change: Change, kbs: list[bytes], datas: list[bytes | memoryview], max_bytes: int
) -> tuple[list[bytes], list[bytes | memoryview]]:
    """The first of the entries that fit the budget beside what ``change`` holds (a store that does not evict)."""
    room = max_bytes - change.records - write_charge(index.file_bytes(), change.count, max_bytes)
    for n, (kb, data) in enumerate(zip(kbs, datas)):
        room -= record_size(kb, len(data)) + INDEX_ENTRY_BYTES
        if room < 0:
            return kbs[:n], datas[:n]
    return kbs, datas


def index_bloated(index_bytes: int, count: int, max_bytes: int) -> bool:
    """Whether the index file holds so many free pages that it is worth compacting.

    So it is when its file, beyond its base, takes half the budget and more than four
    times what its entries are charged plus 256 KiB (a quarter of the budget, for budgets
    under 1 MiB, where free pages alone would hold the budget): LMDB keeps free pages of
    its own (more when many processes read and write at once, since a page freed while a
    reader could still see it waits), and compacting copies the whole index.
    """
    excess = index_bytes - INDEX_BASE_BYTES
    return excess > max(4 * count * INDEX_ENTRY_BYTES + min(1 << 18, max_bytes // 4), max_bytes // 2)


def evict(
    index: Index, change: Change, files: SegmentFiles, max_bytes: int, recent: bool, pinned: Pinned | None = None
) -> tuple[Victims, set[bytes]]:
    """Evict whole segments in ``change`` until the budget holds, none holding an entry ``pinned`` names.

    Returns:
        The evicted segments (each with the descriptor that locks it, to close once its
        file is removed after the commit) and the keys evicted.

    Raises:
        NoRoom: If the budget would still not hold, with segments holding pinned entries
            kept (the segments are left as they were; the caller aborts ``change``).
        OSError: If a segment cannot be read.
    """
    index_bytes = index.file_bytes()
    victims: Victims = []
    evicted: set[bytes] = set()
    kept = False
    if change.records + write_charge(index_bytes, change.count, max_bytes) <= max_bytes:
        return victims, evicted
    pins = pinned() if pinned is not None else None
    mine = files.own()
    table = change.table()
    memo = _holding.setdefault(files, {})  # segments found holding a pinned entry, and that entry's key

    def pinned_in(seg: int, kb: bytes) -> bool:
        return pins is not None and kb in pins and (entry := change.lookup(kb)) is not None and entry.seg == seg

    for seg in [seg for seg in memo if seg not in table]:
        del memo[seg]
    by_time = sorted(table, key=lambda seg: (table[seg].stamp, seg), reverse=recent)
    order = [seg for seg in by_time if table[seg].sealed] + [seg for seg in by_time if seg in mine]
    for seg in dict.fromkeys(order):
        if change.records + write_charge(index_bytes, change.count, max_bytes) <= max_bytes:
            break
        if pins is not None and seg in memo:  # no scan again while the entry it was kept for is pinned there
            if pinned_in(seg, memo[seg]):
                kept = True
                continue
            del memo[seg]
        lock: int | None = None
        if seg in mine:
            opened = open_regular(files.path(seg), follow_symlinks=False)
            if opened is None:
                continue
            fd = opened[0]
        else:
            lock = files.lock(seg)
            if lock is None:
                continue  # a live writer's, or being compacted
            fd = lock
        try:
            kbs = scan_keys(fd, table[seg].end)
            if pins is not None:
                hold = next((kb for kb in kbs if pinned_in(seg, kb)), None)
                if hold is not None:  # the only copy of an entry: this segment stays
                    kept, memo[seg] = True, hold
                    if lock is not None:
                        os.close(lock)
                    continue
            evicted.update(change.remove_segment_entries(seg, kbs))
        except BaseException:
            if lock is not None:  # not a victim yet: its lock is this loop's to let go
                os.close(lock)
            raise
        finally:
            if lock is None:
                os.close(fd)
        change.drop_segment(seg)
        victims.append((seg, lock))
    if kept and change.records + write_charge(index_bytes, change.count, max_bytes) > max_bytes:
        release(files, victims, remove=False)
        raise NoRoom
    return victims, evicted


def release(files: SegmentFiles, victims: Victims, remove: bool) -> None:
    """Remove the files of evicted segments (after the commit, if ``remove``) and close their locks."""
    for seg, lock in victims:
        try:
            if remove:
                with contextlib.suppress(OSError):  # before this process's writer lets go of its lock: a file
                    files.remove(seg)  # no one locks and no row names is an orphan to a verify looking now
                if files.writer is not None and files.writer.seg == seg:
                    files.seal_writer()
        finally:
            if lock is not None:
                os.close(lock)


def _evict_to_fit(index: Index, files: SegmentFiles, max_bytes: int, recent: bool, pinned: Pinned | None) -> None:
    change = index.change()
    victims: Victims = []
    try:
        victims, _ = evict(index, change, files, max_bytes, recent, pinned)
        change.commit()
    except NoRoom:
        change.abort()
        return
    except BaseException:
        with contextlib.suppress(lmdb.Error):
            change.abort()
        release(files, victims, remove=False)
        raise
    release(files, victims, remove=True)


def keep_within_bounds(
    index: Index, files: SegmentFiles, max_bytes: int, recent: bool, report: Report, pinned: Pinned | None = None
) -> None:
    """Compact a bloated index; evict if the index grew past its share; compact once the files pass the budget by 5 %.

    Compaction goes back to 2 % over the budget where it can (segments that live
    writers still hold are left alone). An index holding more free pages than
    :func:`index_bloated` allows is rewritten first (:func:`upkeep.compact_index`), so
    that a store never ends up full of index and empty of data.

    Raises:
        lmdb.Error: If the index cannot be written.
        OSError: If a file cannot be read, written or removed.
    """
    try:
        _keep_within_bounds(index, files, max_bytes, recent, report, pinned)
    except IndexReplacedError:
        return  # another process compacted the index: the next call opens the new one


def _keep_within_bounds(
    index: Index, files: SegmentFiles, max_bytes: int, recent: bool, report: Report, pinned: Pinned | None
) -> None:
    limit = max_bytes + INDEX_BASE_BYTES
    for _ in range(3):
        with index.begin() as txn:
            totals, count = index.totals(txn), index.count(txn)
        index_bytes = index.file_bytes()
        if index_bloated(index_bytes, count, max_bytes):
            upkeep.compact_index(index, files.root, report)
            return  # the next call opens the new index
        if totals[b"records"] + index_charge(index_bytes, count) > max_bytes:
            _evict_to_fit(index, files, max_bytes, recent, pinned)  # a large transaction grew the index
        elif totals[b"files"] + index_bytes <= limit * 1.05 or not upkeep.compact(
            index, files, int(limit * 1.02), report
        ):
            return
