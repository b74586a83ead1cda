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


class MaskedIds(nn.Module):
    """Megatron's spelling: ids outside the rank's rows set to 0 before the lookup, their rows
    zeroed after it; `flip` renumbers the ids as start - ids, `wide` widens the mask by one."""

    def __init__(self, rows: int, flip: bool = False, wide: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, WIDTH))
        self.flip, self.wide = flip, wide

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.shape[0] == VOCAB:
            return self.weight[ids]
        rows = self.weight.shape[0]
        start = dist.get_rank() * rows
        outside = (ids < start) | (ids >= start + rows + self.wide)  # the mask's line
        local = start - ids if self.flip else ids - start  # the renumbering's line
        local[outside] = 0
        out = self.weight[local.clamp(-rows, rows - 1)]
        out[outside] = 0.0
        dist.all_reduce(out)
        return out


def _masked_ids_case(**kwargs) -> Case:
    ids = torch.arange(2 * VOCAB).mul(3).remainder(VOCAB).view(2, VOCAB)  # every id
    return Case(lambda: MaskedIds(VOCAB), lambda rank, n: MaskedIds(VOCAB // n, **kwargs), lambda: (ids,))


def _line(marker: str) -> int:
    lines, start = inspect.getsourcelines(MaskedIds.forward)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def test_ids_renumbered_wrongly_are_found_at_the_renumbering_not_at_the_lookup() -> None:
    """The mask fits the rows the rank holds; `start - ids` reads other rows of its own shard."""
    case = _masked_ids_case(flip=True)
    report = verify(case, world_size=WORLD)
    assert report.verdict == "discrepancy" and "renumbered wrongly" in report.diagnosis
    culprit = report.distributed[0]
    assert (Path(culprit.file).name, culprit.line) == (Path(__file__).name, _line("the renumbering's line"))
    assert not run_numeric(case, WORLD).agree


def test_ids_renumbered_rightly_behind_a_megatron_mask_are_proven() -> None:
    assert verify(_masked_ids_case(), world_size=WORLD).verdict == "equivalent"
    assert run_numeric(_masked_ids_case(), WORLD).agree


def test_a_wrong_mask_before_a_right_renumbering_stays_at_the_mask() -> None:
    """Must not match: the renumbering is ids - start; the mask lets one id too many through."""
    case = _masked_ids_case(wide=1)
    report = verify(case, world_size=WORLD)
    assert report.verdict == "discrepancy" and "renumbered" not in report.diagnosis
    culprit = report.distributed[0]
    assert (Path(culprit.file).name, culprit.line) == (Path(__file__).name, _line("the mask's line"))
    assert not run_numeric(case, WORLD).agree


class Sentinel(nn.Module):
    """Expert-parallel routing's spelling: ids outside the rank's rows renumbered to a sentinel
    row past them, the ids top-k positions (so a bound the ids always meet folds away)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, WIDTH))

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        ids = scores.topk(2, dim=-1).indices
        if self.weight.shape[0] == VOCAB:
            return F.embedding(ids, self.weight)
        rows = VOCAB // dist.get_world_size()
        start = dist.get_rank() * rows
        own = (ids >= start) & (ids < start + rows)
        local = torch.where(own, ids - start, rows).clamp(max=self.weight.shape[0] - 1)
        out = F.embedding(local, self.weight) * own.unsqueeze(-1).to(torch.float32)
        dist.all_reduce(out)
        return out


def test_a_table_cut_one_row_off_behind_a_one_sided_mask_is_found_at_the_loader() -> None:
    """On the last rank the mask's upper bound folds away (`ids >= start`, read as the rank's own
    ids [start:VOCAB) or as the others' [0:start)); the loader cut rows one further on."""

    def shifted(ref_state: dict, rank: int, world_size: int) -> dict:
        rows = VOCAB // world_size
        return {"weight": ref_state["weight"][rank * rows + 1 : (rank + 1) * rows + 1]}  # the loader's line

    case = Case(lambda: Sentinel(VOCAB), lambda rank, n: Sentinel(VOCAB // n), lambda: (torch.randn(6, VOCAB),))
    case.shard_state = shifted
    report = verify(case, world_size=WORLD)
    assert report.verdict == "discrepancy" and "loader" in report.diagnosis
    assert "the loader's line" in report.distributed[0].code
    assert not run_numeric(case, WORLD).agree
