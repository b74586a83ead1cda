"""fused-naive-concat: NeMo Automodel combined-QKV attention sharded with DTensor ColwiseParallel.

Origin: NeMo Automodel #1324. The custom model fuses the HF q_proj/k_proj/v_proj into one
qkv_proj; its state-dict adapter builds the fused weight as the plain concatenation
[Wq; Wk; Wv], and the TP plan applies ColwiseParallel to it, i.e. Shard(0): rank 0 gets all of Q
plus part of K, the last rank part of K and all of V. Each rank then splits its local output with
its local q/k/v sizes; shapes fit, values do not. The fix lays the fused weight out per rank,
[q_0; k_0; v_0; q_1; k_1; v_1; ...], so that Shard(0) gives rank r exactly [q_r; k_r; v_r].
"""

import math

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

HIDDEN = 64
N_HEADS = 16
N_KV_HEADS = 8
HEAD_DIM = HIDDEN // N_HEADS
BATCH, SEQ = 2, 5

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


def repeat_kv(x, n_rep):
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


class CombinedQKVAttention(nn.Module):
    """The Automodel attention: one fused qkv_proj; head counts are the local ones under TP."""

    def __init__(self, tp_size=1):
        super().__init__()
        self.num_heads = N_HEADS // tp_size
        self.num_kv_heads = N_KV_HEADS // tp_size
        self.qkv_proj = nn.Linear(HIDDEN, (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(N_HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden):
        b, s, _ = hidden.shape
        qkv = self.qkv_proj(hidden)  # local columns of the fused output (ColwiseParallel, local output)
        q_size, kv_size = self.num_heads * HEAD_DIM, self.num_kv_heads * HEAD_DIM
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, self.num_kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, self.num_kv_heads, HEAD_DIM).transpose(1, 2)
        n_rep = self.num_heads // self.num_kv_heads
        out = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, q_size))  # RowwiseParallel: all-reduce


def reference():
    return LlamaAttention()


def distributed(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = CombinedQKVAttention(tp_size=world_size)
    return parallelize_module(model, mesh, {"qkv_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    """The HF -> Automodel state-dict adapter, then the Shard(0) / Shard(1) cuts of the TP plan."""
    q, k, v = (ref_state[f"{name}_proj.weight"] for name in ("q", "k", "v"))
    qkv = torch.cat([torch.cat([w.chunk(world_size, dim=0)[r] for w in (q, k, v)]) for r in range(world_size)], dim=0)  # FIX: per-rank layout [q_0; k_0; v_0; q_1; ...], so Shard(0) gives rank r [q_r; k_r; v_r]
    return {
        "qkv_proj.weight": qkv.chunk(world_size, dim=0)[rank],  # ColwiseParallel: Shard(0)
        "o_proj.weight": ref_state["o_proj.weight"].chunk(world_size, dim=1)[rank],  # RowwiseParallel: Shard(1)
    }
