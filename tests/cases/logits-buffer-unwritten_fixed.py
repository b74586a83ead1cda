"""logits-buffer-unwritten: gathered vocab-parallel logits copied into a preallocated buffer, one
column short per rank.

Origin: inference engines gather a column-parallel lm_head's logits into an output they allocate
once (`out = torch.empty(...)`, then `out[..., a:b] = piece` for each rank's piece), to skip the
copy of `torch.cat`. The buggy twin takes each rank's slice end as inclusive (`b - 1`): the last
column of every rank's slice keeps whatever the allocation held.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 16
VOCAB = 32
NUM_TOKENS = 5

WORLD_SIZE = 2
OUTPUT = "replicate"


class ParallelLMHead(nn.Module):
    """Column-parallel lm_head: this rank's rows of the (vocab, hidden) weight, logits gathered."""

    def __init__(self, world_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB // world_size, HIDDEN))

    def forward(self, hidden_states):
        local = F.linear(hidden_states, self.weight)
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, local)
        out = torch.empty(hidden_states.shape[0], VOCAB)
        width = local.shape[-1]
        for r, piece in enumerate(pieces):
            out[..., r * width:(r + 1) * width] = piece  # FIX
        return out


class LMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states):
        return F.linear(hidden_states, self.weight)


def reference():
    return LMHead()


def distributed(rank, world_size):
    return ParallelLMHead(world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)
