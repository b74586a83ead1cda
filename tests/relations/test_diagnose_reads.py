"""What a collective is handed: a MAX over shares of a sum, a SUM of partial maxima (wrong reduce op),
and a buffer made with torch.empty that the missing all-gather should have filled (uninitialised
memory read). Each buggy program is found at its line and disagrees numerically; each fixed twin is
proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case, load_case
from shardproof.oracle import run_numeric

HIDDEN, FFN, VOCAB = 8, 16, 12


class Mlp(nn.Module):
    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class RowParallelMlp(Mlp):
    def __init__(self, world_size: int, op: dist.ReduceOp):
        super().__init__(FFN // world_size)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(F.gelu(self.up(x)))
        dist.all_reduce(y, op=self.op)  # BUG when op is MAX
        return y


class Logits(nn.Module):
    """The largest logit of each token: its max over the vocabulary."""

    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).amax(-1)


class VocabParallelMax(Logits):
    def __init__(self, world_size: int, op: dist.ReduceOp):
        super().__init__(VOCAB // world_size)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local_max = self.head(x).amax(-1)
        dist.all_reduce(local_max, op=self.op)  # BUG when op is SUM
        return local_max


class GatheredLogits(nn.Module):
    def __init__(self, world_size: int, gather: bool):
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB // world_size, bias=False)
        self.world_size, self.gather = world_size, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sum() * torch.ones(*x.shape[:-1], VOCAB)  # unread too, but of all ranks' parts of a piece
        local = self.head(x)  # BUG without the all_gather: nothing reads it
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        if self.gather:
            dist.all_gather(pieces, local)
        return torch.cat(pieces, dim=-1)


class GatheredActivations(GatheredLogits):
    """The value to gather made in two steps, both of a rank's part's size: the all-gather was handed the last."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)  # unread too without the all_gather, but not what it was handed
        local = torch.tanh(logits)  # BUG without the all_gather: nothing reads it
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        if self.gather:
            dist.all_gather(pieces, local)
        return torch.cat(pieces, dim=-1)


class TanhHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(x))


class ScatteredMlp(Mlp):
    """Row parallel, the sum over ranks reduce-scattered along the tokens (sequence parallel)."""

    def __init__(self, world_size: int, scatter: bool):
        super().__init__(FFN // world_size)
        self.world_size, self.scatter = world_size, scatter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(F.gelu(self.up(x)))  # BUG without the reduce-scatter: nothing reads it
        out = torch.empty(y.shape[0] // self.world_size, *y.shape[1:])
        if self.scatter:
            dist.reduce_scatter_single(out, y)
        return out


def gathered_rows(shard: torch.Tensor, world_size: int, gather: bool) -> torch.Tensor:
    """Every rank's rows of a parameter, as FSDP unshards one before use."""
    full = shard.new_empty(shard.shape[0] * world_size, *shard.shape[1:])  # BUG without the all_gather
    if gather:
        dist.all_gather_into_tensor(full, shard)
    return full


class ShardedHead(nn.Module):
    """The head's rows flat-sharded over the ranks, gathered whole where it is used."""

    def __init__(self, world_size: int, gather: bool):
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB // world_size, bias=False)
        self.world_size, self.gather = world_size, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, gathered_rows(self.head.weight, self.world_size, self.gather))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class BatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).mean(0)


class DataParallelBatchMean(BatchMean):
    """Each rank's mean over its shard of the batch, averaged over ranks."""

    def __init__(self, op: dist.ReduceOp):
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.proj(x).mean(0)
        dist.all_reduce(mean, op=self.op)  # BUG when op is SUM: the means of world size shards added up
        return mean


def _inputs() -> tuple:
    return (torch.randn(2, 3, HIDDEN),)


def _check(case: Case, world_size: int, kind: str | None) -> str:
    report = verify(case, world_size=world_size)
    numbers = run_numeric(case, world_size)
    if kind is None:
        assert report.verdict == "equivalent", report.diagnosis
        assert numbers.agree, numbers.detail
        return ""
    assert not numbers.agree
    assert report.verdict == "discrepancy" and report.kind == kind, report.diagnosis
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and "# BUG" in culprit.code, report.distributed
    return report.diagnosis + " | " + report.fix


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_max_over_shares_of_a_sum_is_a_wrong_reduce_op(world_size: int) -> None:
    def case(op: dist.ReduceOp) -> Case:
        return Case(Mlp, lambda r, n: RowParallelMlp(n, op), _inputs)

    said = _check(case(dist.ReduceOp.MAX), world_size, "wrong reduce op")
    assert "ReduceOp.MAX" in said and "only with ReduceOp.SUM" in said and "`y`" in said
    _check(case(dist.ReduceOp.SUM), world_size, None)


