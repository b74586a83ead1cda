"""The driver's sites: a rank chosen wrongly (a neighbour's, taken as a remainder of the rank) is
named first at the line that chose it, before the op whose offset it makes, also when a list
index pinned it to an int; a rank lost (a constant passed for it) at the line that passes the
constant; a neighbour picked on the line that uses it there, not where the rank was first
regrouped, unless a number was given for the rank further back; a parameter the reference trains
that no rank's model holds, at the line returning a rank's model. The buggy programs disagree
numerically and are found there; the fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

VOCAB, HIDDEN, TOKENS = 16, 4, 6


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the table; ids outside them are looked up as row 0 and zeroed."""

    def __init__(self, rank: int, world_size: int, tabled: bool = False):
        super().__init__()
        rows = VOCAB // world_size
        table = [(r * rows, (r + 1) * rows) for r in range(world_size)]  # every rank's rows
        # tabled: a list index pins the rank to an int, so its bounds keep no trace of the rank
        self.start, self.stop = table[rank] if tabled else (rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(torch.empty(rows, HIDDEN))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(local)
        return local


def neighbour(rank: int, world_size: int) -> nn.Module:
    return VocabParallelEmbedding((rank + 1) % world_size, world_size)  # BUG: a neighbour's rows


def constant(rank: int, world_size: int) -> nn.Module:
    return VocabParallelEmbedding(0, world_size)  # BUG: rank 0's rows at every rank


def pinned_neighbour(rank: int, world_size: int) -> nn.Module:
    return VocabParallelEmbedding((rank + 1) % world_size, world_size, tabled=True)  # BUG: a neighbour's rows


def own(rank: int, world_size: int) -> nn.Module:
    return VocabParallelEmbedding(rank, world_size)


def shard_state(state: dict, rank: int, world_size: int) -> dict:
    rows = VOCAB // world_size
    return {"weight": state["weight"][rank * rows : (rank + 1) * rows]}


def neighbours_state(state: dict, rank: int, world_size: int) -> dict:
    group_rank = rank % world_size  # regrouped first, rightly
    return {"weight": state["weight"].chunk(world_size)[(group_rank + 1) % world_size]}  # BUG: a neighbour's rows


def case(distributed, world_size: int, shard=shard_state) -> Case:
    return Case(lambda: nn.Embedding(VOCAB, HIDDEN), distributed, lambda: (torch.randint(0, VOCAB, (TOKENS,)),),
                world_size, shard)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("wrong", [neighbour, constant, pinned_neighbour])
def test_a_rank_chosen_wrongly_is_named_at_the_line_that_chose_it(wrong, world_size: int) -> None:
    buggy = case(wrong, world_size)
    assert not run_numeric(buggy, world_size).agree
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy", report.diagnosis
    first = report.distributed[0]
    assert Path(first.file).name == Path(__file__).name and "# BUG" in first.code, report.distributed
    fixed = case(own, world_size)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_neighbour_picked_on_the_line_using_it_is_named_there(world_size: int) -> None:
    """The symbolic rank remembers where it was first regrouped (`rank % world_size`); the
    neighbour is picked later, on the line that cuts the rows."""
    buggy = case(own, world_size, neighbours_state)
    assert not run_numeric(buggy, world_size).agree
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy", report.diagnosis
    assert "# BUG" in report.distributed[0].code, report.distributed


def test_a_number_further_back_comes_before_a_neighbour_picked_on_the_first_line() -> None:
    """Rank 0's rows at every rank, then a neighbour's: the constant is named first (rank_flow's order)."""
    buggy = case(constant, 2, neighbours_state)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy", report.diagnosis
    first = report.distributed[0]
    assert "Embedding(0, world_size)" in first.code and "a number" in first.op, report.distributed


class Perceptron(nn.Module):
    def __init__(self, bias: bool = True, twice: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN, bias=bias)
        self.twice = twice

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * (2 if self.twice else 1))  # BUG when twice


def replicated(bug: str):
    def distributed(rank: int, world_size: int) -> nn.Module:
        return Perceptron(bias=bug != "unheld", twice=bug == "twice")  # BUG when unheld

    return Case(Perceptron, distributed, lambda: (torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)),
                loss=lambda out, x, target: ((out - target) ** 2).mean(), mode="train")


@pytest.mark.parametrize(("bug", "unheld"), [("unheld", True), ("twice", False)])
def test_a_parameter_no_rank_holds_is_named_at_the_line_returning_a_rank_model(bug: str, unheld: bool) -> None:
    """No rank's model has `fc2.bias`: whatever the proof finds follows from it; the line returning
    the model leads. Must not match: every parameter held, the fault is the forward's."""
    buggy = replicated(bug)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy", report.diagnosis
    first = report.distributed[0]
    assert Path(first.file).name == Path(__file__).name and f"# BUG when {bug}" in first.code, report.distributed
    assert ("no rank's model holds `fc2.bias`" in report.diagnosis) == unheld, report.diagnosis
    assert ("so that one of them holds `fc2.bias`" in report.fix) == unheld, report.fix
    fixed = replicated("")
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree
