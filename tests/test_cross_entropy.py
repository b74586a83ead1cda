"""Vocab-parallel cross entropy (Megatron's forward, spelled with gather and masked_fill) under
variations of how the row max is reduced over ranks. The verdict must follow the numbers: the max
shift cancels over the reals, so any per-row shift all ranks share is correct, a rank-local one
is not."""

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

VOCAB, HIDDEN, TOKENS = 16, 8, (2, 3)
REDUCE_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


class VocabParallelLoss(nn.Module):
    """This rank's vocab rows of the lm head, then the per-token loss across ranks."""

    def __init__(self, rank: int, world_size: int, max_reduce: str | None) -> None:
        super().__init__()
        self.rank, self.max_reduce = rank, max_reduce
        self.weight = nn.Parameter(torch.empty(VOCAB // world_size, HIDDEN))

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        peak = logits.max(dim=-1, keepdim=True)[0]
        if self.max_reduce is not None:
            dist.all_reduce(peak, op=REDUCE_OPS[self.max_reduce])
        logits = logits - peak
        lo = self.rank * logits.size(-1)
        outside = (target < lo) | (target >= lo + logits.size(-1))
        local = target - lo
        local[outside] = 0
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked)
        total = logits.exp().sum(dim=-1)
        dist.all_reduce(total)
        return total.log() - picked


class Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(F.linear(hidden, self.weight), dim=-1)
        return -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def _case(max_reduce: str | None) -> Case:
    return Case(
        Loss,
        lambda rank, n: VocabParallelLoss(rank, n, max_reduce),
        lambda: (torch.randn(*TOKENS, HIDDEN), torch.randint(0, VOCAB, TOKENS)),
    )


def _checked(case: Case, world_size: int):
    report = verify(case, world_size=world_size)
    agree = run_numeric(case, world_size).agree
    assert report.verdict != "equivalent" or agree
    assert report.verdict != "discrepancy" or not agree
    return report, agree


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_max_reduced_by_max_is_proven(world_size: int) -> None:
    report, _ = _checked(_case("max"), world_size)
    assert report.verdict == "equivalent", report.diagnosis


def test_rank_local_max_is_a_partial_max_at_its_line() -> None:
    report, _ = _checked(_case(None), 2)
    assert report.verdict == "discrepancy"
    assert "missing reduction" in report.diagnosis and "partial max" in report.diagnosis
    lines, start = inspect.getsourcelines(VocabParallelLoss.forward)
    line = start + next(i for i, text in enumerate(lines) if "logits.max(" in text)
    assert report.distributed[0].line == line


def test_max_reduced_by_sum_is_a_shared_shift_and_never_a_discrepancy() -> None:
    report, agree = _checked(_case("sum"), 2)
    assert agree
    assert report.verdict != "discrepancy", report.diagnosis
