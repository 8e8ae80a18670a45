"""Feature files: one fixed-stride file of rows per features cache, read by index in one gather.

:mod:`.layout` describes a sample's fields and packs them into a row; :mod:`.file` is the
file (header, rows with their checks, resumable writes).
"""
