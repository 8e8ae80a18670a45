"""The RAM tier's rows file of a dataset's samples, by index (:class:`~torchcache.stores.rows.RowsFile`)."""

from __future__ import annotations

import threading
from pathlib import Path

from ..errors import CorruptEntryError
from ..faults import Fault, Report
from ..stores.rows import Geometry, RowsFile

__all__ = ["ROWS_NAME", "SampleRows"]

#: The RAM tier's rows file.
ROWS_NAME = "samples.tcrows"
_ROWS_HEADER = {"kind": "samples"}


class SampleRows:
    """The RAM tier's rows file of a dataset's samples: made by the first frames stored, opened by the others.

    Every row is a frame of the size of the first frame stored. A file that is not valid
    is reported once and left alone (the tier keeps to its packed store).

    Args:
        directory: The RAM tier's directory.
        length: The dataset's length.
        max_bytes: The tier's budget: the file's size at most.
        report: Called with ``(kind, message)`` for a damaged row or an unusable file.
    """

    def __init__(self, directory: Path, length: int, max_bytes: int, report: Report) -> None:
        self.path = directory / ROWS_NAME
        self.length = length
        self.max_bytes = max_bytes
        self._report = report
        self._lock = threading.Lock()
        self.file: RowsFile | None = None
        #: ``False`` once the file proved unusable (it is then left alone).
        self.usable = True
        self.attach()

    def __repr__(self) -> str:
        return f"SampleRows({str(self.path)!r}, {self.file!r})"

    def attach(self) -> RowsFile | None:
        """The file, opened now if another process made it since (``None``: there is none, or it is unusable)."""
        if self.file is not None or not self.usable:
            return self.file
        with self._lock:
            if self.file is None and self.usable:
                try:
                    file = RowsFile.open(self.path)
                except FileNotFoundError:
                    return None
                except (OSError, CorruptEntryError) as exc:
                    self._unusable(str(exc))
                    return None
                if file.header != _ROWS_HEADER or file.length != self.length:
                    file.close()
                    self._unusable("it was made for another dataset")
                    return None
                self.file = file
        return self.file

    def create(self, frame_size: int, head: int) -> RowsFile | None:
        """The file for frames of ``frame_size`` bytes (``None``: the budget holds none, or it cannot be made)."""
        capacity = Geometry.of(self.length, frame_size, head, _ROWS_HEADER).capacity(self.max_bytes, self.length)
        if capacity <= 0:
            return self.attach()
        with self._lock:
            if self.file is None and self.usable:
                try:
                    self.file = RowsFile.create(
                        self.path,
                        _ROWS_HEADER,
                        self.length,
                        frame_size,
                        head=head,
                        capacity=capacity,
                        allocate_rows=False,
                    )
                except (OSError, CorruptEntryError, ValueError) as exc:
                    self._unusable(f"cannot create it ({exc})")
                    return None
        return self.attach()

    def shortfall(self) -> int:
        """Samples the budget would hold beyond the open file's rows (a file made for a smaller budget)."""
        file = self.file
        if file is None:
            return 0
        return max(0, file.geometry.capacity(self.max_bytes, self.length) - file.capacity)

    def _unusable(self, why: str) -> None:
        self.usable = False
        self._report(Fault.ROWS, f"the rows file {self.path} is not used: {why}")

    def close(self) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()
            self.file = None
