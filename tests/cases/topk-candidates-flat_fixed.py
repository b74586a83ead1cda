"""topk-candidates-flat: top-k sampling candidates all-gathered into a flat tensor and read back
with the ranks' candidates of different tokens mixed.

Origin: the top-k step of a vocab-parallel sampler gathering with `all_gather_into_tensor`, which
stacks the ranks' (tokens, k) candidates along dim 0; each token's candidates must be brought
together along the last dim (the ranks' blocks joined along it). The buggy twin views
the (ranks * tokens, k) buffer as (tokens, ranks * k): it gathers along the wrong dim, each row
then holds candidates of other tokens.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 16
VOCAB = 64
TOP_K = 4
NUM_TOKENS = 5

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


def all_gather_candidates(x):
    """(tokens, k) on each rank -> (tokens, ranks * k): every rank's candidates of each token."""
    world_size = dist.get_world_size()
    flat = x.new_empty(world_size * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(flat, x.contiguous())
    return torch.cat(flat.chunk(world_size), dim=-1)  # FIX


class ParallelTopK(nn.Module):
    """This rank's rows of the (vocab, hidden) lm_head weight; returns the top-k logits and ids."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.rank = rank
        self.vocab_per_rank = VOCAB // world_size
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        local_values, local_ids = torch.topk(logits, TOP_K)
        values = all_gather_candidates(local_values)
        ids = all_gather_candidates(local_ids + self.rank * self.vocab_per_rank)
        top_values, chosen = torch.topk(values, TOP_K)
        return top_values, torch.gather(ids, 1, chosen)


class TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states):
        return torch.topk(F.linear(hidden_states, self.weight), TOP_K)


def reference():
    return TopK()


def distributed(rank, world_size):
    return ParallelTopK(rank, world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)
