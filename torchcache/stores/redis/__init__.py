"""The Redis store: entries on a Redis server or a Redis Cluster, under one budget per namespace.

:mod:`.url` parses and redacts server URLs, :mod:`.link` holds the connection and its
faults, :mod:`.keys` and :mod:`.namespace` lay entries out on the server, :mod:`.verify`
checks them, and :mod:`.store` is the :class:`~.store.RedisStore`. The ``redis`` package
is imported only when a store opens (the ``redis`` extra).
"""

from .store import RedisStore

__all__ = ["RedisStore"]
