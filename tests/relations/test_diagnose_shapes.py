"""An output of another shape than the reference's, found at the op that made its sizes go wrong
(relations/diagnose/diagnoser.py, `wrong_shape`): the buggy program is found at its `# BUG` line and
disagrees numerically; the fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
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


class LocalTopAlong(TopLogits):
    """Each rank's top values over its vocab slice (along `dim`), gathered along the vocab."""

    def __init__(self, world_size: int, dim: int):
        super().__init__(VOCAB // world_size)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x).topk(TOP, dim=self.dim).values  # BUG when dim is 0: the top tokens, not logits
        candidates = funcol.all_gather_tensor(local.t().contiguous(), 0, dist.group.WORLD).t()
        return candidates.topk(TOP, dim=-1).values


def test_an_op_on_the_wrong_axis_is_named_before_a_layout_the_tool_inferred() -> None:
    """The weight's shard the tool inferred (no `shard_state`) has no line of the user's: the top k
    along the wrong dim that reads it comes first."""
    def case(dim: int) -> Case:
        return Case(TopLogits, lambda r, n: LocalTopAlong(n, dim), lambda: (torch.randn(TOKENS + 1, HIDDEN),))

    buggy = case(0)
    report = verify(buggy, world_size=2)
    assert not run_numeric(buggy, 2).agree
    assert report.verdict == "discrepancy", report.diagnosis
    assert "# BUG" in report.distributed[0].code, report.distributed
    fixed = case(-1)
    assert verify(fixed, world_size=2).verdict == "equivalent" and run_numeric(fixed, 2).agree


class Logits(nn.Module):
    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class GatheredLogits(Logits):
    """A column-parallel head whose logits are all-gathered along the vocabulary."""

    def __init__(self, world_size: int):
        super().__init__(VOCAB // world_size)
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x)
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(pieces, local)
        return torch.cat(pieces, dim=-1)


def _head_rows(start_at_zero: bool):
    def shard_state(ref: dict, rank: int, world_size: int) -> dict:
        rows = VOCAB // world_size
        start = 0 if start_at_zero else rank * rows
        return {"head.weight": ref["head.weight"][start : (rank + 1) * rows]}  # BUG when the start is 0

    return shard_state


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensors_of_other_shapes_for_one_collective_are_found_where_their_shapes_part(world_size: int) -> None:
    """Rank 1's loader cuts twice the rows of rank 0's: the all-gather gets tensors of other shapes,
    found at the loader's cut."""
    def case(start_at_zero: bool) -> Case:
        return Case(Logits, lambda r, n: GatheredLogits(n), lambda: (torch.randn(TOKENS, HIDDEN),),
                    shard_state=_head_rows(start_at_zero), output="replicate")

    buggy = case(True)
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy" and report.kind == "mismatched collectives", report.diagnosis
    assert "the shapes part at `slice`" in report.diagnosis and "# BUG" in report.distributed[0].code, report.distributed
    with pytest.raises(RuntimeError, match="must match the size"):  # the real run fails at the all-gather
        run_numeric(buggy, world_size)
    fixed = case(False)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree
