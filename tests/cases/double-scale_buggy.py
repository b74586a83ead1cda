"""double-scale: a sequence-parallel mean pool divided by world_size twice.

Origin: the double-averaging class (pre-divided partial sums that are averaged again after the
all-reduce, as in DDP/DeepSpeed gradient_predivide_factor mix-ups), here in a forward pass. The
sequence is split across ranks; each rank divides its partial sum of tokens by the full sequence
length (seq_local * world_size), so the all-reduced sum already is the mean. The buggy twin then
divides by world_size once more. At world size 1 the extra division is by 1.
"""

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 32
NUM_LABELS = 8
BATCH, SEQ = 2, 8

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


class MeanPoolClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(HIDDEN, NUM_LABELS)

    def forward(self, hidden):
        return self.classifier(hidden.mean(dim=1))


class SequenceParallelMeanPoolClassifier(nn.Module):
    """Each rank holds SEQ / world_size tokens of every sequence; the classifier is replicated."""

    def __init__(self, world_size):
        super().__init__()
        self.world_size = world_size
        self.classifier = nn.Linear(HIDDEN, NUM_LABELS)

    def forward(self, hidden):
        pooled = hidden.sum(dim=1) / (hidden.shape[1] * self.world_size)  # this rank's share of the mean
        dist.all_reduce(pooled)
        return self.classifier(pooled / self.world_size)  # BUG(scale): the partial sums were already divided by world_size


def reference():
    return MeanPoolClassifier()


def distributed(rank, world_size):
    return SequenceParallelMeanPoolClassifier(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=1)[rank]
