"""Case: a residual MLP stack trained with pipeline parallelism over the ranks.

The L layers are cut into n * CHUNKS stages of equal length; stage s runs on rank s % n, which
holds its layers under their reference names (`layers.<i>.*`, a ModuleDict as torchtitan keeps
them), the last stage's rank the head too: one stage per rank (CHUNKS = 1), or CHUNKS virtual
stages per rank for an interleaved schedule. The batch is cut into microbatches; the schedule
(pipeline_schedules.py, SCHEDULE: "1f1b", "gpipe" or, with CHUNKS > 1, "interleaved" or "gpipe")
sends activations forward and gradients backward with `dist.send`/`dist.recv`; the last stage's
loss is each microbatch's mean squared error divided by the number of microbatches. Claimed: the last stage's loss is the
reference's, and every stage's gradients are the reference's gradients of its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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
CHUNKS = 1
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

    def __init__(self, config: PipeConfig, layers: list[int], head: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(config.hidden) for i in layers})
        self.head = nn.Linear(config.hidden, 1) if head else None

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return self.run(x, list(self.layers), self.head is not None)

    def run(self, x: torch.Tensor, layers: list[str], head: bool) -> torch.Tensor:
        """Layers `layers` (keys of self.layers), then the head if `head`: one stage."""
        for key in layers:
            x = self.layers[key](x)
        return self.head(x) if head else x


def reference() -> nn.Module:
    return Stack(CONFIG, list(range(CONFIG.layers)), head=True)


def _stage_count(world_size: int) -> int:
    """CHUNKS stages per rank; one alone, whose stages would message themselves, runs one."""
    return world_size * CHUNKS if world_size > 1 else 1


def _stages(rank: int, world_size: int) -> list[range]:
    """The layers of each stage this rank runs, in order: stages rank, rank + n, ..."""
    stages = _stage_count(world_size)
    if CONFIG.layers % stages or CONFIG.batch % CONFIG.microbatches:
        raise ValueError(f"{CONFIG.layers} layers over {stages} stages, or a batch of {CONFIG.batch} in "
                         f"{CONFIG.microbatches} microbatches, do not divide")
    per_stage = CONFIG.layers // stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(rank, stages, world_size)]


def distributed(rank: int, world_size: int) -> nn.Module:
    layers = [i for stage in _stages(rank, world_size) for i in stage]
    return Stack(CONFIG, layers, head=rank == world_size - 1)


def inputs() -> tuple:
    return torch.randn(CONFIG.batch, CONFIG.hidden), torch.randn(CONFIG.batch, 1)


def loss(output: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor | None:
    """The stage's step; the last stage returns the loss, the others None."""
    x, target = inputs
    size = CONFIG.batch // CONFIG.microbatches
    stages = _stage_count(world_size)
    runs = [StageRun(partial(model.run, layers=[str(i) for i in layers], head=s == stages - 1), s, stages,
                     list(x.split(size)), list(target.split(size)), lambda i: (size, CONFIG.hidden),
                     lambda out, y: loss(out, None, y), ranks=world_size)
            for s, layers in zip(range(rank, stages, world_size), _stages(rank, world_size))]
    SCHEDULES[SCHEDULE](runs, CONFIG.microbatches)
    return runs[-1].total
