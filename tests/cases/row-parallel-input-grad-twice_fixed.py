"""row-parallel-input-grad-twice: the gradient of a row-parallel layer's replicated input is
all-reduced twice, by the scatter into the tensor-parallel region and by an extra hook.

Origin: the double-reduction class (a collective added where a mapping's backward already issues
it), in Megatron style. `RowParallelLinear(input_is_parallel=False)` takes a replicated input and
keeps this rank's slice of its last dim. Here the scatter is written as
`copy_to_tensor_model_parallel_region` (forward identity, backward all-reduce) followed by the
slice: each rank's input gradient is its slice's gradient zero-padded, and the all-reduce
completes it. The model also registers a tensor hook that all-reduces the same gradient, a
leftover from when the scatter was a plain slice whose backward did not reduce: the gradient
reaching the norm below is world_size times too large. The fix drops the hook.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, OUT = 16, 8
BATCH, SEQ = 2, 3

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Pass the input to the model parallel region (all-reduce in backward)."""

    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.clone()
        dist.all_reduce(grad_output)
        return grad_output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce the input from the model parallel region (identity in backward)."""

    @staticmethod
    def forward(ctx, input_):
        input_ = input_.clone()
        dist.all_reduce(input_)
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def scatter_to_tensor_model_parallel_region(input_):
    """Keep this rank's chunk of the last dim; the copy's backward sums the zero-padded gradients."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    input_ = _CopyToModelParallelRegion.apply(input_)
    return input_.chunk(world_size, dim=-1)[rank]


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, world_size, input_is_parallel=False):
        super().__init__()
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size // world_size))
        self.bias = nn.Parameter(torch.empty(output_size))

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight)
        return _ReduceFromModelParallelRegion.apply(output_parallel) + self.bias


class OutputHead(nn.Module):
    """LayerNorm, then a projection of the normalised features."""

    def __init__(self, world_size=None):
        super().__init__()
        self.tensor_parallel = world_size is not None
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = RowParallelLinear(HIDDEN, OUT, world_size) if self.tensor_parallel else nn.Linear(HIDDEN, OUT)

    def forward(self, hidden_states):
        normed = self.norm(hidden_states)  # FIX: no extra all-reduce hook on its gradient
        return self.proj(normed)


def reference():
    return OutputHead()


def distributed(rank, world_size):
    return OutputHead(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def loss(output, hidden_states):
    return output.pow(2).mean()
