"""ulysses-gather-dim: Ulysses sequence parallelism with the heads joined back along the sequence.

Origin: DeepSpeed-Ulysses' `_SeqAllToAll` (deepspeed/sequence/layer.py) and its ports (yunchang's
`all_to_all_4D`, Megatron's `all_to_all_sp2hp` / `all_to_all_hp2sp`), where the scatter and gather
indices are passed by position and the output of the second all_to_all is reassembled with its
pieces along the wrong dim. Each rank holds s / n tokens; an all_to_all gives it every token of
its n-th of the heads (scatter heads, gather sequence), it attends over the whole sequence, and a
second all_to_all gives back its tokens with every head (scatter sequence, gather heads). The
buggy twin joins the received pieces (one per rank: that rank's heads of this rank's tokens) as
if they were tokens: a reshape to (b, s_local, heads, d) hides it. At world size 1 there is one
piece and nothing to misplace.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 64
N_HEADS = 16
HEAD_DIM = HIDDEN // N_HEADS
BATCH, SEQ = 2, 16

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = ("shard", 1)


def heads_to_sequence(x, world_size):
    """(b, s_local, heads, d) -> (b, s, heads / n, d): this rank's heads of every token."""
    b, s_local, heads, d = x.shape
    pieces = x.reshape(b, s_local, world_size, heads // world_size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)  # piece j: rank j's tokens, this rank's heads
    return received.permute(1, 0, 2, 3, 4).reshape(b, world_size * s_local, heads // world_size, d)


def sequence_to_heads(x, world_size):
    """(b, s, heads / n, d) -> (b, s_local, heads, d): every head of this rank's tokens."""
    b, s, local_heads, d = x.shape
    pieces = x.reshape(b, world_size, s // world_size, local_heads, d).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces)  # piece j: this rank's tokens, rank j's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // world_size, world_size * local_heads, d)  # FIX: pieces are heads


class Attention(nn.Module):
    def __init__(self, world_size=1):
        super().__init__()
        self.world_size = world_size
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden):
        b, s_local, _ = hidden.shape
        q, k, v = (proj(hidden).view(b, s_local, N_HEADS, HEAD_DIM) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (heads_to_sequence(t, self.world_size).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2)
        return self.o_proj(sequence_to_heads(out, self.world_size).reshape(b, s_local, HIDDEN))


def reference():
    return Attention()


def distributed(rank, world_size):
    return Attention(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=1)[rank]
