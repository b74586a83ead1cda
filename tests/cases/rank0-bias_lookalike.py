"""rank0-bias (look-alike, correct): row-parallel bias added on rank 0 only, before the all-reduce.

Origin: TGI #1036 and nano-vllm #99. A row-parallel linear layer adds its bias to the local
partial sum on rank 0 only and then all-reduces: the bias enters the sum exactly once, so this is
equivalent to adding it after the reduction. It looks like row-bias-before-reduce, but it is
correct and must not be flagged.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
INTERMEDIATE = 64
NUM_TOKENS = 6

WORLD_SIZE = 2
OUTPUT = "replicate"


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, tp_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size // tp_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size // tp_size))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, tp_rank, tp_size):
        super().__init__()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp_size))
        self.bias = nn.Parameter(torch.empty(output_size))

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class MLP(nn.Module):
    def __init__(self, tp_rank=0, tp_size=1):
        super().__init__()
        self.up_proj = ColumnParallelLinear(HIDDEN, INTERMEDIATE, tp_size)
        self.down_proj = RowParallelLinear(INTERMEDIATE, HIDDEN, tp_rank, tp_size)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


def reference():
    return MLP()


def distributed(rank, world_size):
    return MLP(rank, world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)
