"""sp-permuted-shards (look-alike, correct): a Megatron-style 2-D mesh (tensor parallel inside
sequence/data parallel) training step whose sequence shards are permuted among the replicas.

An equivalent refactoring (issue 14's mutation harness found it unknown): replica d reads the
sequence shard d + 1 (mod the number of replicas) instead of shard d. Every token is still read by
exactly one replica, the per-token losses and gradients are averaged over all of them, so the step
is the reference's. It looks like an off-by-one shard index but must not be flagged.
Ranks form a (data, tensor) grid as in examples/mlp_tp_dp.py: rank = dp_rank * tp + tp_rank.
"""


from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MlpConfig:
    hidden: int = 8
    ffn: int = 16
    batch: int = 2
    seq: int = 8
    lr: float = 0.1


CONFIG = MlpConfig()
WORLD_SIZE = 4
MODE = "step"


@dataclass(frozen=True)
class Grid:
    """This rank's place in the (data, tensor) grid and its two process groups."""

    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup


def _sizes(world_size: int) -> tuple[int, int]:
    tp = min(2, world_size)
    if world_size % tp or CONFIG.ffn % tp or CONFIG.seq % (world_size // tp):
        raise ValueError(f"world_size={world_size} does not split into tp={tp} x dp={world_size // tp} for {CONFIG}")
    return tp, world_size // tp


def initialize_model_parallel(rank: int, world_size: int) -> Grid:
    tp, dp = _sizes(world_size)
    tp_group = dp_group = None
    for d in range(dp):  # TP groups: consecutive ranks
        ranks = list(range(d * tp, (d + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for t in range(tp):  # DP groups: one rank of every TP group
        ranks = list(range(t, world_size, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return Grid(tp, dp, rank % tp, rank // tp, tp_group, dp_group)


class Mlp(nn.Module):
    """The single-device reference."""

    def __init__(self, config: MlpConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden)
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TensorParallelMlp(nn.Module):
    """One rank's MLP: parameter names match the reference's, shapes are its TP shards."""

    def __init__(self, config: MlpConfig, grid: Grid):
        super().__init__()
        self.grid = grid
        self.norm = nn.LayerNorm(config.hidden)
        self.up = nn.Linear(config.hidden, config.ffn // grid.tp)
        self.down = nn.Linear(config.ffn // grid.tp, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToTensorParallelRegion.apply(self.norm(x), self.grid.tp_group)
        partial = F.linear(F.gelu(self.up(h)), self.down.weight)
        return _ReduceFromTensorParallelRegion.apply(partial, self.grid.tp_group) + self.down.bias


def reference() -> nn.Module:
    return Mlp(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    return TensorParallelMlp(CONFIG, initialize_model_parallel(rank, world_size))


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.hidden),)


def shard_state(ref: dict, rank: int, world_size: int) -> dict:
    tp, _ = _sizes(world_size)
    tp_rank = rank % tp
    return {
        "norm.weight": ref["norm.weight"],
        "norm.bias": ref["norm.bias"],
        "up.weight": ref["up.weight"].chunk(tp, 0)[tp_rank],
        "up.bias": ref["up.bias"].chunk(tp, 0)[tp_rank],
        "down.weight": ref["down.weight"].chunk(tp, 1)[tp_rank],
        "down.bias": ref["down.bias"],
    }


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    tp, dp = _sizes(world_size)
    # the sequence shards rotated among the data-parallel ranks: replica d reads shard d + 1
    return full.chunk(dp, 1)[(rank // tp + 1) % dp]


def loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, x)


def optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=CONFIG.lr)


def distributed_step(model: TensorParallelMlp, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    (x,) = inputs
    batch_loss = loss(model(x), x)
    batch_loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=model.grid.dp_group)
    optimizer(list(model.parameters())).step()
    return batch_loss
