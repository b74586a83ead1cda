"""The loader's cut of an input that takes another share than the output claim gives the rank
(relations/diagnose/input_cuts.py): its values are regions of the reference's and agree until an
op pairs them with the rank's own positions, yet the site is the cut. Each buggy program disagrees
numerically; each fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric
from shardproof.programs import zigzag_chunks
from shardproof.relations.diagnose.input_cuts import claimed_spans

BATCH, SEQ, HIDDEN = 2, 8, 4


class Positional(nn.Module):
    """A projection of each token scaled by a table of its position's values (as rope scales by
    its cosines); a rank reads the table at the positions the claim gives it."""

    def __init__(self, rank: int = 0, world_size: int = 1, zigzag: bool = False, offset: int = 0):
        super().__init__()
        self.rank, self.world_size, self.zigzag, self.offset = rank, world_size, zigzag, offset
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.table = nn.Parameter(torch.randn(2 * SEQ, HIDDEN), requires_grad=False)  # positions to spare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.positions(x.shape[1])

    def positions(self, s_local: int) -> torch.Tensor:
        if not self.zigzag:
            start = ((self.rank + self.offset) % self.world_size) * s_local  # BUG when offset
            return self.table[start : start + s_local]
        half = s_local // 2
        chunks = [c for c, (owner, _) in enumerate(zigzag_chunks(self.world_size)) if owner == self.rank]
        return torch.cat([self.table[c * half : (c + 1) * half] for c in chunks]) if self.world_size > 1 else self.table[:s_local]


def _case(cut, zigzag: bool = False, offset: int = 0) -> Case:
    return Case(Positional, lambda r, n: Positional(r, n, zigzag, offset), lambda: (torch.randn(BATCH, SEQ, HIDDEN),),
                shard_input=cut, output=("shard", 1, "zigzag") if zigzag else ("shard", 1))


def _by_positions(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, dim=1)[rank]


def _by_batch(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, dim=0)[rank]  # BUG: the batch, where the positions are the ranks'


def _zigzag(neighbour: int):
    def cut(i: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        chunks = full.chunk(2 * world_size, dim=1)
        return torch.cat([chunks[(rank + neighbour) % world_size], chunks[2 * world_size - 1 - rank]], dim=1)  # BUG when neighbour

    return cut


def _first_site(report) -> tuple[str, str]:
    first = report.distributed[0]
    return Path(first.file).name, first.code


@pytest.mark.parametrize("cut, zigzag", [(_by_batch, False), (_zigzag(1), True)], ids=["batch", "zigzag-neighbour"])
def test_a_cut_of_another_share_than_the_claim_gives_is_found_at_the_cut(cut, zigzag: bool) -> None:
    """The batch cut where the output is claimed along the sequence, or a neighbour's first chunk
    where it is claimed zigzag: the values agree (regions of the reference's) until the rank's
    own positions scale them."""
    buggy = _case(cut, zigzag)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    name, code = _first_site(report)
    assert name == Path(__file__).name and code.startswith("return") and "# BUG" in code, report.distributed
    assert f"where the output is claimed as {'zigzag' if zigzag else 'Shard'}(1)" in report.diagnosis, report.diagnosis
    fixed = _case(_zigzag(0) if zigzag else _by_positions, zigzag)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


def test_a_fault_after_a_right_cut_is_not_blamed_on_the_cut() -> None:
    """Must not match: the loader cuts each rank's own tokens; the model reads another rank's
    positions. The site stays at the model's line."""
    buggy = _case(_by_positions, offset=1)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy", report.diagnosis
    name, code = _first_site(report)
    assert name == Path(__file__).name and "# BUG when offset" in code, report.distributed
    assert "cuts its shard of `inputs()" not in report.diagnosis, report.diagnosis


def test_the_claimed_spans_are_chunk_rank_or_its_zigzag_pair() -> None:
    assert claimed_spans("shard", 16, 1, 2) == [(8, 16)]
    assert claimed_spans("zigzag", 16, 0, 2) == [(0, 4), (12, 16)]
    assert claimed_spans("zigzag", 16, 1, 2) == [(4, 8), (8, 12)]
    assert claimed_spans("shard", 15, 0, 2) is None
