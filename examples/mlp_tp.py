"""Case: a Megatron-LM tensor-parallel MLP, column-parallel up projection then row-parallel down.

Each rank holds rows [r*ffn/n, (r+1)*ffn/n) of the up projection (and its bias) and the matching
columns of the down projection, so its down-projection output is a partial sum: `dist.all_reduce`
makes it whole, and the down bias is added once, after the reduce. The state needs no
`shard_state`: shardproof infers each cut from the parameter shapes (rows of `up.*`, columns of
`down.weight`, `down.bias` copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MlpConfig:
    hidden: int = 32
    ffn: int = 64
    seq: int = 4
    batch: int = 2


CONFIG = MlpConfig()
PRESETS = {"small": MlpConfig(), "llama3-8b": MlpConfig(hidden=4096, ffn=14336, seq=16, batch=1)}
WORLD_SIZE = 2
OUTPUT = "replicate"


class Mlp(nn.Module):
    """The single-device reference."""

    def __init__(self, config: MlpConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks: the result stays sharded along its last dim."""

    def __init__(self, in_features: int, out_features: int, world_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features // world_size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks: all-reduce the partial products, then add the bias once."""

    def __init__(self, in_features: int, out_features: int, world_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world_size))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y + self.bias


class ParallelMlp(nn.Module):
    """One rank's MLP; parameter names match the reference's."""

    def __init__(self, config: MlpConfig, world_size: int):
        super().__init__()
        if config.ffn % world_size:
            raise ValueError(f"ffn={config.ffn} is not divisible by world_size={world_size}")
        self.up = ColumnParallelLinear(config.hidden, config.ffn, world_size)
        self.down = RowParallelLinear(config.ffn, config.hidden, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def reference() -> nn.Module:
    return Mlp(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    return ParallelMlp(CONFIG, world_size)


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.hidden),)
