"""bsh-transpose: transformers-neuronx attention output in (seq, batch, hidden) layout.

Origin: transformers-neuronx commit 69d039d. The neuronx attention keeps its activations in
(n_active_tokens, batch, hidden) order. After the row-parallel output projection the partial
result is (seq * batch, hidden) and has to be viewed back as (seq, batch, hidden) and transposed
to the caller's (batch, seq, hidden) before the all-reduce. The buggy twin views it directly as
(batch, seq, hidden), as if the rows were batch-major: batch and sequence positions get mixed.
The element count is the same, so nothing crashes (batch > 1 is needed to see it).
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 32
N_HEADS = 8
HEAD_DIM = HIDDEN // N_HEADS
BATCH, SEQ = 2, 3

WORLD_SIZE = 2
OUTPUT = "replicate"


def attention(q, k, v):
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class Attention(nn.Module):
    """The single-device reference, in the usual (batch, seq, hidden) layout."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden):
        b, s, _ = hidden.shape
        q = self.q_proj(hidden).view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(hidden).view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(hidden).view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
        out = attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, HIDDEN))


class NeuronAttention(nn.Module):
    """One rank: column-parallel q/k/v heads, attention in (seq, batch) order, row-parallel o_proj."""

    def __init__(self, tp_degree):
        super().__init__()
        self.n_heads_tp = N_HEADS // tp_degree
        self.q_proj = nn.Linear(HIDDEN, self.n_heads_tp * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, self.n_heads_tp * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, self.n_heads_tp * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(self.n_heads_tp * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden):
        batch, n_active_tokens, _ = hidden.shape
        sbh = hidden.transpose(0, 1)  # (seq, batch, hidden): the neuronx activation layout
        q = self.q_proj(sbh).view(n_active_tokens, batch, self.n_heads_tp, HEAD_DIM).permute(1, 2, 0, 3)
        k = self.k_proj(sbh).view(n_active_tokens, batch, self.n_heads_tp, HEAD_DIM).permute(1, 2, 0, 3)
        v = self.v_proj(sbh).view(n_active_tokens, batch, self.n_heads_tp, HEAD_DIM).permute(1, 2, 0, 3)
        out = attention(q, k, v)  # (batch, heads, seq, d)
        out = out.permute(2, 0, 1, 3).reshape(n_active_tokens * batch, self.n_heads_tp * HEAD_DIM)
        out = self.o_proj(out)  # (seq * batch, hidden), a partial sum over this rank's heads
        out = out.reshape(batch, n_active_tokens, HIDDEN)  # BUG(layout): rows are seq-major (s * b); viewing them as (batch, seq) mixes batch and sequence
        dist.all_reduce(out)
        return out


def reference():
    return Attention()


def distributed(rank, world_size):
    return NeuronAttention(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)
