"""The dataset cache: :class:`~.dataset.CachedDataset` and the :class:`~.cache.SampleCache` under it.

Samples are keyed by :mod:`.keys`, turned into frames by :mod:`.encode` and back by
:mod:`.decode` (the frame format is :mod:`.format`), and kept in a RAM tier shared by
every process of a job (:mod:`.shm`, slots by index) over a disk or Redis tier, each
behind a :class:`~.tiers.SampleTier`. :class:`~.sampler.WindowSampler` orders the epochs of
a cache in a bucket so that each segment is fetched once.
"""
