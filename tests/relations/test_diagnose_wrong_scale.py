"""Wrong scale found at the op that combined the right terms with the wrong coefficients, not at an
earlier difference the reference writes another way (relations/diagnose/wrong_scale.py, `_scaled`).
The buggy program is found at its `# BUG` line and disagrees numerically; the fixed twin is proven
and agrees."""

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


# --- gradients accumulated over micro-batches, then averaged over ranks ---------------------------
class GeluMlp(nn.Module):
    """GELU's backward folds irrational constants into the gradient's coefficient (to 2^-59 here)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _accumulating(micro_scale: int, op: dist.ReduceOp) -> Case:
    """A bf16 model whose two micro-batches' gradients are summed in fp32 (each divided by
    `micro_scale`; 2 is right), then reduced over the data-parallel ranks with `op` (AVG is right)."""

    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        (x,) = inputs
        sums = {p: torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()}
        losses = []
        for micro in x.chunk(2, 0):
            loss = F.mse_loss(model(micro), micro)
            (loss / micro_scale).backward()
            for p, total in sums.items():
                total.add_(p.grad.float())
                p.grad = None
            losses.append(loss.detach())
        for p, total in sums.items():
            dist.all_reduce(total, op=op)
            p.grad = total.to(p.dtype)
        return torch.stack(losses).mean()

    def bf16(state: dict, rank: int, world_size: int) -> dict:
        return {name: t.to(torch.bfloat16) for name, t in state.items()}

    return Case(GeluMlp, lambda r, n: GeluMlp().to(torch.bfloat16), lambda: (torch.randn(8, HIDDEN),),
                shard_input=lambda i, full, r, n: full.chunk(n, 0)[r].to(torch.bfloat16), shard_state=bf16,
                loss=F.mse_loss, distributed_step=step)


def test_accumulated_gradients_averaged_over_ranks_are_proven(checked_step) -> None:
    assert checked_step(_accumulating(2, dist.ReduceOp.AVG), 2).verdict == "equivalent"


def test_a_sum_where_the_mean_is_meant_names_the_reduce_op_and_the_rescaling_that_would_also_do(checked_step) -> None:
    report = checked_step(_accumulating(2, dist.ReduceOp.SUM), 2)
    assert report.kind == "wrong reduce op" and "(x2)" in report.diagnosis, report.diagnosis
    assert report.distributed[0].op == "all_reduce"
    assert report.fix.startswith("reduce with ReduceOp.AVG, not ReduceOp.SUM") and "or scale by 1/4 instead of 1/2" in report.fix


def test_a_wrong_share_scale_is_reported_without_the_coefficients_float_constants_fold_to(checked_step) -> None:
    """Divided by 8 where 2 is meant: no reduce op makes it right, so the division is the culprit,
    and the fix is the share's scale (the whole's coefficient in the normal form is 2^-59-ish noise)."""
    report = checked_step(_accumulating(8, dist.ReduceOp.AVG), 2)
    assert report.kind == "wrong scale" and "(x1/4)" in report.diagnosis, report.diagnosis
    assert report.distributed[0].op == "div in the backward"
    assert report.fix.startswith("scale by 1/2 instead of 1/8 at line")
    assert "576460752303423488" not in report.diagnosis + report.fix


# --- a rank's rows of a gradient, scaled by a mean over its own columns -----------------------------
class Columns(nn.Module):
    """A column-parallel projection: each rank its rows of the weight, its columns of the output."""

    def __init__(self, out: int = VOCAB):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _mean_absolute(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.abs().mean()


def _column_step(whole_count: bool):
    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        local = model(*inputs).abs()
        if whole_count:
            share = local.sum() / (local.numel() * world_size)
        else:
            share = local.sum() / local.numel()  # BUG: the mean over this rank's columns, not all of them
        share.backward()
        total = share.detach().clone()
        dist.all_reduce(total)
        return total
    return step


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_ranks_rows_of_a_gradient_with_the_wrong_coefficient_are_a_wrong_scale(world_size: int) -> None:
    """Each rank's weight gradient is its rows of the reference's, scaled by a mean over its own
    columns: the coefficient of a region of a reference term, compared with the reference's on
    the whole, is a wrong scale, set where the share is divided."""
    def case(whole_count: bool) -> Case:
        return Case(Columns, lambda r, n: Columns(VOCAB // n), lambda: (torch.randn(TOKENS, HIDDEN),), world_size,
                    shard_state=lambda state, r, n: {"proj.weight": state["proj.weight"].chunk(n, 0)[r]},
                    output=("shard", -1), loss=_mean_absolute, distributed_step=_column_step(whole_count), mode="train")

    buggy = case(False)
    assert not run_numeric(buggy, world_size, mode="train").agree
    report = verify(buggy, world_size=world_size)
    assert report.verdict == "discrepancy" and report.kind == "wrong scale", report.diagnosis
    assert f"x{world_size}" in report.diagnosis
    first = report.distributed[0]
    assert Path(first.file).name == Path(__file__).name and "# BUG" in first.code, report.distributed
    fixed = case(True)
    assert verify(fixed, world_size=world_size).verdict == "equivalent" and run_numeric(fixed, world_size, mode="train").agree


# --- an expert's gradient over every rank's tokens, averaged where its parameter is read -----------
EXPERTS, FFN = 4, 8


def _experts(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_e down[e] @ gelu(up[e] @ x)."""
    out = torch.zeros_like(x)
    for e in range(up.shape[0]):
        out = out + F.linear(F.gelu(F.linear(x, up[e])), down[e])
    return out


