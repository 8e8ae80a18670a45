"""The module cache: ``@torchcache()`` on a module class, a method or a function.

:mod:`.decorator` wraps the class or callable, :mod:`.engine` holds one :class:`~.engine.Cache`
per instance (its key, its tiers, the call path), :mod:`.arguments` splits a call's
inputs into batch items, :mod:`.fingerprint` and :mod:`.versions` key the module and see
its weights change, :mod:`.outputs` rebuilds output containers, and :mod:`.precompute`
fills a cache ahead of training. It keeps outputs in the tiers of :mod:`torchcache.tiers`.
"""
