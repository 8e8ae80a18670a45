"""Verification of a packed store: every record's checksum, the totals, the segment rows, the files.

With ``fix``, entries that fail are removed, rows of segments whose file is gone are
dropped, the totals and segment rows are recomputed from the entries, and orphaned
segment files (no index row, no live writer) are removed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable

import lmdb

from ..batched import VerifyReport
from .format import check_record, decode_key, record_size
from .index import Entry, Index, IndexReplacedError, Segment, unpack_entry
from .segments import SegmentFiles
from .upkeep import known_segments, remove_unindexed

__all__ = ["verify", "verify_settled"]


def verify_settled(
    index: Index, reopen: Callable[[], Index | None], files: SegmentFiles, fix: bool, tries: int = 3
) -> VerifyReport:
    """:func:`verify`, again on the index ``reopen`` gives where another process replaced (compacted) it meanwhile.

    What was read of a replaced index may be stale: entries evicted since, which would
    read as damaged, and segments made since, which would look unindexed.

    Raises:
        IndexReplacedError: If the index was replaced at each of ``tries`` attempts to repair it.
        lmdb.Error: If the index cannot be read or (with ``fix``) written.
        OSError: If a segment file cannot be read.
    """
    for last in [False] * (tries - 1) + [True]:
        try:
            report = verify(index, files, fix)
        except IndexReplacedError:  # found by the repair, before it changed anything
            if last:
                raise
        else:
            if report.ok or last or not index.replaced():
                return report
        again = reopen()
        if again is None:
            return VerifyReport(problems=["the index cannot be opened"])
        index = again
    raise ValueError(f"tries must be positive, got {tries}")


def verify(index: Index, files: SegmentFiles, fix: bool, chunk: int = 1 << 16) -> VerifyReport:
    """Check every entry's record, the totals, the segment rows and the files.

    Entries are checked ``chunk`` at a time, each chunk's reads in file order, while other
    processes may write: an entry written, moved or removed since it was read is not
    damage, and the totals are compared with the entries in one snapshot of the index.

    Raises:
        lmdb.Error: If the index cannot be read or (with ``fix``) written.
        OSError: If a segment file cannot be read.
    """
    result = VerifyReport()
    bad, result.entries = _bad_records(index, files, chunk)
    result.bad = [decode_key(kb) for kb, _ in bad]
    if not bad:
        result.problems.extend(_count_problems(index))
    result.problems.extend(_file_problems(index, files))
    result.problems.extend(
        f"{files.path(seg)} is a link or special file at a segment's name" for seg in _planted(index, files)
    )
    if fix and not result.ok:
        _repair(index, files, bad)
        remove_unindexed(index, files, wait=True)
        for seg in _planted(index, files):  # those whose rows the repair dropped too
            with contextlib.suppress(FileNotFoundError):
                os.unlink(files.path(seg))  # the link itself, never what it names
        result.fixed = True
    return result


def _planted(index: Index, files: SegmentFiles) -> list[int]:
    """The segment names the index does not know held by a link or a special file (never opened; not directories)."""
    with index.begin() as txn:
        table = index.segment_table(txn)
    planted = []
    for seg, entry in sorted(files.listed().items()):
        with contextlib.suppress(OSError):
            if (
                seg not in table
                and not entry.is_file(follow_symlinks=False)
                and not entry.is_dir(follow_symlinks=False)
            ):
                planted.append(seg)
    return planted


def _file_problems(index: Index, files: SegmentFiles) -> list[str]:
    """Segment rows without their file, and files without their row, each seen twice.

    Other processes evict, compact and seal segments meanwhile: a row is dropped before
    its file is removed, and a file is made (locked by its writer) before its row is
    written. So a missing file is a problem only if its row is still there at a second
    look, and a file without a row only if a second look after a second read of the rows
    finds it still so (one that was indexed, or evicted and removed, in between is not).
    """
    with index.begin() as txn:
        table = index.segment_table(txn)
    missing = [seg for seg in table if not os.path.isfile(files.path(seg))]
    if missing:  # evicted meanwhile: its row went before its file, so a row still there after the look is not
        known = known_segments(index)
        missing = [seg for seg in missing if seg in known]
    orphans = set(files.orphans(set(table)))
    if orphans:
        orphans &= set(files.orphans(known_segments(index)))
    return [f"segment {seg}: {files.path(seg)} is missing or not a regular file" for seg in missing] + [
        f"{files.path(seg)} is not in the index" for seg in sorted(orphans)
    ]


def _bad_records(index: Index, files: SegmentFiles, chunk: int) -> tuple[list[tuple[bytes, Entry | None]], int]:
    """The entries whose record fails its checks, and how many entries were read."""
    with index.begin() as txn:
        table = index.segment_table(txn)
    suspects: list[tuple[bytes, Entry | None]] = []
    seen = 0
    after = b""
    while True:
        with index.begin() as txn:
            rows = list(itertools.islice(index.iter_entries(txn, after), chunk))
        if not rows:
            break
        after = rows[-1][0] + b"\0"
        seen += len(rows)
        for kb, entry in sorted(rows, key=lambda row: (row[1].seg, row[1].offset) if row[1] else (-1, 0)):
            if not _intact(files, table, kb, entry):
                suspects.append((kb, entry))
    if not suspects:
        return [], seen
    # Read again, then look: eviction drops a segment's row before it removes the file, and
    # compaction moves an entry before it removes the old file, so a record that cannot be
    # read is damage only if its entry and segment row are still there after the read.
    unread = [(kb, entry) for kb, entry in suspects if not _readable(files, kb, entry)]
    with index.begin() as txn:  # written again, moved by compaction or removed since: not damage
        table = index.segment_table(txn)
        now = [unpack_entry(txn.get(kb, db=index.entries)) for kb, _ in unread]
    return [(kb, entry) for (kb, entry), current in zip(unread, now) if current == entry], seen


def _intact(files: SegmentFiles, table: dict[int, Segment], kb: bytes, entry: Entry | None) -> bool:
    return entry is not None and entry.seg in table and _readable(files, kb, entry)


def _readable(files: SegmentFiles, kb: bytes, entry: Entry | None) -> bool:
    """Whether the record of ``entry`` reads back whole (``None``, an entry that cannot be decoded, does not)."""
    if entry is None:
        return False
    data = files.read(entry.seg, entry.offset, record_size(kb, entry.length))
    return not isinstance(data, str) and check_record(data, kb, entry.length) is not None


def _count_problems(index: Index) -> list[str]:
    """Where the totals and segment rows disagree with the entries, in one snapshot of the index."""
    problems = []
    with index.begin() as txn:
        table = index.segment_table(txn)
        totals = index.stored_totals(txn)
        live: dict[int, list[int]] = {seg: [0, 0] for seg in table}
        payload = 0
        for kb, entry in index.iter_entries(txn):
            if entry is not None and entry.seg in live:
                live[entry.seg][0] += record_size(kb, entry.length)
                live[entry.seg][1] += 1
                payload += entry.length
    if payload != totals[b"payload"]:
        problems.append(f"the index counts {totals[b'payload']:,} payload bytes, the entries hold {payload:,}")
    records = sum(size for size, _ in live.values())
    if records != totals[b"records"]:
        problems.append(f"the index counts {totals[b'records']:,} record bytes, the entries take {records:,}")
    files_bytes = sum(-(-row.end // 4096) * 4096 for row in table.values())
    if totals[b"files"] != files_bytes:
        problems.append(f"the index counts {totals[b'files']:,} file bytes, its segments take {files_bytes:,}")
    for seg, (size, count) in live.items():
        if (size, count) != (table[seg].live, table[seg].records):
            row = table[seg]
            problems.append(
                f"segment {seg}: the index counts {row.records} live records of {row.live:,} bytes, "
                f"found {count} of {size:,}"
            )
    return problems


def _repair(index: Index, files: SegmentFiles, bad: list[tuple[bytes, Entry | None]]) -> None:
    """Remove bad entries and those of missing segments; recompute the totals and rows from the entries."""
    change = index.change()
    txn = change.txn
    try:
        for kb, entry in bad:  # under the write lock: an entry written again since it was checked stays
            if unpack_entry(txn.get(kb, db=index.entries)) == entry:
                txn.delete(kb, db=index.entries)
        table = index.segment_table(txn)
        gone = {seg for seg in table if not os.path.isfile(files.path(seg))}
        rows = [(kb, e) for kb, e in index.iter_entries(txn)]
        change.payload = change.records = change.count = 0
        counts = {seg: [0, 0] for seg in table if seg not in gone}
        for kb, entry in rows:
            if entry is None or entry.seg not in counts:
                txn.delete(kb, db=index.entries)
                continue
            size = record_size(kb, entry.length)
            change.payload += entry.length
            change.records += size
            change.count += 1
            counts[entry.seg][0] += size
            counts[entry.seg][1] += 1
        for seg in gone:
            change.drop_segment(seg)
        for seg, (size, count) in counts.items():
            row = change.segment(seg)
            row[2], row[3] = size, count
        change.files = sum(-(-row.end // 4096) * 4096 for row in change.table().values())
        change.commit()
    except BaseException:
        with contextlib.suppress(lmdb.Error):
            change.abort()
        raise
