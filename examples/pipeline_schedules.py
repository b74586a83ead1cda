"""Pipeline-parallel training schedules written by hand, shared by the pipeline example cases (not a
case file itself).

Stage s runs its part of the model on each microbatch, receiving the stage input from stage s-1
(the first stage reads the batch) and sending its output to stage s+1 (the last stage computes the
loss of the microbatch, divided by the number of microbatches so that their sum is the loss of the
batch). Backward, the last stage differentiates each microbatch's loss; every other stage receives
the gradient of its output from stage s+1 and backpropagates it; every stage but the first sends
the gradient of its input back to stage s-1. A pipeline of P ranks whose first is rank f runs stage
s on rank f + s % P: one stage per rank, or with virtual stages (interleaving) the V chunks s = r,
r + P, ..., r + (V-1) P on rank f + r. A message is tagged with the stage it goes to (and its
direction), so that each stage's messages keep their order on their own channel. Parameter gradients
accumulate over the microbatches in `.grad`, as in every pipeline framework. A schedule takes the
runs of a rank's stages (one, or its chunks in order) and the number of microbatches.

GPipe runs every forward, then every backward. 1F1B (PipeDream-flush, Megatron's schedule) runs
`stages - stage - 1` warm-up forwards, then alternates one forward and one backward, then drains
the remaining backwards: at most `stages - stage` microbatches' activations are alive at a time.
Interleaved 1F1B (Megatron's virtual pipeline) runs the chunks of groups of P microbatches in turn,
forward chunk by chunk and backward from the last chunk: `2 (P - r - 1) + (V - 1) P` warm-up
forwards on rank r, then one forward and one backward alternately, then the remaining backwards;
the bubble shrinks by V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class StageRun:
    """One stage's state over a training step: what each microbatch's forward kept for its backward."""

    module: Callable[[torch.Tensor], torch.Tensor]  # the stage's forward
    stage: int
    stages: int
    inputs: list[torch.Tensor]  # the first stage's microbatches of the model input
    targets: list[torch.Tensor]  # the last stage's microbatches of the loss targets
    activation: Callable[[int], tuple[int, ...]]  # the shape of microbatch i's stage input
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    first_rank: int = 0  # the rank of the pipeline's first stage
    ranks: int = 0  # the ranks of the pipeline (0: one per stage)
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
    def width(self) -> int:
        return self.ranks or self.stages

    @property
    def previous(self) -> int:
        return self.first_rank + (self.stage - 1) % self.width

    @property
    def next(self) -> int:
        return self.first_rank + (self.stage + 1) % self.width

    def _tag(self, stage: int, backward: bool) -> int:
        """The tag of messages to `stage`: activations 0 ..< stages, gradients from stages on."""
        return stage + self.stages * backward

    def forward(self, i: int) -> None:
        if self.first:
            x = self.inputs[i]
        else:
            x = torch.empty(self.activation(i))
            dist.recv(x, self.previous, tag=self._tag(self.stage, False))
            x.requires_grad_()
            self.received[i] = x
        out = self.module(x)
        if self.last:
            out = self.loss(out, self.targets[i]) / len(self.targets)
            self.total = out.detach() if self.total is None else self.total + out.detach()
        else:
            dist.send(out.detach(), self.next, tag=self._tag(self.stage + 1, False))
        self.outputs[i] = out

    def backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        if self.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, self.next, tag=self._tag(self.stage, True))
            out.backward(grad)
        if not self.first:
            dist.send(self.received.pop(i).grad, self.previous, tag=self._tag(self.stage - 1, True))


def gpipe(runs: list[StageRun], microbatches: int) -> None:
    for run in runs:
        for i in range(microbatches):
            run.forward(i)
    for run in reversed(runs):
        for i in range(microbatches):
            run.backward(i)


def one_f_one_b(runs: list[StageRun], microbatches: int) -> None:
    (run,) = runs
    warmup = min(run.stages - run.stage - 1, microbatches)
    for i in range(warmup):
        run.forward(i)
    for i in range(microbatches - warmup):
        run.forward(warmup + i)
        run.backward(i)
    for i in range(microbatches - warmup, microbatches):
        run.backward(i)


def interleaved_1f1b(runs: list[StageRun], microbatches: int) -> None:
    chunks, ranks, rank = len(runs), runs[0].width, runs[0].stage
    if microbatches % ranks:
        raise ValueError(f"interleaving needs the microbatches ({microbatches}) in groups of the pipeline's {ranks} ranks")
    total = microbatches * chunks

    def unit(k: int, forward: bool) -> tuple[StageRun, int]:
        """The k-th forward (or backward) of this rank: its chunk's run and the microbatch."""
        group, within = divmod(k, ranks * chunks)
        chunk = within // ranks
        return runs[chunk if forward else chunks - 1 - chunk], group * ranks + within % ranks

    warmup = min(2 * (ranks - rank - 1) + (chunks - 1) * ranks, total)
    for k in range(warmup):
        run, i = unit(k, True)
        run.forward(i)
    for k in range(total - warmup):
        run, i = unit(warmup + k, True)
        run.forward(i)
        run, i = unit(k, False)
        run.backward(i)
    for k in range(total - warmup, total):
        run, i = unit(k, False)
        run.backward(i)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}
