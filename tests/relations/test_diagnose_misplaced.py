"""Outputs that are the reference's sum but for some terms (relations/diagnose/misplaced.py): one
term from the wrong place (another region of the reference's values), or the sum's terms split over
ranks with no sum over ranks (or one by MAX: relations/diagnose/reads.py). Each buggy program is
found with its kind and disagrees numerically; each fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

SIZE = 4


class Shift(nn.Module):
    """3x plus a bias; `scale` sits beside it in the state (a flat buffer holds both)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(SIZE))
        self.bias = nn.Parameter(torch.randn(SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3 * x + self.bias


class FlatShift(Shift):
    """The parameters flattened into one buffer, each rank keeping its partition, all-gathered
    before use (ZeRO-3's way); the bias is read back from its slot."""

    def __init__(self, rank: int, world_size: int, wrong: bool):
        super().__init__()
        self.rank, self.world_size, self.wrong = rank, world_size, wrong

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([self.scale, self.bias])
        size = flat.numel() // self.world_size
        start = 0 if self.wrong else self.rank * size
        partition = flat[start : start + size]  # BUG when wrong: every rank keeps rank 0's partition
        gathered = torch.empty_like(flat)
        dist.all_gather_into_tensor(gathered, partition.contiguous())
        return 3 * x + gathered[SIZE:]


def _case(wrong: bool) -> Case:
    return Case(Shift, lambda r, n: FlatShift(r, n, wrong), lambda: (torch.randn(SIZE),))


def test_a_bias_read_from_another_parameters_slot_is_a_term_from_the_wrong_place() -> None:
    report, numbers = verify(_case(True), world_size=2), run_numeric(_case(True), 2)
    assert not numbers.agree
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    assert "adds scale where the reference adds bias" in report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed


def test_the_bias_read_from_its_own_slot_is_proven() -> None:
    report, numbers = verify(_case(False), world_size=2), run_numeric(_case(False), 2)
    assert report.verdict == "equivalent", report.diagnosis
    assert numbers.agree, numbers.detail


class Branches(nn.Module):
    """Two branches of the input added up."""

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(SIZE, SIZE, bias=False)
        self.right = nn.Linear(SIZE, SIZE, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


class BranchPerRank(Branches):
    """Rank 0 computes the left branch, rank 1 the right one; the sum over ranks adds them."""

    def __init__(self, rank: int, op: dist.ReduceOp | None):
        super().__init__()
        self.rank, self.op = rank, op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.left(x) if self.rank == 0 else self.right(x)  # BUG when op is None: never summed
        if self.op is not None:
            dist.all_reduce(y, op=self.op)  # BUG when op is MAX
        return y


def _branches(op: dist.ReduceOp | None) -> Case:
    return Case(Branches, lambda r, n: BranchPerRank(r, op), lambda: (torch.randn(3, SIZE),))


@pytest.mark.parametrize("op, kind", [(None, "missing reduction"), (dist.ReduceOp.MAX, "wrong reduce op")])
def test_a_sum_whose_terms_ranks_hold_apart_needs_a_sum_over_ranks(op: dist.ReduceOp | None, kind: str) -> None:
    report, numbers = verify(_branches(op), world_size=2), run_numeric(_branches(op), 2)
    assert not numbers.agree
    assert report.verdict == "discrepancy" and report.kind == kind, report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed
    assert "ranks [1] hold" in report.diagnosis if op is None else "only ReduceOp.SUM gives it" in report.diagnosis


def test_the_branches_summed_over_ranks_are_proven() -> None:
    report, numbers = verify(_branches(dist.ReduceOp.SUM), world_size=2), run_numeric(_branches(dist.ReduceOp.SUM), 2)
    assert report.verdict == "equivalent", report.diagnosis
    assert numbers.agree, numbers.detail
