"""topk-local-k: each rank keeps too few top-k candidates of its vocabulary slice.

Origin: the top-k step of a vocab-parallel sampler (see topk-offset): each rank's top k over its
slice, shifted to global token ids, all-gathered along the vocab dim, the top k of the gathered
candidates taken. Every rank must keep k candidates, as all k winners may lie in one slice; the
buggy twin keeps ceil(k / world_size), as if the winners spread evenly over the ranks.
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


def all_gather_last(x):
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=-1)


class ParallelTopK(nn.Module):
    """This rank's rows of the (vocab, hidden) lm_head weight; returns the top-k logits and ids."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.vocab_per_rank = VOCAB // world_size
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        local_values, local_ids = logits.topk(-(-TOP_K // self.world_size), dim=-1)  # BUG(too-few): ceil(k / world_size) candidates per rank; all k winners may lie in one slice
        values = all_gather_last(local_values)
        ids = all_gather_last(local_ids + self.rank * self.vocab_per_rank)
        top_values, chosen = values.topk(TOP_K, dim=-1)
        return top_values, ids.gather(-1, chosen)


class TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states):
        top_values, ids = F.linear(hidden_states, self.weight).topk(TOP_K, dim=-1)
        return top_values, ids


def reference():
    return TopK()


def distributed(rank, world_size):
    return ParallelTopK(rank, world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)
