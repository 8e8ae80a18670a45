"""What is under a cache root: finding caches, describing them, removing them, and the root's budget.

:mod:`.inspect` finds caches and reads their files and usage without changing them,
:mod:`.layouts` describes what their entries hold, :mod:`.removal` removes caches and
files (only torchcache's own), and :mod:`.budget` keeps the root under its budget
whenever a cache opens. Both products use it, and so does the command line.
"""
