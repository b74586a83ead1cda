"""interleaved-qkv (look-alike, correct): a fused QKV projection interleaved per head, as
Megatron-LM and GPT-NeoX lay it out, tensor parallel over heads.

An equivalent refactoring (issue 14's mutation harness found it unknown): the fused weight's rows
are [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...], one block per head, and q, k and v are split from
the projection with `view(batch, seq, heads, 3, head_dim)` and `select`. A rank's heads are then
one contiguous block of rows, so a plain chunk of the fused weight is its shard. Must be proven.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, HEAD_DIM = 32, 8, 4
BATCH, SEQ = 2, 6

WORLD_SIZE = 2
OUTPUT = "replicate"
MODE = "train"  # the loss and every parameter's gradient


def attend(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention over the heads of a per-head interleaved [q_h | k_h | v_h] projection."""
    batch, seq, _ = qkv.shape
    grouped = qkv.view(batch, seq, heads, 3, HEAD_DIM)
    q, k, v = (grouped.select(3, i).transpose(1, 2) for i in range(3))
    scores = torch.matmul(q, k.transpose(-2, -1)) * HEAD_DIM**-0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    out = torch.matmul(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1), v)
    return out.transpose(1, 2).reshape(batch, seq, heads * HEAD_DIM)


class Attention(nn.Module):
    def __init__(self, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(HIDDEN, 3 * heads * HEAD_DIM)
        self.dense = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dense(attend(self.qkv(x), self.heads))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)  # the row-parallel dense: partial sums over the heads
        return out


def reference():
    return Attention()


def distributed(rank, world_size):
    return Attention(HEADS // world_size)


def shard_state(ref_state, rank, world_size):
    return {
        "qkv.weight": ref_state["qkv.weight"].chunk(world_size, dim=0)[rank],  # this rank's heads' [q|k|v] blocks
        "qkv.bias": ref_state["qkv.bias"].chunk(world_size, dim=0)[rank],
        "dense.weight": ref_state["dense.weight"].chunk(world_size, dim=1)[rank],
    }


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN),)


def loss(output, *inputs):
    return output.square().mean()
