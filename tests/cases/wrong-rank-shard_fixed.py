"""wrong-rank-shard: a checkpoint loader that gives one weight the next rank's shard.

Origin: the off-by-one shard index in hand-written TP loaders (rank vs. rank + 1, or a rank
renumbered by another parallel dimension). Every weight is cut for this rank except up_proj,
which is cut for rank (rank + 1) % world_size: silu(gate) of rank r's intermediate slice is
multiplied by rank r+1's up projection. Shapes fit; at world size 1 the index is still 0.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
INTERMEDIATE = 64
NUM_TOKENS = 6

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


class LlamaMLP(nn.Module):
    def __init__(self, tp_size=1):
        super().__init__()
        self.tp_size = tp_size
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE // tp_size, bias=False)  # ColumnParallelLinear
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE // tp_size, bias=False)  # ColumnParallelLinear
        self.down_proj = nn.Linear(INTERMEDIATE // tp_size, HIDDEN, bias=False)  # RowParallelLinear

    def forward(self, x):
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out


def reference():
    return LlamaMLP()


def distributed(rank, world_size):
    return LlamaMLP(tp_size=world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    return {
        "gate_proj.weight": ref_state["gate_proj.weight"].chunk(world_size, dim=0)[rank],
        "up_proj.weight": ref_state["up_proj.weight"].chunk(world_size, dim=0)[rank],  # FIX: this rank's shard
        "down_proj.weight": ref_state["down_proj.weight"].chunk(world_size, dim=1)[rank],
    }
