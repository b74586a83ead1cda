"""sp-permuted-gather (look-alike, correct): sequence-parallel per-token layers on [s, b, h]
activations whose ranks hold the sequence shards in a permuted order, all-gathered into one buffer
and put back in order with `index_select`.

An equivalent refactoring (issue 14's third, forward): rank r computes shard perm[r] (here the
reverse order), `all_gather_into_tensor` lays the ranks' blocks out in rank order, and
`index_select` over the ranks' dim picks them in shard order: the reference's output. Must be proven.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
SEQ, BATCH = 8, 2

WORLD_SIZE = 2
OUTPUT = "replicate"


def shard_of_rank(world_size):
    return [world_size - 1 - rank for rank in range(world_size)]


class Mlp(nn.Module):
    def __init__(self, world_size=1):
        super().__init__()
        self.world_size = world_size
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        y = self.down(F.gelu(self.up(self.norm(x))))
        if self.world_size == 1:
            return y
        gathered = torch.empty((self.world_size * y.shape[0], *y.shape[1:]))
        dist.all_gather_into_tensor(gathered, y.contiguous())
        owners = torch.tensor([shard_of_rank(self.world_size).index(shard) for shard in range(self.world_size)])
        return gathered.view(self.world_size, -1, *y.shape[1:]).index_select(0, owners).flatten(0, 1)


def reference():
    return Mlp()


def distributed(rank, world_size):
    return Mlp(world_size)


def inputs():
    return (torch.randn(SEQ, BATCH, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 0)[shard_of_rank(world_size)[rank]]
