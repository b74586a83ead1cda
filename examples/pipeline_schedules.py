"""Pipeline-parallel training schedules written by hand, shared by the pipeline example cases (not a
case file itself).

One stage per rank: stage s runs its part of the model on each microbatch, receiving the stage
input from stage s-1 (the first stage reads the batch) and sending its output to stage s+1 (the last
stage computes the loss of the microbatch, divided by the number of microbatches so that their sum
is the loss of the batch). Backward, the last stage differentiates each microbatch's loss; every
other stage receives the gradient of its output from stage s+1 and backpropagates it; every stage
but the first sends the gradient of its input back to stage s-1. Stage s of a pipeline whose first
stage is rank f runs on rank f + s. Parameter gradients accumulate
over the microbatches in `.grad`, as in every pipeline framework.

GPipe runs every forward, then every backward. 1F1B (PipeDream-flush, Megatron's schedule) runs
`stages - stage - 1` warm-up forwards, then alternates one forward and one backward, then drains
the remaining backwards: at most `stages - stage` microbatches' activations are alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class StageRun:
    """One stage's state over a training step: what each microbatch's forward kept for its backward."""

    module: nn.Module
    stage: int
    stages: int
    inputs: list[torch.Tensor]  # the first stage's microbatches of the model input
    targets: list[torch.Tensor]  # the last stage's microbatches of the loss targets
    activation: Callable[[int], tuple[int, ...]]  # the shape of microbatch i's stage input
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    first_rank: int = 0  # the rank of the pipeline's first stage
    received: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> stage input
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> output (last: its loss)
    total: torch.Tensor | None = None  # the last stage's loss of the batch

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def previous(self) -> int:
        return self.first_rank + self.stage - 1

    @property
    def next(self) -> int:
        return self.first_rank + self.stage + 1

    def forward(self, i: int) -> None:
        if self.first:
            x = self.inputs[i]
        else:
            x = torch.empty(self.activation(i))
            dist.recv(x, self.previous)
            x.requires_grad_()
            self.received[i] = x
        out = self.module(x)
        if self.last:
            out = self.loss(out, self.targets[i]) / len(self.targets)
            self.total = out.detach() if self.total is None else self.total + out.detach()
        else:
            dist.send(out.detach(), self.next)
        self.outputs[i] = out

    def backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        if self.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, self.next)
            out.backward(grad)
        if not self.first:
            dist.send(self.received.pop(i).grad, self.previous)


def gpipe(run: StageRun, microbatches: int) -> None:
    for i in range(microbatches):
        run.forward(i)
    for i in range(microbatches):
        run.backward(i)


def one_f_one_b(run: StageRun, microbatches: int) -> None:
    warmup = min(run.stages - run.stage - 1, microbatches)
    for i in range(warmup):
        run.forward(i)
    for i in range(microbatches - warmup):
        run.forward(warmup + i)
        run.backward(i)
    for i in range(microbatches - warmup, microbatches):
        run.backward(i)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
