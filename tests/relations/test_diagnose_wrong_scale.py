"""Wrong scale found at the op that combined the right terms with the wrong coefficients, not at an
earlier difference the reference writes another way (relations/diagnose/wrong_scale.py, `_scaled`).
The buggy program is found at its `# BUG` line and disagrees numerically; the fixed twin is proven
and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, VOCAB, TOKENS = 4, 8, 3


class Scores(nn.Module):
    """0.9 (sum - max) - 0.1 sum of squares of the logits, the sums and max over the vocabulary."""

    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        s, m, q = y.sum(-1), y.amax(-1), (y * y).sum(-1)
        return 0.9 * s - (0.1 * q + 0.9 * m)


class VocabParallelScores(Scores):
    def __init__(self, world_size: int, swapped: bool):
        super().__init__(VOCAB // world_size)
        self.swapped = swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        s, m, q = y.sum(-1), y.amax(-1), (y * y).sum(-1)
        dist.all_reduce(s)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        dist.all_reduce(q)
        spread = s - m
        if self.swapped:
            return 0.1 * q - 0.9 * spread  # BUG: the operands of the difference swapped
        return 0.9 * spread - 0.1 * q


def _vocab_rows(state: dict, rank: int, world_size: int) -> dict:
    return {"head.weight": state["head.weight"].chunk(world_size, 0)[rank]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_combination_of_the_right_terms_with_the_wrong_signs_is_found_where_it_is_combined(world_size: int) -> None:
    def case(swapped: bool) -> Case:
        return Case(Scores, lambda r, n: VocabParallelScores(n, swapped), lambda: (torch.randn(TOKENS, HIDDEN),),
                    shard_state=_vocab_rows)

    buggy = case(True)
    assert not run_numeric(buggy, world_size).agree
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy" and report.kind == "wrong scale", report.diagnosis
    first = report.distributed[0]
    assert Path(first.file).name == Path(__file__).name and "# BUG" in first.code, report.distributed
    fixed = case(False)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree
