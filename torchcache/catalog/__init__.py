"""What is under a cache root: finding and describing caches, checking them, and the root's budget.

:mod:`.inspect` finds and describes caches without changing them; :mod:`.maintenance`
verifies, repairs and removes them, and keeps the root under its budget whenever a cache
opens. Both products use it, and so does the command line.
"""
