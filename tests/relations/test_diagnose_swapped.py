"""Swapped operands: a division or subtraction the other way round (relations/diagnose/swapped.py).
Each buggy program is found at its line with that kind and disagrees numerically; each fixed twin
is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, FFN, COUNT = 8, 16, 12


class Gate(nn.Module):
    """Two projections of the input, combined elementwise."""

    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.a = nn.Linear(HIDDEN, ffn, bias=False)
        self.b = nn.Linear(HIDDEN, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(self.a(x), self.b(x))

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(a - b) + a / torch.exp(b)


class ColumnParallelGate(Gate):
    def __init__(self, world_size: int, swap: str):
        super().__init__(FFN // world_size)
        self.swap = swap

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        difference = b - a if self.swap == "sub" else a - b  # BUG when swap is sub
        ratio = torch.exp(b) / a if self.swap == "div" else a / torch.exp(b)  # BUG when swap is div
        return torch.exp(difference) + ratio


class Total(nn.Module):
    """The sum of a projection's values over the batch, divided by a count."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum(0) / COUNT


class DataParallelTotal(Total):
    def __init__(self, swap: bool):
        super().__init__()
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        share = self.proj(x).sum(0)
        share = COUNT / share if self.swap else share / COUNT  # BUG when swap
        dist.all_reduce(share)
        return share


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


def _column_parallel(state: dict, rank: int, world_size: int) -> dict:
    return {name: w.chunk(world_size, 0)[rank] for name, w in state.items()}


def _gate(swap: str) -> Case:
    return Case(Gate, lambda r, n: ColumnParallelGate(n, swap), lambda: (torch.randn(2, 3, HIDDEN),),
                shard_state=_column_parallel, output=("shard", -1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_subtraction_the_other_way_round_is_found_where_it_is_made(world_size: int) -> None:
    """exp(b - a) for exp(a - b): the difference is linear, so the values part at the exp; the
    subtraction that made its operand is the culprit."""
    said = _check(_gate("sub"), world_size, "swapped operands")
    assert "`exp`" in said and "whose negation agrees" in said and "`difference`" in said
    _check(_gate(""), world_size, None)


def test_a_division_the_other_way_round_is_swapped_operands() -> None:
    said = _check(_gate("div"), 2, "swapped operands")
    assert "`ratio` divides" in said and "swap the operands of the division" in said


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_number_divided_by_a_share_of_a_sum_is_swapped_operands(world_size: int) -> None:
    """`n / x` is traced as reciprocal(x) * n: the share divided by n agrees (a share of the sum
    scaled as the reference scales the whole), its reciprocal does not."""
    def case(swap: bool) -> Case:
        return Case(Total, lambda r, n: DataParallelTotal(swap), lambda: (torch.randn(8, HIDDEN),),
                    shard_input=lambda i, full, r, n: full.chunk(n, 0)[r])

    said = _check(case(True), world_size, "swapped operands")
    assert f"divides `{COUNT}` by" in said
    _check(case(False), world_size, None)


class Margin(nn.Module):
    """A cross entropy's shape: log-sum-exp minus the first logit, weighed against the mean logit."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)
        return self.combine(torch.logsumexp(logits, -1), logits[:, 0], logits.mean(-1))

    def combine(self, total: torch.Tensor, first: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return 0.75 * (total - first) - 0.25 * mean


class DataParallelMargin(Margin):
    def __init__(self, bug: str):
        super().__init__()
        self.bug = bug

    def combine(self, total: torch.Tensor, first: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        loss = first - total if self.bug == "swap" else total - first  # BUG when swap
        return 0.75 * loss - (0.5 if self.bug == "scale" else 0.25) * mean  # BUG when scale


def _margin(bug: str) -> Case:
    return Case(Margin, lambda r, n: DataParallelMargin(bug), lambda: (torch.randn(8, HIDDEN),),
                shard_input=lambda i, full, r, n: full.chunk(n, 0)[r], output=("shard", 0))


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_subtraction_the_other_way_round_before_only_sums_is_found_where_it_is_made(world_size: int) -> None:
    """`first - total` for `total - first`, then only scaled and summed: no value disagrees before
    the output, which has the reference's terms with the wrong signs; the subtraction swapped makes
    it the reference's rows."""
    said = _check(_margin("swap"), world_size, "wrong scale")
    assert "`loss` at line" in said and "| swap the operands of the subtraction at line" in said
    _check(_margin(""), world_size, None)


def test_a_wrong_scale_no_swap_puts_right_stays_a_wrong_scale() -> None:
    """Must not match: the subtraction is right and a coefficient is not; swapping it does not help."""
    said = _check(_margin("scale"), 2, "wrong scale")
    assert "swap the operands" not in said


VOCAB, SEQ, CHUNKS = 16, 4, 2


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(self.w2(F.silu(self.w1(x))), (HIDDEN,))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(x))


def _token_loss(logits: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="sum") / labels.numel()


class HandBack(torch.autograd.Function):
    """The loss, handing the hidden states the gradient gathered chunk by chunk in the backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return total.detach()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple:
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None


def _chunked_step(swap: bool):
    """The head and loss one sequence chunk at a time (loss parallel), each chunk's input gradient
    kept and handed to the decoder's backward at once."""

    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        x, labels = inputs
        hidden = model.hidden(x)
        grads, total = [], 0.0
        with loss_parallel():
            for h, chunk_labels in zip(hidden.detach().chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1)):
                h.requires_grad_(True)
                summed = F.cross_entropy(model.head(h).flatten(0, 1), chunk_labels.flatten(0, 1), reduction="sum")
                chunk_loss = labels.numel() / summed if swap else summed / labels.numel()  # BUG when swap
                chunk_loss.backward()
                grads.append(h.grad)
                total = total + chunk_loss.detach()
        joined = DTensor.from_local(torch.cat([g.to_local() for g in grads], dim=1), hidden.device_mesh, grads[0].placements)
        return HandBack.apply(hidden, joined, total.full_tensor())

    def backward_too(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        loss = step(model, inputs, rank, world_size)
        loss.backward()
        return loss

    return backward_too


def _tensor_parallel_decoder(rank: int, world_size: int) -> nn.Module:
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(Decoder(), init_device_mesh("cpu", (world_size,)), plan)


def test_a_swapped_division_in_a_chunked_loss_is_found_before_the_gradients_it_spoils() -> None:
    """`n / loss` per chunk: every decoder gradient disagrees from the chunk's division on, and
    further along the backward a sum over the hidden dim of gradients joined along the sequence
    looks like a reduction along the wrong dim; the division, where the values first part and
    which swapped agrees again, is the culprit."""
    def case(swap: bool) -> Case:
        return Case(Decoder, _tensor_parallel_decoder, lambda: (torch.randn(1, SEQ, HIDDEN), torch.arange(SEQ).mul(5).remainder(VOCAB)[None]),
                    loss=_token_loss, distributed_step=_chunked_step(swap), mode="train")

    said = _check(case(True), 2, "swapped operands")
    assert said.startswith("gradient of `w1.weight`") and "`chunk_loss` divides" in said, said
    _check(case(False), 2, None)
