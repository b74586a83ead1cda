"""topk-offset: top-k sampling candidates over vocab-parallel logits without the ranks' offsets.

Origin: the top-k step of an inference engine's sampler with a vocab-parallel lm_head (vLLM-style,
without gathering the full logits): each rank takes the top k of its vocabulary slice, shifts the
positions by its slice's start `rank * vocab_per_rank`, all-gathers values and positions along the
vocab dim, takes the top k of the gathered candidates and reads the positions at the chosen ones.
The buggy twin gathers the positions within each rank's slice.
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
        self.rank = rank
        self.vocab_per_rank = VOCAB // world_size
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        local_values, local_ids = logits.topk(TOP_K, dim=-1)  # BUG(layout): positions within this rank's slice; its start rank * vocab_per_rank is never added
        values, ids = all_gather_last(local_values), all_gather_last(local_ids)
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
