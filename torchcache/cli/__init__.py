"""The ``torchcache`` command: ``ls``, ``info``, ``verify``, ``prune``, ``clear``, ``migrate``.

:mod:`.main` parses the command line, :mod:`.commands` runs each command, :mod:`.verify`
checks caches entry by entry, :mod:`.migrate` moves torchcache 1.0 entry files into a
packed store, :mod:`.output` writes tables and JSON, and :mod:`.redis` runs the commands
on a Redis server.
"""

from .main import main

__all__ = ["main"]
