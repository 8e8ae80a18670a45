"""Rows of one size by dataset index, in one file, checked on every read (:class:`RowsFile`)."""

from .file import RowsFile, RowsRead
from .format import Geometry, runs

__all__ = ["Geometry", "RowsFile", "RowsRead", "runs"]
