"""Whether rows of the same items computed in two batches are equal up to the noise of floating point.

A module's rows for one item may differ in their last bits between batch sizes (other
kernels, other blocking of a matrix product): :func:`close` tells that noise from a
dependence on the batch, element by element, on the scale of each column over the batch
(:func:`column_scale`).
"""

from __future__ import annotations

import torch

__all__ = ["Scales", "close", "column_scale", "rows_agree"]

_OUTLIER = 10.0  #: rows this many times the typical row's size are left out of the columns' scale


def rows_agree(expected: torch.Tensor, found: torch.Tensor, batch_rows: torch.Tensor) -> bool:
    """Whether rows computed in another batch equal ``expected`` up to the noise of floating point.

    Args:
        expected: Rows as computed in a batch.
        found: The same items' rows computed in another batch.
        batch_rows: All the rows of the batch ``expected`` comes from (the scale of each column).
    """
    return close(expected, found, expected.dtype, column_scale(batch_rows))


def column_scale(rows: torch.Tensor) -> torch.Tensor:
    """The root mean square of each column of a batch's rows (one row per item), and of all its values, last.

    Rows far larger than the batch's typical row (an outlier image) are left out: they
    would make every column's scale theirs, and a dependence on the batch small beside
    them but large beside the other rows would pass.
    """
    if not (rows.is_floating_point() or rows.is_complex()):
        return torch.zeros(1, dtype=torch.float64)
    values = rows.detach().reshape(len(rows), -1)
    if values.is_complex():
        values = values.abs()
    squares = values.to(torch.float64, copy=True)  # one copy, squared in place (a batch of (197, 768) rows: 39 MB)
    if not bool(torch.isfinite(values).all()):
        squares.masked_fill_(~torch.isfinite(squares), 0.0)
    squares.square_()
    size = squares.mean(dim=1).sqrt()  # each row's
    typical = float(size.median())  # the lower median: one outlier of two or three rows is not typical
    usual = size <= _OUTLIER * typical if typical > 0 else torch.ones_like(size, dtype=torch.bool)
    columns = squares.mean(dim=0) if bool(usual.all()) else squares[usual].mean(dim=0)
    return torch.cat([columns.sqrt(), columns.mean().sqrt().reshape(1)])  # and of all values: the columns' mean


def close(expected: torch.Tensor, found: torch.Tensor, stored: torch.dtype, scale: torch.Tensor) -> bool:
    """Whether two sets of rows are equal up to the noise of floating point between batch sizes.

    Element by element: within a relative tolerance (0.1 %, or 4 units in the last place
    of a low-precision dtype) of the larger of its value and a floor (an element near zero
    may come from large terms that cancel, whose rounding is what varies between batch
    sizes). The floor is a tenth of the root mean square of its column over the rows of
    the whole batch, and at least a hundredth of that of all its values (``scale``, from
    :func:`column_scale`). So a value that is small beside the rest of its row (a score
    beside an embedding, a column a thousand times smaller than the others) is still
    compared on its own scale.
    """
    if not (expected.is_floating_point() or expected.is_complex()):
        return torch.equal(expected, found.to(expected.dtype))
    if stored.is_floating_point and expected.is_floating_point():  # both on the grid of what is stored
        expected, found = expected.to(stored), found.to(stored)
    a = expected.detach().to(torch.complex128 if expected.is_complex() else torch.float64).reshape(len(expected), -1)
    b = found.detach().to(a.dtype).reshape(len(found), -1)
    special = a.isnan() | a.isinf() | b.isnan() | b.isinf()
    if special.any():
        if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a[a.isinf()], b[a.isinf()])):
            return False
        a, b = a.masked_fill(special, 0.0), b.masked_fill(special, 0.0)
    info = torch.finfo(stored if stored.is_floating_point else torch.float32)
    tolerance = max(1e-3, 4 * info.eps)
    columns, overall = scale[:-1].to(a.device), float(scale[-1])
    floor = (0.1 * columns).clamp_min(0.01 * overall + torch.finfo(torch.float64).tiny)  # each column on its own scale
    spacing = 2 * info.smallest_normal * info.eps  # a step of the stored dtype's subnormals, where steps are fixed
    return bool(((a - b).abs() <= tolerance * torch.maximum(a.abs(), b.abs()).clamp_min(floor) + spacing).all())


class Scales:
    """The :func:`column_scale` of each output leaf's rows, computed once when a comparison first needs it.

    Rows equal bit for bit need none: the scale of a large batch costs more than a forward
    of a cheap module (a copy of the batch in float64 and a few passes over it).
    """

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows
        self.found: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.found:
            self.found[i] = column_scale(self.rows[i])
        return self.found[i]
