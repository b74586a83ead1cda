"""An output of another shape than the reference's, found at the op that made its sizes go wrong
(relations/diagnose/diagnoser.py, `wrong_shape`): the buggy program is found at its `# BUG` line and
disagrees numerically; the fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, VOCAB, TOKENS, TOP = 8, 16, 5, 3


class TopLogits(nn.Module):
    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).topk(TOP, dim=-1).values


class VocabParallelTopLogits(TopLogits):
    """Each rank's top values over its vocab slice, gathered, then the top over all candidates."""

    def __init__(self, world_size: int, dim: int):
        super().__init__(VOCAB // world_size)
        self.world_size, self.dim = world_size, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x).topk(TOP, dim=-1).values
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(pieces, local)
        candidates = torch.cat(pieces, dim=self.dim)  # BUG when dim is 0: the candidates of other tokens
        return candidates.topk(TOP, dim=-1).values


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_output_of_the_wrong_shape_is_found_where_its_sizes_go_wrong(world_size: int) -> None:
    def case(dim: int) -> Case:
        return Case(TopLogits, lambda r, n: VocabParallelTopLogits(n, dim), lambda: (torch.randn(TOKENS, HIDDEN),))

    buggy = case(0)
    report = verify(buggy, world_size=world_size)
    assert not run_numeric(buggy, world_size).agree
    assert report.verdict == "discrepancy" and "wrong layout" in report.diagnosis, report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed
    fixed = case(-1)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree
