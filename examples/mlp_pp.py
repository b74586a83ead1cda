"""Case: a residual MLP stack trained with pipeline parallelism, one stage per rank.

Rank s holds layers [s*L/n, (s+1)*L/n) under their reference names (`layers.<i>.*`, a ModuleDict
as torchtitan keeps them), the last rank the head too. The batch is cut into MICROBATCHES; the
schedule (pipeline_schedules.py, SCHEDULE: "1f1b" or "gpipe") sends activations forward and
gradients backward with `dist.send`/`dist.recv`; the last stage's loss is each microbatch's mean
squared error divided by the number of microbatches. Claimed: the last stage's loss is the
reference's, and every stage's gradients are the reference's gradients of its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline_schedules import SCHEDULES, StageRun


@dataclass(frozen=True)
class PipeConfig:
    layers: int = 8
    hidden: int = 8
    batch: int = 8
    microbatches: int = 4


CONFIG = PipeConfig()
PRESETS = {"small": PipeConfig(), "wide": PipeConfig(layers=16, hidden=1024, batch=16, microbatches=8)}
SCHEDULE = "1f1b"
WORLD_SIZE = 2
MODE = "train"


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    """The reference (every layer and the head), or one stage of it (`layers`, `head`)."""

    def __init__(self, config: PipeConfig, layers: range, head: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(config.hidden) for i in layers})
        self.head = nn.Linear(config.hidden, 1) if head else None

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(x)


def reference() -> nn.Module:
    return Stack(CONFIG, range(CONFIG.layers), head=True)


def distributed(rank: int, world_size: int) -> nn.Module:
    if CONFIG.layers % world_size or CONFIG.batch % CONFIG.microbatches:
        raise ValueError(f"{CONFIG.layers} layers over {world_size} stages, or a batch of {CONFIG.batch} in "
                         f"{CONFIG.microbatches} microbatches, do not divide")
    per_stage = CONFIG.layers // world_size
    return Stack(CONFIG, range(rank * per_stage, (rank + 1) * per_stage), head=rank == world_size - 1)


def inputs() -> tuple:
    return torch.randn(CONFIG.batch, CONFIG.hidden), torch.randn(CONFIG.batch, 1)


def loss(output: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor | None:
    """The stage's step; the last stage returns the loss, the others None."""
    x, target = inputs
    size = CONFIG.batch // CONFIG.microbatches
    run = StageRun(model, rank, world_size, list(x.split(size)), list(target.split(size)),
                   lambda i: (size, CONFIG.hidden), lambda out, y: loss(out, None, y))
    SCHEDULES[SCHEDULE](run, CONFIG.microbatches)
    return run.total
