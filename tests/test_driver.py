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


EXPERTS = 4


def mixture(x: torch.Tensor, gates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_e gates[:, e] * weights[e] @ x."""
    out = torch.zeros_like(x)
    for e in range(weights.shape[0]):
        out = out + gates[:, e : e + 1] * F.linear(x, weights[e])
    return out


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN))
        self.register_buffer("router", torch.randn(EXPERTS, HIDDEN))  # frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixture(x, F.linear(x, self.router), self.weight)


class ExpertParallel(Experts):
    """This rank's experts, the first where its group's start; their partial outputs summed over ranks."""

    def __init__(self, rank: int, world_size: int, first_of=lambda rank, world_size, local: rank % world_size * local):
        super().__init__()
        self.local = EXPERTS // world_size
        self.first = first_of(rank, world_size, self.local)
        self.weight = nn.Parameter(torch.empty(self.local, HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.linear(x, self.router)[:, self.first : self.first + self.local]
        partial = mixture(x, gates, self.weight)
        dist.all_reduce(partial)
        return partial


def experts_of(state: dict, rank: int, world_size: int) -> dict:
    local = EXPERTS // world_size
    first = rank % world_size * local
    return {"weight": state["weight"][first : first + local], "router": state["router"]}


def rank0_experts_of(state: dict, rank: int, world_size: int) -> dict:
    local = EXPERTS // world_size
    first = 0 * local  # BUG: rank 0's experts at every rank
    return {"weight": state["weight"][first : first + local], "router": state["router"]}


def rank0_gates(rank: int, world_size: int) -> nn.Module:
    return ExpertParallel(rank, world_size, lambda rank, world_size, local: 0 % world_size * local)  # BUG


def experts(shard, distributed=ExpertParallel) -> Case:
    return Case(Experts, distributed, lambda: (torch.randn(TOKENS, HIDDEN),), 2, shard,
                loss=lambda out, x: F.mse_loss(out, x), mode="train")


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_number_for_the_rank_where_the_state_is_cut_comes_before_the_line_regrouping_the_programs(world_size: int) -> None:
    """The gates the program reads stand for the rank regrouped (RankExpr.origin names that line),
    and are right; the experts' weights, cut at a number for the rank, are not: the values the
    sites read come from that cut (rank_flow.cut_lines)."""
    buggy = experts(rank0_experts_of)
    assert not run_numeric(buggy, world_size).agree
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy", report.diagnosis
    assert "# BUG" in report.distributed[0].code and "a number" in report.distributed[0].op, report.distributed
    fixed = experts(experts_of)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree


def test_a_state_cut_at_the_regrouped_rank_gives_way_to_the_programs_number() -> None:
    """Must not match: the state is cut right (a regrouped rank is no number), the program's gates
    are read at a number for the rank."""
    buggy = experts(experts_of, rank0_gates)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy", report.diagnosis
    assert "# BUG" in report.distributed[0].code, report.distributed


class _Scale(torch.autograd.Function):
    """x times 2 / (its width + extra), with a custom backward that adds `plus` to the saved scale."""

    @staticmethod
    def forward(ctx, x, extra, plus):
        scale = 2.0 / (x.shape[-1] + extra)  # the scale's line
        ctx.scale, ctx.plus = scale, plus
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        scale, plus = ctx.scale, ctx.plus
        return grad * (scale + plus), None, None  # the backward's line


class _Scaled(nn.Module):
    def __init__(self, extra: int = 0, plus: float = 0.0) -> None:
        super().__init__()
        self.linear, self.extra, self.plus = nn.Linear(4, 4), extra, plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(self.linear(x), self.extra, self.plus)


def _scaled_case(**wrong) -> Case:
    return Case(reference=_Scaled, distributed=lambda rank, n: _Scaled(**wrong), inputs=lambda: (torch.randn(6, 4),),
                loss=lambda out, x: out.mean(), mode="train")


@pytest.mark.parametrize("wrong, first", [({"extra": 1}, "the scale's line"), ({"plus": 1.0}, "the backward's line")])
def test_a_number_a_custom_backward_reads_from_ctx_is_named_where_the_forward_computed_it(wrong, first: str) -> None:
    """A scale computed wrong in the forward makes the loss fail too: named where it was computed,
    before the backward's line that uses it. The backward's own arithmetic wrong (the loss right):
    must not match, the backward's line stays first."""
    report = verify(_scaled_case(**wrong), world_size=2)
    assert report.verdict == "discrepancy" and first in report.distributed[0].code
    assert not run_numeric(_scaled_case(**wrong), 2).agree
    assert verify(_scaled_case(), world_size=2).verdict == "equivalent" and run_numeric(_scaled_case(), 2).agree
