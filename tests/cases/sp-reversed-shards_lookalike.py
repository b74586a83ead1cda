"""sp-reversed-shards (look-alike, correct): a sequence-parallel training step whose ranks read the
sequence shards in reverse order.

An equivalent refactoring (issue 14's third, on every rank rather than among replicas): rank r reads
shard world_size - 1 - r of the sequence. Every token is still read by exactly one rank and the
per-token losses and gradients are averaged over all of them, so the step is the reference's at
every world size from 2 on. It looks like a wrong shard index but must not be flagged.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
BATCH, SEQ = 2, 8

WORLD_SIZE = 2
MODE = "train"


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


def reference():
    return Mlp()


def distributed(rank, world_size):
    return Mlp()


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 1)[world_size - 1 - rank]  # the shards in reverse rank order


def loss(output, x):
    return F.mse_loss(output, x)


def distributed_step(model, inputs, rank, world_size):
    (x,) = inputs
    batch_loss = loss(model(x), x)
    batch_loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return batch_loss
