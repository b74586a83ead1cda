"""moe-expert-scale: expert-parallel weight gradients never scaled by 1 / ep.

Origin: megablocks #20 ("Fix weight gradients with expert model parallelism"). With expert model
parallelism over the data-parallel group, each rank computes the mean loss of its own tokens and
the dense weights' gradients are averaged over the ranks, as data parallelism does. The routed
experts are not replicated: each lives on one rank and gets every rank's tokens through the
all_to_all, so its gradient is the sum of the ranks' per-rank means, ep times the mean over all
tokens, and no all-reduce follows to average it. megablocks' fix scales the experts' weight
gradients by 1 / expert_parallel_world_size in the forward (`scale_gradient`).

Dispatch is torchtitan's and DeepEP's fixed-size buffer: every rank's tokens go to every rank; a
rank's experts run on all of them, the results come back by the inverse all_to_all, and the
token's own rank weighs them by its router's gates (zero for experts not chosen), so the proof
covers every routing. The marked line is the experts' forward, which takes the weights unscaled.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN_HIDDEN = 8, 8
NUM_EXPERTS, TOP_K = 16, 2
TOKENS = 16  # in all, split over the data-parallel ranks

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"
OUTPUT = ("shard", 0)


class ScaleGradient(torch.autograd.Function):
    """The identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


scale_gradient = ScaleGradient.apply


class LearnedRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)

    def forward(self, x):
        scores = self.layer(x).softmax(dim=-1)
        expert_weights, expert_indices = torch.topk(scores, TOP_K, dim=-1)
        return torch.zeros_like(scores).scatter(-1, expert_indices, expert_weights)  # (tokens, experts)


class MLP(nn.Module):
    """This rank's experts, their weights stacked: (local experts, hidden, ffn)."""

    def __init__(self, num_local_experts, expert_parallel_world_size):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_local_experts, HIDDEN, FFN_HIDDEN) * HIDDEN ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_local_experts, FFN_HIDDEN, HIDDEN) * FFN_HIDDEN ** -0.5)
        self.gradient_scale = None if expert_parallel_world_size == 1 else 1 / expert_parallel_world_size

    def scale_grad(self, w):
        return w if self.gradient_scale is None else scale_gradient(w, self.gradient_scale)

    def forward(self, x):  # (tokens, hidden) -> (local experts, tokens, hidden)
        return torch.matmul(F.silu(torch.matmul(x, self.w1)), self.w2)  # BUG(scale): each expert's gradient sums every rank's mean


class MoE(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.world_size = world_size
        self.router = LearnedRouter()
        self.mlp = MLP(NUM_EXPERTS // world_size, world_size)

    def forward(self, x):
        n, tokens = self.world_size, x.shape[0]
        gates = self.router(x)
        received = funcol.all_to_all_single_autograd(torch.cat([x] * n), None, None, dist.group.WORLD)
        out = self.mlp(received)  # this rank's experts on every rank's tokens
        local = out.shape[0]
        sent = out.view(local, n, tokens, HIDDEN).transpose(0, 1).contiguous()  # piece j: rank j's tokens
        returned = funcol.all_to_all_single_autograd(sent, None, None, dist.group.WORLD)
        per_expert = returned.reshape(n * local, tokens, HIDDEN)  # every expert, in global order
        return (gates.t().unsqueeze(-1) * per_expert).sum(0)


def reference():
    return MoE()


def distributed(rank, world_size):
    return MoE(rank, world_size)


def inputs():
    return (torch.randn(TOKENS, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size)[rank]


def shard_state(ref_state, rank, world_size):
    local = NUM_EXPERTS // world_size
    return {k: v[rank * local : (rank + 1) * local] if k.startswith("mlp.") else v for k, v in ref_state.items()}


def loss(output, x):
    return output.pow(2).mean()


def distributed_step(model, inputs, rank, world_size):
    """Data parallel: this rank's mean loss; the dense (router) gradients averaged over the ranks,
    the experts' left as they are (each lives on one rank)."""
    (x,) = inputs
    batch_loss = loss(model(x), x)
    batch_loss.backward()
    dist.all_reduce(model.router.layer.weight.grad, op=dist.ReduceOp.AVG)
    total = batch_loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total
