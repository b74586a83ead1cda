"""greedy-argmax-offset: greedy sampling over vocab-parallel logits without the ranks' offsets.

Origin: the sampler of an inference engine with a vocab-parallel lm_head (vLLM-style, without
gathering the full logits): each rank takes the max and argmax over its vocabulary slice, adds
its slice's start `rank * vocab_per_rank` to the argmax, all-gathers both, and picks the position
of the rank holding the largest max. The buggy twin gathers the positions within each rank's
slice: every rank's token id looks like one of rank 0's.
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


def all_gather_stacked(x):
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.stack(pieces)


class ParallelGreedyHead(nn.Module):
    """This rank's rows of the (vocab, hidden) lm_head weight; returns the greedy token ids."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.rank = rank
        self.vocab_per_rank = VOCAB // world_size
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        local_max, local_idx = logits.max(dim=-1)  # BUG(layout): positions within this rank's slice; its start rank * vocab_per_rank is never added
        maxes, ids = all_gather_stacked(local_max), all_gather_stacked(local_idx)
        best_rank = maxes.argmax(dim=0, keepdim=True)
        return ids.gather(0, best_rank).squeeze(0)


class GreedyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states):
        return F.linear(hidden_states, self.weight).argmax(dim=-1)


def reference():
    return GreedyHead()


def distributed(rank, world_size):
    return ParallelGreedyHead(rank, world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)
