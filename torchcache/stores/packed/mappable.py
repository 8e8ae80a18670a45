"""Whether an index file is safe to map and to read, checked before LMDB maps it in this process."""

from __future__ import annotations

import os
import stat
import struct

import lmdb

from .index import reserve_lock_file

__all__ = ["cut_short", "unsound_pages", "unsound_snapshot"]

_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_META = struct.Struct("<II8xQ48x48xQQ")  # magic, version, mapsize, the free and main trees, last page, txnid
_DB_ROOT_AT = 40  # an MDB_db's root page, after md_pad, md_flags, md_depth and four counts
_MAGIC = 0xBEEFC0DE


def cut_short(path: str) -> str | None:
    """Why the index file at ``path`` cannot be mapped safely, or ``None``.

    LMDB maps the index into memory, and a process that touches a page beyond the end of
    a file cut short dies of ``SIGBUS``. So, before it is opened, the file's length is
    checked against what its header (read with ``pread``, not mapped) says it holds. A
    file LMDB cannot read at all is not reported here: opening it fails and it is rebuilt.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None  # not a file LMDB can map (opening it fails, and it is replaced)
    except OSError:
        return None
    try:  # read-only and without the lock file: nothing is written, no other use is disturbed
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=3)
    except lmdb.Error:
        return None  # unreadable (opening it fails as damaged), or open in this process already
    try:
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except lmdb.Error:
        return None
    finally:
        env.close()
    try:  # measured after the header: a writer grows the file before it commits a header
        size = os.stat(path).st_size
    except OSError:
        return None
    return f"cut short: {size:,} bytes, its header describes {needed:,}" if size < needed else None


def unsound_pages(path: str, txnid: int | None = None) -> str | None:
    """Why LMDB could read outside the index file at ``path`` while following its trees, or ``None``.

    LMDB keeps no checksums: an index whose pages were damaged in place (bit rot, a
    planted file, a power cut while another program wrote it) can send a reader past the
    end of its mapping, and the process dies of ``SIGBUS``. This walks every tree of the
    newest meta page with ``pread`` (nothing mapped) and checks that every page, node,
    key and value it reaches lies inside the file. A store runs it when it opens its
    index, inside a read transaction whose id is ``txnid`` (its pages cannot be reused
    meanwhile); ``torchcache verify`` and ``ls`` run it before they open the index,
    outside one: a writer may then reuse pages as they are walked, so a problem counts
    only if it is found again in each of three walks.
    """
    for _ in range(1 if txnid is not None else 3):
        problem = _unsound_once(path, txnid)
        if problem is None:
            return None
    return problem


def unsound_snapshot(path: str) -> str | None:
    """:func:`unsound_pages` of the index at ``path``, walked as a reader its lock file counts.

    A writer cannot reuse the pages of that reader's snapshot while they are walked. Where
    the lock file cannot be used (none yet, not a regular file, a read-only directory, the
    index open in this process), the walk is outside a transaction. Nothing is created.
    """
    lock = path + "-lock"
    try:
        if not stat.S_ISREG(os.lstat(lock).st_mode):
            return unsound_pages(path)
        reserve_lock_file(lock)  # its pages allocated first, as a store does: a hole LMDB writes is a SIGBUS
        env = lmdb.open(path, subdir=False, readonly=True, lock=True, max_dbs=3)  # writes only its reader slot
    except (OSError, lmdb.Error):
        return unsound_pages(path)
    try:
        with env.begin() as txn:
            return unsound_pages(path, txn.id())
    finally:
        env.close()


def _unsound_once(path: str, txnid: int | None) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        first = os.pread(fd, 16 + _META.size, 0)
        if len(first) < 16 + _META.size:
            return None
        psize = struct.unpack_from("<I", first, 16 + 24)[0]  # the page size, in the free tree's md_pad
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            return None  # not a page size: opening it fails, and it is rebuilt
        metas = [first, os.pread(fd, 16 + _META.size, psize)]
        found = [_META.unpack_from(m, 16) for m in metas if len(m) == 16 + _META.size]
        found = [m for m in found if m[0] == _MAGIC]
        if not found:
            return None  # not an LMDB file: opening it fails, and it is rebuilt
        if txnid is not None:
            found = [m for m in found if m[4] == txnid]
            if not found:
                return None  # written over since the transaction began: nothing to check against
        meta = max(found, key=lambda m: m[4])
        raw = next(m for m in metas if len(m) == 16 + _META.size and _META.unpack_from(m, 16) == meta)
        size = os.fstat(fd).st_size  # after the header: a writer grows the file before it commits one
        npages = min(size // psize, meta[3] + 1)
        main_root = struct.unpack_from("<Q", raw, 16 + 24 + 48 + _DB_ROOT_AT)[0]
        return _walk(fd, psize, npages, [main_root])
    except OSError as exc:
        return f"cannot be read ({exc})"
    finally:
        os.close(fd)


def _walk(fd: int, psize: int, npages: int, roots: list[int]) -> str | None:
    todo, seen = list(roots), {(1 << 64) - 1}  # P_INVALID: the root of an empty tree
    while todo:
        pgno = todo.pop()
        if pgno in seen:
            continue
        seen.add(pgno)
        if not 2 <= pgno < npages:
            return f"a tree points to page {pgno}, outside its {npages} pages"
        page = os.pread(fd, psize, pgno * psize)
        _, _, flags, lower, upper = _HEADER.unpack_from(page)
        if not flags & (_P_BRANCH | _P_LEAF) or flags & _P_LEAF2 or not 16 <= lower <= upper <= psize:
            return f"page {pgno} is not a tree page"
        for i in range((lower - 16) // 2):
            at = struct.unpack_from("<H", page, 16 + 2 * i)[0]
            if not upper <= at <= psize - _NODE.size:
                return f"page {pgno} has a node outside it"
            lo, hi, nflags, ksize = _NODE.unpack_from(page, at)
            data = at + _NODE.size + ksize
            if flags & _P_BRANCH:
                todo.append(lo | hi << 16 | nflags << 32)
                if data > psize:
                    return f"page {pgno} has a key outside it"
                continue
            dsize = lo | hi << 16
            if nflags & _F_BIGDATA:
                if data + 8 > psize:
                    return f"page {pgno} has a value outside it"
                first = struct.unpack_from("<Q", page, data)[0]
                if not 2 <= first < npages or first + (-(-(dsize + 16) // psize)) > npages:
                    return f"page {pgno} has a value in pages outside the file"
            elif data + dsize > psize:
                return f"page {pgno} has a value outside it"
            elif nflags & _F_SUBDATA and dsize >= _DB_ROOT_AT + 8:
                todo.append(struct.unpack_from("<Q", page, data + _DB_ROOT_AT)[0])
    return None