def test_a_sum_of_partial_maxima_is_a_wrong_reduce_op() -> None:
    def case(op: dist.ReduceOp) -> Case:
        return Case(Logits, lambda r, n: VocabParallelMax(n, op), _inputs)

    said = _check(case(dist.ReduceOp.SUM), 2, "wrong reduce op")
    assert "Partial(max)" in said and "only with ReduceOp.MAX" in said
    _check(case(dist.ReduceOp.MAX), 2, None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_sum_off_by_the_group_size_that_avg_makes_right_is_a_wrong_reduce_op(world_size: int) -> None:
    """The reduce op is the word to change, not the scale of every rank's share (the mean's division)."""
    def case(op: dist.ReduceOp) -> Case:
        return Case(BatchMean, lambda r, n: DataParallelBatchMean(op), lambda: (torch.randn(8, 3, HIDDEN),),
                    shard_input=lambda i, full, r, n: full.chunk(n, 0)[r], output="replicate")

    said = _check(case(dist.ReduceOp.SUM), world_size, "wrong reduce op")
    assert f"(x{world_size})" in said and "ReduceOp.SUM" in said and "with ReduceOp.AVG it gives" in said
    _check(case(dist.ReduceOp.AVG), world_size, None)


def test_a_buffer_no_all_gather_filled_is_an_uninitialised_memory_read() -> None:
    def case(gather: bool) -> Case:
        return Case(Head, lambda r, n: GatheredLogits(n, gather), _inputs, output="replicate")

    said = _check(case(False), 2, "uninitialised memory read")
    assert "`pieces`" in said and "allocated empty at line" in said and "nothing wrote" in said
    assert "`local` (line" in said and "never read" in said and "from `local`" in said
    _check(case(True), 2, None)


def test_a_buffer_no_all_gather_filled_is_found_at_the_last_value_made_before_it() -> None:
    def case(gather: bool) -> Case:
        return Case(TanhHead, lambda r, n: GatheredActivations(n, gather), _inputs, output="replicate")

    said = _check(case(False), 2, "uninitialised memory read")
    assert "`local` (line" in said and "never read" in said
    _check(case(True), 2, None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_buffer_no_all_gather_of_a_parameter_filled_is_found_where_it_is_allocated(world_size: int) -> None:
    """No value the program computes is left unread (the gather was handed a parameter): the
    allocation is named first, where the fill belongs, not the caller reading the result."""
    def case(gather: bool) -> Case:
        return Case(Head, lambda r, n: ShardedHead(n, gather), _inputs, output="replicate")

    said = _check(case(False), world_size, "uninitialised memory read")
    assert "`full`" in said and "never read" not in said
    _check(case(True), world_size, None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_buffer_no_reduce_scatter_filled_is_found_at_the_sum_it_should_have_scattered(world_size: int) -> None:
    """The value left unread holds every rank's part of the buffer (world size times its elements)."""
    def case(scatter: bool) -> Case:
        return Case(Mlp, lambda r, n: ScatteredMlp(n, scatter), lambda: (torch.randn(8, HIDDEN),),
                    shard_state=_row_parallel, output=("shard", 0))

    said = _check(case(False), world_size, "uninitialised memory read")
    assert "`out`" in said and "`y`" in said and "never read" in said
    _check(case(True), world_size, None)


def _row_parallel(state: dict, rank: int, world_size: int) -> dict:
    return {"up.weight": state["up.weight"].chunk(world_size, 0)[rank],
            "down.weight": state["down.weight"].chunk(world_size, 1)[rank]}


def test_a_max_reduce_scatter_of_flat_gradients_is_a_wrong_reduce_op_where_ops_before_it_are_unrelated(tmp_path) -> None:
    """ZeRO's reduce-scatter of the flattened gradients with MAX: the flat master copy's views
    before it relate to nothing by themselves, and the reduce-scatter is still named. The oracle's
    threaded group runs a MAX reduce-scatter as gloo does."""
    example = Path(__file__).parents[2] / "examples" / "mlp_dp_zero.py"
    buggy = tmp_path / "mlp_dp_zero.py"
    buggy.write_text(example.read_text().replace("op=dist.ReduceOp.AVG)", "op=dist.ReduceOp.MAX)  # BUG"))
    report = verify(buggy)
    assert report.verdict == "discrepancy" and report.kind == "wrong reduce op", report.diagnosis
    assert "# BUG" in report.distributed[0].code and "only with ReduceOp.SUM" in report.diagnosis
    assert not run_numeric(load_case(buggy), 2).agree
    fixed = load_case(example)
    assert verify(fixed).verdict == "equivalent" and run_numeric(fixed, 2).agree


@pytest.mark.parametrize("world_size", [2, 4])
def test_partial_maxima_gathered_over_ranks_and_reduced_over_tokens_are_a_wrong_reduce_dim(tmp_path, world_size: int) -> None:
    """A greedy head over vocab shards: each rank's best logit per token, gathered into (ranks,
    tokens), must be compared over the ranks (dim 0); over the tokens it combines nothing."""
    fixed_file = Path(__file__).parents[1] / "cases" / "greedy-argmax-funcol_fixed.py"
    buggy = tmp_path / "greedy_head.py"
    buggy.write_text(fixed_file.read_text().replace("bests.argmax(dim=0, keepdim=True), dim=0)[0]",
                                                    "bests.argmax(dim=1, keepdim=True), dim=0)[0]  # BUG"))
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy" and report.kind == "wrong reduce dim", report.diagnosis
    assert "# BUG" in report.distributed[0].code and "along dim 0" in report.fix, report.fix
    assert not run_numeric(load_case(buggy), world_size).agree
    fixed = load_case(fixed_file)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size).agree
