"""A divergence that reaches a rank in a message is followed to the sender (relations/diagnose/
diagnoser.py, `_diverging_from`): a recv is a copy of what was sent, so the values parted on the
sending rank. Pipeline stages, one per rank, each microbatch run forward and backward in turn; the
first stage's gradients come in through the recv of its output's gradient. Each buggy step is
found at its line with its kind and disagrees numerically; the fixed step is proven and agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

LAYERS, HIDDEN, BATCH, MICROBATCHES = 4, 8, 8, 2


class Stack(nn.Module):
    def __init__(self, layers=range(LAYERS)):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(HIDDEN, HIDDEN) for i in layers})

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _stage(rank: int, world_size: int) -> Stack:
    per_stage = LAYERS // world_size
    return Stack(range(rank * per_stage, (rank + 1) * per_stage))


def _inputs() -> tuple:
    return torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)


def _loss(output: torch.Tensor, x: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _pipelined(bug: str):
    """Forward and backward of each microbatch in turn, activations sent on, gradients sent back."""

    def step(model: Stack, inputs: tuple, rank: int, world_size: int) -> torch.Tensor | None:
        first, last = rank == 0, rank == world_size - 1
        losses = []
        for x, target in zip(*(t.chunk(MICROBATCHES) for t in inputs)):
            if not first:
                x = torch.empty(x.shape)
                dist.recv(x, rank - 1)
                x.requires_grad_()
            out = model(x)
            if last:
                out = MICROBATCHES / _loss(out, None, target) if bug == "swap" else _loss(out, None, target) / MICROBATCHES  # BUG when swap
                losses.append(out.detach())
                out.backward()
            else:
                dist.send(out.detach(), rank + 1)
                grad = torch.empty_like(out)
                dist.recv(grad, rank + 1)
                out.backward(2 * grad if bug == "twice" else grad)  # BUG when twice
            if not first:
                dist.send(x.grad, rank - 1)
        return sum(losses) if last else None

    return step


def _case(bug: str) -> Case:
    return Case(Stack, _stage, _inputs, loss=_loss, distributed_step=_pipelined(bug), mode="train")


def _found(bug: str, world_size: int, kind: str) -> str:
    case = _case(bug)
    report = verify(case, world_size=world_size)
    numbers = run_numeric(case, world_size)
    assert not numbers.agree
    assert report.verdict == "discrepancy" and report.kind == kind, report.diagnosis
    assert set(report.claims) <= set(numbers.differing), (report.claims, numbers.differing)
    culprit = report.distributed[0]
    assert Path(culprit.file).name == Path(__file__).name and f"# BUG when {bug}" in culprit.code, report.distributed
    return report.diagnosis


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_stage_gradient_wrong_from_the_last_stage_loss_is_found_at_the_loss(world_size: int) -> None:
    """`n / loss` for `loss / n` on the last stage: the first stage's gradients, the claims read
    first, are wrong because the gradient they receive is; the division is the culprit."""
    said = _found("swap", world_size, "swapped operands")
    assert said.startswith("gradient of `layers.0.") and f"on rank {world_size - 1}" in said, said
    report = verify(_case(""), world_size=world_size)
    assert report.verdict == "equivalent", report.diagnosis
    assert run_numeric(_case(""), world_size).agree


def test_a_right_gradient_received_and_used_wrong_is_found_on_the_receiver() -> None:
    """Must not match: the gradient received agrees with the reference, so nothing is followed; the
    stage that scales it is the culprit."""
    said = _found("twice", 2, "wrong scale")
    assert "on rank 1" not in said, said
