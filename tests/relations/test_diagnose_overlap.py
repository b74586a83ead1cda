"""Overlapping shards: a rank cuts one operand of a row-parallel contraction at another offset than
the other, so over the ranks that operand's shards overlap and leave a gap; or ranks gather rows
cut at another offset than their own (overlapping, or out of order). The diagnosis names the kind
of fault, the loader line and the tensor it cuts, and agrees with the numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case, load_case
from shardproof.oracle import run_numeric

MLP = Path(__file__).parents[2] / "examples" / "mlp_tp.py"
WORLD = 2
HIDDEN = 4


def _one_row_off(ref_state: dict, rank: int, world_size: int) -> dict:
    """The default cut (rows of `up`, columns of `down`), but rank 0's `up` rows start one further
    on: its activations are columns [1, ffn/n + 1) while its `down` columns are [0, ffn/n)."""
    out = {}
    for name, tensor in ref_state.items():
        dim = 0 if name.startswith("up.") else (1 if name == "down.weight" else None)
        out[name] = tensor if dim is None else tensor.chunk(world_size, dim)[rank]
    width = out["up.bias"].shape[0]
    if rank == 0:
        out["up.weight"], out["up.bias"] = ref_state["up.weight"][1 : width + 1], ref_state["up.bias"][1 : width + 1]  # BUG
    return out


def test_an_activation_shard_one_row_off_is_overlapping_shards_at_the_loader_line() -> None:
    case = load_case(MLP)
    case.shard_state = _one_row_off
    report = verify(case, world_size=WORLD)
    assert not run_numeric(case, WORLD).agree
    assert report.verdict == "discrepancy", report.diagnosis
    assert "overlapping shards" in report.diagnosis and "first operand" in report.diagnosis
    assert "`up.weight`" in report.diagnosis
    culprit = report.distributed[0]
    assert (Path(culprit.file).name, culprit.rank) == (Path(__file__).name, 0) and "# BUG" in culprit.code


def test_pieces_counted_twice_by_a_sum_over_ranks_are_overlapping_shards() -> None:
    """Every rank loads shard 0: the all-reduce adds piece [0, n/2) twice and never reads the rest,
    a structural fault (it stands without numbers on a model too large to run)."""
    case = load_case(Path(__file__).parents[1] / "cases" / "all-ranks-shard-0_buggy.py")
    report = verify(case, world_size=WORLD)
    assert not run_numeric(case, WORLD).agree
    assert report.verdict == "discrepancy" and "wrong layout (overlapping shards)" in report.diagnosis


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(x))


class SequenceParallelHead(Head):
    """The tanh on this rank's rows of the sequence, all-gathered before the projection."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = torch.tanh(x)
        gathered = torch.empty(local.shape[0] * self.world_size, *local.shape[1:])
        dist.all_gather_into_tensor(gathered, local)
        return self.proj(gathered)


def _sequence_parallel(chunk: Callable[[int, int], int]) -> Case:
    return Case(Head, lambda r, n: SequenceParallelHead(n), lambda: (torch.randn(8, HIDDEN),),
                shard_input=lambda i, full, r, n: full.chunk(n, 0)[chunk(r, n)])  # BUG unless chunk(r, n) == r


@pytest.mark.parametrize("chunk, kind, said", [
    (lambda r, n: 0, "overlapping shards", "overlap at [0:4) and leave out [4:8)"),  # BUG: rank 0's rows everywhere
    (lambda r, n: (r + 1) % n, "wrong layout", "hold every part once but out of the members' order"),  # BUG: the next's
])
def test_gathered_rows_some_rank_cut_at_another_offset_are_found_at_the_cut(chunk, kind: str, said: str) -> None:
    case = _sequence_parallel(chunk)
    report = verify(case, world_size=WORLD)
    assert not run_numeric(case, WORLD).agree
    assert report.verdict == "discrepancy" and report.kind == kind and said in report.diagnosis, report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed


def test_gathered_rows_each_rank_cut_at_its_own_offset_are_proven() -> None:
    case = _sequence_parallel(lambda r, n: r)
    report = verify(case, world_size=WORLD)
    assert report.verdict == "equivalent", report.diagnosis
    assert run_numeric(case, WORLD).agree
