"""A term from the wrong place (relations/diagnose/misplaced.py): every op only moves or adds
agreeing values, and the output is the reference's sum but for one term, another region of the
reference's values. The buggy program is found with its wrong region and disagrees numerically;
the fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

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
