"""einsum-attention (look-alike, correct): head-parallel attention whose products are einsums over
(batch, seq, heads, head_dim) activations, trained.

An equivalent refactoring in the class of issue 14's einsum row-parallel product: torch runs
`einsum("bqhd,bkhd->bhqk", q, k)` as one bmm over the batch and heads flattened together, its operands
unsqueezed and permuted, and views the product back with a size-1 dim for the contracted one. A
rank's heads are then a block of every batch entry's heads, not a range of the flattened batch.
Must be proven.
"""

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, HEADS, HEAD_DIM = 16, 8, 2
BATCH, SEQ = 2, 5

WORLD_SIZE = 2
OUTPUT = "replicate"
MODE = "train"


class Attention(nn.Module):
    def __init__(self, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(HIDDEN, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (self.heads, HEAD_DIM)) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM**-0.5
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v).flatten(2)
        out = self.o_proj(out)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)
        return out


def reference():
    return Attention()


def distributed(rank, world_size):
    return Attention(HEADS // world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def loss(output, *inputs):
    return output.square().mean()
