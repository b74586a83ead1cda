"""fsdp-expert-divisor: Megatron-FSDP scales expert gradients by the expert-data-parallel size only.

Origin: Megatron-LM #5956. With expert parallelism, the tokens of every rank of an EP group reach
its experts, so an expert's gradient sums the losses of dp x ep ranks (each the mean over its own
tokens) and must be divided by all of them before the reduce-scatter over the expert-data-parallel
group, as dense gradients are divided by the data-parallel size. Megatron-FSDP's expert
`gradient_scaling_factor` was 1 / (expert data-parallel size): the expert gradients come out ep
times too large. The fix divides by the full data-parallel size.

World = edp x ep, the ranks of an EP group consecutive. The MoE routes every token to every
expert, weighted by a softmax gate (no routing sizes to follow); tokens are all-gathered over
the EP group, each rank applies its experts, and the partial outputs are reduce-scattered back. Each
rank's experts are FSDP-sharded (flat) over the expert-data-parallel group: all-gathered before
use, their gradient scaled and reduce-scattered after the backward. The router is frozen here
(a buffer): its gradient, averaged over all ranks as a dense one, is not this bug's.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN, EXPERTS = 4, 8, 2
TOKENS = 16
EP = 2  # expert-parallel size (1 at world size 1)

WORLD_SIZE = 4
BUG_WORLD_SIZE = 2  # at 2 the expert-DP group is one rank: the gradient is divided by 1, not 2
MODE = "train"


def run_experts(x, gates, w1, w2):
    """sum_e gates[:, e] * w2[e] @ gelu(w1[e] @ x)."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        out = out + gates[:, e : e + 1] * F.linear(F.gelu(F.linear(x, w1[e])), w2[e])
    return out


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("router", torch.randn(EXPERTS, HIDDEN))  # frozen
        self.w1 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / HIDDEN**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / FFN**0.5)

    def forward(self, x):
        return x + run_experts(x, F.softmax(F.linear(x, self.router), -1), self.w1, self.w2)


class FSDPAllGather(torch.autograd.Function):
    """Unshard a flat parameter over the expert-data-parallel group; its gradient is averaged by the
    reduce-scatter back over that group (Megatron-FSDP's gradient_scaling_factor, then a sum)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        full = shard.new_empty(shard.numel() * dist.get_world_size(group))
        dist.all_gather_into_tensor(full, shard, group=group)
        return full

    @staticmethod
    def backward(ctx, grad):
        grad = grad / dist.get_world_size()  # FIX: every data-parallel rank (dp x ep) whose tokens reach the experts
        shard = grad.new_empty(grad.numel() // dist.get_world_size(ctx.group))
        dist.reduce_scatter_tensor(shard, grad.contiguous(), group=ctx.group)
        return shard, None


def init_groups(rank, world_size):
    ep = min(EP, world_size)
    ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world_size // ep)]
    edp_groups = [dist.new_group(list(range(e, world_size, ep))) for e in range(ep)]
    return ep, ep_groups[rank // ep], edp_groups[rank % ep]


class ExpertParallelMoE(nn.Module):
    """This rank's experts (EXPERTS / ep of them), flat-sharded over the expert-data-parallel group."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.ep, self.ep_group, self.edp_group = init_groups(rank, world_size)
        self.edp = world_size // self.ep
        self.first = rank % self.ep * (EXPERTS // self.ep)
        local = EXPERTS // self.ep
        self.register_buffer("router", torch.empty(EXPERTS, HIDDEN))
        self.w1 = nn.Parameter(torch.empty(local * FFN * HIDDEN // self.edp))
        self.w2 = nn.Parameter(torch.empty(local * HIDDEN * FFN // self.edp))

    def forward(self, x):
        local = EXPERTS // self.ep
        tokens = funcol.all_gather_tensor_autograd(x, 0, self.ep_group)
        gates = F.softmax(F.linear(tokens, self.router), -1)[:, self.first : self.first + local]
        w1 = FSDPAllGather.apply(self.w1, self.edp_group).view(local, FFN, HIDDEN)
        w2 = FSDPAllGather.apply(self.w2, self.edp_group).view(local, HIDDEN, FFN)
        partial = run_experts(tokens, gates, w1, w2)
        return x + funcol.reduce_scatter_tensor_autograd(partial, "sum", 0, self.ep_group)


def reference():
    return MoE()


def distributed(rank, world_size):
    return ExpertParallelMoE(rank, world_size)


def shard_state(ref_state, rank, world_size):
    ep = min(EP, world_size)
    edp, local = world_size // ep, EXPERTS // ep
    first = rank % ep * local

    def shard(weight):
        return weight[first : first + local].reshape(-1).chunk(edp)[rank // ep]

    return {"router": ref_state["router"], "w1": shard(ref_state["w1"]), "w2": shard(ref_state["w2"])}


def inputs():
    return (torch.randn(TOKENS, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size)[rank]


def loss(output, x):
    return F.mse_loss(output, x)


def distributed_step(model, inputs, rank, world_size):
    (x,) = inputs
    batch_loss = loss(model(x), x)
    batch_loss.backward()  # the experts' gradients are reduce-scattered by FSDPAllGather.backward
    return batch_loss
