"""Case: FSDP2, torch's own `fully_shard`, training residual MLP blocks on a 1-D mesh (or HSDP).

Each block, then the root, is wrapped with `torch.distributed.fsdp.fully_shard`: every parameter
becomes a DTensor sharded on dim 0 (`Shard(0)`) over the mesh, and every rank reads a 1/n slice of
the batch. FSDP2's hooks all-gather a block's parameters before its forward (and again before its
backward, the blocks being resharded after their forward), and reduce-scatter its gradients with
the average over ranks after its backward, through its own flat buffers (`fsdp::all_gather_copy_in`,
`fsdp::split_with_sizes_copy`, `fsdp::chunk_cat`). Nothing is written by hand: the loader is
DTensor's placements and the step is `loss.backward()`. With `REPLICAS = 2` the mesh is 2-D,
(replicate, shard): HSDP, each parameter `(Replicate(), Shard(0))`, its gradient reduce-scattered
within a group and all-reduced across the groups.

shardproof proves the mean of the ranks' losses and every rank's gradient shard against the
single-device model on the whole batch (`MODE = "train"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


@dataclass(frozen=True)
class MlpConfig:
    hidden: int = 16
    ffn: int = 32
    layers: int = 2
    batch: int = 8


CONFIG = MlpConfig()
WORLD_SIZE = 2
MODE = "train"
REPLICAS = 1  # HSDP: above 1, a (replicate, shard) mesh of REPLICAS groups each sharding the parameters


class Block(nn.Module):
    def __init__(self, config: MlpConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden)
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Mlp(nn.Module):
    def __init__(self, config: MlpConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def reference() -> nn.Module:
    return Mlp(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    if CONFIG.batch % world_size:
        raise ValueError(f"batch={CONFIG.batch} is not divisible by world_size={world_size}")
    model = Mlp(CONFIG)
    replicas = min(REPLICAS, world_size)
    if replicas == 1:
        mesh = init_device_mesh("cpu", (world_size,))
    else:  # HSDP: gradients reduce-scattered within a group, then all-reduced across the groups
        mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.hidden),)


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, 0)[rank]


def loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reconstruction error, averaged over this rank's batch."""
    return F.mse_loss(output, x)


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    (x,) = inputs
    batch_loss = loss(model(x), x)
    batch_loss.backward()  # FSDP2's post-backward hooks reduce-scatter the gradients
    return batch_loss
