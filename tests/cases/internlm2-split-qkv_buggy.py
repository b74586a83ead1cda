"""internlm2-split-qkv: vLLM InternLM2 attention, wqkv stored interleaved per kv group.

Origin: vLLM #8017 (InternVL2 / InternLM2 output gibberish with tensor_parallel_size > 1, broken
by the split_qkv introduced in #7187), fixed in #8055. InternLM2's checkpoint stores wqkv
interleaved per kv group: [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...].
Since #7187 the fused weight is loaded by QKVParallelLinear's fused-checkpoint loader, which cuts it
as if it were [Wq; Wk; Wv]: each rank holds its chunk of the first q_size rows, of the next kv_size
rows and of the last kv_size rows. split_qkv then reads its rank-local output with the global,
per-group interleaved layout. At tp=1 that is right; at tp>1 q, k and v get rows of the wrong
heads, with shapes that fit. The fix (#8055) all-gathers the fused output, restores the global
interleaved order, splits it with the global head counts and keeps this rank's heads.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 64
N_HEADS = 16
N_KV_HEADS = 8
HEAD_DIM = HIDDEN // N_HEADS
NUM_TOKENS = 8

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


def tensor_model_parallel_all_gather(input_, dim=-1):
    world_size = dist.get_world_size()
    chunks = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(chunks, input_.contiguous())
    return torch.cat(chunks, dim=dim)


def split_tensor_along_last_dim(tensor, num_partitions):
    return torch.split(tensor, tensor.shape[-1] // num_partitions, dim=-1)


class InternLM2Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, tp_size=1, tp_rank=0):
        super().__init__()
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.total_num_heads = num_heads
        self.num_heads = num_heads // tp_size
        self.total_num_kv_heads = num_kv_heads
        self.num_kv_heads = num_kv_heads // tp_size
        self.head_dim = hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.key_value_groups = int(self.num_heads / self.num_kv_heads)
        self.scaling = self.head_dim**-0.5
        # QKVParallelLinear: this rank's [q_r | k_r | v_r] output columns
        self.wqkv = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        # RowParallelLinear
        self.wo = nn.Linear(self.q_size, hidden_size, bias=False)

    def split_qkv(self, qkv):
        seq_len = qkv.shape[0]
        qkv = qkv.view(seq_len, self.num_kv_heads, self.key_value_groups + 2, self.head_dim)  # BUG(layout): the per-kv-group interleaved layout of the checkpoint read on this rank's [q_r | k_r | v_r] output
        q, k, v = torch.split(qkv, [self.key_value_groups, 1, 1], dim=-2)
        q = q.reshape(seq_len, self.q_size)
        k = k.reshape(seq_len, self.kv_size)
        v = v.reshape(seq_len, self.kv_size)
        return q, k, v

    def forward(self, hidden_states):
        num_tokens = hidden_states.shape[0]
        q, k, v = self.split_qkv(self.wqkv(hidden_states))
        q = q.view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)
        k = k.repeat_interleave(self.key_value_groups, dim=0)
        v = v.repeat_interleave(self.key_value_groups, dim=0)
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.scaling, dim=-1)
        attn = torch.matmul(probs, v).transpose(0, 1).reshape(num_tokens, self.q_size)
        out = self.wo(attn)
        if self.tp_size > 1:
            dist.all_reduce(out)  # tensor_model_parallel_all_reduce
        return out


def reference():
    return InternLM2Attention(HIDDEN, N_HEADS, N_KV_HEADS)


def distributed(rank, world_size):
    return InternLM2Attention(HIDDEN, N_HEADS, N_KV_HEADS, tp_size=world_size, tp_rank=rank)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    """vLLM's loaders: QKVParallelLinear cuts the fused wqkv as [Wq; Wk; Wv]; wo by input columns."""
    q_rows, kv_rows = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    wqkv = ref_state["wqkv.weight"]
    parts = wqkv.split([q_rows, kv_rows, kv_rows], dim=0)
    return {
        "wqkv.weight": torch.cat([part.chunk(world_size, dim=0)[rank] for part in parts], dim=0),
        "wo.weight": ref_state["wo.weight"].chunk(world_size, dim=1)[rank],
    }
