"""Which part of a dim is a rank's own chunk, and the loader's cut of another one found at its line
(relations/diagnose/shards.py): each buggy program is found at its `# BUG` line and disagrees
numerically; each fixed twin is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric
from shardproof.relations.diagnose.shards import _is_chunk_of_rank, _is_rank_chunk
from shardproof.relations.diagnose.wrong_layout import LayoutFaults
from shardproof.relations.layout import box_along
from shardproof.relations.rules import Rules


def test_equal_chunks_are_the_ranks_own_modulo_their_count() -> None:
    assert _is_rank_chunk(1, (4, 8), (0, 8)) and _is_rank_chunk(3, (4, 8), (0, 8))
    assert not _is_rank_chunk(0, (4, 8), (0, 8))
    assert _is_rank_chunk(5, (0, 8), (0, 8))  # the whole is every rank's


def test_an_empty_part_is_no_ranks_chunk() -> None:
    """A rank whose head range came out empty (a wrong rank passed to the head split) holds [6:6):
    no rank's chunk, and no division by its zero width."""
    assert not _is_rank_chunk(0, (6, 6), (0, 12))
    assert _is_rank_chunk(0, (0, 0), (0, 0))


def test_consecutive_shards_stacked_along_a_new_axis_ahead_are_no_wrong_axis() -> None:
    """Sequence shards (2, 4, d) given a new axis and joined along it: ahead of the sequence
    (2, 1, 4, d) -> (2, 2, 4, d) is the whole, reshaped (XLA's all-gather of sequence shards);
    behind it (2, 4, 1, d) -> (2, 4, 2, d) interleaves the rows: the wrong axis."""
    class Probe(LayoutFaults):
        def __init__(self, rules: Rules) -> None:
            self.r = rules

    r = Rules()
    x = r.leaf("x", (2, 8, 3), "float32")
    shards = [r.slice(x, box_along((2, 8, 3), 1, 4 * i, 4 * i + 4)) for i in range(2)]
    ahead = r.cat([r.view(s, (2, 1, 4, 3)) for s in shards], 1)
    behind = r.cat([r.view(s, (2, 4, 1, 3)) for s in shards], 2)
    assert Probe(r)._wrong_axis(ahead) is None
    assert Probe(r)._wrong_axis(behind) == (2, 1)
    assert Probe(r)._wrong_axis(r.cat([r.view(s, (2, 1, 4, 3)) for s in reversed(shards)], 1)) == (1, 2)


def test_fewer_chunks_than_ranks_may_be_shared_in_runs() -> None:
    """Two kv heads over four ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1 (GQA)."""
    assert _is_chunk_of_rank(1, 4, (0, 4), (0, 8)) and _is_chunk_of_rank(2, 4, (4, 8), (0, 8))
    assert _is_chunk_of_rank(1, 4, (4, 8), (0, 8))  # dealt round
    assert not _is_chunk_of_rank(1, 2, (0, 4), (0, 8)) and not _is_chunk_of_rank(0, 4, (2, 2), (0, 8))


# --- the loader's cut, found at the loader's line ------------------------------------------------

HIDDEN, SEQ, FFN = 8, 8, 16


class MeanPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=1))


class SequenceParallelMeanPool(MeanPool):
    """Each rank holds a shard of every sequence; the head is replicated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.sum(dim=1) / SEQ  # this rank's share of the mean
        dist.all_reduce(pooled)
        return self.head(pooled)


class GatedMlp(nn.Module):
    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ColumnGatedMlp(GatedMlp):
    """The fused [gate; up] weight holds this rank's gate rows, then its up rows."""

    def __init__(self, world_size: int):
        super().__init__(FFN // world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        dist.all_reduce(y)
        return y


def _sequence_shard(wrong: bool):
    def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        if wrong:
            return full.chunk(world_size, dim=1)[0]  # BUG: every rank reads shard 0
        return full.chunk(world_size, dim=1)[rank]

    return shard_input


def _gate_up_loader(wrong: bool):
    def shard_state(ref: dict, rank: int, world_size: int) -> dict:
        gate, up = ref["gate_up.weight"].chunk(2, dim=0)
        if wrong:
            gate = gate.chunk(world_size, dim=0)[0]  # BUG: rank 0's gate rows on every rank
        else:
            gate = gate.chunk(world_size, dim=0)[rank]
        up = up.chunk(world_size, dim=0)[rank]
        return {"gate_up.weight": torch.cat([gate, up]), "down.weight": ref["down.weight"].chunk(world_size, dim=1)[rank]}

    return shard_state


def _check(case: Case, world_size: int, kind: str | None) -> str:
    report = verify(case, world_size=world_size)
    numbers = run_numeric(case, world_size)
    if kind is None:
        assert report.verdict == "equivalent" and numbers.agree, report.diagnosis
        return ""
    assert not numbers.agree
    assert report.verdict == "discrepancy" and kind in report.diagnosis, report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed
    return report.diagnosis + " | " + report.fix


@pytest.mark.parametrize("world_size", [2, 4])
def test_shares_of_a_sum_cut_from_one_shard_on_every_rank_are_overlapping_shards_at_the_cut(world_size: int) -> None:
    """Every rank reads the input's first sequence shard: the ranks' shares of the mean overlap and
    leave a gap, which no reduction mends: the fault is the cut in shard_input, not the all-reduce."""

    def case(wrong: bool) -> Case:
        return Case(MeanPool, lambda r, n: SequenceParallelMeanPool(), lambda: (torch.randn(2, SEQ, HIDDEN),),
                    shard_input=_sequence_shard(wrong))

    said = _check(case(True), world_size, "overlapping shards")
    assert "`inputs()[0]`" in said and "not at its own chunk" in said
    _check(case(False), world_size, None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_fused_weights_block_cut_at_another_ranks_chunk_is_found_at_the_loader(world_size: int) -> None:
    """The runtime split of [gate; up] is right for a shard loaded right; the gate rows the loader
    cut are not the rank's, so the loader's line is the one to change."""

    def case(wrong: bool) -> Case:
        return Case(GatedMlp, lambda r, n: ColumnGatedMlp(n), lambda: (torch.randn(2, 3, HIDDEN),),
                    shard_state=_gate_up_loader(wrong))

    said = _check(case(True), world_size, "wrong layout")
    assert "gate" in said
    _check(case(False), world_size, None)

