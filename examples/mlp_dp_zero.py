"""Case: a data-parallel MLP trained with ZeRO stage 2 and AdamW, DeepSpeed style.

Every rank holds the whole model and a 1/n slice of the batch. After the local backward, the
gradients are flattened into one contiguous buffer (padded to a multiple of the world size) and
reduce-scattered with the average over ranks, so rank r keeps only partition r of the averaged
gradient. The partition boundaries ignore parameter boundaries: one partition may hold the tail
of `up.weight` and the head of `up.bias`. Each rank runs AdamW on its partition of the flat
parameters only (its optimizer state is 1/n of the full one), then all-gathers the updated
partitions and copies them back into the parameters.

The reference is the same MLP on the whole batch with `torch.optim.AdamW` and the same
hyper-parameters. shardproof proves that the mean of the ranks' losses is the reference loss and
that every rank's parameters after the step equal the reference's (`MODE = "step"`).
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
    ffn: int = 12
    batch: int = 8
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1


CONFIG = MlpConfig()
WORLD_SIZE = 2
MODE = "step"


class Mlp(nn.Module):
    def __init__(self, config: MlpConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=CONFIG.lr, betas=CONFIG.betas, eps=CONFIG.eps, weight_decay=CONFIG.weight_decay
    )


class Zero2Optimizer:
    """Partitioned AdamW: gradients reduce-scattered over a flat buffer, parameters all-gathered."""

    def __init__(self, params: list[torch.Tensor], rank: int, world_size: int):
        self.params = params
        self.rank, self.world_size = rank, world_size
        numel = sum(p.numel() for p in params)
        self.padded = -(-numel // world_size) * world_size
        self.partition_size = self.padded // world_size
        start = rank * self.partition_size
        flat = self._flatten([p.detach() for p in params])
        self.partition = flat[start : start + self.partition_size].clone()  # this rank's fp32 master slice
        self.optimizer = _adamw([self.partition])

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return F.pad(flat, (0, self.padded - flat.numel()))

    def step(self) -> None:
        flat_grad = self._flatten([p.grad for p in self.params])
        grad_partition = torch.empty(self.partition_size, dtype=flat_grad.dtype)
        dist.reduce_scatter_single(grad_partition, flat_grad, op=dist.ReduceOp.AVG)
        for p in self.params:
            p.grad = None  # stage 2: only the reduced partition is kept
        self.partition.grad = grad_partition
        self.optimizer.step()
        flat = torch.empty(self.padded, dtype=self.partition.dtype)
        dist.all_gather_single(flat, self.partition)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def reference() -> nn.Module:
    return Mlp(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    if CONFIG.batch % world_size:
        raise ValueError(f"batch={CONFIG.batch} is not divisible by world_size={world_size}")
    return Mlp(CONFIG)


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.hidden),)


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, 0)[rank]


def loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reconstruction error, averaged over this rank's batch."""
    return F.mse_loss(output, x)


def optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return _adamw(params)


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    (x,) = inputs
    zero = Zero2Optimizer(list(model.parameters()), rank, world_size)
    batch_loss = loss(model(x), x)
    batch_loss.backward()
    zero.step()
    return batch_loss
