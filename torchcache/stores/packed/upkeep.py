"""Upkeep of a packed store: opening and rebuilding the index, sealing, compaction, verification.

Compaction copies the live records of a sealed segment to the compacting process's own
segment, repoints their index rows (only those that still point at the old copy) and
removes the old file. It runs under an exclusive ``flock`` on ``compact.lock`` (one
compactor at a time) and on the segment itself, which a live writer's shared lock
forbids; it takes the emptiest segments first, so dead space is given back at the
least copying. A reader that looked an entry up before the move and opens the file
after its removal looks the key up again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
import threading
import time

import lmdb

from ..._log import logger
from ...faults import Fault, Report
from .format import encode_record, scan_records
from .index import (
    DAMAGE,
    INDEX_NAME,
    MIN_MAP_SIZE,
    Change,
    Entry,
    Index,
    IndexDamageError,
    open_index,
)
from .locks import INDEX_LOCK_NAME, LOCK_NAMES, exclusive
from .mappable import cut_short, unsound_pages
from .segments import TMP_PREFIX, SegmentFiles

__all__ = [
    "compact",
    "compact_index",
    "discard_index",
    "disk_bytes",
    "index_damage",
    "known_segments",
    "open_or_recover",
    "remove_unindexed",
    "seal_orphans",
]

_MOVE_BYTES = 8 << 20
_NO_ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)
Report = Report
#: Times a write that finds the index's map full grows it and tries again.
_GROW_TRIES = 8


def compact_index(index: Index, root: str, report: Report) -> None:
    """Replace an index that holds far more free pages than entries with a compact copy of it.

    LMDB reuses a freed page only once no reader can still see it, so with many writers
    and readers at once its file can grow past what its entries need, and it never
    shrinks: charged to the budget, it would leave no room for entries. Holding the
    index's write lock (nothing can be committed meanwhile), a compact copy of it is
    written beside it and renamed over it, and the old lock file is removed with it;
    a writer that was waiting for the write lock finds the file replaced and opens the
    new one (:meth:`~torchcache.stores.packed.index.Index.change`). Every entry is kept.

    Raises:
        lmdb.Error: If the copy cannot be made.
        OSError: If it cannot be written or renamed.
    """
    with exclusive(root, wait=False) as got, exclusive(root, True, INDEX_LOCK_NAME) as alone:
        if not got or not alone:
            return  # another process compacts the store: the next write tries again
        before = index.file_bytes()
        change = index.change()  # holding LMDB's write lock: no writer is inside a transaction of this index
        tmp = os.path.join(root, f"{TMP_PREFIX}index-{os.getpid()}-{time.monotonic_ns()}.tmp")
        try:
            failed: list[BaseException] = []
            copier = threading.Thread(target=_copy_compact, args=(index, tmp, failed))
            copier.start()  # a read transaction of another thread: this one holds the write transaction
            copier.join()
            if failed:
                raise failed[0]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(index.path + "-lock")  # the next process to open the new file makes a new one
            os.replace(tmp, index.path)
            logger.info("the index of %s outgrew its entries (%s bytes); compacted it", root, f"{before:,}")  # upkeep
        finally:
            change.abort()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _copy_compact(index: Index, path: str, failed: list[BaseException]) -> None:
    try:
        with index.begin() as txn:
            index.env.copy(path, compact=True, txn=txn)
    except BaseException as exc:  # noqa: BLE001 (handed to the thread that waits for it)
        failed.append(exc)


def _no_access(exc: BaseException) -> bool:
    if isinstance(exc, lmdb.ReadonlyError):
        return True
    code = exc.errno if isinstance(exc, OSError) else getattr(exc, "code", None)
    return code in _NO_ACCESS


def discard_index(root: str, identity: tuple[int, int] | None) -> None:
    """Remove a damaged index (only if it is still the file ``identity`` names, when given).

    Raises:
        OSError: If it cannot be removed.
    """
    path = os.path.join(root, INDEX_NAME)
    with exclusive(root, wait=True), exclusive(root, True, INDEX_LOCK_NAME):
        if identity is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) != identity:
                    return  # already replaced
        _remove_index_files(root)


def _remove_index_files(root: str) -> None:
    """Remove the index and its lock file (call holding ``compact.lock``)."""
    path = os.path.join(root, INDEX_NAME)
    for name in (path, path + "-lock"):
        with contextlib.suppress(FileNotFoundError):
            if not os.path.isdir(name) or os.path.islink(name):
                os.unlink(name)
            else:  # a directory someone put there: out of the way, not into it
                os.rename(name, f"{name}.damaged-{os.getpid()}-{time.monotonic_ns()}")


def open_or_recover(root: str, report: Report, map_size: int = MIN_MAP_SIZE) -> Index:
    """Open a store's index: read-only where it cannot be written, replaced if damaged.

    Only a failed check of the file's content is damage (a file cut short, one that is
    not a regular file, or an LMDB error of :data:`~torchcache.stores.packed.index.DAMAGE`):
    the index is then replaced, and the new one is filled from the segment files, so
    nothing intact is lost with it. Any other error opening it (no memory or address
    space, a full disk, a lock held) is raised and the file is left as it is.

    Raises:
        lmdb.Error: If LMDB refuses it for another reason than damage.
        OSError: If it cannot be opened or replaced.
    """
    problem = cut_short(os.path.join(root, INDEX_NAME))
    if problem is not None:  # mapping it could kill the process (SIGBUS): replace it
        report(Fault.INDEX, f"the index of {root} is {problem}; rebuilding it from the segment files")
        discard_index(root, None)
    try:
        index = open_index(root, readonly=False, map_size=map_size)
        problem = None
        if index.users == 1:  # first opened in this process (a shared one was walked then)
            with index.begin() as txn:  # pages LMDB would follow outside the file: reading them kills the process
                problem = unsound_pages(index.path, txn.id())
        if problem is not None:
            index.close()
            raise IndexDamageError(errno.EINVAL, problem)
    except (*DAMAGE, IndexDamageError) as exc:
        report(Fault.INDEX, f"the index of {root} is damaged ({exc}); rebuilding it from the segment files")
        discard_index(root, None)
        index = open_index(root, readonly=False, map_size=map_size)
    except (lmdb.Error, OSError) as exc:
        if _no_access(exc):
            return open_index(root, readonly=True, map_size=map_size)
        raise
    try:
        count = 0
        for attempt in range(_GROW_TRIES):
            change = index.change()
            if not change.fresh:
                change.abort()
                return index
            files = SegmentFiles(root, 1)
            try:
                count = _rebuild(change, files)
                change.commit()
                break
            except lmdb.MapFullError:
                with contextlib.suppress(lmdb.Error):
                    change.abort()
                if attempt + 1 == _GROW_TRIES:
                    raise
                index.grow()
            finally:
                files.close()
        if count:
            report(Fault.INDEX, f"indexed {count} entries found in the segment files of {root}")
    except lmdb.ReadonlyError:
        pass
    except BaseException:
        index.close()
        raise
    return index


def _rebuild(change: Change, files: SegmentFiles) -> int:
    """Index every intact record of every segment file not being evicted (a later copy of a key wins).

    A segment that another process is evicting or compacting (it holds an exclusive lock
    on the file until the file is gone) is left out: its entries are misses, never
    records of a file about to vanish. A shared lock is held while a file is read.
    """
    count = 0
    for seg in sorted(files.listed()):
        change.next_seg = max(change.next_seg, seg + 1)
        fd = files.lock(seg, fcntl.LOCK_SH)
        if fd is None:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            continue
        try:
            for offset, kb, payload in scan_records(fd, 0, st.st_size):
                change.add_many([kb], [(seg, offset)], [len(payload)])
                count += 1
        except OSError:
            pass  # what was read before the error is indexed
        finally:
            os.close(fd)
        change.seal(seg)
        change.set_end(seg, min(st.st_size, st.st_blocks * 512))
    return count


def seal_orphans(index: Index, files: SegmentFiles) -> None:
    """Seal the segments whose writer died, counting any torn tail as dead bytes, and sweep orphans.

    Only segments not yet sealed and files the index does not know are looked at: the
    time is proportional to the number of writers that died, not to the store. Each row
    is looked at again in the write transaction: one that another process sealed,
    evicted or compacted since is left as it is, never written back.

    Raises:
        lmdb.Error: If the index cannot be written.
        OSError: If the directory cannot be listed.
    """
    with index.begin() as txn:
        table = index.segment_table(txn)
    mine = files.own()
    found: dict[int, int | None] = {}
    for seg, row in table.items():
        if row.sealed or seg in mine:
            continue
        fd = files.lock(seg)
        if fd is None:
            if not os.path.lexists(files.path(seg)):
                found[seg] = None
            continue
        st = os.fstat(fd)
        os.close(fd)
        found[seg] = min(st.st_size, st.st_blocks * 512)
    if found:
        change = index.change()
        now = change.table()
        for seg, size in found.items():
            if seg not in now or now[seg].sealed:
                continue  # sealed, evicted or compacted by another process since the look above
            if size is None:
                change.drop_segment(seg)
            else:
                change.seal(seg)
                change.set_end(seg, max(change.segment(seg)[1], size))
        change.commit()
    remove_unindexed(index, files, wait=False)


def known_segments(index: Index) -> set[int]:
    """The segments the index knows now (a fresh read).

    Raises:
        lmdb.Error: If the index cannot be read.
    """
    with index.begin() as txn:
        return set(index.segment_table(txn))


def compact(index: Index, files: SegmentFiles, target: int, report: Report) -> int:
    """Compact sealed segments, emptiest first, until the files take at most ``target`` bytes.

    Returns:
        Segments compacted (0 if another process is compacting).

    Raises:
        lmdb.Error: If the index cannot be written.
        OSError: If a file cannot be read, written or removed.
    """
    done = 0
    with exclusive(files.root, wait=False) as locked:
        if not locked:
            return 0
        for _ in range(1 << 16):
            with index.begin() as txn:
                table = index.segment_table(txn)
                used = index.totals(txn)[b"files"]
            if used + index.file_bytes() <= target:
                break
            mine = files.writer.seg if files.writer is not None else None
            # Emptiest first; a segment with little dead space is not worth copying.
            order = sorted(
                (seg for seg in table if seg != mine and table[seg].end - table[seg].live >= _min_gain(table[seg].end)),
                key=lambda s: table[s].live / max(1, table[s].end),
            )
            for seg in order:
                fd = files.lock(seg)
                if fd is None:
                    if not os.path.lexists(files.path(seg)):
                        _move(index, files, seg, [], last=True)
                        break
                    continue
                try:
                    _compact_segment(index, files, seg, fd, table[seg].end)
                finally:
                    os.close(fd)
                done += 1
                break
            else:
                if mine is None or table[mine].end - table[mine].live < _min_gain(table[mine].end):
                    break
                change = index.change()  # only this process's own segment is left: seal it
                change.seal(mine)
                change.commit()
                files.seal_writer()
    return done


def _min_gain(end: int) -> int:
    return max(4096, end // 64)


def _compact_segment(index: Index, files: SegmentFiles, seg: int, fd: int, end: int) -> None:
    batch: list[tuple[int, bytes, bytes]] = []
    size = 0
    for offset, kb, payload in scan_records(fd, 0, min(end, os.fstat(fd).st_size)):
        batch.append((offset, kb, bytes(payload)))
        size += len(payload)
        if size >= _MOVE_BYTES:
            _move(index, files, seg, batch, last=False)
            batch, size = [], 0
    _move(index, files, seg, batch, last=True)


def _move(index: Index, files: SegmentFiles, seg: int, batch: list[tuple[int, bytes, bytes]], last: bool) -> None:
    """Copy the records of ``batch`` still indexed at ``seg`` to this process's segment."""
    change = index.change()
    try:
        live: list[tuple[bytes, Entry, bytes]] = []
        for offset, kb, payload in batch:
            entry = change.lookup(kb)
            if entry is not None and entry.seg == seg and entry.offset == offset:
                live.append((kb, entry, payload))
        if live:
            places = files.append(change, [(encode_record(kb, payload), payload) for kb, _, payload in live])
            for (kb, entry, _), (new_seg, new_offset) in zip(live, places):
                change.move(kb, entry, new_seg, new_offset)
        if last:
            if change.segment(seg)[3] > 0:  # rows the scan did not reach (a damaged record)
                stale = [(kb, e) for kb, e in index.iter_entries(change.txn) if e is not None and e.seg == seg]
                for kb, entry in stale:
                    change.remove(kb, entry)
            change.drop_segment(seg)
        change.commit()
    except BaseException:
        with contextlib.suppress(lmdb.Error):
            change.abort()
        files.aborted()
        raise
    files.committed()
    if last:
        files.remove(seg)


