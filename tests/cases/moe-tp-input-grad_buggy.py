"""moe-tp-input-grad: TP-sharded experts whose replicated input leaves DTensor by `to_local()`
without a Partial gradient placement: the input's gradient is never all-reduced.

Origin: torchtitan #1878 (issue #1805). With tensor parallelism on the routed experts, every TP
rank sees the same tokens (Replicate) and a slice of each expert's hidden dim (w1 and w3 Shard(1),
w2 Shard(2)). `GroupedExperts` runs on plain tensors, so its forward calls `to_local()` on the
weights and on the input; the input's gradient from a rank's slice is that rank's share of a sum
(Partial), but `to_local()` without `grad_placements` declares it Replicate, so the all-reduce the
backward needs never runs and everything upstream of the MoE (here the MoE's RMSNorm) trains on a
rank's share. The marked line is the expert's product whose backward makes that share; the fix
(one line) is `to_local(grad_placements=(Partial(),))` on the input. The experts' outputs leave as
Partial and are all-reduced (redistributed to Replicate) before the router's gates weigh them.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

DIM, HIDDEN_DIM = 8, 16
NUM_EXPERTS, TOP_K = 4, 2
TOKENS = 6

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class GroupedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN_DIM, DIM) * DIM ** -0.5)
        self.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, DIM, HIDDEN_DIM) * HIDDEN_DIM ** -0.5)
        self.w3 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN_DIM, DIM) * DIM ** -0.5)

    def forward(self, x):  # (tokens, dim) -> (experts, tokens, dim)
        w1, w2, w3 = self.w1, self.w2, self.w3
        if isinstance(w1, DTensor):
            # plain tensors inside, as with the dynamic-shape inputs of expert parallelism
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
            x = x.to_local()  # declares the input's gradient Replicate
        return torch.stack([_run_expert(x, w1[e], w2[e], w3[e]) for e in range(NUM_EXPERTS)])


def _run_expert(x, w1, w2, w3):
    """torchtitan's `_run_experts_for_loop`, one expert on its tokens."""
    h = F.silu(torch.matmul(x, w1.transpose(-2, -1))) * torch.matmul(x, w3.transpose(-2, -1))  # BUG(partial): x's gradient, a rank's share of the hidden dim, never all-reduced
    return torch.matmul(h, w2.transpose(-2, -1))


class TensorParallel(ParallelStyle):
    """torchtitan's TP for GroupedExperts: weights sharded on the hidden dim, input Replicate,
    output Partial."""

    def _apply(self, module, device_mesh):
        for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(getattr(module, name), device_mesh, [Shard(dim)])))
        module.register_forward_pre_hook(lambda mod, args: (DTensor.from_local(args[0], device_mesh, (Replicate(),)),))
        module.register_forward_hook(
            lambda mod, args, out: DTensor.from_local(out, device_mesh, (Partial(),)).redistribute(placements=(Replicate(),)).to_local()
        )
        return module


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, NUM_EXPERTS, bias=False)

    def forward(self, x):
        scores, selected = torch.topk(torch.softmax(self.gate(x), dim=-1), TOP_K, dim=-1)
        return torch.zeros(x.shape[0], NUM_EXPERTS, dtype=x.dtype).scatter(-1, selected, scores)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.router = Router()
        self.experts = GroupedExperts()

    def forward(self, x):
        h = self.ffn_norm(x)
        out = self.experts(h)
        return x + (self.router(h).t().unsqueeze(-1) * out).sum(0)


def reference():
    return MoEBlock()


def distributed(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    return parallelize_module(MoEBlock(), mesh, {"experts": TensorParallel()})


def inputs():
    return (torch.randn(TOKENS, DIM),)


def loss(output, x):
    return output.pow(2).mean()
