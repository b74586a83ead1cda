"""An op along another dim than its values need (relations/diagnose/dims.py): found at that op,
not where its value is used later. Each buggy program disagrees numerically; each fixed twin is
proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, ROWS = 8, 8


class Scores(nn.Module):
    """A projection's values, normalised (softmax) or summed over the features, then projected again."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.reduce(self.proj(x), -1))

    def reduce(self, y: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.softmax(y, dim) if self.op == "softmax" else y * y.sum(dim, keepdim=True)


class DataParallelScores(Scores):
    def __init__(self, op: str, bug: str):
        super().__init__(op)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) / 2 if self.bug == "operand" else self.proj(x)  # BUG when operand
        dim = 0 if self.bug == "dim" else -1
        z = torch.softmax(y, dim) if self.op == "softmax" else y * y.sum(dim, keepdim=True)  # BUG when dim
        return self.out(z)


def _case(op: str, bug: str) -> Case:
    return Case(lambda: Scores(op), lambda r, n: DataParallelScores(op, bug), lambda: (torch.randn(ROWS, HIDDEN),),
                shard_input=lambda i, full, r, n: full.chunk(n, 0)[r], output=("shard", 0))


@pytest.mark.parametrize("op", ["softmax", "sum"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_an_op_along_another_dim_is_found_at_that_op(op: str, world_size: int) -> None:
    """Along dim 0 (the rank's rows) the values part at the op; along dim 1 they agree."""
    buggy = _case(op, "dim")
    assert not run_numeric(buggy, world_size).agree
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    first = report.distributed[0]
    assert Path(first.file).name == Path(__file__).name and "# BUG when dim" in first.code, report.distributed
    assert "works along dim 0" in report.diagnosis and "along dim 1" in report.diagnosis
    fixed = _case(op, "")
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree


@pytest.mark.parametrize("op", ["softmax", "sum"])
def test_an_op_along_the_right_dim_of_a_wrong_operand_is_not_blamed_on_its_dim(op: str) -> None:
    """Must not match: along either dim the op's value disagrees, its operand being wrong (halved: the
    rules cannot tell the softmax of half the values from the reference's, so the proof stays open)."""
    buggy = _case(op, "operand")
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict != "equivalent" and "works along dim" not in report.diagnosis, report.diagnosis


SEQ, HALF = 8, 4  # tokens; each rank's queries and each key block (square blocks)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).T / HIDDEN**0.5
        return torch.softmax(scores, -1) @ self.v(x)


class BlockwiseAttention(Attention):
    """The rank's queries over two key blocks, merged by their log-sum-exps (an online softmax)."""

    def __init__(self, rank: int, lse_dim: int):
        super().__init__()
        self.rank, self.lse_dim = rank, lse_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x)[self.rank * HALF : (self.rank + 1) * HALF], self.k(x), self.v(x)
        outs, lses = [], []
        for block in range(SEQ // HALF):
            scores = q @ k[block * HALF : (block + 1) * HALF].T / HIDDEN**0.5
            outs.append(torch.softmax(scores, -1) @ v[block * HALF : (block + 1) * HALF])
            lses.append(torch.logsumexp(scores, self.lse_dim if block == 0 else -1))  # BUG when lse_dim is 0
        merged = torch.logsumexp(torch.stack(lses), 0)
        return sum(torch.exp(lse - merged)[:, None] * out for lse, out in zip(lses, outs))


def test_a_value_along_another_dim_that_agrees_alone_is_found_where_it_is_made() -> None:
    """A block's log-sum-exp over its queries is a partial result as much as over its keys; the
    values part only at the merge. Over the keys, the ops after it agree: its line is the site."""
    def case(lse_dim: int) -> Case:
        return Case(Attention, lambda r, n: BlockwiseAttention(r, lse_dim), lambda: (torch.randn(SEQ, HIDDEN),),
                    output=("shard", 0))

    buggy = case(0)
    assert not run_numeric(buggy, 2).agree
    report = verify(buggy, world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "wrong layout", report.diagnosis
    first = report.distributed[0]
    assert "# BUG when lse_dim" in first.code and "`logsumexp`" in report.diagnosis, report.distributed
    assert "works along dim 0" in report.diagnosis and "the ops after it agree" in report.diagnosis
    fixed = case(-1)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree
