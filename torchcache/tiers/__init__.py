"""Tiers: where a cache keeps item outputs, as tensors or as framed bytes.

A tier turns tensors into what it keeps and back. The memory tier keeps tensors in
slabs; the persistent tier encodes each item as a checked frame (:mod:`torchcache.codec`)
and keeps it in a byte store of :mod:`torchcache.stores`, written by the thread of
:mod:`.writer`. Imports flow one way: tiers use stores, stores know nothing of tensors
or tiers.
"""
