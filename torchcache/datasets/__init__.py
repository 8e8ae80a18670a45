"""The dataset cache: :class:`~.dataset.CachedDataset` and the :class:`~.sample_cache.SampleCache` under it.

Samples are keyed by :mod:`.sample_keys`, turned into bytes by :mod:`.samples`, and kept
in a RAM tier shared by every process of a job (:mod:`.shm`, slots by index) over a disk
or Redis tier, each behind :mod:`.sample_tiers`.
"""
