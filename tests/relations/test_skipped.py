"""A backward step a rank skips is diagnosed at the forward line whose backward it is, and only
when the numbers differ: DTensor's loss_parallel with log_softmax on its own line (no other op
shares the line, so its backward leaves no op), read by nll_loss only (right) or by an entropy
bonus too (wrong)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

THIS_FILE = str(Path(__file__).resolve())
VOCAB, HIDDEN = 16, 8


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)


def _parallel_head(rank: int, world_size: int) -> nn.Module:
    plan = {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(Head(), init_device_mesh("cpu", (world_size,)), plan)


def _inputs() -> tuple:
    return torch.randn(6, HIDDEN), torch.arange(6).mul(5).remainder(VOCAB)


def _nll_only(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(logits, dim=-1)
    return F.nll_loss(log_probs, labels)


def _with_entropy(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(logits, dim=-1)
    return F.nll_loss(log_probs, labels) + 0.1 * (log_probs.exp() * log_probs).sum(-1).mean()


def _case(loss: Callable) -> Case:
    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        with loss_parallel():
            value = loss(model(*inputs), *inputs)
            value.backward()
        return value

    functions = [Head.forward, _parallel_head, _inputs, loss, step]
    return Case(Head, _parallel_head, _inputs, loss=loss, distributed_step=step, mode="train",
                source=Path(THIS_FILE), source_functions=functions)


@pytest.mark.parametrize("world_size", [2, 4])
def test_log_softmax_backward_skipped_under_loss_parallel_is_named_at_its_line(world_size: int) -> None:
    case = _case(_with_entropy)
    report = verify(case, world_size=world_size)
    assert not run_numeric(case, world_size, mode="train").agree
    assert report.verdict == "discrepancy", report.diagnosis
    assert "missing backward step" in report.diagnosis and "gradient of `output.weight`" in report.diagnosis
    culprit = report.distributed[0]
    assert (culprit.file, culprit.line) == (THIS_FILE, inspect.getsourcelines(_with_entropy)[1] + 1)
    assert culprit.op.endswith("in the backward")


def test_log_softmax_read_by_nll_only_is_proven() -> None:
    case = _case(_nll_only)
    report = verify(case, world_size=2)
    assert run_numeric(case, 2, mode="train").agree
    assert report.verdict == "equivalent", report.diagnosis
