"""qkv-gqa-offset: transformers-neuronx fused-QKV attention with grouped-query heads.

Origin: transformers-neuronx attention, fused_qkv path (the case in the seed slides). The loader
fuses the HF q/k/v weights per rank into one (hidden, (n_heads_tp + 2 * n_kv_heads_tp) * d)
matrix [Q_r | K_r | V_r]; the attention block slices the fused output back into Q, K and V.
K must start after the local Q part, at n_heads_tp * slice_lim; the buggy twin starts it at
column 0, so K is read from Q's columns. Shapes still fit: nothing crashes.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 64
N_HEADS = 16
N_KV_HEADS = 8
HEAD_DIM = HIDDEN // N_HEADS
BATCH, SEQ = 2, 5

WORLD_SIZE = 2
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


class LlamaAttention(nn.Module):
    """The single-device reference: HF Llama attention with separate q/k/v projections."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, N_HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, N_KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, N_KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(N_HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden):
        b, s, _ = hidden.shape
        q = self.q_proj(hidden).view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(hidden).view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(hidden).view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
        n_rep = N_HEADS // N_KV_HEADS
        out = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, N_HEADS * HEAD_DIM))


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
        active_k = fused[..., self.n_heads_tp * slice_lim : (self.n_heads_tp + self.n_kv_heads_tp) * slice_lim]  # FIX: K starts after the local Q part
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
    return LlamaAttention()


def distributed(rank, world_size):
    return NeuronFusedQKVAttention(world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    """The neuronx loader: shard q/k/v by heads, fuse them per rank, store transposed."""
    q = ref_state["q_proj.weight"].chunk(world_size, dim=0)[rank]
    k = ref_state["k_proj.weight"].chunk(world_size, dim=0)[rank]
    v = ref_state["v_proj.weight"].chunk(world_size, dim=0)[rank]
    o = ref_state["o_proj.weight"].chunk(world_size, dim=1)[rank]
    return {"qkv_weight": torch.cat([q, k, v], dim=0).t(), "out_weight": o.t()}
