"""ddp-wrong-group: DDP averages gradients over a group that leaves out the sequence-parallel ranks.

Origin: VeOmni #1115 (issue #1059, also #1086). With Ulysses sequence parallelism every rank
holds a slice of the sequence, so its gradient covers only its own tokens and must be averaged
over the data-parallel and the sequence-parallel ranks together (the `dp_sp` group FSDP already
reduces over). The DDP branch of `build_parallelize_model` used `dp_group`, which excludes the
sequence dimension; with world_size == ulysses_size it is a group of one rank, and the gradient
all-reduce is a silent no-op. The fix uses the flattened `dp_sp` group.

Only the token-wise MLP block is modelled (Ulysses' all-to-alls live in attention). DDP is the
small Python reducer torch's C++ one stands for: a hook averages each gradient once accumulated.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
SEQ = 8  # one sequence, split over the Ulysses ranks

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


@dataclass
class ParallelState:
    """world = dp x ulysses; ranks of one sequence are consecutive."""

    dp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup
    dp_sp_group: dist.ProcessGroup


def init_parallel_state(rank, world_size, ulysses_size):
    dp_size = world_size // ulysses_size
    dp_groups = [dist.new_group(list(range(u, world_size, ulysses_size))) for u in range(ulysses_size)]
    ulysses_groups = [dist.new_group(list(range(d * ulysses_size, (d + 1) * ulysses_size))) for d in range(dp_size)]
    dp_sp_group = dist.new_group(list(range(world_size)))
    return ParallelState(dp_groups[rank % ulysses_size], ulysses_groups[rank // ulysses_size], dp_sp_group)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)))


def build_parallelize_model(model, parallel_state):
    """The DDP branch: average every gradient over the data-parallel ranks once it is accumulated."""
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(
            lambda p: dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=parallel_state.dp_group)  # BUG(wrong-group): no SP ranks
        )
    return model


def reference():
    return Mlp()


def distributed(rank, world_size):
    return Mlp()


def inputs():
    return (torch.randn(1, SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 1)[rank]  # ulysses_size == world_size: every rank one sequence slice


def loss(output, x):
    return F.mse_loss(output, x)


def distributed_step(model, inputs, rank, world_size):
    (x,) = inputs
    parallel_state = init_parallel_state(rank, world_size, ulysses_size=world_size)
    model = build_parallelize_model(model, parallel_state)
    batch_loss = loss(model(x), x)
    batch_loss.backward()
    return batch_loss
