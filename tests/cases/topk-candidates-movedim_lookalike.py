"""topk-candidates-movedim: top-k sampling candidates all-gathered into a flat tensor and brought
together per token by a view, a movedim and a reshape (vLLM's spelling), not by chunk and cat.

Looks like topk-candidates-flat's buggy twin (a reshape of the flat buffer straight to
(tokens, ranks * k)), but the movedim first puts each token's blocks of all ranks side by side:
correct.
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
OUTPUT = "replicate"


def all_gather_candidates(x):
    """(tokens, k) on each rank -> (tokens, ranks * k): every rank's candidates of each token."""
    world_size = dist.get_world_size()
    flat = x.new_empty(world_size * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(flat, x.contiguous())
    per_rank = flat.view(world_size, *x.shape)  # (ranks, tokens, k)
    return per_rank.movedim(0, 1).reshape(x.shape[0], world_size * x.shape[1])


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
