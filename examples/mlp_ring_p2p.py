"""Case: a tensor-parallel MLP whose column-parallel activations are gathered by a ring of messages.

Each rank holds rows [r*ffn/n, (r+1)*ffn/n) of the up projection. Instead of `all_gather`, the
shards travel round the ring: at each of the n-1 steps a rank passes the shard it received last to
rank r+1 and receives rank r-1's, with `batch_isend_irecv` (the irecv listed first, as
`batch_isend_irecv` allows; ring attention exchanges its KV blocks the same way). Rank r then holds
the shards of ranks r, r-1, ..., r-n+1 and puts them back in rank order. The down projection is
replicated. The proof pairs each irecv with the isend of the rank before on that channel, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MlpConfig:
    hidden: int = 16
    ffn: int = 32
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


def ring_all_gather(shard: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Every rank's shard, concatenated in rank order along the last dim, passed round a ring."""
    shards = {rank: shard}
    current = shard.contiguous()
    for step in range(1, world_size):
        received = torch.empty_like(current)
        ops = [dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
               dist.P2POp(dist.isend, current, (rank + 1) % world_size)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        shards[(rank - step) % world_size] = received
        current = received
    return torch.cat([shards[r] for r in range(world_size)], dim=-1)


class RingMlp(nn.Module):
    """One rank's MLP; parameter names match the reference's."""

    def __init__(self, config: MlpConfig, rank: int, world_size: int):
        super().__init__()
        if config.ffn % world_size:
            raise ValueError(f"ffn={config.ffn} is not divisible by world_size={world_size}")
        self.up = nn.Linear(config.hidden, config.ffn // world_size)
        self.down = nn.Linear(config.ffn, config.hidden)
        self.rank, self.world_size = rank, world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ring_all_gather(F.gelu(self.up(x)), self.rank, self.world_size)
        return self.down(h)


def reference() -> nn.Module:
    return Mlp(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    return RingMlp(CONFIG, rank, world_size)


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.hidden),)
