"""einsum-row-parallel (look-alike, correct): a Megatron-style ParallelMLP whose row-parallel
product is written with `torch.einsum` instead of `F.linear`.

An equivalent refactoring (issue 14's mutation harness found it unknown): torch lowers the einsum
to a batched product over a batch of one, with size-1 dims inserted into the sharded operand and
permuted, so the rank's partial sum reaches its all-reduce through reshapes the reference never
makes. It is the same product and must be proven, not flagged as a missing reduction.
"""


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
FFN = 4 * HIDDEN
BATCH, SEQ = 2, 3

WORLD_SIZE = 2
OUTPUT = "replicate"


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce the input from the model parallel region (identity in backward)."""

    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_)
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def reduce_from_tensor_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, world_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size // world_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size // world_size))

    def forward(self, input_):
        return F.linear(input_, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, world_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size // world_size))
        self.bias = nn.Parameter(torch.empty(output_size))

    def forward(self, input_):
        # the same product as F.linear, written as an einsum (which torch runs as a bmm over a
        # batch of one, its operands unsqueezed and permuted)
        output_ = reduce_from_tensor_model_parallel_region(torch.einsum("bsf,hf->bsh", input_, self.weight))
        return output_ + self.bias


class ParallelMLP(nn.Module):
    def __init__(self, world_size):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(HIDDEN, FFN, world_size)
        self.dense_4h_to_h = RowParallelLinear(FFN, HIDDEN, world_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(HIDDEN, FFN)
        self.dense_4h_to_h = nn.Linear(FFN, HIDDEN)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))


def reference():
    return MLP()


def distributed(rank, world_size):
    return ParallelMLP(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def loss(output, *inputs):
    return output.square().mean()
