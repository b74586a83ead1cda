"""allgather-wrong-dim: a column-parallel lm_head whose logits are gathered along the wrong dim.

Origin: the gather-along-the-wrong-axis class (cf. TransformerEngine #530: all_gather_into_tensor
concatenates on dim 0 where the caller meant the last dim). Each rank computes the logits of its
vocabulary slice; they must be concatenated along the vocab dim. The buggy twin concatenates the
gathered chunks along dim 0 (tokens); the final view to (num_tokens, vocab) still fits, so token
rows and vocab columns are silently interleaved.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
VOCAB = 64
NUM_TOKENS = 6

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


def gather_from_tensor_model_parallel_region(input_):
    world_size = dist.get_world_size()
    tensor_list = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(tensor_list, input_.contiguous())
    return torch.cat(tensor_list, dim=0)  # BUG(layout): concatenated along dim 0 (tokens) instead of the vocab dim (-1)


class ParallelLMHead(nn.Module):
    """Column-parallel lm_head: this rank's rows of the (vocab, hidden) weight, logits gathered."""

    def __init__(self, world_size):
        super().__init__()
        self.vocab_size = VOCAB
        self.weight = nn.Parameter(torch.empty(VOCAB // world_size, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        logits = gather_from_tensor_model_parallel_region(logits)
        return logits.view(-1, self.vocab_size)  # [num_tokens, vocab]


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
