"""Where the normal form stops, equality saturation (egglog) finishes the proof, and only there."""

from __future__ import annotations

import torch

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric


class Scaled(torch.nn.Module):
    def __init__(self, reassociate: bool, drop: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4, 8))
        self.b = torch.nn.Parameter(torch.randn(4, 8))
        self.reassociate, self.drop = reassociate, drop

    def forward(self, x):
        if self.drop:
            return x * self.a
        return (x * self.a) * self.b if self.reassociate else x * (self.a * self.b)


def _case(reassociate: bool, drop: bool = False) -> Case:
    return Case(lambda: Scaled(False), lambda rank, n: Scaled(reassociate, drop), lambda: (torch.randn(4, 8),))


def test_reassociated_product_is_proven_by_saturation() -> None:
    case = _case(reassociate=True)
    assert run_numeric(case, 2).agree
    assert verify(case, world_size=2).verdict == "equivalent"


def test_a_different_product_is_not_proven() -> None:
    case = _case(reassociate=True, drop=True)
    report = verify(case, world_size=2)
    assert not run_numeric(case, 2).agree
    assert report.verdict != "equivalent"


class ColumnParallel(torch.nn.Module):
    """A column-parallel linear whose ranks return their own columns, gathered or (the bug) not."""

    def __init__(self, columns: slice = slice(None), gather: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4)[columns])
        self.gather = gather

    def forward(self, x):
        y = x @ self.weight.T
        if self.gather and y.shape[-1] != 8:
            import torch.distributed as dist

            parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, y)
            y = torch.cat(parts, -1)
        return y


def _column_case(gather: bool) -> Case:
    return Case(lambda: ColumnParallel(), lambda rank, n: ColumnParallel(slice(4 * rank, 4 * rank + 4), gather),
                lambda: (torch.randn(3, 4),),
                shard_state=lambda state, rank, n: {"weight": state["weight"][4 * rank : 4 * rank + 4]})


def test_an_output_of_another_shape_than_the_reference_is_a_wrong_layout_at_its_line() -> None:
    report = verify(_column_case(gather=False), world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    assert "shape (3, 4) where the reference's has (3, 8)" in report.diagnosis
    assert report.distributed[0].code.strip() == "y = x @ self.weight.T"
    assert not run_numeric(_column_case(gather=False), 2).agree
    assert verify(_column_case(gather=True), world_size=2).verdict == "equivalent"
    assert run_numeric(_column_case(gather=True), 2).agree
