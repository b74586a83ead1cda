"""Where a missing all-reduce belongs (relations/diagnose/missing_reduction.py): after the last op
that only adds shares up. The buggy program is found at its `# BUG` line and disagrees numerically;
the fixed twin is proven and agrees."""

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

HIDDEN, BATCH, STEPS = 4, 8, 2


def _mse(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, x)


def _accumulating_step(reduce: bool):
    def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        """Micro-batch gradients added into buffers, the buffers averaged over the data-parallel ranks."""
        buffers = [torch.zeros_like(p) for p in model.parameters()]
        total = torch.zeros(())
        for micro_batch in inputs[0].chunk(STEPS):
            value = _mse(model(micro_batch), micro_batch) / STEPS
            grads = torch.autograd.grad(value, list(model.parameters()))
            for buffer, grad in zip(buffers, grads):
                buffer.add_(grad)  # BUG: the sum of the micro-batches is never averaged over ranks
            total = total + value.detach()
        for param, buffer in zip(model.parameters(), buffers):
            if reduce:
                dist.all_reduce(buffer, op=dist.ReduceOp.AVG)
            param.grad = buffer
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total

    return distributed_step


def _batch_shard(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size)[rank]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_missing_gradient_all_reduce_belongs_after_the_accumulation(world_size: int) -> None:
    def case(reduce: bool) -> Case:
        return Case(lambda: nn.Linear(HIDDEN, HIDDEN), lambda r, n: nn.Linear(HIDDEN, HIDDEN),
                    lambda: (torch.randn(BATCH * world_size, HIDDEN),), shard_input=_batch_shard, loss=_mse,
                    distributed_step=_accumulating_step(reduce), mode="train")

    buggy = case(False)
    report = verify(buggy, world_size=world_size)
    assert not run_numeric(buggy, world_size).agree
    assert report.verdict == "discrepancy" and "missing reduction" in report.diagnosis, report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed
    assert f"after line {culprit.line} " in report.fix
    fixed = case(True)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree
