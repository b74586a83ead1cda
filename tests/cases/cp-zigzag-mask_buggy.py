"""cp-zigzag-mask: context parallelism by KV all-gather over a load-balanced (zigzag) sequence,
its causal mask built from contiguous positions.

Origin: all-gather-KV context parallelism as Llama 3 trains long contexts (torch's
`context_parallel` with its head-tail load balancer, Megatron's `get_batch_on_this_cp_rank`): the
sequence is cut into 2 * cp chunks and rank r holds chunks r and 2 * cp - 1 - r, so every rank
gets the same share of the causal mask's work. Each rank projects its own tokens, all-gathers K
and V (differentiably: the backward of the all-gather is a reduce-scatter of their gradients),
puts them back in position order and attends its queries to the whole sequence under a causal
mask built from its own positions. The buggy twin builds the mask from the positions a contiguous
split would give the rank, [r * s_local, (r + 1) * s_local), the bug of a port that adds load
balancing to the tokens but not to the position ids: at world size 1 the two coincide.
One packed sequence (THD without a batch dim). Training: each rank's loss is the mean over its
own tokens; the gradients of the replicated weights are averaged over the CP group, as FSDP/DDP
over the data x context mesh does.
"""

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

HIDDEN = 32
N_HEADS = 4
HEAD_DIM = HIDDEN // N_HEADS
SEQ = 16

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = ("shard", 0, "zigzag")


def zigzag_positions(seq, rank, world_size):
    """The positions rank `rank` holds: chunks rank and 2 * world_size - 1 - rank of 2 * world_size."""
    chunk = seq // (2 * world_size)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk)])


def gather_sequence(x, world_size):
    """(h, s_local, d) zigzag shards from every rank -> (h, s, d) in position order."""
    gathered = funcol.all_gather_tensor_autograd(x.contiguous(), 1, list(range(world_size)))
    halves = [h for piece in gathered.chunk(world_size, dim=1) for h in piece.chunk(2, dim=1)]
    return torch.cat(halves[0::2] + halves[1::2][::-1], dim=1)  # chunk j of the sequence, j = 0 .. 2 * world_size - 1


class CausalAttention(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden, targets):
        s_local, _ = hidden.shape  # one packed sequence of tokens (THD without the batch)
        seq = s_local * self.world_size
        q = self.q_proj(hidden).view(s_local, N_HEADS, HEAD_DIM).transpose(0, 1)
        k = self.k_proj(hidden).view(s_local, N_HEADS, HEAD_DIM).transpose(0, 1)
        v = self.v_proj(hidden).view(s_local, N_HEADS, HEAD_DIM).transpose(0, 1)
        if self.world_size > 1:
            k = gather_sequence(k, self.world_size)
            v = gather_sequence(v, self.world_size)
        future = torch.arange(self.rank * s_local, (self.rank + 1) * s_local)[:, None] < torch.arange(seq)[None, :]  # BUG(layout): contiguous positions
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.o_proj(out.transpose(0, 1).reshape(s_local, HIDDEN))


def reference():
    return CausalAttention()


def distributed(rank, world_size):
    return CausalAttention(rank, world_size)


def inputs():
    return torch.randn(SEQ, HIDDEN), torch.randn(SEQ, HIDDEN)


def shard_input(index, full, rank, world_size):
    chunks = full.chunk(2 * world_size, dim=0)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=0)


def loss(output, hidden, targets):
    return ((output - targets) ** 2).mean()


def distributed_step(model, inputs, rank, world_size):
    value = loss(model(*inputs), *inputs)
    value.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return value
