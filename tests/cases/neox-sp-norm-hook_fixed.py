"""neox-sp-norm-hook: the sequence-parallel LayerNorm gradient hooks sit on parameters that never
train, and they average where they must sum.

Origin: GPT-NeoX #1259 (on the sequence-parallel PR #1257). Under sequence parallelism each rank's
norms see only its tokens, so their weight and bias gradients are partial sums over the sequence.
NeoX registers `reduce_weight_grads_from_model_parallel_region` as a tensor hook on every norm
parameter. Two faults: the hooks were registered on a model object before the one that trains was
made (in NeoX, before `deepspeed.initialize`; here, before `to_sequential()` rebuilds the layers
from their specs), so they never fire; and the hook divided the all-reduced gradient by the
model-parallel world size, averaging what must be summed over sequence shards. The fixed twin
registers the hooks on the model that trains and sums.
NeoX's loop walks `named_parameters()` recursively; the final norm's wrapper `NormPipe` has "norm"
in its class name too, so the final norm's parameters get the hook twice and, with the summing
hook, their gradient is all-reduced twice (shardproof reports double counting). Both twins here
register each parameter's hook once (`recurse=False`).
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


# --- megatron/mpu/mappings.py ---------------------------------------------------------------------
def _gather_along_first_dim(input_):
    world_size = dist.get_world_size()
    if world_size == 1:
        return input_
    tensor_list = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(tensor_list, input_.contiguous())
    return torch.cat(tensor_list, dim=0).contiguous()


def _reduce_scatter_along_first_dim(input_):
    world_size = dist.get_world_size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.reduce_scatter_tensor(output, input_.contiguous())
    return output


def _split_along_first_dim(input_):
    world_size = dist.get_world_size()
    if world_size == 1:
        return input_
    return input_.chunk(world_size, dim=0)[dist.get_rank()].contiguous()


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


# --- megatron/model -------------------------------------------------------------------------------
class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class ParallelMLP(nn.Module):
    def __init__(self, tp_size, sequence_parallel):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.dense_h_to_4h = nn.Linear(HIDDEN, FFN // tp_size)  # ColumnParallelLinear
        self.dense_4h_to_h = nn.Linear(FFN // tp_size, HIDDEN, bias=False)  # RowParallelLinear

    def forward(self, hidden_states):
        if self.sequence_parallel:
            hidden_states = _GatherFromSequenceParallelRegion.apply(hidden_states, True)
        output = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))
        if self.sequence_parallel:
            output = _ReduceScatterToSequenceParallelRegion.apply(output)
        return output


class ParallelTransformerLayer(nn.Module):
    """The MLP half of a NeoX layer on [s, b, h] activations (s split under sequence parallelism)."""

    def __init__(self, tp_size, sequence_parallel):
        super().__init__()
        self.post_attention_layernorm = LayerNorm(HIDDEN)
        self.mlp = ParallelMLP(tp_size, sequence_parallel)

    def forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


class NormPipe(nn.Module):
    """The final norm, then the gather out of the sequence-parallel region for a replicated head."""

    def __init__(self, sequence_parallel):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.norm = LayerNorm(HIDDEN)

    def forward(self, x):
        x = self.norm(x)
        if self.sequence_parallel:
            x = _GatherFromSequenceParallelRegion.apply(x, False)
        return x


class LayerSpec:
    def __init__(self, typename, *args):
        self.typename, self.args = typename, args

    def build(self):
        return self.typename(*self.args)


class GPT2ModelPipe(nn.Module):
    """Built from layer specs; `to_sequential()` builds the layers again as a plain nn.Sequential."""

    def __init__(self, neox_args):
        super().__init__()
        tp, sp = neox_args["model_parallel_size"], neox_args["sequence_parallel"]
        self.specs = [LayerSpec(ParallelTransformerLayer, tp, sp), LayerSpec(NormPipe, sp)]
        self.layers = nn.ModuleList(spec.build() for spec in self.specs)

    def to_sequential(self):
        return nn.Sequential(*(spec.build() for spec in self.specs))


def reduce_weight_grads_from_model_parallel_region(input_):
    """A hook that can be applied to any weight tensor via .register_hook().
    Allreduces grads for e.g. LN weights across the model parallel group."""
    if dist.get_world_size() == 1:
        return input_
    dist.all_reduce(input_)  # FIX: summed over sequence shards, not averaged
    return input_


def mark_norms_for_sequence_parallel_grad_sync(module, neox_args):
    """Register the all-reduce hook on the parameters of every module whose class name has "norm"."""
    if not neox_args["sequence_parallel"]:
        return
    for module_ in module.modules():
        if "norm" in type(module_).__name__.lower():
            for name, param in module_.named_parameters(recurse=False):
                if param.requires_grad:
                    param.register_hook(reduce_weight_grads_from_model_parallel_region)


def get_model(neox_args):
    model = GPT2ModelPipe(neox_args).to_sequential()
    mark_norms_for_sequence_parallel_grad_sync(model, neox_args)  # FIX: on the model that trains
    return model


def reference():
    return get_model({"model_parallel_size": 1, "sequence_parallel": False})


def distributed(rank, world_size):
    return get_model({"model_parallel_size": world_size, "sequence_parallel": True})


def inputs():
    return (torch.randn(SEQ, BATCH, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=0)[rank]


def loss(output, hidden_states):
    return output.pow(2).mean()
