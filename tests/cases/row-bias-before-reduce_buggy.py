"""row-bias-before-reduce: Paddle fleet-style RowParallelLinear adding its bias before the all-reduce.

Origin: PaddlePaddle #35186. A row-parallel linear layer computes a partial sum on every rank and
all-reduces it; its (replicated) bias must be added once, after the reduction. The buggy twin
passes the bias to the local matmul, so every rank adds it and the all-reduce sums it tp times.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
FFN = 64
BATCH, SEQ = 2, 3

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, world_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features // world_size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // world_size))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, world_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world_size))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight, self.bias)  # BUG(double-count): bias added on every rank before the all-reduce, so it is summed tp times
        dist.all_reduce(output_parallel)  # mp_allreduce
        output = output_parallel
        return output


class ParallelMLP(nn.Module):
    def __init__(self, world_size):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, world_size)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, world_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def reference():
    return MLP()


def distributed(rank, world_size):
    return ParallelMLP(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)
