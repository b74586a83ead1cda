"""A vocab-parallel lookup whose mask lets another range of ids through than the rows the rank
holds (an off-by-one bound, torchtitan's spelling: rows at clamped local ids times a float mask):
overlapping shards at the mask's line, in agreement with the numbers; the right bounds are proven."""

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

VOCAB, WIDTH, WORLD = 16, 4, 2


class VocabParallel(nn.Module):
    def __init__(self, rows: int, upper: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, WIDTH))
        self.upper = upper  # added to the mask's upper bound: 0 is right

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.shape[0] == VOCAB:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        offset = dist.get_rank() * rows
        mask = (ids >= offset) & (ids < offset + rows + self.upper)  # the mask's line
        out = F.embedding((ids - offset).clamp(0, rows - 1), self.weight) * mask.unsqueeze(-1).to(torch.float32)
        dist.all_reduce(out)
        return out


def _case(upper: int) -> Case:
    ids = torch.arange(2 * VOCAB).mul(3).remainder(VOCAB).view(2, VOCAB)  # every id
    return Case(lambda: VocabParallel(VOCAB), lambda rank, n: VocabParallel(VOCAB // n, upper), lambda: (ids,))


@pytest.mark.parametrize("upper, said", [(1, "counted twice"), (-1, "no rank counts them")])
def test_a_mask_off_by_one_is_overlapping_shards_at_its_line(upper: int, said: str) -> None:
    report = verify(_case(upper), world_size=WORLD)
    assert report.verdict == "discrepancy" and "overlapping shards" in report.diagnosis and said in report.diagnosis
    lines, start = inspect.getsourcelines(VocabParallel.forward)
    mask_line = start + next(i for i, line in enumerate(lines) if "the mask's line" in line)
    culprit = report.distributed[0]
    assert (Path(culprit.file).name, culprit.line) == (Path(__file__).name, mask_line)
    assert not run_numeric(_case(upper), WORLD).agree


def test_the_right_mask_is_proven() -> None:
    assert verify(_case(0), world_size=WORLD).verdict == "equivalent"
    assert run_numeric(_case(0), WORLD).agree


def test_a_table_shard_cut_for_another_rank_is_overlapping_shards_at_the_loader() -> None:
    """The mask holds the rank's own ids, the loader gave it another rank's rows: the loader's slice."""

    def every_rank_rows_0(ref_state: dict, rank: int, world_size: int) -> dict:
        return {"weight": ref_state["weight"].chunk(world_size)[0]}  # the loader's line

    case = _case(0)
    case.shard_state = every_rank_rows_0
    report = verify(case, world_size=WORLD)
    assert report.verdict == "discrepancy" and "overlapping shards" in report.diagnosis
    assert "loader" in report.diagnosis and "the loader's line" in report.distributed[0].code
    assert not run_numeric(case, WORLD).agree
