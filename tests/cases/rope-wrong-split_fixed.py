"""rope-wrong-split: rotary embedding on a sequence shard rotated with the wrong positions.

Origin: the position-offset bug of sequence/context-parallel attention (position ids not sliced
with the tokens, e.g. Ulysses / context-parallel ports of HF models). The sequence is split across
ranks; each rank projects its own tokens, rotates q and k, all-gathers k and v (all-gather-KV
context parallelism, as in Llama 3) and attends its queries to the whole sequence. Rank r holds
positions [r * s_local, (r + 1) * s_local) and must read those rows of the cos/sin cache; the
buggy twin reads rows [0, s_local) on every rank, so for rank > 0 both q and the gathered k carry
the wrong rotation. Shapes fit; at world size 1 the two slices coincide.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 32
N_HEADS = 4
HEAD_DIM = HIDDEN // N_HEADS
MAX_POSITIONS = 16
BATCH, SEQ = 2, 8

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = ("shard", 1)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """x: (b, heads, s, d); cos, sin: (s, d // 2), neox style."""
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((sin, sin), dim=-1)
    return x * cos + rotate_half(x) * sin


def all_gather_seq(x, world_size):
    """(b, h, s_local, d) from every rank -> (b, h, s, d)."""
    chunks = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(chunks, x.contiguous())
    return torch.cat(chunks, dim=2)


class RotaryAttention(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
        freqs = torch.outer(torch.arange(MAX_POSITIONS).to(inv_freq.dtype), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, hidden):
        b, s_local, _ = hidden.shape
        q = self.q_proj(hidden).view(b, s_local, N_HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(hidden).view(b, s_local, N_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(hidden).view(b, s_local, N_HEADS, HEAD_DIM).transpose(1, 2)
        cos_sin = self.cos_sin_cache[self.rank * s_local : (self.rank + 1) * s_local]  # FIX: this rank's positions
        cos, sin = cos_sin.chunk(2, dim=-1)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.world_size > 1:
            k = all_gather_seq(k, self.world_size)
            v = all_gather_seq(v, self.world_size)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s_local, HIDDEN))


def reference():
    return RotaryAttention()


def distributed(rank, world_size):
    return RotaryAttention(rank, world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=1)[rank]
