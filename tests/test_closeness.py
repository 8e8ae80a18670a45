"""Rows of one item from two batches: equal up to floating-point noise, on each column's scale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchcache import torchcache
from torchcache.module import closeness
from torchcache.module.closeness import column_scale, rows_agree


def _reference_scale(rows: torch.Tensor) -> torch.Tensor:
    """The definition, written plainly: per-column RMS over the rows not 10x the typical row, then of all values."""
    magnitude = rows.detach().abs().to(torch.float64).reshape(len(rows), -1)
    squares = magnitude.masked_fill(magnitude.isnan() | magnitude.isinf(), 0.0).square()
    size = squares.mean(dim=1).sqrt()
    typical = float(size.median())
    usual = size <= 10 * typical if typical > 0 else torch.ones_like(size, dtype=torch.bool)
    squares = squares[usual]
    return torch.cat([squares.mean(dim=0).sqrt(), squares.mean().sqrt().reshape(1)])


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(64, 12, generator=g)
    outlier = plain.clone()
    outlier[3] *= 1000  # left out of the columns' scale
    special = plain.clone()
    special[1, 2], special[5, 7], special[9, 0] = float("nan"), float("inf"), -float("inf")
    return [
        plain,
        outlier,
        special,
        torch.randn(8, 3, 4, 5, generator=g).to(torch.float16),
        torch.randn(8, 6, generator=g).to(torch.bfloat16),
        torch.randn(16, 5, generator=g, dtype=torch.float64),
        torch.randn(16, 4, generator=g, dtype=torch.complex64),
        torch.zeros(4, 3),
        torch.randn(1, 7, generator=g),
    ]


@pytest.mark.parametrize("index", range(len(_batches())))
def test_the_column_scale_is_its_definition(index: int) -> None:
    rows = _batches()[index]
    got, want = column_scale(rows), _reference_scale(rows)
    assert got.dtype == torch.float64 and got.shape == (rows[0].numel() + 1,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)


def test_the_column_scale_of_integers_is_zero() -> None:
    assert torch.equal(column_scale(torch.arange(12).reshape(4, 3)), torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
def test_the_column_scale_leaves_the_rows_as_they_were(dtype: torch.dtype) -> None:
    rows = torch.randn(8, 5, dtype=dtype)
    rows[2, 1] = float("nan")
    before = rows.clone()
    column_scale(rows)
    assert torch.equal(rows.isnan(), before.isnan())
    assert torch.equal(rows.nan_to_num(), before.nan_to_num())


def test_rows_agree_within_noise_and_not_beyond() -> None:
    batch = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    expected = batch[:2]
    assert rows_agree(expected, expected * (1 + 1e-6), batch)
    assert not rows_agree(expected, expected * 1.01, batch)
    assert not rows_agree(expected, expected + 0.05 * batch[2:4], batch)


class _Nudged(nn.Module):
    """Rows a relative 1e-7 apart between batches of six items and others: the noise a batched kernel makes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float64) * (1 + 1e-7 * (len(x) != 6))


class _Same(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize(("module", "scales"), [(_Same, 0), (_Nudged, 1)])
def test_the_check_measures_a_batch_only_when_its_rows_differ_in_their_bits(
    module: type[nn.Module], scales: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    measure = closeness.column_scale

    def counted(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return measure(rows)

    monkeypatch.setattr(closeness, "column_scale", counted)
    model = torchcache(persistent=False)(module())
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(x), module()(x))  # checked: three sets of items, each in a batch of its own
    assert calls == [6] * scales  # once for the batch's one leaf, however many sets differ
    assert torch.equal(model(x), module()(x)) and model.cache_instance.stats().hits == 6
