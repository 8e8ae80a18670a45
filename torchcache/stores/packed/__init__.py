"""The packed store: entries appended to segment files, found through an LMDB index.

:mod:`.format` is the on-disk format (segment records, index values), :mod:`.index` the
LMDB index, :mod:`.segments` the segment files, :mod:`.read` the batched read path,
:mod:`.evict` and :mod:`.upkeep` the budget and compaction, :mod:`.opening` recovery at
open, :mod:`.verify` the checks, and :mod:`.store` the :class:`~.store.PackedStore` that
ties them together.
"""

from .store import PackedStore

__all__ = ["PackedStore"]
