"""Positions used along another dim than the one they were found along (relations/diagnose/
indices.py): greedy sampling over vocab-parallel logits picks each token from the ranks' stack of
candidates at the rank with the largest logit; picked along the vocabulary instead, it reads another
axis. The buggy program is found at its line and disagrees numerically; the fixed twin is proven."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, VOCAB, TOKENS = 8, 16, 5


class Greedy(nn.Module):
    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).argmax(dim=-1)


class VocabParallelGreedy(Greedy):
    def __init__(self, rank: int, world_size: int, dim: int):
        super().__init__(VOCAB // world_size)
        self.offset, self.dim = rank * (VOCAB // world_size), dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        tokens = funcol.all_gather_tensor((logits.argmax(dim=-1) + self.offset)[None], 0, dist.group.WORLD)
        bests = funcol.all_gather_tensor(logits.amax(dim=-1)[None], 0, dist.group.WORLD)
        return torch.take_along_dim(tokens, bests.argmax(dim=0, keepdim=True), dim=self.dim)[0]  # BUG when dim is 1


def _case(dim: int) -> Case:
    return Case(Greedy, lambda r, n: VocabParallelGreedy(r, n, dim), lambda: (torch.randn(TOKENS, HIDDEN),))


def test_positions_found_along_the_ranks_picked_along_the_vocabulary_read_another_axis() -> None:
    report, numbers = verify(_case(1), world_size=2), run_numeric(_case(1), 2)
    assert not numbers.agree
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    assert "picks along dim 1" in report.diagnosis and "found along dim 0" in report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed


@pytest.mark.parametrize("world_size", [2, 4])
def test_positions_picked_along_the_dim_they_were_found_along_are_proven(world_size: int) -> None:
    report, numbers = verify(_case(0), world_size=world_size), run_numeric(_case(0), world_size)
    assert report.verdict == "equivalent", report.diagnosis
    assert numbers.agree, numbers.detail
