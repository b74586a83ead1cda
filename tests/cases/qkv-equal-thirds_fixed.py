"""qkv-equal-thirds: transformers-neuronx loading a fused-QKV checkpoint with grouped-query heads.

Origin: transformers-neuronx attention (the case in the seed slides), second variant. The
checkpoint stores one fused qkv_proj weight [Wq; Wk; Wv] (Phi-3 style). The neuronx loader splits
it into Wq, Wk, Wv, shards each by heads and re-fuses them per rank as [Q_r | K_r | V_r]. The split
must use the sizes (n_heads * d, n_kv_heads * d, n_kv_heads * d); the buggy twin splits it into
equal thirds, which is only right when n_kv_heads == n_heads. Each rank's fused weight still has
the right shape, and at world size 1 the thirds re-fuse into the original matrix, so the bug only
shows with tensor parallelism.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 48
N_HEADS = 16
N_KV_HEADS = 8
HEAD_DIM = HIDDEN // N_HEADS
Q_SIZE = N_HEADS * HEAD_DIM
KV_SIZE = N_KV_HEADS * HEAD_DIM
BATCH, SEQ = 2, 5

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


def repeat_kv(x, n_rep):
    """(b, n_kv, s, d) -> (b, n_kv * n_rep, s, d): each kv head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, n_rep, s, d).reshape(b, n_kv * n_rep, s, d)


def attention(q, k, v):
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class Phi3Attention(nn.Module):
    """The single-device reference: one fused qkv_proj, split by the real q/k/v sizes."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, Q_SIZE + 2 * KV_SIZE, bias=False)
        self.o_proj = nn.Linear(Q_SIZE, HIDDEN, bias=False)

    def forward(self, hidden):
        b, s, _ = hidden.shape
        q, k, v = self.qkv_proj(hidden).split([Q_SIZE, KV_SIZE, KV_SIZE], dim=-1)
        q = q.view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
        n_rep = N_HEADS // N_KV_HEADS
        out = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, Q_SIZE))


class NeuronFusedQKVAttention(nn.Module):
    """One rank of the neuronx attention: fused [Q_r | K_r | V_r] weight, row-parallel output."""

    def __init__(self, tp_degree):
        super().__init__()
        self.n_heads_tp = N_HEADS // tp_degree
        self.n_kv_heads_tp = N_KV_HEADS // tp_degree
        fused_width = (self.n_heads_tp + 2 * self.n_kv_heads_tp) * HEAD_DIM
        # neuronx keeps weights transposed: (in_features, out_features)
        self.qkv_weight = nn.Parameter(torch.empty(HIDDEN, fused_width))
        self.out_weight = nn.Parameter(torch.empty(self.n_heads_tp * HEAD_DIM, HIDDEN))

    def forward(self, hidden):
        b, s, _ = hidden.shape
        fused = torch.matmul(hidden, self.qkv_weight)
        slice_lim = fused.shape[-1] // (self.n_heads_tp + 2 * self.n_kv_heads_tp)
        active_q = fused[..., : self.n_heads_tp * slice_lim]
        active_k = fused[..., self.n_heads_tp * slice_lim : (self.n_heads_tp + self.n_kv_heads_tp) * slice_lim]
        active_v = fused[..., (self.n_heads_tp + self.n_kv_heads_tp) * slice_lim :]
        q = active_q.view(b, s, self.n_heads_tp, HEAD_DIM).transpose(1, 2)
        k = active_k.view(b, s, self.n_kv_heads_tp, HEAD_DIM).transpose(1, 2)
        v = active_v.view(b, s, self.n_kv_heads_tp, HEAD_DIM).transpose(1, 2)
        n_rep = self.n_heads_tp // self.n_kv_heads_tp
        out = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))
        out = out.transpose(1, 2).reshape(b, s, self.n_heads_tp * HEAD_DIM)
        out = torch.matmul(out, self.out_weight)
        dist.all_reduce(out)
        return out


def reference():
    return Phi3Attention()


def distributed(rank, world_size):
    return NeuronFusedQKVAttention(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    """The neuronx loader: split the fused checkpoint, shard q/k/v by heads, re-fuse per rank."""
    fused = ref_state["qkv_proj.weight"]
    wq, wk, wv = fused.split([Q_SIZE, KV_SIZE, KV_SIZE], dim=0)  # FIX: split by the real q/k/v sizes
    q = wq.chunk(world_size, dim=0)[rank]
    k = wk.chunk(world_size, dim=0)[rank]
    v = wv.chunk(world_size, dim=0)[rank]
    o = ref_state["o_proj.weight"].chunk(world_size, dim=1)[rank]
    return {"qkv_weight": torch.cat([q, k, v], dim=0).t(), "out_weight": o.t()}
