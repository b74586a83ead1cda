"""The loader's cut of an input that takes another share than the rank's (relations/diagnose/
input_cuts.py): its values are regions of the reference's and agree until an op pairs them with
the rank's own positions or joins them over ranks, yet the site is the cut. Each buggy program
disagrees numerically; each fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric
from shardproof.relations.diagnose.input_cuts import claimed_spans

BATCH, SEQ, HIDDEN = 2, 8, 4


class Positional(nn.Module):
    """A projection of each token scaled by a table of its position's values (as rope scales by its cosines)."""

    def __init__(self, rank: int = 0, world_size: int = 1, offset: int = 0):
        super().__init__()
        self.rank, self.world_size, self.offset = rank, world_size, offset
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.table = nn.Parameter(torch.randn(2 * SEQ, HIDDEN), requires_grad=False)  # positions to spare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s_local = x.shape[1]
        start = ((self.rank + self.offset) % self.world_size) * s_local  # BUG when offset
        return self.proj(x) * self.table[start : start + s_local]


def _positional(cut, offset: int = 0) -> Case:
    return Case(Positional, lambda r, n: Positional(r, n, offset), lambda: (torch.randn(BATCH, SEQ, HIDDEN),),
                shard_input=cut, output=("shard", 1))


def _by_positions(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, dim=1)[rank]


def _neighbours(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, dim=1)[(rank + 1) % world_size]  # BUG: a neighbour's tokens


def _by_batch(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, dim=0)[rank]  # BUG: the batch, where the positions are the ranks'


def _first_site(report) -> tuple[str, str]:
    first = report.distributed[0]
    return Path(first.file).name, first.code


def test_a_cut_of_another_share_than_the_claim_gives_is_found_at_the_cut() -> None:
    """A neighbour's tokens, or the batch cut where the output is claimed along the sequence: the
    values agree (regions of the reference's) until the position table is added."""
    for cut in (_neighbours, _by_batch):
        buggy = _positional(cut)
        assert not run_numeric(buggy, 2).agree
        report = verify(buggy, world_size=2)
        assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
        name, code = _first_site(report)
        assert name == Path(__file__).name and code.startswith("return full.chunk") and "# BUG" in code, report.distributed
        assert "where the output is claimed as Shard(1)" in report.diagnosis, report.diagnosis
    fixed = _positional(_by_positions)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


def test_a_fault_after_a_right_cut_is_not_blamed_on_the_cut() -> None:
    """Must not match: the loader cuts each rank's own tokens; the model reads another rank's
    positions. The site stays at the model's line."""
    buggy = _positional(_by_positions, offset=1)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy", report.diagnosis
    name, code = _first_site(report)
    assert name == Path(__file__).name and "# BUG when offset" in code, report.distributed
    assert "cuts its shard of `inputs()" not in report.diagnosis, report.diagnosis


class Summed(nn.Module):
    """The sum over the rows of a projection, every rank's rows summed by an all-reduce."""

    def __init__(self, world_size: int = 1):
        super().__init__()
        self.world_size = world_size
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.proj(x).sum(0)
        if self.world_size > 1:
            dist.all_reduce(total)
        return total


def _summed(cut) -> Case:
    return Case(Summed, lambda r, n: Summed(n), lambda: (torch.randn(SEQ, HIDDEN),), shard_input=cut)


def test_cuts_that_overlap_over_the_ranks_are_found_at_the_cut() -> None:
    """No claim gives the ranks' shares (the output is replicated), but cuts meant to partition the
    rows (their widths add up to them) that overlap and leave rows out are the fault."""
    buggy = _summed(lambda i, full, rank, world_size: full.chunk(world_size, dim=0)[0])  # BUG: every rank chunk 0
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "overlapping shards", report.diagnosis
    name, code = _first_site(report)
    assert name == Path(__file__).name and "# BUG: every rank chunk 0" in code, report.distributed
    assert "overlap at [0:4) and leave out [4:8)" in report.diagnosis, report.diagnosis
    fixed = _summed(lambda i, full, rank, world_size: full.chunk(world_size, dim=0)[rank])
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


def test_the_claimed_spans_are_chunk_rank_or_its_zigzag_pair() -> None:
    assert claimed_spans("shard", 16, 1, 2) == [(8, 16)]
    assert claimed_spans("zigzag", 16, 0, 2) == [(0, 4), (12, 16)]
    assert claimed_spans("zigzag", 16, 1, 2) == [(4, 8), (8, 12)]
    assert claimed_spans("shard", 15, 0, 2) is None