def remove_unindexed(index: Index, files: SegmentFiles, wait: bool) -> int:
    """Remove the segment files the index does not know and no live writer holds; return how many.

    Only while ``index`` is still the store's index, checked holding ``compact.lock``,
    under which an index is replaced: a process whose index another one replaced must
    not take the new index's segments for orphans. Without ``wait``, nothing is
    removed while another process holds the lock (the next open sweeps).

    Raises:
        lmdb.Error: If the index cannot be read.
        OSError: If the directory cannot be listed.
    """
    with exclusive(files.root, wait) as locked:
        if not locked or index.replaced():
            return 0
        return files.sweep(functools.partial(known_segments, index))


def disk_bytes(root: str) -> int:
    """Bytes the store's own files in ``root`` take on disk (allocated blocks)."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(INDEX_NAME) or name in LOCK_NAMES or (name.startswith("seg-") and name.endswith(".tcs")):
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def index_damage(root: str) -> str | None:
    """Why LMDB refuses the index of a store directory as it is, if it does (opening the store rebuilds it).

    It is read without its lock file and without writing anything. An index cut short is
    left to :func:`~torchcache.stores.packed.mappable.cut_short`, and errors that are not
    damage (no memory, no access) are not reported.
    """
    path = os.path.join(root, INDEX_NAME)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or cut_short(path) is not None:
            return None
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=3)
    except OSError:
        return None
    except DAMAGE as exc:
        return f"the index is damaged ({exc})"
    except lmdb.Error:
        return None
    try:
        with env.begin() as txn:
            for table in (b"entries", b"segments", b"meta"):
                txn.stat(env.open_db(table, txn=txn, create=False))
    except (*DAMAGE, lmdb.NotFoundError) as exc:
        return f"the index is damaged ({exc})"
    except lmdb.Error:
        return None
    finally:
        env.close()
    return None
