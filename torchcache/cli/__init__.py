"""The ``torchcache`` command: ``ls``, ``info``, ``verify``, ``prune``, ``clear``, ``migrate``.

:mod:`.main` parses the command line, :mod:`.commands` runs each command, :mod:`.output`
writes tables and JSON, and :mod:`.redis` runs the commands on a Redis server.
"""

from .main import main

__all__ = ["main"]
