"""expert-wrong-group: expert gradients reduced over the dense data-parallel group when the
expert tensor-parallel size differs from the tensor-parallel size.

Origin: Megatron-LM #5916 (and its kin #6099, #6470: expert parameters handled with the dense
tensor-parallel topology when ETP != TP). Megatron carves the expert layers' ranks out of the same
world as the dense ones, TP x DP = ETP x EP x EDP: here TP = world with sequence parallelism, so
DP = 1, while the experts run with ETP = 1 and EP = 1, so every rank holds every expert whole and
EDP = world. Each rank's experts see only its sequence shard's tokens: their gradients are shares
of a sum over the expert-data-parallel group. The buggy DDP picks the reduction group from the
dense topology for every parameter (`allreduce` attribute lost), so the expert gradients are
"reduced" over the data-parallel group, one rank, and stay each rank's share. With ETP == TP the
groups would coincide and the bug hide. The router is a sequence-parallel parameter: its
gradient is all-reduced over the tensor-parallel group, as Megatron does for such weights.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN_HIDDEN = 8, 8
NUM_EXPERTS, TOP_K = 4, 2
SEQ = 16  # one sequence, split over the tensor-parallel ranks (sequence parallelism)

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"
OUTPUT = ("shard", 0)


@dataclass
class ProcessGroups:
    """TP = world (DP = 1); ETP = EP = 1, so EDP = world."""

    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    expt_dp: dist.ProcessGroup


def initialize_model_parallel(rank, world_size):
    world = dist.new_group(list(range(world_size)))
    singles = [dist.new_group([r]) for r in range(world_size)]
    return ProcessGroups(tp=world, dp=singles[rank], expt_dp=world)


class TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN) * HIDDEN ** -0.5)

    def forward(self, x):
        probs, indices = torch.topk(torch.softmax(F.linear(x, self.weight), dim=-1), TOP_K, dim=-1)
        return torch.zeros(x.shape[0], NUM_EXPERTS, dtype=x.dtype).scatter(-1, indices, probs)


class SequentialMLP(nn.Module):
    """Every expert whole on this rank (ETP = EP = 1), applied to this rank's tokens."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, FFN_HIDDEN) * HIDDEN ** -0.5)
        self.fc2 = nn.Parameter(torch.randn(NUM_EXPERTS, FFN_HIDDEN, HIDDEN) * FFN_HIDDEN ** -0.5)
        for p in (self.fc1, self.fc2):
            p.allreduce = False  # Megatron's mark of an expert parameter

    def forward(self, x):  # (tokens, hidden) -> (experts, tokens, hidden)
        return torch.matmul(F.silu(torch.matmul(x, self.fc1)), self.fc2)


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.experts = SequentialMLP()
        self.router.weight.sequence_parallel = True

    def forward(self, x):
        probs = self.router(x)
        return (probs.t().unsqueeze(-1) * self.experts(x)).sum(0)


def reference():
    return MoELayer()


def distributed(rank, world_size):
    return MoELayer()


def inputs():
    return (torch.randn(SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size)[rank]


def loss(output, x):
    return output.pow(2).sum() / output.numel()


def finalize_model_grads(model, groups):
    """Sequence-parallel weights summed over TP; every other gradient summed over its DP group."""
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=groups.tp)
        else:
            dist.all_reduce(param.grad, group=groups.dp)  # BUG(wrong-group): expert grads need groups.expt_dp


def distributed_step(model, inputs, rank, world_size):
    """Megatron's per-token loss: each rank's token sum over the whole sequence's count."""
    (x,) = inputs
    groups = initialize_model_parallel(rank, world_size)
    share = model(x).pow(2).sum() / (x.numel() * world_size)
    share.backward()
    finalize_model_grads(model, groups)
    total = share.detach().clone()
    dist.all_reduce(total, group=groups.tp)
    return total
