"""Checking an object store cache: every entry read and checked against its digest, index objects judged.

``fix`` hides damaged entries behind a tombstone and removes index objects that are not
valid (a damaged manifest with its segment); what could not be read is never judged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..batched import VerifyReport
from .manifests import MANIFEST, SEGMENT, TOMBSTONE, UNJUDGED, tombstone

if TYPE_CHECKING:
    from .store import ObjectStore

__all__ = ["hide", "verify_store"]


def hide(store: ObjectStore, keys: list[str]) -> None:
    """Upload a tombstone of ``keys`` and apply it.

    Raises:
        StoreUnavailableError: If the bucket cannot be written.
    """
    name = store.bucket.new_name() + TOMBSTONE
    body = tombstone(keys)
    store.bucket.put(name, body, "write a tombstone")
    with store._lock:
        store._apply(name, body)


def verify_store(store: ObjectStore, fix: bool) -> VerifyReport:
    """Read and check every entry (see the module docstring for what ``fix`` repairs)."""
    store.refresh()
    keys = store._known.keys()
    gone = sorted(k for s, size in store._known.segments.items() if not size for k, *_ in store._known.members(s))
    store._damaged = []
    try:
        read = store.get_many(keys)
        bad = sorted(set(store._damaged))  # their bytes fail the digest: only those are hidden by a fix
    finally:
        store._damaged = None
    # Unread: not found though still in the index (a segment another process removed meanwhile is not)
    judged = set(bad) | set(gone)
    unread = sum(1 for key, data in zip(keys, read) if data is None and key in store._known and key not in judged)
    problems = [f"{len(bad)} entries fail their checksum"] if bad else []
    if gone:  # a manifest whose segment object was removed: its entries can never be read
        problems.append(f"{len(gone)} entries are in segments removed from the bucket")
    with store._lock:  # one of a newer torchcache is not damage: not removed, and verify cannot vouch for it
        newer = {name: why for name, why in store._known.invalid.items() if why.startswith(UNJUDGED)}
        invalid = {name: why for name, why in store._known.invalid.items() if name not in newer}
    problems += [
        f"{store.bucket.path(name)} is not a valid index object ({why})" for name, why in sorted(invalid.items())
    ]
    unsure = (
        [f"{unread} entries could not be read (the bucket refused or was away); verify again"] if unread > 0 else []
    )
    if store.unreadable:
        unsure.append(f"{len(store.unreadable)} index objects could not be read (the bucket refused); verify again")
    unsure += [f"{store.bucket.path(name)} is {why}: not checked" for name, why in sorted(newer.items())]
    if fix and (bad or gone):  # hidden whatever the index says
        hide(store, bad + gone)
    if fix and invalid:  # a damaged manifest's segment cannot be read without it: both go
        store.bucket.remove(sorted(invalid))
        segments = [n.removesuffix(MANIFEST) + SEGMENT for n in invalid if n.endswith(MANIFEST)]
        store.bucket.remove([n for n in segments if n in store.bucket.sizes])
        with store._lock:
            for name in invalid:
                store._known.invalid.pop(name, None)
    return VerifyReport(len(keys), bad, problems, fixed=bool(fix and (bad or gone or invalid)), unsure=unsure)
