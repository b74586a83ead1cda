"""A gradient's missing reduction named where the user's step syncs it (relations/diagnose/grad_sync.py):
after the `backward()` call that hands a share over unreduced, at the sync helper's line of a
collective that leaves out ranks holding the rest of the sum, else after the step's last
accumulation of it. Not when the share goes on through the backward (the model's fault), nor when
shardproof's own step runs the backward. Each buggy program disagrees numerically; each fixed twin
is proven and agrees."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, BATCH = 4, 8


class _Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # FORWARD


def _line(source, text: str) -> int:
    lines, start = inspect.getsourcelines(source)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _sync_grads(model: nn.Module) -> None:
    for param in model.parameters():
        dist.all_reduce(param.grad)


def _data_parallel_step(synced: bool):
    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        (x,) = inputs
        value = F.mse_loss(model(x), x) / world_size
        value.backward()  # BACKWARD
        if synced:
            _sync_grads(model)
        total = value.detach().clone()
        dist.all_reduce(total)
        return total
    return step


def _data_parallel(synced: bool | None) -> Case:
    """Data parallelism over the batch; the step's own (`synced`: with its gradient sync), or
    shardproof's (None), which syncs nothing."""
    step = None if synced is None else _data_parallel_step(synced)
    return Case(_Proj, lambda r, n: _Proj(), lambda: (torch.randn(BATCH, HIDDEN),),
                shard_input=lambda i, full, r, n: full.chunk(n)[r], loss=lambda out, x: F.mse_loss(out, x),
                distributed_step=step, mode="train")


def test_a_gradient_sync_the_step_skips_is_named_after_its_backward_call() -> None:
    buggy = _data_parallel(False)
    report = verify(buggy, world_size=2)
    assert not run_numeric(buggy, 2).agree
    assert report.verdict == "discrepancy" and report.kind == "missing reduction", report.diagnosis
    first = report.distributed[0]
    assert (Path(first.file).name, first.line) == (Path(__file__).name, _line(_data_parallel_step, "# BACKWARD")), first
    assert f"after the backward call at line {first.line}" in report.fix
    assert any(s.line == _line(_Proj, "# FORWARD") for s in report.distributed[1:]), report.distributed
    fixed = _data_parallel(True)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


def test_without_a_step_of_the_users_the_share_stays_at_its_forward_line() -> None:
    """shardproof's default step runs the backward: no line of the user's calls it."""
    case = _data_parallel(None)
    report = verify(case, world_size=2)
    assert not run_numeric(case, 2).agree
    assert report.kind == "missing reduction", report.diagnosis
    assert report.distributed[0].line == _line(_Proj, "# FORWARD"), report.distributed
    assert "backward call" not in report.fix


class _Tied(nn.Module):
    """`weight` used twice: x @ W.T, then @ W (an embedding and its tied output layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight), self.weight.T)


def _sync_tied(model: nn.Module, tied: bool) -> None:
    if tied:
        dist.all_reduce(model.main_grad)  # the two stages' copies summed
    dist.all_reduce(model.main_grad, group=model.alone)  # SYNC: the data-parallel group (this rank alone)


def _pipeline_step(sync: bool, tied: bool):
    """Two stages, each holding the weight: rank 0 applies it first, rank 1 second, the gradient
    accumulated in a `main_grad` buffer, synced (if `sync`) and applied by SGD."""
    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor | None:
        (x,) = inputs
        if rank == 0:
            h = F.linear(x, model.weight)
            dist.send(h.detach(), 1)
            grad = torch.empty_like(h)
            dist.recv(grad, 1)
            h.backward(grad)
            value = None
        else:
            h = torch.empty(BATCH, HIDDEN)
            dist.recv(h, 0)
            h.requires_grad_()
            value = F.mse_loss(F.linear(h, model.weight.T), x)
            value.backward()
            dist.send(h.grad, 0)
        model.main_grad = torch.zeros(HIDDEN, HIDDEN)
        model.main_grad.add_(model.weight.grad)  # ACCUMULATE
        if sync:
            _sync_tied(model, tied)
        with torch.no_grad():
            model.weight.sub_(0.1 * model.main_grad)
            model.weight.grad = None
        return value
    return step


def _pipeline(sync: bool, tied: bool) -> Case:
    def stage(rank: int, world_size: int) -> nn.Module:
        model = _Tied()
        model.alone = [dist.new_group([r]) for r in range(world_size)][rank]
        return model
    return Case(_Tied, stage, lambda: (torch.randn(BATCH, HIDDEN),), loss=lambda out, x: F.mse_loss(out, x),
                distributed_step=_pipeline_step(sync, tied), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                mode="step")


@pytest.mark.parametrize("sync, culprit", [(True, (_sync_tied, "# SYNC")), (False, (_pipeline_step, "# ACCUMULATE"))],
                         ids=["sync-without-the-tie", "no-sync"])
def test_a_tied_weights_copies_never_summed_are_named_where_the_step_syncs_them(sync: bool, culprit: tuple) -> None:
    buggy = _pipeline(sync, False)
    report = verify(buggy, world_size=2)
    assert not run_numeric(buggy, 2).agree
    assert report.verdict == "discrepancy" and report.kind == "missing reduction", report.diagnosis
    assert report.distributed[0].line == _line(*culprit), report.distributed
    fixed = _pipeline(True, True)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree
