"""A reduction over too few ranks, or one missing upstream (relations/diagnose/upstream.py): a
tensor-parallel MLP whose input gradient misses its all-reduce (the copy into the tensor-parallel
region's backward) reaches the data-parallel all-reduce of the norm's gradients through the norm's
backward; the missing all-reduce is named where the shares are made, not the data-parallel group.
A gradient whose shares come straight from the weight's own contraction, all-reduced over too small
a group, stays a wrong group. Buggy programs disagree numerically; the fixed twins are proven and agree."""

from __future__ import annotations

import inspect
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, FFN, BATCH = 4, 8, 8


class _Mlp(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(ffn, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the input gradient's shares summed over the tensor-parallel group (if `reduce`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.reduce = group, reduce
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        grad = grad.clone()
        if ctx.reduce:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def _groups(rank: int, world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(tensor-parallel, data-parallel) group of `rank`: pairs of neighbours, and every other rank."""
    tp = [dist.new_group([first, first + 1]) for first in range(0, world_size, 2)]
    dp = [dist.new_group(list(range(t, world_size, 2))) for t in range(2)]
    return tp[rank // 2], dp[rank % 2]


class _TensorParallelMlp(_Mlp):
    def __init__(self, rank: int, world_size: int, reduce: bool) -> None:
        super().__init__(FFN // 2)
        self.tp, self.dp = _groups(rank, world_size)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToRegion.apply(self.norm(x), self.tp, self.reduce)
        partial = F.linear(F.gelu(self.up(h)), self.down.weight)  # MADE
        dist.all_reduce(partial, group=self.tp)
        return partial + self.down.bias


def _tp_state(ref: dict, rank: int, world_size: int) -> dict:
    half = rank % 2
    return {**ref, "up.weight": ref["up.weight"].chunk(2)[half], "up.bias": ref["up.bias"].chunk(2)[half],
            "down.weight": ref["down.weight"].chunk(2, 1)[half]}


def _dp_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """One step's gradients, averaged over the data-parallel group."""
    (x,) = inputs
    value = F.mse_loss(model(x), x)
    value.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=model.dp)
    return value


def _line(source, text: str) -> int:
    lines, start = inspect.getsourcelines(source)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_input_gradient_all_reduce_missing_is_named_where_its_shares_are_made(world_size: int) -> None:
    def case(reduce: bool) -> Case:
        return Case(_Mlp, lambda r, n: _TensorParallelMlp(r, n, reduce), lambda: (torch.randn(BATCH, HIDDEN),),
                    shard_state=_tp_state, shard_input=lambda i, full, r, n: full.chunk(n // 2)[r // 2],
                    loss=lambda out, x: F.mse_loss(out, x), distributed_step=_dp_step, mode="train")

    buggy = case(False)
    report = verify(buggy, world_size=world_size)
    assert not run_numeric(buggy, world_size).agree
    assert report.verdict == "discrepancy" and report.kind == "missing reduction", report.diagnosis
    assert report.distributed[0].line == _line(_TensorParallelMlp, "# MADE"), report.distributed
    pair = report.distributed[0].rank // 2 * 2
    assert f"over ranks {[pair, pair + 1]} after line" in report.fix and "wrong group" not in report.diagnosis.split(";")[0]
    fixed = case(True)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree


class _Replica(nn.Linear):
    """Its gradient reduced over every rank (`wide`), or over the rank alone."""

    def __init__(self, rank: int, world_size: int, wide: bool) -> None:
        super().__init__(HIDDEN, HIDDEN)
        alone = [dist.new_group([r]) for r in range(world_size)]
        self.group = dist.new_group(list(range(world_size))) if wide else alone[rank]


def _replica_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    (x,) = inputs
    value = F.mse_loss(model(x), x) / world_size
    value.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, group=model.group)  # GROUP
    total = value.detach().clone()
    dist.all_reduce(total)
    return total


def test_a_weight_gradient_reduced_over_too_few_ranks_stays_a_wrong_group() -> None:
    """Each rank's gradient is its batch shard's contraction, reduced right away: no computation
    between where the shares are made and the reduction, so its group is the fault."""
    def case(wide: bool) -> Case:
        return Case(lambda: nn.Linear(HIDDEN, HIDDEN), lambda r, n: _Replica(r, n, wide),
                    lambda: (torch.randn(BATCH, HIDDEN),), shard_input=lambda i, full, r, n: full.chunk(n)[r],
                    loss=lambda out, x: F.mse_loss(out, x), distributed_step=_replica_step, mode="train")

    buggy = case(False)
    report = verify(buggy, world_size=2)
    assert not run_numeric(buggy, 2).agree
    assert report.verdict == "discrepancy" and report.kind == "wrong group", report.diagnosis
    assert report.distributed[0].line == _line(_replica_step, "# GROUP")
    fixed = case(True)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree
