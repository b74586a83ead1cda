"""sp-scatter-allgather (look-alike, correct): scatter into the sequence-parallel region, all-gather back.

Origin: Megatron-LM #1635. scatter_to_sequence_parallel_region splits a replicated [s, b, h]
input along the sequence dim and keeps this rank's chunk; its backward all-gathers, which is right
for a replicated input. In the forward each rank runs a layer norm and a replicated-weight linear
on its tokens (both per token), and gather_from_sequence_parallel_region all-gathers the result
along the sequence dim: equal to running the layers on the whole sequence. Must not be flagged.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
SEQ, BATCH = 8, 2

WORLD_SIZE = 2
OUTPUT = "replicate"


def _split_along_first_dim(input_):
    world_size = dist.get_world_size()
    if world_size == 1:
        return input_
    local_dim_size = input_.size(0) // world_size
    dim_offset = dist.get_rank() * local_dim_size
    return input_[dim_offset : dim_offset + local_dim_size].contiguous()


def _gather_along_first_dim(input_):
    world_size = dist.get_world_size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous())
    return output


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Split the input and keep only the chunk of this rank (backward: all-gather)."""

    @staticmethod
    def forward(ctx, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the input from the sequence-parallel region (backward: split)."""

    @staticmethod
    def forward(ctx, input_):
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_first_dim(grad_output)


class Block(nn.Module):
    """Per-token layers on [s, b, h] activations."""

    def __init__(self, sequence_parallel=False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.norm = nn.LayerNorm(HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states):
        if self.sequence_parallel:
            hidden_states = _ScatterToSequenceParallelRegion.apply(hidden_states)
        hidden_states = F.gelu(self.dense(self.norm(hidden_states)))
        if self.sequence_parallel:
            hidden_states = _GatherFromSequenceParallelRegion.apply(hidden_states)
        return hidden_states


def reference():
    return Block()


def distributed(rank, world_size):
    return Block(sequence_parallel=True)


def inputs():
    return (torch.randn(SEQ, BATCH, HIDDEN),)
