"""sentinel-expert-grad: expert-parallel slots of other ranks' experts keep an expert output, so
their zero routing weight still takes a gradient to the router.

Origin: transformers #48687 (fixed in #48689), `experts_implementation="batched_mm"` under expert
parallelism. Every rank holds every token; the router hook (RouterParallel) renumbers this rank's
experts locally and turns the others into a sentinel id, their scores zeroed; the experts run every
routing slot through its expert (the sentinel clamped to the last local one), weigh it by its score
and the MoE output is summed over ranks. The sentinel slots' outputs are not zero, and the zero
weight hides them in the forward only: the router's gradient collects <grad, output> for slots the
rank never routed. The fix masks the routing weights of sentinel slots in the experts.

Marked: the line where the experts read the routing weights (the fix masks the sentinel slots'
there); the diagnosis names the gradient reaching the router's all-reduce there.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

HIDDEN, INTERMEDIATE = 8, 4
NUM_EXPERTS, TOP_K = 8, 2
TOKENS = 6

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class AllReduceBackward(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the EP group."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


class AllReduceForward(torch.autograd.Function):
    """Sums the partial outputs over the EP group; each rank's gradient is the whole's."""

    @staticmethod
    def forward(ctx, x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


class TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN) * HIDDEN ** -0.5)

    def forward(self, hidden_states):
        router_probs = F.linear(hidden_states, self.weight).softmax(dim=-1)
        router_scores, router_indices = torch.topk(router_probs, TOP_K, dim=-1)
        return router_scores, router_indices


class Experts(nn.Module):
    """This rank's experts, stacked; batched_mm: every routing slot through its expert."""

    def __init__(self, num_experts):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, HIDDEN, 2 * INTERMEDIATE) * HIDDEN ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, INTERMEDIATE, HIDDEN) * INTERMEDIATE ** -0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_experts = self.gate_up_proj.size(0)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_ids = top_k_index.reshape(-1)
        token_idx = torch.arange(hidden_states.size(0)).unsqueeze(1).expand(-1, TOP_K).reshape(-1)
        sentinel = expert_ids >= num_experts  # slots of experts on other ranks
        expert_ids = expert_ids.clamp(max=num_experts - 1)
        sample_weights = top_k_weights.reshape(-1)  # BUG(double-count): a sentinel slot keeps its expert output, so every rank sends its weight a gradient
        current = hidden_states[token_idx]
        gate, up = torch.bmm(current.unsqueeze(1), self.gate_up_proj[expert_ids]).squeeze(1).chunk(2, dim=-1)
        out_per_sample = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.down_proj[expert_ids]).squeeze(1)
        out_per_sample = out_per_sample * sample_weights.unsqueeze(-1)
        return final_hidden_states.index_add(0, token_idx, out_per_sample)


class MoE(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.router = TopKRouter()
        self.experts = Experts(NUM_EXPERTS // world_size)

    def forward(self, hidden_states):
        router_scores, router_indices = self.router(hidden_states)
        if self.world_size > 1:  # RouterParallel: other ranks' experts become the sentinel, their scores zeroed
            num_local = NUM_EXPERTS // self.world_size
            first = self.rank * num_local
            local = (router_indices >= first) & (router_indices < first + num_local)
            router_indices = torch.where(local, router_indices - first, num_local)
            router_scores = AllReduceBackward.apply(router_scores)
            with torch.no_grad():
                router_scores.masked_fill_(~local, 0.0)
        out = self.experts(hidden_states, router_indices, router_scores)
        if self.world_size > 1:
            out = AllReduceForward.apply(out)
        return out


def reference():
    return MoE()


def distributed(rank, world_size):
    return MoE(rank, world_size)


def inputs():
    return (torch.randn(TOKENS, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    local = NUM_EXPERTS // world_size
    return {k: v[rank * local : (rank + 1) * local] if k.startswith("experts.") else v for k, v in ref_state.items()}


def loss(output, x):
    return output.pow(2).mean()
