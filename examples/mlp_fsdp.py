"""Case: fully sharded data parallel (ZeRO stage 3) written by hand, FSDP1 style: flat parameters.

Every rank reads a 1/n slice of the batch and holds 1/n of every parameter. The model is cut into
units as an auto-wrap policy cuts it (each residual block, and the root holding what is left: the
final norm). A unit's parameters are flattened in registration order into one buffer, padded to a
multiple of the world size, and rank r keeps chunk r of it as its one parameter `_flat_param`, so
a chunk boundary may fall inside a weight or between a weight and a bias. Before a unit runs, the
chunks are all-gathered and the full buffer is viewed as the wrapped module's parameters; in the
backward, the full buffer's gradient is reduce-scattered, so rank r keeps chunk r of the sum, and
scaled to the average as FSDP1 scales it: divided by a pre-divide factor before the reduction and
by the rest of the world size after it (so that low-precision sums neither overflow nor underflow).
Then AdamW steps on each rank's chunks only (`MODE = "step"`).

The reference is the same model on the whole batch with `torch.optim.AdamW`. shardproof proves the
mean of the ranks' losses, every rank's flat gradient chunk (the chunk of the reference gradients
flattened the same way) and every updated chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MlpConfig:
    hidden: int = 8
    ffn: int = 12
    layers: int = 2
    batch: int = 8
    lr: float = 1e-2
    weight_decay: float = 0.1


CONFIG = MlpConfig()
WORLD_SIZE = 2
MODE = "step"


class Block(nn.Module):
    def __init__(self, config: MlpConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden)
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Mlp(nn.Module):
    """The single-device reference."""

    def __init__(self, config: MlpConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def gradient_divide_factors(world_size: int) -> tuple[int, int]:
    """FSDP1's split of the 1/world_size average: the largest power of two pre-divide factor not
    above the square root, the rest after the reduction."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor, world_size // factor


class _AllGatherFlat(torch.autograd.Function):
    """All-gather the flat shards; the backward reduce-scatters the full gradient to the average."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.world_size = world_size
        full = shard.new_empty(shard.numel() * world_size)
        dist.all_gather_single(full, shard)
        return full

    @staticmethod
    def backward(ctx, full_grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        predivide, postdivide = gradient_divide_factors(ctx.world_size)
        full_grad = full_grad / predivide
        shard_grad = full_grad.new_empty(full_grad.numel() // ctx.world_size)
        dist.reduce_scatter_single(shard_grad, full_grad)
        return shard_grad / postdivide, None


def flat_param_layout(module: nn.Module, skip: tuple[str, ...] = ()) -> list[tuple[str, torch.Size]]:
    """The (name, shape) of every parameter a unit flattens, in registration order."""
    return [(name, p.shape) for name, p in module.named_parameters() if not name.startswith(skip)]


def padded_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


def flat_shard(tensors: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s chunk of the tensors flattened into one buffer, zero-padded to a multiple of
    the world size."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return F.pad(flat, (0, padded_numel(flat.numel(), world_size) - flat.numel())).chunk(world_size)[rank]


class FlatParamUnit(nn.Module):
    """One FSDP unit: the wrapped module's own parameters (not those of nested units) live as this
    rank's chunk of one flat buffer, and are views of the all-gathered buffer while it runs."""

    def __init__(self, module: nn.Module, world_size: int, skip: tuple[str, ...] = ()):
        super().__init__()
        self.world_size = world_size
        self.layout = flat_param_layout(module, skip)
        padded = padded_numel(sum(math.prod(shape) for _, shape in self.layout), world_size)
        for name, _ in self.layout:
            owner, _, leaf = name.rpartition(".")
            del module.get_submodule(owner)._parameters[leaf]
        self.module = module
        self._flat_param = nn.Parameter(torch.empty(padded // world_size))

    def unshard(self) -> None:
        """All-gather the flat buffer and set the wrapped module's parameters to views of it."""
        full = _AllGatherFlat.apply(self._flat_param, self.world_size)
        offset = 0
        for name, shape in self.layout:
            owner, _, leaf = name.rpartition(".")
            numel = math.prod(shape)
            setattr(self.module.get_submodule(owner), leaf, full[offset : offset + numel].view(shape))
            offset += numel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.unshard()
        return self.module(x)


def fully_shard_mlp(model: Mlp, world_size: int) -> FlatParamUnit:
    """Wrap every block, then the root with what is left."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = FlatParamUnit(layer, world_size)
    return FlatParamUnit(model, world_size, skip=("layers.",))


def reference() -> nn.Module:
    return Mlp(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    if CONFIG.batch % world_size:
        raise ValueError(f"batch={CONFIG.batch} is not divisible by world_size={world_size}")
    return fully_shard_mlp(Mlp(CONFIG), world_size)


def shard_state(ref: dict, rank: int, world_size: int) -> dict:
    """The flat chunks, cut from the reference's parameters as FSDP1 flattens them: each block's in
    registration order, the root's from what no block holds."""
    state = {}
    for i in range(CONFIG.layers):
        prefix = f"layers.{i}."
        block = [t for name, t in ref.items() if name.startswith(prefix)]
        state[f"module.{prefix}_flat_param"] = flat_shard(block, rank, world_size)
    root = [t for name, t in ref.items() if not name.startswith("layers.")]
    state["_flat_param"] = flat_shard(root, rank, world_size)
    return state


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.hidden),)


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, 0)[rank]


def loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reconstruction error, averaged over this rank's batch."""
    return F.mse_loss(output, x)


def optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=CONFIG.lr, weight_decay=CONFIG.weight_decay)
