"""all-ranks-shard-0: a GGUF checkpoint loader that never receives the tensor-parallel rank.

Origin: vllm-gguf-plugin #103. The plugin's weight loader slices every tensor-parallel weight
with a rank it was never given, so it uses 0: every rank loads shard 0 of every weight. The shard
shapes are right, so the model loads and runs; the all-reduce then sums tp copies of rank 0's
partial result.
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

# weight name -> the dimension tensor parallelism splits
TP_SPLIT_DIM = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}


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
    """The GGUF loader: narrow each weight to this rank's shard along its split dimension."""
    state = {}
    for name, dim in TP_SPLIT_DIM.items():
        weight = ref_state[name]
        shard_size = weight.shape[dim] // world_size
        state[name] = weight.narrow(dim, rank * shard_size, shard_size)  # FIX: start at this rank's shard
    return state
