"""greedy-argmax-funcol: greedy sampling over vocab-parallel logits, gathered with functional
collectives, with each rank's offset one slice too far.

Origin: the sampler of greedy-argmax-off-by-one spelled as compiled-friendly code writes it:
`funcol.all_gather_tensor` (its result wrapped for autograd) and `torch.take_along_dim` at the
argmax of the ranks' maxes (which wraps the indices by a remainder). The buggy twin shifts by
`(rank + 1) * vocab_per_rank`, as if ranks counted from 1.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
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
        token = logits.argmax(dim=-1) + (self.rank + 1) * self.vocab_per_rank  # BUG(layout): ranks counted from 1: every id one slice too far
        best = logits.amax(dim=-1)
        tokens = funcol.all_gather_tensor(token[None], 0, dist.group.WORLD)
        bests = funcol.all_gather_tensor(best[None], 0, dist.group.WORLD)
        return torch.take_along_dim(tokens, bests.argmax(dim=0, keepdim=True), dim=0)[0]


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