class Experts(nn.Module):
    def __init__(self, experts: int = EXPERTS):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, FFN, HIDDEN) / HIDDEN**0.5)
        self.down = nn.Parameter(torch.randn(experts, HIDDEN, FFN) / FFN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _experts(x, self.up, self.down)


class Averaged(torch.autograd.Function):
    """Reads a parameter; its gradient, which sums the losses of every rank, is averaged over them."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad / dist.get_world_size()


class ExpertParallel(nn.Module):
    """This rank's experts (flat, as FSDP holds them), applied to every rank's tokens, their outputs
    summed back to each rank's; the gradients of those `averaged` averaged over the ranks."""

    def __init__(self, world_size: int, averaged: tuple[str, ...]):
        super().__init__()
        self.local, self.averaged = EXPERTS // world_size, averaged
        self.up = nn.Parameter(torch.empty(self.local * FFN * HIDDEN))
        self.down = nn.Parameter(torch.empty(self.local * HIDDEN * FFN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = list(range(dist.get_world_size()))
        tokens = funcol.all_gather_tensor_autograd(x, 0, group)
        up = (Averaged.apply(self.up) if "up" in self.averaged else self.up).view(self.local, FFN, HIDDEN)
        down = (Averaged.apply(self.down) if "down" in self.averaged else self.down).view(self.local, HIDDEN, FFN)  # BUG
        return x + funcol.reduce_scatter_tensor_autograd(_experts(tokens, up, down), "sum", 0, group)


def _expert_parallel(world_size: int, averaged: tuple[str, ...], step=None) -> Case:
    return Case(Experts, lambda r, n: ExpertParallel(n, averaged), lambda: (torch.randn(8, HIDDEN),), world_size,
                shard_state=lambda state, r, n: {k: v.chunk(n)[r].reshape(-1) for k, v in state.items()},
                shard_input=lambda i, full, r, n: full.chunk(n)[r], loss=F.mse_loss, distributed_step=step)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_gradient_not_averaged_where_its_parameter_is_read_is_a_wrong_scale_there(checked_step, world_size: int) -> None:
    """The loss agrees and the other expert weight's gradient is averaged: nothing on the way from
    where this gradient is computed scales it, so the average belongs where its parameter is read."""
    report = checked_step(_expert_parallel(world_size, ("up",)), world_size)
    assert report.verdict == "discrepancy" and report.kind == "wrong scale", report.diagnosis
    assert f"(x{world_size})" in report.diagnosis and "while the loss and another gradient agree" in report.diagnosis
    assert "# BUG" in report.distributed[0].code and report.claims == ["gradient of `down`"], report.distributed
    assert checked_step(_expert_parallel(world_size, ("up", "down")), world_size).verdict == "equivalent"


def _seeded_step(divided: bool):
    """Every rank's loss divided by the ranks' count before the backward: the seed averages the
    gradients, which sum every rank's losses."""
    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        (x,) = inputs
        loss = F.mse_loss(model(x), x)
        (loss / world_size if divided else loss).backward()  # BUG when not divided
        return loss
    return step


def test_a_seed_scaled_wrong_is_not_taken_for_a_gradient_not_averaged_where_its_parameter_is_read(checked_step) -> None:
    """Must not match: no gradient is averaged where its parameter is read, and all are off by the
    same factor: the seed is (the step's loss not divided before its backward)."""
    report = checked_step(_expert_parallel(2, (), _seeded_step(False)), 2)
    assert report.verdict == "discrepancy" and "another gradient agree" not in report.diagnosis, report.diagnosis
    assert ".view(self.local" not in report.distributed[0].code, report.distributed  # no parameter's read first
    assert checked_step(_expert_parallel(2, (), _seeded_step(True)), 2).verdict == "equivalent"
