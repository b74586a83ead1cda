"""greedy-argmax-off-by-one: greedy sampling over vocab-parallel logits with each rank's offset one
slice too far.

Origin: the same sampler as greedy-argmax-offset, spelled with `torch.argmax` and `amax` and
gathered into flat tensors: each rank's argmax over its vocabulary slice shifted to a global token
id, and its max, all-gathered (`all_gather_into_tensor`, ranks along a new leading dim), the id of
the rank with the largest max taken. The buggy twin shifts by `(rank + 1) * vocab_per_rank`, as if
ranks counted from 1.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 16
VOCAB = 32
NUM_TOKENS = 5

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


class ParallelGreedyHead(nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.vocab_per_rank = VOCAB // world_size
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        token = logits.argmax(dim=-1) + self.rank * self.vocab_per_rank  # FIX
        best = logits.amax(dim=-1)
        tokens = token.new_empty(self.world_size, *token.shape)
        bests = best.new_empty(self.world_size, *best.shape)
        dist.all_gather_into_tensor(tokens, token)
        dist.all_gather_into_tensor(bests, best)
        return torch.gather(tokens, 0, bests.argmax(dim=0)[None])[0]


class GreedyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states):
        return torch.argmax(F.linear(hidden_states, self.weight), dim=-1)


def reference():
    return GreedyHead()


def distributed(rank, world_size):
    return ParallelGreedyHead(rank, world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)
