"""Linearity read off DTensor's sharding strategies (`ir/sharding_laws.py`), checked numerically."""

from __future__ import annotations

import pytest
import torch

from shardproof.ir import aten_ops
from shardproof.ir.aten_ops import Operand
from shardproof.ir.sharding_laws import linear_in

GATHER = ("aten.index.Tensor", ((Operand(0), (Operand(1),)), (), ()))
PUT = ("aten.index_put.default", ((Operand(0), (Operand(1),), Operand(2)), (), ()))
SELECT = ("aten.index_select.default", ((Operand(0), 0, Operand(1)), (), ()))
CUMSUM = ("aten.cumsum.default", ((Operand(0), 0), (), ()))
SORT = ("aten.sort.default", ((Operand(0),), (), (0,)))
ROWS, INDEX = ((6, 4), "float64"), ((5,), "int64")


def _values(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(6, 4, dtype=torch.float64, generator=gen), torch.randperm(6, generator=gen)[:5],
            torch.randn(5, 4, dtype=torch.float64, generator=gen)]


@pytest.mark.parametrize("op, attrs, inputs, partial, linear", [
    (*GATHER, (ROWS, INDEX), {0}, True),  # a row gather of a partial sum
    (*GATHER, (ROWS, INDEX), {1}, False),  # indices are no sum
    (*SELECT, (ROWS, INDEX), {0}, True),
    (*PUT, (ROWS, INDEX, ((5, 4), "float64")), {0, 2}, True),  # a write of partial rows into partial rows
    (*PUT, (ROWS, INDEX, ((5, 4), "float64")), {0}, False),  # the written rows are not partial
    (*CUMSUM, (ROWS,), {0}, False),  # linear, but DTensor replicates first: nothing is claimed
    (*SORT, (ROWS,), {0}, False),
])
def test_linearity_as_dtensor_propagates_partial_sums(op: str, attrs, inputs, partial: set[int], linear: bool) -> None:
    assert linear_in(op, attrs, inputs, frozenset(partial)) is linear
    if not linear:
        return
    gen = torch.Generator().manual_seed(0)
    whole, halves = _values(gen), [_values(gen) for _ in range(2)]
    for i in partial:  # split the partial operands in two shares, keep the rest as in `whole`
        halves[0][i] = whole[i] - halves[1][i]
    for h in halves:
        for i in range(len(inputs)):
            if i not in partial:
                h[i] = whole[i]
    n = len(inputs)
    shares = sum(aten_ops.run(op, h[:n], attrs) for h in halves)
    torch.testing.assert_close(shares, aten_ops.run(op, whole[:n], attrs))
