"""A rank's output that is another rank's share of the claimed output (relations/diagnose/
other_share.py), and the loader's cut under the program's own reordering of its rows
(input_cuts.py): every op computes regions of the reference's, so no op diverges first. Each
buggy program disagrees numerically; each fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

ROWS, HIDDEN = 8, 4


class Parity(nn.Module):
    """Rows routed to one of two experts by their parity (a hash layer's routing), sorted by
    expert, then put back in order: its output rows are rows of different products."""

    def __init__(self, rank: int = 0, world_size: int = 1, shift: int = 0):
        super().__init__()
        self.rank, self.world_size, self.shift = rank, world_size, shift
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = sorted(range(x.shape[0]), key=lambda i: i % 2)
        rows = torch.cat([x[i : i + 1] for i in order])
        half = x.shape[0] // 2
        done = torch.cat([self.experts[0](rows[:half]), self.experts[1](rows[half:])])
        return torch.cat([done[order.index(i) : order.index(i) + 1] for i in range(x.shape[0])])


class Returned(Parity):
    """The ranks' rows gathered and each rank's taken back, row by row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        every = funcol.all_gather_tensor(super().forward(x), 0, dist.group.WORLD)
        owner, n = (self.rank + self.shift) % self.world_size, x.shape[0]
        return torch.cat([every[j : j + 1] for j in range(owner * n, (owner + 1) * n)])  # BUG when shift


def _cut(shift: int):
    def cut(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        return full.chunk(world_size)[(rank + shift) % world_size]  # BUG when shift

    return cut


def _first_chunk(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size)[0]  # BUG when shift: every rank's cut is rank 0's


def _case(model: type[Parity], cut_shift: int = 0, shift: int = 0, cut=None) -> Case:
    return Case(Parity, lambda r, n: model(r, n, shift), lambda: (torch.randn(ROWS, HIDDEN),),
                shard_input=cut or _cut(cut_shift), output=("shard", 0))


def _found_at_bug(buggy: Case) -> str:
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    first = report.distributed[0]
    assert Path(first.file).name == Path(__file__).name and "# BUG when shift" in first.code, report.distributed
    return report.diagnosis


def test_a_loader_cut_of_another_share_is_found_under_the_programs_reordering() -> None:
    """The loader hands each rank the other's rows; the program sorts them by expert itself, so
    what it reads is no cut of a share: the cut is found before that."""
    diagnosis = _found_at_bug(_case(Parity, cut_shift=1))
    assert "cuts its shard of `inputs()[0]` at [4:8) along dim 0" in diagnosis, diagnosis
    fixed = _case(Parity)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


def test_a_rank_holding_its_share_is_not_the_one_diagnosed() -> None:
    """Every rank cuts rank 0's rows: rank 0 is right, rank 1's cut is found."""
    diagnosis = _found_at_bug(_case(Parity, cut=_first_chunk))
    assert "rank 1 cuts its shard of `inputs()[0]` at [0:4) along dim 0" in diagnosis, diagnosis


def test_an_output_of_another_ranks_share_is_found_where_it_is_made() -> None:
    """Each rank computes its own rows right, then returns the other's."""
    diagnosis = _found_at_bug(_case(Returned, shift=1))
    assert "on rank 0 is rank 1's share of the reference's output ([4:8) of dim 0)" in diagnosis, diagnosis
    assert "cuts its shard" not in diagnosis, diagnosis
    fixed = _case(Returned)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


class Reversed(Parity):
    """Must not match: the rank's own rows, in reverse order, are no rank's share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return torch.cat([out[j : j + 1] for j in reversed(range(x.shape[0]))])


def test_rows_that_are_no_ranks_share_are_not_called_another_share() -> None:
    buggy = _case(Reversed)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert "share of the reference's output" not in (report.diagnosis or ""), report.diagnosis
