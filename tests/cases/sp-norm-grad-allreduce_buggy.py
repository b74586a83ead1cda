"""sp-norm-grad-allreduce: sequence-parallel LayerNorm weights lose their `sequence_parallel` flag,
so Megatron's finalize step never all-reduces their gradients across tensor-parallel ranks.

Origin: TransformerEngine #1528 (broken by #1033; seen as Megatron-LM #1446, "final_layernorm
gradient mismatch when TP+SP enabled"). Under sequence parallelism a norm sees only this rank's
tokens, so its weight and bias gradients are partial sums over the sequence; Megatron's
`_allreduce_layernorm_grads` sums them over the TP group for every parameter flagged
`sequence_parallel`. TE's refactored norm sets the flag in `reset_parameters`, which its base class
calls before the subclass has stored `self.sequence_parallel`: the flag is never set and the
all-reduce skips the norms. The fix sets the flags once `sequence_parallel` is known.
The marked line is where the unreduced partial sum is created: the layer norm whose backward
formula sums its weight gradient over this rank's tokens only (the flag itself is not an op).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

HIDDEN, FFN = 8, 16
SEQ, BATCH = 8, 2

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


# --- megatron/core/tensor_parallel/mappings.py ---------------------------------------------------
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


def _reduce_scatter_along_first_dim(input_):
    world_size = dist.get_world_size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.reduce_scatter_tensor(output, input_.contiguous())
    return output


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Gather the input from sequence parallel region and concatenate."""

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        # A tensor-parallel consumer leaves partial gradients: reduce-scatter. A replicated one: split.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce scatter the input from the model parallel region."""

    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


# --- layers ---------------------------------------------------------------------------------------
class _NormBase(nn.Module):
    """TE's operation-based norm: creates its parameters and initialises them at construction."""

    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.normalized_shape, self.eps = (normalized_shape,), eps
        self.weight = nn.Parameter(torch.empty(normalized_shape))
        self.bias = nn.Parameter(torch.empty(normalized_shape))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


class LayerNorm(_NormBase):
    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel=None):
        super().__init__(normalized_shape, eps)
        self.sequence_parallel = sequence_parallel

    def reset_parameters(self):
        super().reset_parameters()
        # Set flag for sequence parallelism (custom Megatron-LM integration)
        if getattr(self, "sequence_parallel", None) is not None:
            self.weight.sequence_parallel = self.sequence_parallel
            self.bias.sequence_parallel = self.sequence_parallel

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # BUG(partial): weight/bias grads sum this rank's tokens only; never all-reduced (flag lost)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, tp_size=1, sequence_parallel=False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(output_size // tp_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size // tp_size))

    def forward(self, input_):
        if self.sequence_parallel:
            input_ = _GatherFromSequenceParallelRegion.apply(input_, True)
        return F.linear(input_, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, tp_size=1, sequence_parallel=False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp_size))

    def forward(self, input_):
        output_parallel = F.linear(input_, self.weight)
        if self.sequence_parallel:
            return _ReduceScatterToSequenceParallelRegion.apply(output_parallel)
        return output_parallel


class GPTBlock(nn.Module):
    """Pre-norm MLP block with a residual, then the final layernorm; [s, b, h], s split under SP."""

    def __init__(self, tp_size=1, sequence_parallel=False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        sp = sequence_parallel or None
        self.pre_mlp_layernorm = LayerNorm(HIDDEN, sequence_parallel=sp)
        self.linear_fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_size, sequence_parallel)
        self.linear_fc2 = RowParallelLinear(FFN, HIDDEN, tp_size, sequence_parallel)
        self.final_layernorm = LayerNorm(HIDDEN, sequence_parallel=sp)

    def forward(self, hidden_states):
        mlp_out = self.linear_fc2(F.gelu(self.linear_fc1(self.pre_mlp_layernorm(hidden_states))))
        hidden_states = self.final_layernorm(hidden_states + mlp_out)
        if self.sequence_parallel:
            hidden_states = _GatherFromSequenceParallelRegion.apply(hidden_states, False)
        return hidden_states


# --- megatron/core/distributed/finalize_model_grads.py --------------------------------------------
def _allreduce_layernorm_grads(model):
    """All-reduce layernorm grads (for sequence parallelism)."""
    if dist.get_world_size() > 1:
        grads = []
        for param in model.parameters():
            if param.requires_grad and getattr(param, "sequence_parallel", False):
                grads.append(param.grad)
        if grads:
            coalesced = _flatten_dense_tensors(grads)
            dist.all_reduce(coalesced)
            for buf, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
                buf.copy_(synced)


def distributed_step(model, inputs, rank, world_size):
    output_tensor = model(*inputs)
    loss_value = loss(output_tensor, *inputs)
    loss_value.backward()
    _allreduce_layernorm_grads(model)
    return loss_value


def reference():
    return GPTBlock()


def distributed(rank, world_size):
    return GPTBlock(tp_size=world_size, sequence_parallel=True)


def inputs():
    return (torch.randn(SEQ, BATCH, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=0)[rank]


def loss(output, hidden_states):
    return output.pow(2).mean()
