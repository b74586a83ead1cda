"""te-gather-last-dim: the weight gradient of a sequence-parallel column-parallel Linear reads a
scrambled input, because "gather along the last dim" concatenates on dim 0.

Origin: TransformerEngine #530 (fixed in #531). TE's `_Linear` keeps the input transposed for the
weight-gradient GEMM (the FP8 cast-transpose path, here in full precision). Under sequence
parallelism each rank holds the transposed input of its own tokens, [in_features, local_tokens],
and the backward all-gathers it along the last (token) dim. `gather_along_last_dim` allocated an
output with a widened last dim but filled it with `all_gather_into_tensor`, which lays the ranks'
tensors one after another in memory: dim 0 of [world_size * in_features, local_tokens], read as
[in_features, tokens]. The fix gathers on dim 0 and concatenates the chunks along the last dim.
The marked line is that collective, whose output the wgrad GEMM reads with the wrong layout.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
SEQ, BATCH = 8, 2

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


def gather_along_first_dim(input_, tp_group=None):
    """Gather tensors and concatenate along the first dimension."""
    world_size = dist.get_world_size(tp_group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous(), group=tp_group)
    return output


def gather_along_last_dim(input_, tp_group=None):
    """Gather tensors and concatenate along the last dimension."""
    world_size = dist.get_world_size(tp_group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size  # FIX: all_gather_into_tensor fills dim 0
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous(), group=tp_group)
    tensor_list = output.chunk(world_size, dim=0)  # FIX: then move the ranks' chunks to the last dim
    return torch.cat(tensor_list, dim=-1).contiguous()  # FIX


def reduce_scatter_along_first_dim(input_, tp_group=None):
    """Reduce-scatter the input tensor across the model parallel group along the first dimension."""
    world_size = dist.get_world_size(tp_group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.reduce_scatter_tensor(output, input_.contiguous(), group=tp_group)
    return output


class _Linear(torch.autograd.Function):
    """Linear with TE's tensor/sequence-parallel communication (column or row parallel)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, parallel_mode, sequence_parallel, tp_group):
        in_features = weight.shape[-1]
        inputmat = inp.view((-1, in_features))
        inputmat_t = inputmat.t().contiguous()  # the transposed copy the wgrad GEMM reads
        if parallel_mode == "column" and sequence_parallel:
            inputmat_total = gather_along_first_dim(inputmat, tp_group)
        else:
            inputmat_total = inputmat
        out = torch.matmul(inputmat_total, weight.t())
        if bias is not None:
            out = out + bias
        if parallel_mode == "row" and sequence_parallel:
            out = reduce_scatter_along_first_dim(out, tp_group)
        ctx.save_for_backward(inputmat_t, weight)
        ctx.use_bias, ctx.inp_shape = bias is not None, inp.shape
        ctx.parallel_mode, ctx.sequence_parallel, ctx.tp_group = parallel_mode, sequence_parallel, tp_group
        return out.view(-1, *inp.shape[1:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        inputmat_t, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous().view((-1, grad_output.shape[-1]))
        if ctx.parallel_mode == "row" and ctx.sequence_parallel:
            grad_output = gather_along_first_dim(grad_output, ctx.tp_group)
        if ctx.parallel_mode == "column" and ctx.sequence_parallel:
            inputmat_t_total = gather_along_last_dim(inputmat_t, ctx.tp_group)
        else:
            inputmat_t_total = inputmat_t
        dgrad = torch.matmul(grad_output, weight)
        if ctx.parallel_mode == "column" and ctx.sequence_parallel:
            dgrad = reduce_scatter_along_first_dim(dgrad, ctx.tp_group)
        wgrad = torch.matmul(grad_output.t(), inputmat_t_total.t())
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return dgrad.view(ctx.inp_shape), wgrad, grad_bias, None, None, None


class Linear(nn.Module):
    """TE-style Linear: `parallel_mode` "column" or "row", inputs [s, b, h] sharded along s."""

    def __init__(self, in_features, out_features, bias=True, parallel_mode=None, sequence_parallel=False,
                 tp_size=1):
        super().__init__()
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        if parallel_mode == "column":
            out_features //= tp_size
        elif parallel_mode == "row":
            in_features //= tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, inp):
        return _Linear.apply(inp, self.weight, self.bias, self.parallel_mode, self.sequence_parallel, None)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence for a replicated consumer (backward: keep this rank's chunk)."""

    @staticmethod
    def forward(ctx, input_):
        return gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        world_size, rank = dist.get_world_size(), dist.get_rank()
        return grad_output.chunk(world_size, dim=0)[rank]


class Mlp(nn.Module):
    def __init__(self, tp_size=1, sequence_parallel=False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.fc1 = Linear(HIDDEN, FFN, parallel_mode="column", sequence_parallel=sequence_parallel, tp_size=tp_size)
        self.fc2 = Linear(FFN, HIDDEN, bias=False, parallel_mode="row", sequence_parallel=sequence_parallel,
                          tp_size=tp_size)

    def forward(self, hidden_states):
        out = self.fc2(F.gelu(self.fc1(hidden_states)))
        if self.sequence_parallel:
            out = _GatherFromSequenceParallelRegion.apply(out)
        return out


def reference():
    return Mlp()


def distributed(rank, world_size):
    return Mlp(tp_size=world_size, sequence_parallel=True)


def inputs():
    return (torch.randn(SEQ, BATCH, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=0)[rank]


def loss(output, hidden_states):
    return output.pow(2).mean()
